"""The framework × engine cells of docs/frameworks.md on CUDA GPUs, without the CPU patches.

The CPU tests run the seam-tested cells with the framework's own CPU refusal lifted
(tests/frameworks/cpu_guards.py); this script runs them as the frameworks ship, on the GPUs:
the test workers (tests/frameworks/*_worker.py) with ``--cuda``, under torchrun (Lightning:
its own launcher) on NCCL, each a fault of its own at a known step and rank, and checks what
every rank wrote with the CPU tests' assertions: each faulty step not applied on every rank,
that rank named, the weights untouched on exactly those steps and finite and identical at the
end, exit 0.

Cells (``--only`` takes a comma-separated list of these names):

- the seam-tested ones: ``hf-fsdp2`` (the Trainer, ``fsdp_config`` version 2),
  ``lightning-deepspeed`` (``DeepSpeedStrategy``, ZeRO 1, 2, 3), ``accelerate-fsdp2``,
  ``accelerate-fp16`` (DDP under Accelerate's GradScaler; a NaN made in the backward alone is
  fp16 overflow there: counted, not blamed);
- the CPU-tested ones, to see them hold on CUDA: ``hf-ddp``, ``hf-deepspeed`` (ZeRO 1, 2, 3),
  ``lightning-fsdp2``, ``accelerate-ddp`` (bf16), ``accelerate-deepspeed`` (ZeRO-2).

Ranks: 2 where 2 GPUs are visible; on one GPU, 1 rank (NCCL takes one rank per GPU), every
fault then on rank 0. One rank reduces nothing: FSDP2 and DeepSpeed's buckets then check the
local gradients at the step, so a single GPU runs the frameworks' CUDA paths (devices, streams,
the engines' own step) but not the checks before a reduction; those need 2 GPUs.

Usage (from the repository root)::

    python bench/gpu_frameworks.py --json $OUT/frameworks.json     # every cell, ~5 min
    python bench/gpu_frameworks.py --only hf-fsdp2,lightning-deepspeed
    python bench/gpu_frameworks.py --dry-run        # print the plan (any machine)
    python bench/gpu_frameworks.py --cpu --only accelerate-ddp   # the CPU smoke test

Exit status: 0 when every cell run passed, 1 when one failed (its output is kept in the JSON
and printed), 2 without a CUDA device (nothing run; ``--cpu`` runs on CPU with the patches).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.frameworks import runner  # noqa: E402  (the test workers' launcher)

EXIT_NO_GPU = 2
STEPS = 6
#: Each rank's fault: step -> (kind, the rank on 2 ranks). On 1 rank every fault is rank 0's.
FAULTS = {1: ("batch", 1), 2: ("loss", 0), 4: ("grad", 1)}


@dataclass
class Cell:
    """One framework × engine cell: the worker, its arguments, the files each rank writes."""

    name: str
    worker: str
    args: list[str]
    files: Callable[[int], list[str]]  # rank -> the JSON files it writes
    launcher: str = "torchrun"  # or "python": Lightning launches its own ranks
    fp16: bool = False
    env: dict[str, str] = field(default_factory=dict)


def faults_spec(world: int) -> tuple[str, str]:
    """The model-made faults (``--faults``) and the batch drill (``NANSENTINEL_INJECT``)."""
    rank = {s: (r if world > 1 else 0) for s, (_, r) in FAULTS.items()}
    model = {"loss": "log0", "grad": "grad"}
    made = ",".join(f"{s}:{rank[s]}:{model[k]}" for s, (k, _) in FAULTS.items() if k in model)
    return made, f"kind=batch,rank={rank[1]},step=1"


def cells(world: int) -> dict[str, Cell]:
    made, drill = faults_spec(world)
    common = [f"--steps={STEPS}", "--accumulate=2", f"--faults={made}"]
    loop = ["--phases=skip", f"--steps={STEPS}", f"--faults={made}", f"--inject={drill}"]
    one = lambda r: [f"rank{r}.json"]  # noqa: E731
    skip = lambda r: [f"rank{r}-skip.json"]  # noqa: E731
    zero = lambda r: [f"rank{r}-zero{s}.json" for s in (1, 2, 3)]  # noqa: E731
    return {c.name: c for c in (
        Cell("hf-fsdp2", "hf_worker.py", ["--fsdp2", *common], one),
        Cell("lightning-deepspeed", "lightning_worker.py",
             [f"--devices={world}", "--phases=skip", *common], skip, launcher="python"),
        Cell("accelerate-fsdp2", "accelerate_worker.py", ["--engine=fsdp2", *loop], one),
        Cell("accelerate-fp16", "accelerate_worker.py",
             ["--engine=ddp", "--precision=fp16", *loop], one, fp16=True),
        Cell("hf-ddp", "hf_worker.py", common, one),
        Cell("hf-deepspeed", "hf_worker.py", ["--deepspeed=1,2,3", *common], zero),
        Cell("lightning-fsdp2", "lightning_worker.py",
             [f"--devices={world}", "--strategy=fsdp2", "--phases=skip", *common], skip,
             launcher="python"),
        Cell("accelerate-ddp", "accelerate_worker.py", ["--engine=ddp", *loop], one),
        Cell("accelerate-deepspeed", "accelerate_worker.py", ["--engine=deepspeed_2", *loop],
             one),
    )}


def expand(cell: Cell) -> list[Cell]:
    """Lightning's DeepSpeed cell runs once per ZeRO stage (one strategy per fit)."""
    if cell.name != "lightning-deepspeed":
        return [cell]
    return [Cell(f"{cell.name}-zero{s}", cell.worker, [*cell.args, f"--strategy=deepspeed_{s}"],
                 cell.files, cell.launcher) for s in (1, 2, 3)]


