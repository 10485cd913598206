"""nansentinel on torchft (torchft_groups.py: a real lighthouse, replica groups as threads
over gloo): a NaN in one group vetoed on every group, named there, struck out live while the
others step on; a dead peer is a regroup, never a crash."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

torchft = pytest.importorskip("torchft")

from torchft.optim import OptimizerWrapper  # noqa: E402

import nansentinel.torchft as nft  # noqa: E402
from nansentinel.common.exclusion import ExclusionStore  # noqa: E402
from nansentinel.config import ConfigError  # noqa: E402
from nansentinel.result import HostExcludedError, SentinelUsageError  # noqa: E402
from tests.distributed.torchft_groups import Group, join, lighthouse, run  # noqa: E402

pytestmark = pytest.mark.timeout(120)


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
        struck = ExclusionStore(exclusions).records()[0].step
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
    # g1's incident reports carry its replica group in their name and job_id, and are named
    # by torchft's step, the count of the exclusion record and the logs (issue 53).
    reports = sorted((tmp_path / "reports").glob("*.json"))
    assert [p.name for p in reports] == [
        f"incident-torchft-g1-step{s:08d}.json" for s in vetoed[g1]], vetoed[g1]
    assert [json.loads(p.read_text())["step"] for p in reports] == vetoed[g1]
    assert struck == vetoed[g0][-1], (struck, vetoed)
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


def test_a_dead_peer_is_a_regroup_never_a_crash(tmp_path: Path) -> None:
    """g1 dies in the middle of a step (after its forward, before its gradients leave): g0's
    backward and step() raise nothing, the step is not committed (``regrouped``), and g0
    trains on alone at the next quorum. torchft's own DDP and rollbacks are refused with the
    reason; torchft's OptimizerWrapper is unwrapped."""
    with lighthouse() as house:
        g0, g1 = Group(house, 0, 0, tmp_path), Group(house, 1, 0, tmp_path)

        other = torch.nn.Linear(4, 2)
        with pytest.raises(SentinelUsageError, match="torchft's own DDP"):
            nft.Sentinel(torchft.ddp.DistributedDataParallel(g0.manager, other),
                         torch.optim.SGD(other.parameters(), lr=0.1))
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
