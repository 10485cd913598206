"""nansentinel on torchft, for real on CPU: a lighthouse in-process
(``torchft._torchft.LighthouseServer``), replica groups as threads, each with its own TCPStore,
``Manager``, ``ProcessGroupGloo`` and nansentinel's torchft DDP.

torch's TCPStore here refuses roughly the 25th client connection to one server and torchft
opens a new client on every regroup (a veto bumps the quorum too): each test keeps to a handful
of vetoes and regroups, with a fresh lighthouse.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

torchft = pytest.importorskip("torchft")

from torch.distributed import TCPStore  # noqa: E402
from torchft._torchft import LighthouseServer  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

import nansentinel.torchft as nft  # noqa: E402
from nansentinel.common.exclusion import ExclusionStore  # noqa: E402
from nansentinel.config import ConfigError  # noqa: E402
from nansentinel.effects.metrics import SentinelMetrics  # noqa: E402
from nansentinel.result import HostExcludedError, NonFiniteError, SentinelUsageError  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@contextmanager
def lighthouse() -> Iterator[LighthouseServer]:
    """A fresh lighthouse on a free port; a group that stops heartbeating is dropped in 0.5 s."""
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=200,
                              heartbeat_timeout_ms=500)
    try:
        yield server
    finally:
        server.shutdown()


class Group:
    """One replica group of one process (a thread): its store, manager, model and sentinel."""

    def __init__(self, house: LighthouseServer, gid: int, seed: int, tmp: Path,
                 rank: tuple[int, int, TCPStore] | None = None, manual: bool = False,
                 **sentinel: Any) -> None:
        """``rank``: (rank, world size, the group's store) for a group of several ranks;
        ``manual``: a plain module whose gradients the loop reduces with manager.allreduce."""
        self.store = TCPStore("localhost", 0, is_master=True,
                              wait_for_workers=False) if rank is None else rank[2]
        grank, gsize = (0, 1) if rank is None else rank[:2]
        torch.manual_seed(seed)
        self.module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                          torch.nn.Linear(8, 2))
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.05)
        #: Whether every state this group served a healing peer was finite.
        self.served: list[bool] = []
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
            load_state_dict=self._load, state_dict=self._state, replica_id=f"g{gid}",
            store_addr="localhost", store_port=self.store.port, rank=grank, world_size=gsize,
            lighthouse_addr=house.address(), timeout=timedelta(seconds=5),
            quorum_timeout=timedelta(seconds=20), connect_timeout=timedelta(seconds=10))
        self.manual = manual
        self.model: torch.nn.Module = (self.module if manual else
                                       nft.DistributedDataParallel(self.manager, self.module))
        self.kwargs = dict(hostname=f"node{gid}" + (f"r{grank}" if gsize > 1 else ""),
                           metrics_port=0,
                           report_dir=str(tmp / "reports"), **sentinel)
        #: Where this group's exporter keeps its values (g0's in the first test).
        self.registry = CollectorRegistry()
        self.results: list[Any] = []
        self.error: BaseException | None = None
        self.finite = True

    def _state(self) -> dict[str, Any]:
        state = {"m": self.module.state_dict(), "o": self.opt.state_dict()}
        self.served.append(all(bool(torch.isfinite(t).all()) for t in state["m"].values()))
        return state

    def _load(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["m"])
        self.opt.load_state_dict(state["o"])

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.module.parameters()]

    def train(self, until: Callable[[Group], bool], hook: Callable[[Group], Any] = lambda g: None
              ) -> None:
        """Steps until ``until(self)``; records every result, and whether a weight ever went
        non-finite after a step; any exception is kept for the test to read."""
        try:
            manager = {"manager": self.manager} if self.manual else {}
            sentinel = nft.Sentinel(self.model, self.opt, **manager, **self.kwargs)
            sentinel.metrics = SentinelMetrics(sentinel.identity, registry=self.registry,
                                               cluster_view=True)
            while not until(self):
                self.opt.zero_grad()
                self.manager.start_quorum()
                x = torch.randn(8, 4)
                poison = hook(self)  # may die here, or poison this batch (real data)
                if poison:
                    x[0, 0] = poison
                sentinel.check_batch(x)
                loss = self.model(x).pow(2).mean()
                sentinel.check_loss(loss)
                loss.backward()
                if self.manual:  # checked before they leave the group, then reduced by hand
                    sentinel.check_grads()
                    for p in self.module.parameters():
                        self.manager.allreduce(p.grad).wait()
                self.results.append(sentinel.step())
                self.finite &= all(bool(torch.isfinite(p).all()) for p in self.module.parameters())
                time.sleep(0.005)
            sentinel.close()
        except BaseException as exc:  # read by the test
            self.error = exc
            if isinstance(getattr(exc, "result", None), nft.FTStepResult):
                self.results.append(exc.result)  # type: ignore[attr-defined]
        finally:
            self.manager.shutdown(wait=False)


def run(groups: list[tuple[Group, Callable[[Group], bool]]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=g.train, args=(until,), daemon=True) for g, until in groups]
    for t in threads:
        t.start()
    return threads


def join(threads: list[threading.Thread], timeout: float = 60) -> None:
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a replica group hung"


def test_a_nan_in_one_group_is_vetoed_on_every_group_named_and_struck_out_live(
        tmp_path: Path) -> None:
    """Group g1's gradients go NaN (a drill) at two of its steps: both steps are vetoed on all
    three groups (should_commit() False everywhere), g1 is named (group, rank, host) on every
    group, no weight is ever non-finite, and at the second strike g1 leaves the quorum while
    g0 and g2 train on without a restart. A new process on g1's host is refused while the host
    is excluded; once cleared, it rejoins and heals from a peer (finite weights, served finite).
    """
    exclusions = tmp_path / "excluded.jsonl"
    common = dict(host_strikes=2, exclusion_file=str(exclusions))
    target = {"step": 10**9}
    with lighthouse() as house:
        g0, g2 = (Group(house, i, 0, tmp_path, **common) for i in (0, 2))
        g1 = Group(house, 1, 0, tmp_path, inject="kind=grad,rank=0,steps=2-2,value=nan;"
                   "kind=grad,rank=0,steps=4-4,value=nan", **common)
        survivors = run([(g, lambda g: g.manager.current_step() >= target["step"])
                         for g in (g0, g2)])
        join(run([(g1, lambda g: False)]))
        assert isinstance(g1.error, HostExcludedError), g1.error
        assert "leaves the quorum" in str(g1.error) and "node1" in str(g1.error)
        assert [r.host for r in ExclusionStore(exclusions).records()] == ["node1"]
        left = g1.results[-1].torchft_step
        deadline = time.monotonic() + 30  # the others go on alone, without a restart
        while min(g0.manager.current_step(), g2.manager.current_step()) < left + 3:
            assert time.monotonic() < deadline, "the survivors stopped stepping"
            time.sleep(0.05)

        # Struck out: a new process on node1 does not join while the host is excluded.
        with pytest.raises(HostExcludedError, match="excluded"):
            refused = Group(house, 1, 5, tmp_path, **common)
            nft.Sentinel(refused.model, refused.opt, **refused.kwargs)
        ExclusionStore(exclusions).clear("node1")  # the operator repaired the host

        # Rejoin: different initial weights, healed from a peer at its first quorum.
        back = Group(house, 1, 7, tmp_path, **common)

        def until_three_more(g: Group) -> bool:
            if g.results and target["step"] == 10**9:
                target["step"] = g.results[0].torchft_step + 3
            return g.manager.current_step() >= target["step"]

        join(run([(back, until_three_more)]))
        join(survivors)

    for g in (g0, g1, g2, back):
        assert g.finite, "a weight went non-finite"
    for g in (g0, g2, back):
        assert g.error is None, g.error
    vetoed = {g: [r.torchft_step for r in g.results if r.poisoned] for g in (g0, g1, g2)}
    assert len(vetoed[g0]) == 2 and vetoed[g0] == vetoed[g1] == vetoed[g2], vetoed
    for g in (g0, g1, g2):
        for r in (r for r in g.results if r.poisoned):
            assert not r.committed and not r.applied
            assert [(p.group, p.rank, p.host, p.kinds) for p in r.poisoned] == [
                ("g1", 0, "node1", ["grad"])]
    assert [p.leaving for r in g0.results for p in r.poisoned] == [False, True]
    # g1's incident reports carry its replica group in their name and job_id.
    assert sorted(p.name for p in (tmp_path / "reports").glob("*.json")) == [
        "incident-torchft-g1-step00000002.json", "incident-torchft-g1-step00000004.json"]
    # The others trained on after g1 left, and agree bit for bit with the healed group.
    assert g0.manager.current_step() == g2.manager.current_step() == target["step"]
    for a, b, c in zip(g0.weights(), g2.weights(), back.weights(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert back.results[0].torchft_step > vetoed[g0][-1], "the rejoined group did not heal"
    served = g0.served + g2.served
    assert served and all(served), served
    # g0's metrics: the vetoed steps count as skipped (not applied), g1's host as blamed
    # twice and excluded.
    value = g0.registry.get_sample_value
    assert value("nansentinel_steps_total", {"outcome": "skipped"}) == 2
    assert value("nansentinel_steps_total", {"outcome": "applied"}) == sum(
        r.committed for r in g0.results)
    assert value("nansentinel_host_blamed_total", {"hostname": "node1"}) == 2
    assert value("nansentinel_host_excluded", {"hostname": "node1"}) == 1


def test_gradients_reduced_by_hand_with_manager_allreduce(tmp_path: Path) -> None:
    """A plain module whose gradients the loop reduces with Manager.allreduce, after
    check_grads(): g1's gradient NaN at its step 2 is vetoed on both groups and named there;
    the weights stay finite and identical. A plain module without its manager is refused."""
    with pytest.raises(SentinelUsageError, match="without manager="):
        plain = torch.nn.Linear(4, 2)
        nft.Sentinel(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    with lighthouse() as house:
        groups = [Group(house, g, 0, tmp_path, manual=True,
                        inject="kind=grad,rank=0,steps=2-2" if g == 1 else None) for g in (0, 1)]
        join(run([(g, lambda g: g.manager.current_step() >= 4) for g in groups]))
    for g in groups:
        assert g.error is None and g.finite, g.error
        assert [(r.torchft_step, [(p.group, p.host) for p in r.poisoned])
                for r in g.results if not r.committed] == [(2, [("g1", "node1")])]
    assert all(torch.equal(a, b) for a, b in zip(*(g.weights() for g in groups), strict=True))


def test_a_nan_batch_under_policy_abort_stops_every_group_at_the_same_step(
        tmp_path: Path) -> None:
    """A NaN in g1's real batch at torchft step 2, policy="abort": both groups raise
    NonFiniteError at that step, naming g1 (batch, loss, grad), with finite weights."""
    with lighthouse() as house:
        groups = [Group(house, i, 0, tmp_path, policy="abort") for i in (0, 1)]

        def poison(g: Group) -> float:
            mine = g.kwargs["hostname"] == "node1" and g.manager.current_step() == 2
            return float("nan") if mine else 0.0

        threads = [threading.Thread(target=g.train, args=(lambda g: False, poison), daemon=True)
                   for g in groups]
        for t in threads:
            t.start()
        join(threads)
    for g in groups:
        assert isinstance(g.error, NonFiniteError) and not isinstance(g.error, HostExcludedError)
        last = g.results[-1]
        assert last.torchft_step == 2 and not last.committed and g.finite
        assert [(p.group, p.host, p.kinds) for p in last.poisoned] == [
            ("g1", "node1", ["batch", "loss", "grad"])]
        assert g.manager.current_step() == 2


def test_a_dead_peer_is_a_regroup_never_a_crash(tmp_path: Path) -> None:
    """g1 dies in the middle of a step (after its forward, before its gradients leave): g0's
    backward and step() raise nothing, the step is not committed (``regrouped``), and g0
    trains on alone at the next quorum. torchft's own DDP, policy="drop" and a GradScaler are
    refused with the reason."""
    with lighthouse() as house:
        g0, g1 = Group(house, 0, 0, tmp_path), Group(house, 1, 0, tmp_path)

        other = torch.nn.Linear(4, 2)
        with pytest.raises(SentinelUsageError, match="torchft's own DDP"):
            nft.Sentinel(torchft.ddp.DistributedDataParallel(g0.manager, other),
                         torch.optim.SGD(other.parameters(), lr=0.1))
        with pytest.raises(ConfigError, match="vetoed on every group"):
            spare = nft.DistributedDataParallel(g0.manager, torch.nn.Linear(4, 2))
            nft.Sentinel(spare, torch.optim.SGD(spare.parameters(), lr=0.1), policy="drop",
                         metrics_port=0)
        spare = nft.DistributedDataParallel(g0.manager, torch.nn.Linear(4, 2))
        sgd = torch.optim.SGD(spare.parameters(), lr=0.1)
        wrapped = nft.Sentinel(spare, OptimizerWrapper(g0.manager, sgd), metrics_port=0)
        assert wrapped.optimizer is sgd  # torchft's wrapper: the sentinel steps what it wraps
        wrapped.abandon()
        with pytest.raises(ConfigError, match="heals a group from a healthy peer"):
            spare = nft.DistributedDataParallel(g0.manager, torch.nn.Linear(4, 2))
            nft.Sentinel(spare, torch.optim.SGD(spare.parameters(), lr=0.1),
                         policy="rollback", metrics_port=0)

        def die(g: Group) -> None:
            if g.manager.current_step() == 3:
                g.manager.shutdown(wait=False)
                g.manager._pg.abort()
                raise SystemExit("g1 died")

        t1 = threading.Thread(target=g1.train, args=(lambda g: False, die), daemon=True)
        t1.start()
        survivor = run([(g0, lambda g: g.manager.current_step() >= 7)])
        join([t1])
        join(survivor)
    assert isinstance(g1.error, SystemExit)
    assert g0.error is None, g0.error
    regrouped = [r for r in g0.results if r.regrouped]
    assert regrouped and not any(r.committed for r in regrouped)
    assert regrouped[0].torchft_step == 3 and "regroups" in regrouped[0].reason
    assert g0.manager.current_step() == 7 and g0.finite


def test_groups_of_two_ranks_veto_on_every_rank_of_every_group(tmp_path: Path) -> None:
    """Two replica groups of two ranks each: a NaN in group 1 rank 1's gradients reaches the
    rank 1 of every group through the health row, and should_commit() (agreed within each
    group) vetoes the step on all four ranks at once; the replicas stay identical."""
    with lighthouse() as house:
        stores = [TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
                  for _ in range(2)]
        ranks = [Group(house, g, 0, tmp_path, rank=(r, 2, stores[g]),
                       inject="kind=grad,rank=0,steps=2-2" if (g, r) == (1, 1) else None)
                 for g in (0, 1) for r in (0, 1)]
        join(run([(g, lambda g: g.manager.current_step() >= 5) for g in ranks]))
    for g in ranks:
        assert g.error is None and g.finite, g.error
        vetoed = [r for r in g.results if not r.committed]
        assert [r.torchft_step for r in vetoed] == [2]
    for r in ranks[1::2]:  # the ranks 1 name it: (group, rank, host)
        assert [(p.group, p.rank, p.host) for p in r.results[2].poisoned] == [
            ("g1", 1, "node1r1")]
    for a, b in ((ranks[0], ranks[2]), (ranks[1], ranks[3])):
        assert all(torch.equal(x, y) for x, y in zip(a.weights(), b.weights(), strict=True))
