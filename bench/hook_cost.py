"""The healthy step's host work per DDP bucket: the sentinel's comm hook against a bare one.

DDP calls a Python communication hook once per gradient bucket, so a Python hook has a floor
of its own (the issue's H200 run: a bare Python hook cost 1.022 of a 625 M bf16 DDP step at
25 MB buckets, 1.010 at 100 MB). This script measures, on one process (NCCL at world size 1
on a GPU, gloo on the CPU), a model of many small layers with small buckets, so that every
kernel is tiny and what is timed is host work:

- ``builtin``: DDP's own C++ all-reduce (no Python hook): the floor below any Python hook;
- ``pyhook``: a bare Python hook as torch's ``default_hooks.allreduce_hook`` writes it
  (scale, ``all_reduce``, ``future.then``);
- ``sentinel``: ``nansentinel.Sentinel(model, optimizer)`` with every default: on NCCL no
  comm hook at all (DDP's C++ all-reduce, and one callback at the end of backward that checks
  the step; ``nansentinel/engines/ddp_seam.py``), elsewhere its comm hook;
- ``sentinel_end``: the end-of-backward seam forced (what NCCL takes by default; run where
  the default is the comm hook: gloo);
- ``sentinel_hook``: the sentinel's comm hook forced (what gloo takes), the check on the last
  bucket;
- ``sentinel_each``: the comm hook with every bucket checked in its own call (one norm
  launch a bucket), as the hook did before issue 46 (3e59761): the "before" column on the
  same machine, where the old checkout cannot be put on ``PYTHONPATH``.

The sentinel's time per bucket is its hook's CPU time, or its end-of-backward callback's
divided by the bare hook's bucket count (the DDP model is the same).

On the CPU the default backend is torch's fake one (every collective a no-op, as in
``bench/scale.py``): gloo's all-reduce costs ~40 µs a call there, ten times the hooks' own
work, and its spread hides them.

For each, the hook's own CPU time (``time.thread_time`` inside the hook, in the thread that
runs it: the autograd engine's on CUDA) per bucket, and per step the host time of
``backward()`` and of the whole step (batch check, loss check, backward, ``step()`` or
``optimizer.step()``), medians over the measured steps. Each step starts after a
``torch.cuda.synchronize()``, so host time is not the GPU's.

Usage::

    python bench/hook_cost.py                      # ~20 s on a GPU, ~40 s on the CPU
    python bench/hook_cost.py --json out.json --layers 96 --width 64

Run it against another checkout by putting that checkout first on ``PYTHONPATH``: the
script uses only ``nansentinel.Sentinel`` and the hook's module path, which both have.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

VARIANTS = ("builtin", "pyhook", "sentinel", "sentinel_end", "sentinel_hook", "sentinel_each")


def bare_hook(process_group, bucket):
    """torch's ``default_hooks.allreduce_hook``, as a user would write it in Python."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(group.size())
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: buffer)  # what fut.value()[0] is, on any backend


def each_bucket(path: Any) -> None:
    """Check ``path``'s (the sentinel's DDP path) steps bucket by bucket, the path it keeps for
    gradients that are bucket views, as every step was before issue 46. A checkout without
    the last-bucket check (3e59761) is left as it is: it checks every bucket already."""
    first = getattr(path, "first_bucket", None)
    if first is None:
        return

    def first_bucket(buffer: torch.Tensor) -> None:
        first(buffer)
        path.at_last = False

    path.first_bucket = first_bucket


