"""What a torchft step pays for nansentinel when each replica group is its own process, as users
run them (``bench/torchft_overhead.py`` runs the groups as threads of one process, where they
share one interpreter lock and the comparison is blurred by it).

A lighthouse in this process, ``--groups`` replica groups of one rank each, each a separate
process (spawned) with its own store and gloo group, a 4-layer 256-wide MLP on the CPU. The two
arms (torchft's DDP and ``OptimizerWrapper``; ``nansentinel.torchft``) alternate round by round,
each round with a fresh lighthouse and fresh processes, so a busy machine weighs on both. Each
process times its steps after a warm-up (wall, and its main thread's CPU time) and, in the
sentinel arm, the health row's own all-reduce (``wire.group_rows.agree``), which a healthy
step pays only where the row cannot ride with the gradients (docs/torchft.md).

    python bench/torchft_processes.py                      # 3 groups, 2 rounds of 60 steps
    python bench/torchft_processes.py --groups 2 --rounds 1 --steps 20
    python bench/torchft_processes.py --layout fsdp2       # FSDP2 + torchft's all-reduce hook
    python bench/torchft_processes.py --parts --steps 300  # one group alone: where its time goes
    python bench/torchft_processes.py --interleave 10 --steps 800  # both arms, same processes

``--parts`` runs one group alone in this process, each arm in turn (no peers, so no waiting on
them): the median step of each arm and, in the sentinel arm, the time of each part of the
sentinel (and of the torchft calls it makes) per step: each part timed around each call, its
median call times its calls a step (parts nest: ``launch_exchange`` holds ``pack``).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import multiprocessing as mp
import queue as queue_module
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

# The checkout's nansentinel, in this process and in the groups' (spawned processes start
# with this sys.path), installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ARMS = ("torchft", "sentinel")


def _fsdp2(module: Any, manager: Any, store: Any) -> Any:
    """torchft's FSDP2 recipe on a group of one rank: ``fully_shard`` over the group's own gloo
    group, each FSDP module's all-reduce hook averaging across the groups through a
    ``ManagedProcessGroup`` (torchtitan's fault-tolerant layout)."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchft.process_group import ManagedProcessGroup

    dist.init_process_group("gloo", store=PrefixStore("group", store), rank=0, world_size=1)
    mesh = DeviceMesh("cpu", [0])
    for layer in module:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    replicate = ManagedProcessGroup(manager)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(
                lambda out: dist.all_reduce(out, group=replicate, op=dist.ReduceOp.AVG))
    return module


def _group(address: str, gid: int, groups: int, arm: str, steps: int, layout: str,
           queue: Any, block: int = 0) -> None:
    """One replica group (one rank): its step times after a warm-up, and the health row's.
    ``block`` > 0 (the sentinel arm): the sentinel watches every other ``block`` steps only,
    the steps between are plain torchft's in the same processes (:func:`interleaved`)."""
    import torch
    from torch.distributed import TCPStore
    from torchft.ddp import DistributedDataParallel as TorchFTDDP
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo
    from torchft_overhead import plain_step, watched_step  # the very steps both benches time

    import nansentinel.step.group_scope as ft_groups
    import nansentinel.torchft as nft

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    rows: list[float] = []
    agree = ft_groups.agree

    def timed_agree(*a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        try:
            return agree(*a, **k)
        finally:
            rows.append(time.perf_counter() - started)

    ft_groups.agree = timed_agree  # type: ignore[assignment]
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=groups,
        load_state_dict=module.load_state_dict, state_dict=module.state_dict,
        replica_id=f"g{gid}", store_addr="localhost", store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=address, timeout=timedelta(seconds=60))
    times: list[float] = []
    cpus: list[float] = []  # the process's main thread's CPU time a step
    plain: list[bool] = []  # interleaved: the steps the sentinel did not watch
    try:
        if layout == "fsdp2":
            model: Any = _fsdp2(module, manager, store)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sentinel: Any = None
        if arm == "torchft":
            model = TorchFTDDP(manager, module) if layout == "ddp" else model
        else:
            if layout == "ddp":
                model = nft.DistributedDataParallel(manager, module)
            own = {"manager": manager} if layout == "fsdp2" else {}
            sentinel = nft.Sentinel(model, opt, metrics_port=0, env={}, **own)
            watch = _watching(sentinel, model)
        wrapper = OptimizerWrapper(manager, opt)

        for step in range(steps):
            # Interleaved, the same processes, model and optimizer take plain torchft's steps
            # in every other block, the sentinel switched off.
            bare = sentinel is None or (block > 0 and (step // block) % 2 == 0)
            if sentinel is not None:
                watch(not bare)
            plain.append(bare)
            started, cpu = time.perf_counter(), time.thread_time()
            if bare:
                plain_step(model, wrapper)
            else:
                watched_step(model, opt, manager, sentinel)
            times.append(time.perf_counter() - started)
            cpus.append(time.thread_time() - cpu)
        if sentinel is not None:
            watch(True)
            sentinel.close()
    finally:
        manager.shutdown(wait=False)
    warmup = steps // 4
    queue.put((gid, times[warmup:], rows[warmup:], cpus[warmup:], plain[warmup:]))


def _watching(sentinel: Any, model: Any) -> Any:
    """``watch(on)``: whether the sentinel watches the gradients' path (off: nansentinel's
    torchft DDP hook reduces as torchft's does, the FSDP2 all-reduce hooks call the user's
    hook at once, as before the sentinel wrapped them)."""
    hooked = getattr(model, "_hook_state", None)
    if hooked is not None:  # nansentinel's torchft DDP
        path = hooked.path

        def watch(on: bool) -> None:
            hooked.path = path if on else None
        return watch
    carrier = next(s.carrier for s in sentinel.scopes if getattr(s, "carrier", None))
    sink = carrier.sink

    def watch_hooks(on: bool) -> None:
        carrier.sink = sink if on else None
    return watch_hooks


def round_of(arm: str, groups: int, steps: int, layout: str
             ) -> tuple[list[float], list[float], list[float]]:
    """One round: ``groups`` processes; their step times, health-row times and CPU times a
    step (each process's main thread) after warm-up."""
    results = _spawned(arm, groups, steps, layout)
    times = [t for _, ts, *_ in results for t in ts]
    rows = [r for _, _, rs, *_ in results for r in rs]
    cpus = [c for *_, cs, _ in results for c in cs]
    return times, rows, cpus


def _spawned(arm: str, groups: int, steps: int, layout: str, block: int = 0) -> list[Any]:
    """``groups`` processes and a lighthouse: what each group's :func:`_group` reported."""
    from torchft._torchft import LighthouseServer

    house = LighthouseServer(bind="[::]:0", min_replicas=groups, join_timeout_ms=1000,
                             heartbeat_timeout_ms=5000)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_group, args=(house.address(), g, groups, arm, steps, layout,
                                                   queue, block))
             for g in range(groups)]
    try:
        for p in procs:
            p.start()
        results = _reports(queue, procs, timeout=600.0)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        house.shutdown()
    return results


def _reports(queue: Any, procs: list[Any], timeout: float, poll: float = 1.0
             ) -> list[Any]:
    """Each group's report, in the order they come; a group that died first (its traceback
    is above) or a bench past ``timeout`` seconds ends the bench within ``poll`` seconds,
    naming them, instead of the others waiting out the timeout."""
    results: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=poll))
        except queue_module.Empty:
            dead = [f"group {g} (exit code {p.exitcode})" for g, p in enumerate(procs)
                    if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"torchft_processes: {', '.join(dead)} ended without a "
                                 "report; its traceback is above") from None
            if time.monotonic() > deadline:
                raise SystemExit(f"torchft_processes: {len(procs) - len(results)} of "
                                 f"{len(procs)} groups sent no report within {timeout:g} s"
                                 ) from None
    return results


