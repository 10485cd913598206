"""Overhead benchmark on CPU: what does nansentinel cost a DDP step, next to the usual recipes?

Two gloo ranks on this machine train a 4-layer transformer under DDP. Every variant (see
``benchlib``) has its own DDP model with identical initial weights, and the variants take
turns step by step in one run, in a balanced rotating order, so that whatever the machine does
meanwhile (other jobs, frequency changes, a GC) hits all of them alike. Each variant's step is
divided by the baseline step of the same round; the table reports the median of those ratios.

Then, in the same processes, each variant's peak memory: the peak of live tensor bytes from
before its model is built (see ``measure_memory`` for why this and not RSS). Finally, in this
process, the check's own cost against one read of the gradient bytes.

The memory phase's profiler prints two ``USDT: ... profiler_start/stop`` lines per variant
on stderr; no environment variable of torch 2.13 turns them off.

Usage::

    python bench/overhead.py                       # full run, 2.5 min on 2 idle cores
    python bench/overhead.py --steps 60 --json bench/results/overhead.json
    python bench/overhead.py --markdown > table.md # markdown only on stdout
    python bench/overhead.py --profile             # + where the sentinel's time goes
    python bench/overhead.py --pp                  # pipeline parallel: 2 stages, GPipe
    python bench/overhead.py --deepspeed 2         # DeepSpeed ZeRO-2 alone vs + the sentinel

``--pp`` runs pipeline_overhead.py instead: the model split into two pipeline stages, one per
rank, plain pipeline against the sentinel (``--schedule``, ``--microbatches``; no memory or
check-cost phase). ``--deepspeed STAGE`` runs deepspeed_overhead.py: a DeepSpeed engine at that
ZeRO stage alone against the same engine under ``Sentinel(engine)`` (step time only).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # sibling modules of this script, not an installed package
import deepspeed_overhead
import pipeline_overhead
import sentinel_parts

WORLD_SIZE = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec(benchlib.RunSpec):
    """Everything a rank of the DDP/FSDP2 benchmark needs beyond ``RunSpec``."""

    variants: tuple[str, ...]
    profile: bool = False
    memory_steps: int = 3
    memory_fresh: bool = False
    phase: str = "timing"
    fsdp: bool = False
    fsdp1: bool = False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python bench/overhead.py",
        description="Step-time and peak-memory overhead of nansentinel vs plain DDP and the "
        "usual NaN-hunting recipes, on 2 CPU gloo ranks.",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=120,
        help="measured rounds; each round runs every variant once (default 120)",
    )
    p.add_argument("--warmup", type=int, default=8, help="unmeasured rounds first (default 8)")
    p.add_argument("--json", metavar="PATH", help="write all numbers as JSON here")
    p.add_argument("--note", default="", help="free text recorded in the report's header")
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print only the markdown report on stdout (progress goes to stderr)",
    )
    p.add_argument(
        "--variants",
        default=",".join(benchlib.DEFAULT_VARIANTS),
        help=f"comma-separated, from {', '.join(benchlib.VARIANTS)} (the baseline "
        "is always included)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="a toy model for smoke tests (numbers meaningless)"
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 instead of DDP: every variant's model is fully_shard-ed (each layer, then "
        "the root); the baseline is plain fully_shard (default variants: baseline,sentinel)",
    )
    p.add_argument(
        "--fsdp1",
        action="store_true",
        help="FSDP1 instead of DDP: every variant's model is FullyShardedDataParallel (each "
        "layer a unit, FULL_SHARD, use_orig_params); the baseline is plain FSDP1 (default "
        "variants: baseline,sentinel); also times the sentinel's work in each comm hook call",
    )
    p.add_argument(
        "--pp",
        action="store_true",
        help="pipeline parallel instead: 2 stages (one per rank), plain pipeline vs sentinel "
        "(pipeline_overhead.py; --variants, memory and check-cost phases do not apply)",
    )
    p.add_argument(
        "--schedule",
        choices=pipeline_overhead.SCHEDULES,
        default="gpipe",
        help="with --pp: the pipeline schedule (default gpipe)",
    )
    p.add_argument(
        "--deepspeed",
        type=int,
        choices=deepspeed_overhead.STAGES,
        metavar="STAGE",
        help="DeepSpeed instead: an engine at this ZeRO stage (0-3) alone vs under "
        "Sentinel(engine), fp32 (deepspeed_overhead.py; --variants, memory and check-cost "
        "phases do not apply)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=4,
        help="with --pp: micro-batches per step (default 4; must divide the batch)",
    )
    for field in dataclasses.fields(benchlib.ModelConfig):
        p.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"model size override (default {field.default})",
        )
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // WORLD_SIZE),
        help="torch threads per rank (default: cores / 2)",
    )
    p.add_argument(
        "--memory-steps",
        type=int,
        default=3,
        help="steps per variant in the peak-memory phase (default 3; 0 skips it)",
    )
    p.add_argument(
        "--memory-fresh",
        action="store_true",
        help="measure memory in a separate pair of processes instead of after the timing "
        "(same numbers, a few seconds slower; a cross-check of the method)",
    )
    p.add_argument(
        "--check-reps",
        type=int,
        default=50,
        help="repetitions of the check-cost micro-benchmark (default 50)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also time the sentinel's parts (perf_counter wrappers) in the run",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before a phase is killed as hung (default 600)",
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=60.0,
        help="gloo collective timeout in seconds (default 60)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = sys.stderr if args.markdown else sys.stdout
    say = functools.partial(print, file=out, flush=True)
    base = benchlib.TINY if args.tiny else benchlib.ModelConfig()
    sizes = {f.name: getattr(args, f.name) for f in dataclasses.fields(benchlib.ModelConfig)}
    cfg = dataclasses.replace(base, **{k: v for k, v in sizes.items() if v is not None})
    if args.pp:
        return _main_pipeline(args, cfg, say)
    if args.deepspeed is not None:
        return _main_deepspeed(args, cfg, say)
    if (args.fsdp or args.fsdp1) and args.variants == ",".join(benchlib.DEFAULT_VARIANTS):
        args.variants = "baseline,sentinel"
    variants = tuple(benchlib.parse_variants(args.variants))
    started = time.perf_counter()
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="nansentinel-bench-") as tmp:
        spec = Spec(
            **_run_spec(args, cfg, tmp),
            variants=variants,
            profile=args.profile,
            memory_steps=args.memory_steps,
            memory_fresh=args.memory_fresh,
            fsdp=args.fsdp,
            fsdp1=args.fsdp1,
        )
        say(
            f"timing: {len(variants)} variants x {args.steps} rounds (+{args.warmup} warm-up) "
            f"on {WORLD_SIZE} gloo ranks, {args.threads} thread(s) each ..."
        )
        ranks = _spawn(_timing_worker, spec, args.timeout)
        times = _merge_times(ranks)
        cpu_times = _merge_times(ranks, "cpu_times", sum)
        per_rank = [r.get("memory", {}) for r in ranks]
        if args.memory_steps > 0 and args.memory_fresh:
            per_rank = [{} for _ in range(WORLD_SIZE)]
            for v in variants:
                say(f"peak memory: {v} in a fresh pair of processes ...")
                one = dataclasses.replace(spec, phase=f"memory-{v}", variants=(v,))
                for mine, theirs in zip(
                    per_rank, _spawn(_memory_worker, one, args.timeout), strict=True
                ):
                    mine.update(theirs)
        memory, mem_detail = _merge_memory(per_rank)
        say("check cost vs one read ...")
        cost = _check_cost_here(cfg, args.threads, args.check_reps)

    summary = benchlib.summarize(times, memory, cpu_times)
    report: dict[str, Any] = {
        "benchmark": "nansentinel overhead, CPU gloo"
        + (", FSDP1" if args.fsdp1 else ", FSDP2" if args.fsdp else ", DDP"),
        "world_size": WORLD_SIZE,
        "threads_per_rank": args.threads,
        "model": dataclasses.asdict(cfg),
        "parameters": ranks[0]["parameters"],
        "steps": args.steps,
        "warmup": args.warmup,
        "variants": list(variants),
        "summary": summary,
        "peak_bytes": memory,
        "memory_detail": mem_detail,
        "check_cost": cost,
        "weights_max_abs_diff_vs_baseline": ranks[0]["weights_diff"],
        "hook_checks": [r.get("hook_checks") for r in ranks],
        "profile": ranks[0].get("profile"),
        "step_times_s": times,
        "step_cpu_times_s": cpu_times,
    }
    _finish(args, {**report, **_context(args, started, load_before)}, render, say)
    return 0


def _main_pipeline(
    args: argparse.Namespace, cfg: benchlib.ModelConfig, say: Callable[..., None]
) -> int:
    """``--pp``: the pipeline-parallel benchmark (pipeline_overhead.py) on 2 ranks."""
    if args.tiny and cfg.layers < 2:
        cfg = dataclasses.replace(cfg, layers=2)  # a layer on each stage
    started = time.perf_counter()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="nansentinel-bench-pp-") as tmp:
        spec = pipeline_overhead.PipeSpec(
            **_run_spec(args, cfg, tmp), schedule=args.schedule, microbatches=args.microbatches
        )
        say(
            f"pipeline timing: baseline and sentinel x {args.steps} rounds (+{args.warmup} "
            f"warm-up), {args.schedule}, {args.microbatches} micro-batches, 2 stages on "
            f"{WORLD_SIZE} gloo ranks, {args.threads} thread(s) each ..."
        )
        ranks = _spawn(_pipeline_worker, spec, args.timeout)
    report = pipeline_overhead.report(spec, ranks, _merge_times)
    _finish(args, {**report, **_context(args, started, load_before)},
            pipeline_overhead.render, say)
    return 0


def _main_deepspeed(
    args: argparse.Namespace, cfg: benchlib.ModelConfig, say: Callable[..., None]
) -> int:
    """``--deepspeed STAGE``: DeepSpeed alone vs under the sentinel (deepspeed_overhead.py)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # inherited by the spawned ranks
    started = time.perf_counter()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="nansentinel-bench-ds-") as tmp:
        spec = deepspeed_overhead.DeepSpeedSpec(**_run_spec(args, cfg, tmp), stage=args.deepspeed)
        say(
            f"DeepSpeed ZeRO-{args.deepspeed} timing: baseline and sentinel x {args.steps} rounds "
            f"(+{args.warmup} warm-up) on {WORLD_SIZE} gloo ranks, {args.threads} thread(s) each"
        )
        ranks = _spawn(_deepspeed_worker, spec, args.timeout)
    report = deepspeed_overhead.report(spec, ranks, _merge_times)
    _finish(args, {**report, **_context(args, started, load_before)},
            deepspeed_overhead.render, say)
    return 0