class HookClock:
    """Wraps a comm hook: CPU seconds inside it and the calls, this step."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.calls = 0
        self.each: list[float] = []
        self.once = 0.0

    def wrap(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)  # DDP inspects the hook's signature
        def timed(state, bucket):
            started = time.thread_time()
            try:
                return hook(state, bucket)
            finally:
                spent = time.thread_time() - started
                self.cpu += spent
                self.calls += 1
                self.each.append(spent)

        return timed

    def wrap_call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A once-a-step callback: its CPU time counted, not its calls."""

        @functools.wraps(fn)
        def timed(*args: Any) -> Any:
            started = time.thread_time()
            try:
                return fn(*args)
            finally:
                self.once += time.thread_time() - started

        return timed

    def take(self) -> tuple[float, int, float]:
        """(CPU seconds, calls, the median call but the step's last) of this step."""
        rest = self.each[:-1]
        out = (self.cpu + self.once, self.calls, statistics.median(rest) if rest else 0.0)
        self.cpu, self.calls, self.each, self.once = 0.0, 0, [], 0.0
        return out


def build(name: str, args: argparse.Namespace, device: torch.device, clock: HookClock
          ) -> tuple[DDP, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                for _ in range(args.layers)]).to(device)
    model = DDP(net, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    sentinel = None
    if name == "pyhook":
        model.register_comm_hook(None, clock.wrap(bare_hook))
    elif name.startswith("sentinel"):
        import nansentinel
        import nansentinel.engines.ddp as ddp

        original = ddp._comm_hook
        ddp._comm_hook = clock.wrap(original)
        seam_for = getattr(ddp, "seam_for", None)
        at_end = getattr(ddp.DDPPath, "_at_end_of_backward", None)
        if at_end is not None:  # the end-of-backward seam's callback, timed like a hook
            ddp.DDPPath._at_end_of_backward = clock.wrap_call(at_end)
        if seam_for is not None and name != "sentinel":
            forced = "end of backward" if name == "sentinel_end" else "comm hook"
            ddp.seam_for = lambda *a, **k: forced
        try:
            sentinel = nansentinel.Sentinel(model, opt, env={}, metrics_port=0,
                                            report_dir=args.report_dir)
        finally:
            ddp._comm_hook = original
            if at_end is not None:
                ddp.DDPPath._at_end_of_backward = at_end
            if seam_for is not None:
                ddp.seam_for = seam_for
        if name == "sentinel_each":
            each_bucket(sentinel.gradients)
    return model, opt, sentinel


def run(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    clock = HookClock()
    model, opt, sentinel = build(name, args, device, clock)
    x = torch.randn(args.batch, args.width, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_bucket, typical, backward, whole, buckets = [], [], [], [], 0
    for step in range(args.warmup + args.steps):
        sync()
        started = time.perf_counter()
        if sentinel is not None:
            sentinel.check_batch({"x": x})
        loss = model(x).float().pow(2).mean()
        if sentinel is not None:
            sentinel.check_loss(loss)
        began = time.perf_counter()
        loss.backward()
        ended = time.perf_counter()
        if sentinel is not None:
            sentinel.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        done = time.perf_counter()
        cpu, calls, median = clock.take()
        if step >= args.warmup:
            backward.append(ended - began)
            whole.append(done - started)
            if cpu:
                per_bucket.append(cpu)  # the step's; per bucket in main()
                typical.append(median)
                buckets = calls
    sync()
    if sentinel is not None:
        gate = getattr(sentinel, "gate", None)
        sentinel.close()
    return {
        "buckets": buckets,
        "hook_cpu_us_per_step": statistics.median(per_bucket) * 1e6 if per_bucket else None,
        "hook_cpu_us_but_last": statistics.median(typical) * 1e6 if typical else None,
        "backward_us": statistics.median(backward) * 1e6,
        "step_us": statistics.median(whole) * 1e6,
        "gate": getattr(gate, "name", None) if sentinel is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/hook_cost.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=64, help="Linear layers (default 64)")
    p.add_argument("--width", type=int, default=64, help="their width (default 64)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bucket-cap-mb", type=float, default=0.01,
                   help="DDP's bucket size (default 0.01: about one layer a bucket)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="each variant this many times")
    p.add_argument("--backend", choices=("nccl", "gloo", "fake"),
                   help="default: nccl on a GPU, else fake (torch's no-op backend, so that "
                        "gloo's own ~40 µs a call on the CPU does not drown the hook's work)")
    p.add_argument("--json", help="write the numbers here")
    p.add_argument("--report-dir", default="/tmp/nansentinel-hook-cost")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = args.backend or ("nccl" if cuda else "fake")
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        store: Any = FakeStore()
    else:
        store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60),
                              wait_for_workers=False)
    kw = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **kw)
    torch.set_num_threads(1)
    # DDP's C++ all-reduce asserts on the fake backend's empty futures: no builtin there, and
    # no end-of-backward seam (DDP's all-reduce again); on NCCL that seam is the default.
    skip = {"fake": ("builtin", "sentinel_end"), "nccl": ("sentinel_end",)}.get(backend, ())
    variants = [v for v in VARIANTS if v not in skip]
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for _ in range(args.rounds):  # interleaved, so that drift hits every variant alike
            for name in variants:
                results[name].append(run(name, args, device))
    finally:
        dist.destroy_process_group()
    summary = {name: {key: statistics.median(r[key] for r in rows)
                      for key in ("hook_cpu_us_per_step", "hook_cpu_us_but_last",
                                  "backward_us", "step_us")
                      if rows[0][key] is not None} | {"buckets": rows[0]["buckets"],
                                                      "gate": rows[0]["gate"]}
               for name, rows in results.items()}
    buckets = summary["pyhook"]["buckets"]  # the same DDP model in every variant
    for row in summary.values():
        if "hook_cpu_us_per_step" in row:
            row["hook_cpu_us_per_bucket"] = row["hook_cpu_us_per_step"] / buckets
        if row["buckets"] == 0 and "hook_cpu_us_per_step" in row:
            row["hook_cpu_us_but_last"] = 0.0  # no call per bucket: DDP's C++ all-reduce
    where = torch.cuda.get_device_name(0) if cuda else f"CPU ({platform.processor() or 'x86'})"
    print(f"host work per DDP bucket, {backend} backend, world size 1 on {where}, torch "
          f"{torch.__version__}, {args.layers} x Linear({args.width}), bucket_cap_mb "
          f"{args.bucket_cap_mb}, {args.steps} steps x {args.rounds} rounds (medians)")
    print("| variant | Python calls a step | sentinel's CPU µs / bucket (all) | a bucket but "
          "the last | backward() µs | whole step µs |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in summary.items():
        hook, typical = row.get("hook_cpu_us_per_bucket"), row.get("hook_cpu_us_but_last")
        print(f"| {name}{' (' + row['gate'] + ' gate)' if row['gate'] else ''} | "
              f"{row['buckets']} | {'—' if hook is None else f'{hook:.1f}'} | "
              f"{'—' if typical is None else f'{typical:.1f}'} | "
              f"{row['backward_us']:.0f} | {row['step_us']:.0f} |")
    py, ours = summary["pyhook"], summary["sentinel"]
    if "sentinel_each" in summary:
        each = summary["sentinel_each"]
        print(f"- a bucket at a time (before issue 46): "
              f"{each['hook_cpu_us_per_bucket'] - py['hook_cpu_us_per_bucket']:+.1f} µs a "
              "bucket over the bare Python hook")
    print(f"- the sentinel's hook: {ours['hook_cpu_us_per_bucket']:.1f} µs a bucket, "
          f"{ours['hook_cpu_us_per_bucket'] - py['hook_cpu_us_per_bucket']:+.1f} µs over the "
          f"bare Python hook (a bucket but the last: "
          f"{ours['hook_cpu_us_but_last'] - py['hook_cpu_us_but_last']:+.1f} µs); "
          f"backward() {ours['backward_us'] - py['backward_us']:+.0f} µs, the "
          f"whole step {ours['step_us'] - py['step_us']:+.0f} µs over it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": where, "torch": torch.__version__,
                       "summary": summary, "rounds": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
