"""The overhead benchmark on one CUDA GPU: the same variants and checks as ``overhead.py``,
timed where the sentinel is meant to run.

One process, NCCL with world size 1 (a TCP store on localhost, OS-chosen port), a single-rank
DDP model per variant. It times, all on the GPU:

- the training step of every variant (``benchlib``), alternating in a balanced order, with
  ``torch.cuda.synchronize()`` around each step, so a step's time is the wall time the user
  pays, host stalls included;
- the gradient checks (``checks.tensor_norm`` over a flat bucket, as the DDP comm hook runs
  it; ``checks.grad_norms`` per tensor, without DDP) against one read of the same bytes
  (``torch.sum`` over a flat tensor) and against ``isfinite().all()``, with CUDA events;
- the batch check and the loss check alone: GPU time (CUDA events) and host time per call
  (how long the Python call takes to return, which is what a GPU-bound loop pays);
- the peak memory of each variant (``torch.cuda.max_memory_allocated`` after a reset, one
  variant alive at a time).

World size 1 has no second rank to disagree with, so the exchange is the identity and the one
host sync per step is reading the health row. It measures the checks' cost and the comm-hook
path, not the network; ``overhead.py`` measures two ranks.

Usage (on a GPU machine; ``bench/run_gpu.sh`` is the prepared run)::

    python bench/gpu_checks.py --steps 60 --json $OUT/gpu.json
    python bench/gpu_checks.py --cpu-size      # the CPU benchmark's model: host-bound steps
    python bench/gpu_checks.py --large --optimizer fused --burst 4 \
        --variants baseline,sentinel,sync,pyhook,pyhook_sync,sentinel_nochecks

``--burst N`` runs N steps of a variant back to back between two synchronisations, so the host
can run ahead of the GPU as in real training (a deferred decision is then off the critical path);
``--memory-fresh`` measures each variant's peak memory in a process of its own.

Exits with status 2 and a message when no CUDA device (or no NCCL) is available.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # a sibling module of this script, not an installed package

from nansentinel import checks

#: Large enough that a step is GPU-bound on an H100/H200 (~110 M parameters, 8 k tokens).
GPU_MODEL = benchlib.ModelConfig(
    d_model=1024, nhead=16, ff=4096, layers=8, seq=512, batch=16, vocab=8192
)
#: The issue's ~0.6 B model: d_model 2048, 12 layers, ff 8192, seq 1024, batch 8, bf16 autocast.
LARGE_MODEL = benchlib.ModelConfig(
    d_model=2048, nhead=16, ff=8192, layers=12, seq=1024, batch=8, vocab=8192, autocast=True
)
EXIT_NO_GPU = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/gpu_checks.py",
        description="nansentinel overhead on one CUDA GPU (NCCL, world size 1).",
    )
    p.add_argument("--steps", type=int, default=60, help="measured rounds (default 60)")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured rounds (default 5)")
    p.add_argument("--json", metavar="PATH", help="write all numbers as JSON here")
    p.add_argument("--markdown", action="store_true", help="only the markdown report on stdout")
    p.add_argument(
        "--variants",
        default=",".join(benchlib.DEFAULT_VARIANTS),
        help=f"comma-separated, from {', '.join(benchlib.VARIANTS)}",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--cpu-size",
        action="store_true",
        help="use the CPU benchmark's 3.7 M-parameter model (short, host-bound steps)",
    )
    size.add_argument("--tiny", action="store_true", help="a toy model (numbers meaningless)")
    size.add_argument(
        "--large", action="store_true", help="~0.6 B parameters under bf16 autocast"
    )
    p.add_argument(
        "--optimizer", choices=benchlib.OPTIMIZERS, default="adamw",
        help="AdamW implementation: torch's default, foreach or fused (default: adamw)",
    )
    p.add_argument("--bucket-cap-mb", type=float, help="DDP bucket size (default: DDP's 25)")
    p.add_argument("--burst", type=int, default=1, help="steps per variant between syncs")
    p.add_argument(
        "--memory-fresh", action="store_true",
        help="measure each variant's peak memory in a fresh process",
    )
    p.add_argument("--memory-only", help=argparse.SUPPRESS)  # one variant's peak, as JSON
    p.add_argument("--memory-steps", type=int, default=3, help="steps per variant (0: skip)")
    p.add_argument("--check-reps", type=int, default=100, help="micro-benchmark repetitions")
    p.add_argument("--timeout", type=float, default=120.0, help="NCCL/store timeout (s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = functools.partial(print, file=sys.stderr if args.markdown else sys.stdout, flush=True)
    if not torch.cuda.is_available():
        print(
            f"gpu_checks: no CUDA device is visible (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}); this benchmark runs only on a GPU machine and "
            "measured nothing. On CPU, run bench/overhead.py.",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    if not dist.is_nccl_available():
        print(
            f"gpu_checks: this torch build ({torch.__version__}) has no NCCL backend; "
            "nothing was measured.",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    cfg = (
        benchlib.TINY if args.tiny else benchlib.ModelConfig() if args.cpu_size
        else LARGE_MODEL if args.large else GPU_MODEL
    )
    variants = benchlib.parse_variants(args.variants)
    device = _device()
    torch.cuda.set_device(device)
    # TF32 matmuls, as GPU training runs them; the checks themselves reduce in fp32.
    torch.set_float32_matmul_precision("high")
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, timeout=timeout, device_id=device
    )
    started = time.perf_counter()
    if args.memory_only:
        try:
            with tempfile.TemporaryDirectory(prefix="nansentinel-gpu-") as tmp:
                peak = _peak_memory(args.memory_only, cfg, device, args.memory_steps, tmp, args)
            print(json.dumps({"variant": args.memory_only, "peak_bytes": peak}))
        finally:
            dist.destroy_process_group()
        return 0
    try:
        with tempfile.TemporaryDirectory(prefix="nansentinel-gpu-") as tmp:
            say(f"timing {len(variants)} variants x {args.steps} rounds on {_gpu_name()} ...")
            times, params, diff = _time_steps(cfg, variants, device, args, tmp)
            say("checks vs one read ...")
            cost, small = _time_checks(cfg, device, args.check_reps)
            _free()
            memory: dict[str, float] = {}
            if args.memory_steps > 0 and args.memory_fresh:
                say("peak memory per variant, each in a fresh process ...")
                memory = {v: _fresh_peak_memory(v, argv) for v in variants}
            elif args.memory_steps > 0:
                say("peak memory per variant ...")
                memory = {
                    v: _peak_memory(v, cfg, device, args.memory_steps, tmp, args)
                    for v in variants
                }
    finally:
        dist.destroy_process_group()
    report: dict[str, Any] = {
        "benchmark": "nansentinel overhead, one CUDA GPU, NCCL world size 1",
        "command": " ".join([sys.executable, *sys.argv]),
        "gpu": _gpu_name(),
        "model": dataclasses.asdict(cfg),
        "optimizer": args.optimizer,
        "bucket_cap_mb": args.bucket_cap_mb,
        "burst": args.burst,
        "memory_fresh": args.memory_fresh,
        "parameters": params,
        "steps": args.steps,
        "warmup": args.warmup,
        "variants": variants,
        "nansentinel": benchlib.library_revision(),
        "summary": benchlib.summarize(times, memory),
        "peak_bytes": memory,
        "check_cost": cost,
        "small_checks": small,
        "weights_max_abs_diff_vs_baseline": diff,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": _nccl_version(),
        "python": platform.python_version(),
        "seconds": time.perf_counter() - started,
        "step_times_s": times,
    }
    print(render(report), flush=True)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        say(f"wrote {path}")
    return 0


def render(report: dict[str, Any]) -> str:
    m = report["model"]
    lines = [
        f"nansentinel overhead — {report['gpu']}, NCCL world size 1, "
        f"{report['parameters'] / 1e6:.1f} M params (d_model {m['d_model']}, {m['layers']} "
        f"layers, batch {m['batch']} x seq {m['seq']}{', bf16 autocast' if m['autocast'] else ''}"
        f"), {report['optimizer']} AdamW, bucket_cap_mb {report['bucket_cap_mb'] or 25}, "
        f"burst {report['burst']}, {report['steps']} rounds, torch "
        f"{report['torch']}, CUDA {report['cuda']}, NCCL {report['nccl']}",
        f"nansentinel: {report['nansentinel']}",
        "",
        benchlib.markdown_table(report["summary"]),
        "",
    ]
    lines += [f"- {v}" for v in benchlib.verdict(report["summary"])]
    lines.append(f"- {benchlib.check_cost_line(report['check_cost'])}")
    for name, s in report["small_checks"].items():
        lines.append(
            f"- {name}: GPU {s['gpu_ms']:.4f} ms, host call {s['host_ms']:.4f} ms (medians)"
        )
    diff = report["weights_max_abs_diff_vs_baseline"]
    lines.append(
        "- final weights, max |variant - baseline|: "
        + ", ".join(f"{k} {v:.2e}" for k, v in diff.items())
    )
    return "\n".join(lines)


def _time_steps(
    cfg: benchlib.ModelConfig,
    names: list[str],
    device: torch.device,
    args: argparse.Namespace,
    tmp: str,
) -> tuple[dict[str, list[float]], int, dict[str, float]]:
    variants = [_build(n, cfg, device, tmp, args) for n in names]
    params = sum(p.numel() for p in variants[0].model.parameters())

    def batches(step: int) -> dict[str, torch.Tensor]:
        return benchlib.make_batch(cfg, 0, step, device)

    if args.burst > 1:
        variants = [Burst(v, args.burst) for v in variants]  # type: ignore[misc]
    benchlib.run_rounds(variants, batches, args.warmup, torch.cuda.synchronize)
    # Wall time only: the host's CPU time would include spinning in cudaDeviceSynchronize.
    times = benchlib.run_rounds(
        variants, batches, args.steps, torch.cuda.synchronize, first_round=args.warmup
    ).wall
    base = variants[0].model.module.state_dict()
    diff = {
        v.name: max(
            (p - base[k]).abs().max().item() for k, p in v.model.module.state_dict().items()
        )
        for v in variants[1:]
    }
    for v in variants:
        v.close()
    del variants, base
    _free()
    return times, params, diff


def _cuda_timer(fn: Callable[[], object]) -> float:
    """GPU seconds of one call, between two CUDA events (launch gaps included)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _host_time(fn: Callable[[], object], reps: int) -> float:
    """Median seconds until the call returns to Python (no sync inside: the checks are meant
    to return before their kernels finish), draining the GPU between reps."""
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _time_checks(
    cfg: benchlib.ModelConfig, device: torch.device, reps: int
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    grads = benchlib.model_grads(cfg, device)
    cost = benchlib.check_cost(grads, _cuda_timer, reps)
    batch = benchlib.make_batch(cfg, 0, 0, device)
    model = benchlib.BenchModel(cfg).to(device)
    with torch.no_grad():
        loss = benchlib.compute_loss(model, batch)
    cases: dict[str, Callable[[], object]] = {
        "checks.batch_norms (batch check)": lambda: checks.batch_norms(batch, device),
        "checks.loss_scalar (loss check)": lambda: checks.loss_scalar(loss),
        "checks.grad_norms (all gradients, no DDP)": lambda: checks.grad_norms(grads),
    }
    small = {}
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        gpu = statistics.median(_cuda_timer(fn) for _ in range(reps))
        small[name] = {"gpu_ms": gpu * 1e3, "host_ms": _host_time(fn, reps) * 1e3}
    return cost, small


class Burst:
    """A variant run ``n`` steps back to back per round (one sync per round, not per step)."""

    def __init__(self, inner: benchlib.Variant, n: int) -> None:
        self.inner, self.n, self.name = inner, n, inner.name
        self.model = inner.model

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        for _ in range(self.n):
            self.inner.step(batch)

    def close(self) -> None:
        self.inner.close()


def _build(
    name: str, cfg: benchlib.ModelConfig, device: torch.device, tmp: str,
    args: argparse.Namespace,
) -> benchlib.Variant:
    return benchlib.build_variant(
        name, cfg, device, report_dir=tmp, optimizer=args.optimizer,
        bucket_cap_mb=args.bucket_cap_mb,
    )


def _fresh_peak_memory(name: str, argv: list[str] | None) -> float:
    """One variant's peak in a process of its own: nothing another variant left behind (a
    cycle through DDP's C++ reducer that gc cannot break, NCCL's stashed tensors, allocator
    state) can raise or lower it."""
    import subprocess

    args = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--memory-fresh"]
    out = subprocess.run(
        [sys.executable, __file__, *args, "--memory-only", name], check=True,
        capture_output=True, text=True, timeout=300,
    ).stdout
    return float(json.loads(out.strip().splitlines()[-1])["peak_bytes"])


def _peak_memory(
    name: str, cfg: benchlib.ModelConfig, device: torch.device, steps: int, tmp: str,
    args: argparse.Namespace,
) -> float:
    """Peak bytes allocated by one variant alone, from before its model exists: weights,
    gradients, DDP buckets, AdamW state, activations, and any copy a guard makes."""
    _free()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    variant = _build(name, cfg, device, tmp, args)
    for step in range(steps):
        variant.step(benchlib.make_batch(cfg, 0, step, device))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - before
    variant.close()
    del variant
    _free()
    return float(peak)


def _free() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _device() -> torch.device:
    return torch.device("cuda", 0)


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


if __name__ == "__main__":
    sys.exit(main())