def _run_spec(args: argparse.Namespace, cfg: benchlib.ModelConfig, tmp: str) -> dict[str, Any]:
    """The ``benchlib.RunSpec`` fields every phase takes from the command line."""
    return {
        "model": cfg,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": args.threads,
        "collective_timeout": args.collective_timeout,
        "port": 0,
        "out_dir": tmp,
    }


def _context(
    args: argparse.Namespace, started: float, load_before: tuple[float, float, float]
) -> dict[str, Any]:
    """What every report records beside its numbers: what ran, where, and how busy it was."""
    return {
        "command": " ".join([sys.executable, *sys.argv]),
        "nansentinel": benchlib.library_revision(),
        "note": args.note,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        # Other jobs on the machine widen the ratios' spread; this says how busy it was.
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "seconds": time.perf_counter() - started,
    }


def _finish(
    args: argparse.Namespace,
    report: dict[str, Any],
    render_fn: Callable[[dict[str, Any]], str],
    say: Callable[..., None],
) -> None:
    """Print the markdown report; write the JSON when asked."""
    print(render_fn(report), flush=True)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, allow_nan=True) + "\n")
        say(f"wrote {path}")


def render(report: dict[str, Any]) -> str:
    """The markdown report: setup line, table, verdicts, check cost, and the profile if any."""
    m = report["model"]
    lines = [
        f"{report['benchmark']}, {report['world_size']} ranks x "
        f"{report['threads_per_rank']} thread(s), {report['parameters'] / 1e6:.2f} M params "
        f"(d_model {m['d_model']}, {m['layers']} layers, batch {m['batch']} x seq {m['seq']}), "
        f"{report['steps']} rounds, torch {report['torch']}, load average "
        f"{report['loadavg_1m_before_after'][0]:.1f} -> {report['loadavg_1m_before_after'][1]:.1f}",
        f"nansentinel: {report['nansentinel']}"
        + (f" ({report['note']})" if report["note"] else ""),
        "",
        benchlib.markdown_table(
            report["summary"],
            {"baseline": "baseline (plain FSDP2 fully_shard)"} if "FSDP2" in report["benchmark"]
            else {"baseline": "baseline (plain FSDP1)"} if "FSDP1" in report["benchmark"]
            else None,
        ),
        "",
    ]
    lines += [f"- {v}" for v in benchlib.verdict(report["summary"])]
    detail = report.get("memory_detail") or {}
    if "sentinel" in detail:
        d = detail["sentinel"]
        lines.append(
            f"- memory: peak {report['peak_bytes']['sentinel'] / 2**20:.2f} MiB (baseline "
            f"{report['peak_bytes']['baseline'] / 2**20:.2f} MiB); the sentinel's largest "
            f"allocation beyond the baseline's: {d['largest_extra_alloc_bytes']} bytes (largest "
            f"gradient {d['largest_grad_bytes']} bytes, all gradients {d['grad_bytes']} bytes)"
        )
    lines.append(f"- {benchlib.check_cost_line(report['check_cost'])}")
    for rank, hooks in enumerate(report.get("hook_checks") or []):
        if hooks:
            lines.append(
                f"- rank {rank}: the sentinel's host work in FSDP1's comm hook (check, withhold), "
                f"per call: median {hooks['median_us']:.1f} µs wall, {hooks['median_cpu_us']:.1f} "
                f"µs CPU, over {hooks['calls']} calls ({hooks['per_step']:.0f} a step)")
    diff = report["weights_max_abs_diff_vs_baseline"]
    lines.append(
        "- final weights, max |variant - baseline|: "
        + ", ".join(f"{k} {v:.2e}" for k, v in diff.items())
        + " (the same arithmetic in every variant: each applied every step)"
    )
    if report.get("profile"):
        lines += ["", sentinel_parts.render(report["profile"], report["summary"])]
    return "\n".join(lines)


