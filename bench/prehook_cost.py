"""The pre-hook seam's cost (torch >= 2.14): host work per collective, and a healthy step.

The pre-hook path (nansentinel/engines/prehook.py) checks each gradient reduction of a loop
that reduces by hand in a process-group pre-hook. Two measurements, each alternating the
variants round by round in one run, medians over the measured steps:

``--mode host`` (default; one process, torch's fake backend at world size 2, rank 0, so that
every collective is a no-op and what is timed is host work): 64 x ``Linear(64)`` (weight and
bias), the loop all-reducing each layer's gradients as one flattened buffer (64 collectives a
step, as DDP makes 64 buckets of the same model at ``bucket_cap_mb=0.01``). CPU time in the
thread that runs the hook, per collective:

- ``loop``: the loop alone, no hook and no sentinel (the baseline of the step ratios);
- ``prehook_bare``: a bare Python pre-hook that reads its ``PreHookArgs`` (the floor of any
  pre-hook);
- ``prehook_sentinel``: ``nansentinel.Sentinel(model, optimizer)``: the pre-hook path;
- ``ddp_pyhook`` and ``ddp_sentinel``: DDP over the same model with a bare Python comm hook
  and with the sentinel's comm hook (bench/hook_cost.py's), per bucket: today's DDP seam.

``--mode step`` (2 gloo ranks on the CPU): a 6-layer MLP (width 512) whose loop all-reduces
every parameter's gradient (``dist.all_reduce(p.grad)``, 12 a step) then steps AdamW;
``baseline`` (the loop alone), ``sentinel`` (the same loop with ``check_batch``,
``check_loss`` and ``step()``: the pre-hook path) and ``checked`` (the same with
``check_grads()`` before the all-reduces: the local path's contract, which the pre-hook
path keeps), in blocks rotated round by round; per round the median step's wall time and
process CPU time, and each one's ratio to the baseline's of the same round; the medians of
those ratios.

Usage::

    python bench/prehook_cost.py                    # ~30 s
    python bench/prehook_cost.py --mode step        # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hook_cost  # bench/hook_cost.py: the DDP variants, as measured there

HOST_VARIANTS = ("loop", "prehook_bare", "prehook_sentinel", "ddp_pyhook", "ddp_sentinel")


class ThreadClock:
    """CPU time and calls inside a wrapped function, this step."""

    def __init__(self) -> None:
        self.cpu, self.calls = 0.0, 0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any) -> Any:
            started = time.thread_time()
            try:
                return fn(*args)
            finally:
                self.cpu += time.thread_time() - started
                self.calls += 1

        return timed

    def take(self) -> tuple[float, int]:
        out, self.cpu, self.calls = (self.cpu, self.calls), 0.0, 0
        return out


def _layers(width: int, layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _reduce_by_layer(model: torch.nn.Sequential) -> None:
    """The loop's own reduction: each layer's gradients as one flat buffer."""
    for layer in model:
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def host_run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One variant of ``--mode host``: CPU µs per collective (or bucket), medians."""
    import nansentinel
    from nansentinel.engines import prehook

    clock = ThreadClock()
    sentinel, model, opt, pg = None, None, None, dist.group.WORLD
    if name.startswith("ddp"):
        ns = argparse.Namespace(width=args.width, layers=args.layers, bucket_cap_mb=0.01,
                                report_dir=args.report_dir)
        inner = hook_cost.HookClock()
        model, opt, sentinel = hook_cost.build(
            "pyhook" if name == "ddp_pyhook" else "sentinel_hook", ns, torch.device("cpu"),
            inner)
    else:
        model = _layers(args.width, args.layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name == "prehook_bare":
            pg.register_pre_hook(7, clock.wrap(lambda a: (a.name, a.input_tensors, a.op_id)))
        elif name == "prehook_sentinel":
            original = prehook.PreHookPath._on
            prehook.PreHookPath._on = clock.wrap(original)
            try:
                sentinel = nansentinel.Sentinel(model, opt, env={}, metrics_port=0,
                                                report_dir=args.report_dir)
            finally:
                prehook.PreHookPath._on = original
            assert sentinel.gradients.caps.label == "collective pre-hooks"
    x = torch.randn(8, args.width)
    per_call, steps, cpus = [], [], []
    for step in range(args.warmup + args.steps):
        started, cpu_started = time.perf_counter(), time.thread_time()
        if sentinel is not None:
            sentinel.check_batch({"x": x})
        loss = model(x).pow(2).mean()
        if sentinel is not None:
            sentinel.check_loss(loss)
        loss.backward()
        if not name.startswith("ddp"):
            _reduce_by_layer(model)
        if sentinel is not None:
            sentinel.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        done, cpu_done = time.perf_counter(), time.thread_time()
        if name.startswith("ddp"):
            cpu, calls, _ = inner.take()
        else:
            cpu, calls = clock.take()
        if step >= args.warmup:
            per_call.append(cpu / calls if calls else 0.0)
            steps.append(done - started)
            cpus.append(cpu_done - cpu_started)
    if sentinel is not None:
        sentinel.close()
    if name == "prehook_bare":
        pg.unregister_pre_hook(7)
    return {"us_per_call": statistics.median(per_call) * 1e6, "calls": calls,
            "step_us": statistics.median(steps) * 1e6,
            "step_cpu_us": statistics.median(cpus) * 1e6}


def host(args: argparse.Namespace) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch.set_num_threads(1)
    rows: dict[str, list[dict[str, Any]]] = {v: [] for v in HOST_VARIANTS}
    try:
        for _ in range(args.rounds):
            for name in HOST_VARIANTS:
                rows[name].append(host_run(name, args))
    finally:
        dist.destroy_process_group()
    print(f"host work per collective, fake backend (world 2, rank 0), torch "
          f"{torch.__version__}, {args.layers} x Linear({args.width}), {args.steps} steps x "
          f"{args.rounds} rounds (medians of rounds)")
    print("| variant | hook calls a step | CPU µs per call (per collective / bucket) | "
          "whole step µs | step ratio vs loop (wall / CPU, median of rounds) |")
    print("|---|---:|---:|---:|---:|")
    loop = rows["loop"]
    for name, runs in rows.items():
        us = statistics.median(r["us_per_call"] for r in runs)
        step = statistics.median(r["step_us"] for r in runs)
        wall = statistics.median(r["step_us"] / b["step_us"]
                                 for r, b in zip(runs, loop, strict=True))
        cpu = statistics.median(r["step_cpu_us"] / b["step_cpu_us"]
                                for r, b in zip(runs, loop, strict=True))
        print(f"| {name} | {runs[0]['calls']} | {us:.1f} | {step:.0f} | "
              f"{wall:.3f} / {cpu:.3f} |")


def _step_rank(rank: int, world: int, port: int, args: argparse.Namespace,
               out: Any) -> None:
    import nansentinel

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(args.depth) for m in
                                  (torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.hidden, generator=g)
    variants = ("baseline", "sentinel", "checked")
    ratios: dict[str, list[float]] = {f"{v}_{k}": [] for v in variants[1:]
                                      for k in ("wall", "cpu")}
    medians: dict[str, list[float]] = {v: [] for v in variants}
    for rnd in range(args.rounds):
        order = variants[rnd % 3:] + variants[:rnd % 3]  # rotated: drift hits each alike
        got: dict[str, tuple[float, float]] = {}
        for name in order:
            sentinel = (nansentinel.Sentinel(model, opt, env={}, metrics_port=0,
                                             report_dir=args.report_dir)
                        if name != "baseline" else None)
            walls, cpus = [], []
            for step in range(args.warmup + args.steps):
                dist.barrier()
                w0, c0 = time.perf_counter(), time.process_time()
                if sentinel is not None:
                    sentinel.check_batch(x)
                loss = model(x).pow(2).mean()
                if sentinel is not None:
                    sentinel.check_loss(loss)
                loss.backward()
                if sentinel is not None and name == "checked":
                    sentinel.check_grads()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
                if sentinel is not None:
                    sentinel.step()
                else:
                    opt.step()
                opt.zero_grad(set_to_none=True)
                if step >= args.warmup:
                    walls.append(time.perf_counter() - w0)
                    cpus.append(time.process_time() - c0)
            if sentinel is not None:
                sentinel.close()
            got[name] = (statistics.median(walls), statistics.median(cpus))
        for name in variants[1:]:
            ratios[f"{name}_wall"].append(got[name][0] / got["baseline"][0])
            ratios[f"{name}_cpu"].append(got[name][1] / got["baseline"][1])
        for name in variants:
            medians[name].append(got[name][0])
    if rank == 0:
        out.put({"ratios": ratios, "medians": medians})
    dist.destroy_process_group()


def step(args: argparse.Namespace) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_step_rank, args=(r, 2, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = out.get(timeout=1800)
    for p in procs:
        p.join()
    ratios, medians = got["ratios"], got["medians"]
    params = (args.hidden * args.hidden + args.hidden) * args.depth
    print(f"healthy step, 2 gloo CPU ranks, torch {torch.__version__}, MLP {args.depth} x "
          f"Linear({args.hidden}) ({params / 1e6:.2f} M parameters, {2 * args.depth} "
          f"all-reduces a step), batch {args.batch}, {args.rounds} rounds x {args.steps} "
          "steps per variant, alternating")
    print("- median step ms: " + ", ".join(
        f"{k} {statistics.median(v) * 1e3:.2f}" for k, v in medians.items()))
    for name, what in (("sentinel", "the pre-hook path (no check_grads())"),
                       ("checked", "check_grads() before the all-reduces (the local path's "
                                   "contract)")):
        wall, cpu = ratios[f"{name}_wall"], ratios[f"{name}_cpu"]
        print(f"- {what} / baseline, median of rounds: wall {statistics.median(wall):.3f} "
              f"(rounds {min(wall):.3f}-{max(wall):.3f}), CPU time "
              f"{statistics.median(cpu):.3f} (rounds {min(cpu):.3f}-{max(cpu):.3f})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/prehook_cost.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("host", "step"), default="host")
    p.add_argument("--layers", type=int, default=64, help="host: Linear layers (default 64)")
    p.add_argument("--width", type=int, default=64, help="host: their width (default 64)")
    p.add_argument("--depth", type=int, default=6, help="step: MLP layers (default 6)")
    p.add_argument("--hidden", type=int, default=512, help="step: their width (default 512)")
    p.add_argument("--batch", type=int, default=32, help="step: batch (default 32)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--report-dir", default="/tmp/nansentinel-prehook-cost")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not hasattr(dist.ProcessGroup, "register_pre_hook"):
        print(f"torch {torch.__version__} has no ProcessGroup.register_pre_hook (torch >= "
              "2.14): nothing to measure", file=sys.stderr)
        return 2
    host(args) if args.mode == "host" else step(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