def interleaved(groups: int, steps: int, layout: str, block: int) -> None:
    """Both arms in the same processes, ``block`` steps each in turn: the sentinel built once
    and switched off for every other block (nansentinel's torchft DDP hook then reduces as
    torchft's, the FSDP2 hooks go straight to the user's), against plain torchft's loop
    (``OptimizerWrapper``) on the same model, groups and lighthouse. A machine whose speed
    drifts over seconds weighs on both arms alike, and each pair of blocks gives a ratio."""
    results = _spawned("sentinel", groups, steps, layout, block)
    times = [t for _, ts, *_ in results for t in ts]
    cpus = [c for *_, cs, _ in results for c in cs]
    plain = [b for *_, bs in results for b in bs]
    arms = {"torchft": [i for i, p in enumerate(plain) if p],
            "sentinel": [i for i, p in enumerate(plain) if not p]}
    print(f"layout {layout}, {groups} groups, {steps} steps a group in blocks of {block} "
          "(the sentinel off, then on, in the same processes)")
    base = statistics.median(times[i] for i in arms["torchft"])
    base_cpu = statistics.median(cpus[i] for i in arms["torchft"])
    for arm, at in arms.items():
        wall, cpu = statistics.median(times[i] for i in at), statistics.median(cpus[i] for i in at)
        print(f"{arm:9s} median step {wall * 1e3:7.2f} ms ({wall / base:.3f}x torchft), CPU "
              f"{cpu * 1e3:6.2f} ms ({cpu / base_cpu:.3f}x), {len(at)} steps")
    # Consecutive blocks (off, then on) of one group, paired: each pair's ratio of medians.
    pairs = []
    for _, ts, _, _, bare in results:
        blocks = [(flag, [t for _, t in run]) for flag, run in
                  itertools.groupby(zip(bare, ts, strict=True), key=lambda x: x[0])]
        for (off, first), (on, second) in itertools.pairwise(blocks):
            if off and not on and len(first) > 2 and len(second) > 2:
                pairs.append(statistics.median(second) / statistics.median(first))
    if pairs:
        print(f"paired blocks: {len(pairs)}, their wall ratios' median "
              f"{statistics.median(pairs):.3f}x (quartiles "
              f"{statistics.quantiles(pairs, n=4)[0]:.3f}x to "
              f"{statistics.quantiles(pairs, n=4)[2]:.3f}x)")