# --- process management --------------------------------------------------------------------


def _spawn(
    fn: Callable[[int, Any], None], spec: benchlib.RunSpec, timeout: float
) -> list[dict[str, Any]]:
    """Run ``fn`` on 2 spawned ranks; return each rank's JSON result.

    The parent owns the rendezvous store on an OS-chosen port (no fixed port, no race for a
    "free" one), and kills both ranks if the phase outlives ``timeout``: a benchmark that hangs
    is worse than one that fails.
    """
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
    )
    spec = dataclasses.replace(spec, port=store.port)
    for r in range(WORLD_SIZE):
        _result_path(spec, r).unlink(missing_ok=True)
    ctx = mp.start_processes(fn, args=(spec,), nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"benchmark phase {fn.__name__} did not finish within {timeout:g} s; "
                    "both ranks were killed"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
        del store
    return [json.loads(_result_path(spec, r).read_text()) for r in range(WORLD_SIZE)]


def _result_path(spec: benchlib.RunSpec, rank: int) -> Path:
    return Path(spec.out_dir) / f"{spec.phase}-rank{rank}.json"


def _init_rank(rank: int, spec: benchlib.RunSpec) -> None:
    torch.set_num_threads(spec.threads)
    store = dist.TCPStore(
        "127.0.0.1", spec.port, None, False, datetime.timedelta(seconds=spec.collective_timeout)
    )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=spec.collective_timeout),
    )


