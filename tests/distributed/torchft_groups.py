"""Replica groups of a torchft job for the tests, for real on CPU: a lighthouse in-process
(``torchft._torchft.LighthouseServer``), each group a thread with its own TCPStore,
``Manager``, ``ProcessGroupGloo`` and nansentinel's torchft DDP (as torchft's own integration
tests run them).

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

import torch
from prometheus_client import CollectorRegistry
from torch.distributed import TCPStore
from torchft._torchft import LighthouseServer
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

import nansentinel.torchft as nft
from nansentinel.effects.metrics import SentinelMetrics


@contextmanager
def lighthouse() -> Iterator[LighthouseServer]:
    """A fresh lighthouse on a free port. A group that stops heartbeating is dropped in 0.5 s;
    a quorum waits up to 3 s for every heartbeating group to ask (the groups of a test start
    together, even on a loaded machine, and none heals past a step the test looks at)."""
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000,
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
            pg=ProcessGroupGloo(timeout=timedelta(seconds=15)), min_replica_size=1,
            load_state_dict=self._load, state_dict=self._state, replica_id=f"g{gid}",
            store_addr="localhost", store_port=self.store.port, rank=grank, world_size=gsize,
            lighthouse_addr=house.address(), timeout=timedelta(seconds=15),
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