def command(cell: Cell, out: Path, world: int, cuda: bool) -> list[str]:
    args = [str(out), *cell.args, *(["--cuda"] if cuda else [])]
    if cell.launcher == "python":
        return runner.python(cell.worker, *args)
    return runner.torchrun(cell.worker, *args, nproc=world)


def check(cell: Cell, out: Path, world: int) -> list[str]:
    """What is wrong with the ranks' files (empty: the cell passed)."""
    problems: list[str] = []
    ranks = {r: [json.loads((out / f).read_text()) for f in cell.files(r) if (out / f).exists()]
             for r in range(world)}
    for r, found in ranks.items():
        if len(found) != len(cell.files(r)):
            problems.append(f"rank {r} wrote {len(found)} of {cell.files(r)}")
    if problems:
        return problems
    for index in range(len(cell.files(0))):
        runs = [normalise(ranks[r][index]) for r in range(world)]
        for r, run in enumerate(runs):
            problems += [f"rank {r}: {p}" for p in check_run(run, world, cell.fp16)]
        if any(run["weights"] != runs[0]["weights"] for run in runs):
            problems.append("the ranks' final weights differ")
    return problems


def normalise(payload: dict[str, Any]) -> dict[str, Any]:
    """The workers' payloads in one shape: {step: (outcome, bad_ranks)}, unchanged, weights."""
    if "skip" in payload:  # accelerate_worker.py
        payload = payload["skip"]
        steps = {s: (r["outcome"], r["bad_ranks"]) for s, r in payload["results"].items()}
    else:
        steps = {s: ("applied", []) for s in payload["unchanged"]}
        steps.update({s: (r["outcome"], r["bad_ranks"]) for s, r in payload["skipped"].items()})
    return {"steps": steps, "unchanged": payload["unchanged"], "weights": payload["weights"]}


def check_run(run: dict[str, Any], world: int, fp16: bool) -> list[str]:
    problems = []
    flat = [v for t in run["weights"] for v in t]
    if not flat or not all(math.isfinite(v) for v in flat):
        problems.append("non-finite final weights")
    for step in range(STEPS):
        outcome, bad = run["steps"].get(str(step), ("missing", []))
        unchanged = run["unchanged"].get(str(step))
        if step in FAULTS:
            kind, rank = FAULTS[step]
            expected = [rank if world > 1 else 0]
            if fp16 and kind == "grad":  # a NaN made in the backward alone is fp16 overflow
                if outcome != "overflow" or unchanged is not True:
                    problems.append(f"step {step}: {outcome}, unchanged={unchanged}; "
                                    "expected overflow")
            elif outcome != "skipped" or bad != expected or unchanged is not True:
                problems.append(f"step {step}: {outcome} {bad}, unchanged={unchanged}; "
                                f"expected skipped {expected}")
        elif outcome not in ("applied", *(("overflow",) if fp16 else ())):
            problems.append(f"step {step}: {outcome} {bad}; expected applied")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/gpu_frameworks.py",
                                description="The framework cells on CUDA GPUs.")
    p.add_argument("--only", help="comma-separated cells (default: all)")
    p.add_argument("--json", metavar="PATH", help="write each cell's result here")
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    p.add_argument("--cpu", action="store_true",
                   help="run on CPU ranks with the CPU patches (the smoke test of this script)")
    p.add_argument("--timeout", type=float, default=300.0, help="per cell, seconds")
    args = p.parse_args(argv)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not (args.cpu or args.dry_run):
        print(f"gpu_frameworks: no CUDA device is visible (torch {torch.__version__}); these "
              "cells run only on a GPU machine and nothing was run. On CPU: pytest "
              "tests/frameworks (or --cpu for this script's smoke test).", file=sys.stderr)
        return EXIT_NO_GPU
    cuda = not args.cpu
    world = 2 if args.cpu or gpus >= 2 else 1
    table = cells(world)
    names = args.only.split(",") if args.only else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown cells {unknown}; known: {', '.join(table)}")
    _, drill = faults_spec(world)
    env = {"NANSENTINEL_INJECT": drill, "DS_ACCELERATOR": "cuda" if cuda else "cpu"}
    plan = [c for n in names for c in expand(table[n])]
    results: dict[str, Any] = {"world": world, "gpus": gpus, "cuda": cuda,
                               "torch": torch.__version__, "cells": {}}
    failed = False
    for cell in plan:
        with tempfile.TemporaryDirectory(prefix=f"nansentinel-{cell.name}-") as tmp:
            out = Path(tmp)
            argv_ = command(cell, out, world, cuda)
            if args.dry_run:
                print(f"{cell.name}: {' '.join(argv_)}")
                continue
            started = time.perf_counter()
            try:
                proc = runner.run(argv_, out, timeout=args.timeout, env={**env, **cell.env})
                problems = ([f"exit {proc.returncode}"] if proc.returncode else []) + \
                    check(cell, out, world)
                tail = proc.stdout[-4000:]
            except AssertionError as exc:  # the runner's overrun
                problems, tail = [str(exc)[:300]], str(exc)[-4000:]
            seconds = round(time.perf_counter() - started, 1)
        failed |= bool(problems)
        verdict = "PASS" if not problems else "FAIL"
        print(f"{verdict} {cell.name} ({seconds} s){''.join(f'; {p}' for p in problems)}",
              flush=True)
        if problems:
            print(tail, flush=True)
        results["cells"][cell.name] = {"pass": not problems, "problems": problems,
                                       "seconds": seconds, **({"tail": tail} if problems else {})}
    if args.json and not args.dry_run:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