def _merge_memory(
    ranks: list[dict[str, dict[str, Any]]],
) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Peak per variant (the larger rank's), and rank 0's largest allocation beyond the
    baseline's."""
    if not ranks or not ranks[0]:
        return {}, {}
    sizes = {v: {int(k): n for k, n in m["alloc_sizes"].items()} for v, m in ranks[0].items()}
    memory, detail = {}, {}
    for v, m in ranks[0].items():
        memory[v] = float(max(r[v]["peak_bytes"] for r in ranks))
        detail[v] = {
            "peak_bytes_per_rank": [r[v]["peak_bytes"] for r in ranks],
            "largest_extra_alloc_bytes": largest_extra_allocation(
                sizes[v], sizes[benchlib.BASELINE]
            ),
            "largest_grad_bytes": m["largest_grad_bytes"],
            "grad_bytes": m["grad_bytes"],
        }
    return memory, detail


def _merge_times(
    ranks: list[dict[str, Any]], key: str = "times", merge: Callable[..., float] = max
) -> dict[str, list[float]]:
    """Per round, the slower rank's wall time (in synchronous data parallelism the slowest rank
    sets the pace), or the ranks' total CPU time (``key="cpu_times", merge=sum``)."""
    names = ranks[0][key].keys()
    return {n: [merge(ts) for ts in zip(*(r[key][n] for r in ranks), strict=True)] for n in names}


# --- phase 1: step times ---------------------------------------------------------------------


def _timing_worker(rank: int, spec: Spec) -> None:
    _init_rank(rank, spec)
    try:
        device = torch.device("cpu")
        timer = sentinel_parts.PartTimer() if spec.profile else None
        if timer is not None:
            timer.install()
        report_dir = str(Path(spec.out_dir) / "reports")
        variants = [
            benchlib.build_variant(v, spec.model, device, report_dir=report_dir, fsdp=spec.fsdp,
                                   fsdp1=spec.fsdp1)
            for v in spec.variants
        ]
        hooks = _HookTimer() if spec.fsdp1 else None
        if timer is not None:
            timer.attach(_by_name(variants, "sentinel"))
        batches = functools.partial(benchlib.make_batch, spec.model, rank, device=device)

        def batch_of(step: int) -> dict[str, torch.Tensor]:
            return batches(step=step)

        def nosync() -> None:  # CPU ops are synchronous; DDP waits for its all-reduce itself
            return None

        benchlib.run_rounds(variants, batch_of, spec.warmup, nosync)
        gc.collect()
        if timer is not None:
            timer.armed = True
        if hooks is not None:
            hooks.install()
        rounds = benchlib.run_rounds(
            variants, batch_of, spec.steps, nosync, first_round=spec.warmup
        )
        if hooks is not None:
            hooks.remove()
        # This rank's weights (its shards under FSDP2).
        first = benchlib.unwrap(variants[0].model).state_dict()
        base = {k: benchlib.local(p) for k, p in first.items()}
        diff = {
            v.name: max(
                (benchlib.local(p) - base[k]).abs().max().item()
                for k, p in benchlib.unwrap(v.model).state_dict().items()
            )
            for v in variants[1:]
        }
        result = {
            "times": rounds.wall,
            "cpu_times": rounds.cpu,
            "parameters": sum(p.numel() for p in variants[0].model.parameters()),
            "weights_diff": diff,
            "profile": timer.per_step(spec.steps) if timer is not None else None,
            "hook_checks": hooks.summary(spec.steps) if hooks is not None else None,
        }
        for v in variants:
            v.close()
        del variants, base
        if spec.memory_steps > 0 and not spec.memory_fresh:
            result["memory"] = {v: measure_memory(v, rank, spec) for v in spec.variants}
        _result_path(spec, rank).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


class _HookTimer:
    """Times the sentinel's own work in each FSDP1 comm hook call (``FSDP1Path.check`` and the
    drop's withhold, :func:`nansentinel.engines.fsdp1._withheld`): the host work it adds to
    each collective, beside FSDP1's own reduction in the same hook."""

    def __init__(self) -> None:
        from nansentinel.engines import fsdp1

        self.module = fsdp1
        self.original = fsdp1._withheld
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def install(self) -> None:
        original = self.original

        def timed(checked: Any, flat: torch.Tensor) -> None:
            wall, cpu = time.perf_counter(), time.thread_time()
            original(checked, flat)
            self.cpu.append(time.thread_time() - cpu)
            self.wall.append(time.perf_counter() - wall)

        self.module._withheld = timed

    def remove(self) -> None:
        self.module._withheld = self.original

    def summary(self, steps: int) -> dict[str, float] | None:
        if not self.wall:
            return None
        return {"calls": len(self.wall), "per_step": len(self.wall) / steps,
                "median_us": statistics.median(self.wall) * 1e6,
                "median_cpu_us": statistics.median(self.cpu) * 1e6}


def _pipeline_worker(rank: int, spec: pipeline_overhead.PipeSpec) -> None:
    _init_rank(rank, spec)
    try:
        _result_path(spec, rank).write_text(json.dumps(pipeline_overhead.worker(rank, spec)))
    finally:
        dist.destroy_process_group()


def _deepspeed_worker(rank: int, spec: deepspeed_overhead.DeepSpeedSpec) -> None:
    _init_rank(rank, spec)
    try:
        _result_path(spec, rank).write_text(json.dumps(deepspeed_overhead.worker(rank, spec)))
    finally:
        dist.destroy_process_group()


def _by_name(variants: list[benchlib.Variant], name: str) -> benchlib.Variant | None:
    return next((v for v in variants if v.name == name), None)


# --- phase 2: peak memory --------------------------------------------------------------------


def _memory_worker(rank: int, spec: Spec) -> None:
    """One variant's memory in a pair of processes of its own (``--memory-fresh``)."""
    _init_rank(rank, spec)
    try:
        result = {v: measure_memory(v, rank, spec) for v in spec.variants}
        _result_path(spec, rank).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure_memory(name: str, rank: int, spec: Spec) -> dict[str, Any]:
    """Peak live tensor bytes of one variant, from before its model exists to after a few steps.

    Why this measure: the question is whether the sentinel makes gradient-sized copies, i.e.
    tensor allocations, which is what ``torch.cuda.max_memory_allocated`` answers on a GPU. On
    CPU, torch's profiler with ``profile_memory=True`` sees every allocation and free of the
    CPU allocator with the running total of allocated bytes; started before the model is built,
    the peak of that total over the window is the variant's whole peak (weights, gradients, DDP
    buckets, AdamW state, activations, and any copy a guard makes). It is exact and repeatable
    to the byte, and it does not depend on timing, so the variants can be measured one after
    the other in the same processes. Peak RSS (ru_maxrss) was the alternative and is worse:
    it includes the ~300 MB of the torch library, which dilutes a 14 MB gradient copy into a
    few percent, and glibc's heap and mmap thresholds move it by megabytes from run to run.

    One blind spot, and how it is closed: the profiler only sees frees made on the thread it
    profiles, so a tensor freed on a gloo thread would stay "allocated". DDP's initial
    broadcast did that (the peak came out a random 14 MB high); ``build_variant`` skips it.
    """
    gc.collect()
    device = torch.device("cpu")
    report_dir = str(Path(spec.out_dir) / "reports")
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        variant = benchlib.build_variant(
            name, spec.model, device, report_dir=report_dir, fsdp=spec.fsdp, fsdp1=spec.fsdp1
        )
        for step in range(spec.memory_steps):
            variant.step(benchlib.make_batch(spec.model, rank, step, device))
    peak, sizes = _memory_events(prof)
    params = [benchlib.local(p) for p in variant.model.parameters()]
    variant.close()
    del variant, prof
    gc.collect()
    return {
        "peak_bytes": peak,
        "alloc_sizes": {str(k): v for k, v in sizes.items()},
        "largest_grad_bytes": max(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
    }


def _memory_events(prof: torch.profiler.profile) -> tuple[int, dict[int, int]]:
    """The peak of live bytes over the profiled window, relative to its start, and how many
    allocations of each size were made (read from the exported trace, the profiler's
    documented output format)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    events = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})
    ]
    events = [e["args"] for e in sorted(events, key=lambda e: e["ts"])]  # not in time order
    if not events:
        raise RuntimeError("the profiler recorded no memory events; cannot measure peak memory")
    # The running total is process-wide: subtract what was live when the window opened.
    start = int(events[0]["Total Allocated"]) - int(events[0]["Bytes"])
    peak = max(int(e["Total Allocated"]) for e in events) - start
    sizes = Counter(int(e["Bytes"]) for e in events if e["Bytes"] > 0)
    return peak, dict(sizes)


def largest_extra_allocation(sizes: dict[int, int], baseline: dict[int, int]) -> int:
    """The largest allocation size a variant made more often than the baseline did, in bytes.

    Why: the peak can hide a transient copy (at this size the peak sits at the start of
    backward, ~18 MB above the end of backward, so a 14 MB copy of all gradients made in the comm
    hook would not move it). Allocation sizes are deterministic, so a gradient-sized copy shows
    here whether or not it lands on the peak.
    """
    extra = [size for size, n in sizes.items() if n > baseline.get(size, 0)]
    return max(extra, default=0)


# --- phase 3: the check's cost against one read ----------------------------------------------


def _check_cost_here(cfg: benchlib.ModelConfig, threads: int, reps: int) -> dict[str, float]:
    """In this process, with the ranks gone: one core's worth of threads, nothing competing."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        grads = benchlib.model_grads(cfg, torch.device("cpu"))

        def timer(fn: Callable[[], object]) -> float:
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started

        return benchlib.check_cost(grads, timer, reps)
    finally:
        torch.set_num_threads(saved)


if __name__ == "__main__":
    sys.exit(main())