#: (module, owner, attribute, label): what --parts times, in the sentinel arm.
PARTS = (
    ("nansentinel.step.sentinel", "Sentinel", "check_batch", "check_batch"),
    ("nansentinel.step.sentinel", "Sentinel", "check_loss", "check_loss"),
    ("nansentinel.engines.torchft", "TorchFTPath", "before_reduction", "bucket checks"),
    ("nansentinel.checks", None, "tensor_norm",
     "  norms (batch, buckets, FSDP2 hook inputs on a shard group of one)"),
    ("nansentinel.step.current", "CurrentStep", "launch_exchange",
     "launch_exchange (health row, pack)"),
    ("nansentinel.step.current", None, "pack", "  pack"),
    ("nansentinel.checks.health", "LocalHealth", "host_row", "  health row (host floats)"),
    ("nansentinel.step.group_scope", "ReplicaGroups", "row", "ride-along row"),
    ("nansentinel.step.sentinel", "Sentinel", "_decide", "the ranks' decision (_decide)"),
    ("nansentinel.step.group_scope", "ReplicaGroups", "agree",
     "the groups' decision (agree, with should_commit and the optimizer)"),
    ("torchft.manager", "Manager", "should_commit", "  torchft should_commit"),
)


def parts(steps: int, layout: str) -> None:
    """One group alone in this process, each arm in turn: median steps, the sentinel's parts."""
    import importlib
    import queue as queue_module

    import torch.distributed as dist
    from torchft._torchft import LighthouseServer

    spent: dict[str, list[float]] = {label: [] for *_, label in PARTS}

    def timed(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label].append(time.perf_counter() - started)

        setattr(owner, name, wrapper)

    medians = {}
    for arm in ARMS:
        if arm == "sentinel":
            for module, owner, name, label in PARTS:
                found = importlib.import_module(module)
                timed(getattr(found, owner) if owner else found, name, label)
        house = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100,
                                 heartbeat_timeout_ms=5000)
        queue: Any = queue_module.Queue()
        try:
            _group(house.address(), 0, 1, arm, steps, layout, queue)
        finally:
            house.shutdown()
            if dist.is_initialized():  # FSDP2's group of one, made again for the next arm
                dist.destroy_process_group()
        _, times, *_ = queue.get()
        medians[arm] = statistics.median(times)
    print(f"layout {layout}, one group alone, {steps} steps ({len(times)} timed after warm-up)")
    for arm in ARMS:
        print(f"{arm:9s} median step {medians[arm] * 1e3:7.3f} ms")
    # A part's median call times its calls a step: the warm-up's first calls left out.
    for label, calls in spent.items():
        per_step = statistics.median(calls) * len(calls) / steps if calls else 0.0
        print(f"  {label:66s} {per_step * 1e3:6.3f} ms/step")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layout", choices=("ddp", "fsdp2"), default="ddp",
                        help="nansentinel's torchft DDP, or FSDP2 with torchft's all-reduce hook")
    parser.add_argument("--interleave", type=int, default=0, metavar="BLOCK",
                        help="one run, both arms in the same processes, BLOCK steps each in "
                             "turn (the sentinel switched off and on); --steps a group")
    parser.add_argument("--parts", action="store_true",
                        help="one group alone in this process: where the sentinel's time goes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parts:
        parts(args.steps, args.layout)
        return 0
    if args.interleave:
        interleaved(args.groups, args.steps, args.layout, args.interleave)
        return 0
    samples: dict[str, list[float]] = {arm: [] for arm in ARMS}
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    rows: list[float] = []
    paired: list[float] = []  # each round's sentinel median over its torchft median
    for _ in range(args.rounds):
        medians = {}
        for arm in ARMS:
            times, row, cpus = round_of(arm, args.groups, args.steps, args.layout)
            samples[arm] += times
            cpu[arm] += cpus
            rows += row
            medians[arm] = statistics.median(times)
        paired.append(medians["sentinel"] / medians["torchft"])
    print(f"layout {args.layout}, {args.groups} groups")
    base = statistics.median(samples["torchft"])
    for arm in ARMS:
        median = statistics.median(samples[arm])
        print(f"{arm:9s} median step {median * 1e3:7.2f} ms  ({median / base:.3f}x torchft, "
              f"{len(samples[arm])} steps)")
    # A machine whose speed drifts between rounds weighs on the pooled medians; each round's
    # two arms ran back to back, so their ratio is less moved by it.
    print(f"per-round wall ratios {' '.join(f'{r:.3f}' for r in paired)}, median "
          f"{statistics.median(paired):.3f}x")
    # The CPU time of each group's main thread a step (the loop, the checks, the decision):
    # what the sentinel adds, less moved than the wall time by other jobs on the machine.
    base_cpu = statistics.median(cpu["torchft"])
    for arm in ARMS:
        median = statistics.median(cpu[arm])
        print(f"{arm:9s} median CPU a step {median * 1e3:7.2f} ms  ({median / base_cpu:.3f}x "
              "torchft)")
    if rows:  # a round trip of its own: only where the row cannot ride with the gradients
        print(f"health row all-reduce median {statistics.median(rows) * 1e3:.2f} ms "
              f"({len(rows)} steps)")
    else:
        print("health row: no round trip of its own (it left with the gradients)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
