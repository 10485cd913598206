"""What a torchft step pays for nansentinel: torchft's own DDP and ``OptimizerWrapper``
against ``nansentinel.torchft`` (its DDP, ``Sentinel.step()``), on the same model and data.

Two replica groups of one process each, as threads of this process (as torchft's own
integration tests run them), a lighthouse in-process, gloo on the CPU. The arms alternate
round by round, each round with a fresh lighthouse, so that a busy machine weighs on both.
Printed: the median step time of each arm, and the median of the health row's own all-reduce
(``nansentinel.wire.group_rows.agree``, as step/group_scope.py calls it) where it takes
one; on nansentinel's torchft DDP the row rides with the last bucket and takes none.

    python bench/torchft_overhead.py                 # 3 rounds of 80 steps, ~30 s
    python bench/torchft_overhead.py --rounds 1 --steps 10   # the smoke run, a few seconds
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore
from torchft._torchft import LighthouseServer
from torchft.ddp import DistributedDataParallel as TorchFTDDP
from torchft.manager import Manager
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

import nansentinel.step.group_scope as ft_groups
import nansentinel.torchft as nft

ARMS = ("torchft", "sentinel")


def plain_step(model: Any, wrapper: Any) -> None:
    """One step of plain torchft's loop (``OptimizerWrapper`` asks ``should_commit()``): the
    step both torchft benches time for their baseline (this one and torchft_processes.py)."""
    wrapper.zero_grad()
    model(torch.randn(64, 256)).pow(2).mean().backward()
    wrapper.step()


def watched_step(model: Any, opt: Any, manager: Any, sentinel: Any) -> None:
    """The same step under ``nansentinel.torchft`` (its ``step()`` asks ``should_commit()``
    and steps the optimizer): what both torchft benches time against :func:`plain_step`."""
    opt.zero_grad()
    manager.start_quorum()
    x = sentinel.check_batch(torch.randn(64, 256))
    loss = model(x).pow(2).mean()
    sentinel.check_loss(loss)
    loss.backward()
    sentinel.step()


def _group(house: LighthouseServer, gid: int, arm: str, steps: int, warmup: int,
           out: dict[int, list[float]]) -> None:
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=2,
        load_state_dict=module.load_state_dict, state_dict=module.state_dict,
        replica_id=f"g{gid}", store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=house.address(), timeout=timedelta(seconds=30))
    times: list[float] = []
    try:
        if arm == "torchft":
            model: Any = TorchFTDDP(manager, module)
            wrapper = OptimizerWrapper(manager, opt)
            for _ in range(steps):
                started = time.perf_counter()
                plain_step(model, wrapper)
                times.append(time.perf_counter() - started)
        else:
            model = nft.DistributedDataParallel(manager, module)
            sentinel = nft.Sentinel(model, opt, metrics_port=0)
            for _ in range(steps):
                started = time.perf_counter()
                watched_step(model, opt, manager, sentinel)
                times.append(time.perf_counter() - started)
            sentinel.close()
    finally:
        manager.shutdown(wait=False)
    out[gid] = times[warmup:]


def round_of(arm: str, steps: int) -> list[float]:
    """One round of ``steps`` on two replica groups: their step times after a warm-up."""
    house = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200,
                             heartbeat_timeout_ms=2000)
    out: dict[int, list[float]] = {}
    threads = [threading.Thread(target=_group, args=(house, g, arm, steps, steps // 4, out))
               for g in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        house.shutdown()
    return out.get(0, []) + out.get(1, [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    row_times: list[float] = []
    agree = ft_groups.agree

    def timed_agree(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return agree(*a, **k)
        finally:
            row_times.append(time.perf_counter() - started)

    ft_groups.agree = timed_agree  # type: ignore[assignment]
    samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(args.rounds):
        for arm in ARMS:
            samples[arm] += round_of(arm, args.steps)
    base = statistics.median(samples["torchft"])
    for arm in ARMS:
        median = statistics.median(samples[arm])
        print(f"{arm:9s} median step {median * 1e3:7.2f} ms  ({median / base:.3f}x torchft)")
    if row_times:  # a round trip of its own: only where the row cannot ride with the gradients
        print(f"health row all-reduce median {statistics.median(row_times) * 1e3:.2f} ms "
              f"({len(row_times)} steps)")
    else:
        print("health row: no round trip of its own (it left with the last DDP bucket)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
