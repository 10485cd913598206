"""Count the host synchronisations the sentinel adds per healthy step on CUDA.

``torch.cuda.set_sync_debug_mode("warn")`` makes PyTorch warn at every operation that
synchronises the host with the GPU. This script runs the same DDP step with and without the
sentinel, for a foreach and a fused AdamW, and reports the warnings per step of each and the
difference, on two paths:

- **NCCL at world size 1** (one GPU; ``--only nccl``). The promises:

  - fused AdamW (the device gate): **0** added syncs per healthy step. The decision's one wait
    is on a CUDA event recorded right after the health vector's copy to pinned memory, at the
    next sentinel call; it is counted apart, as the share of steps where that event was not
    yet done when the host got there (the host then waits for the end of backward, not for
    the optimizer);
  - foreach AdamW (the host gate): at most 1 (reading the health vector before the optimizer).

  Alone, the exchange, its watchdog and the replica check are off, so this path cannot show
  what the multi-rank path costs.
- **gloo over CUDA tensors on several ranks** (``--world``, default 2, sharing the GPUs there
  are; ``--only gloo``): the multi-rank path, with the health exchange, its watchdog and the
  replica fingerprints (every :data:`FINGERPRINT_EVERY` steps) as at scale. Gloo reduces on the
  host, so the exchange copies the vector to the host when it leaves (where NCCL would not)
  and the replica check reads its comparison there: the promise is at most 1 a step on either
  gate, plus one per replica check.

Without CUDA (CI) the gloo path runs the same loops on the CPU, on the same ranks, and says
that nothing was counted (``tests/e2e/test_bench_smoke.py`` runs it so, so that it cannot rot
between GPU loans); ``bench/run_gpu.sh`` runs it on a lent GPU machine. It exits 1 when a
promise is broken, 0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel.step import record

STEPS = 10
WARMUP = 5  # DDP rebuilds its buckets after the first step
#: Replica checks in the measured window of the gloo path: every this many steps.
FINGERPRINT_EVERY = 5
#: Added host syncs per healthy step, at most: NCCL at world size 1, by optimizer.
PROMISE = {"foreach": 1.0, "fused": 0.0}
#: The same on gloo over CUDA tensors: the vector's one copy to the host, plus the replica
#: checks' reads of their comparison (one per check).
PROMISE_GLOO = {impl: 1.0 + 1.0 / FINGERPRINT_EVERY for impl in PROMISE}


class EventWaits:
    """Counts decisions whose event was still pending when the host asked (a real wait): the
    one place this script reads the device gate's own record (step/record.py)."""

    def __init__(self) -> None:
        self.waited = self.total = 0
        self._read = record.StepRecord.read

    def __enter__(self) -> EventWaits:
        counter = self
        original = self._read

        def read(step: record.StepRecord) -> list[float]:
            if step.values is None and step.gated:
                counter.total += 1
                counter.waited += not step.landed()
            return original(step)

        record.StepRecord.read = read  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        record.StepRecord.read = self._read  # type: ignore[method-assign]


def count_syncs(model: torch.nn.Module, opt: torch.optim.Optimizer,
                sentinel: nansentinel.Sentinel | None, device: torch.device, width: int,
                steps: int) -> float | None:
    """Host syncs per step over ``steps`` steps after the warm-up; None off CUDA (the steps
    run, nothing is counted)."""
    generator = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(32, width, generator=generator).to(device)
    batch = {"x": x, "ids": torch.arange(32, device=device)}

    def step() -> None:
        if sentinel is not None:
            sentinel.check_batch(batch)
        loss = model(batch["x"]).float().pow(2).mean()
        if sentinel is not None:
            sentinel.check_loss(loss)
        loss.backward()
        if sentinel is not None:
            sentinel.step()  # the result is not read: reading it is a sync by the user's choice
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        step()
    if device.type != "cuda":
        for _ in range(steps):
            step()
        return None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught) / steps


def measure(rank: int, world: int, backend: str, init: str, width: int, steps: int,
            out: str) -> None:
    """One rank: every optimizer, with and without the sentinel; its counts into ``out``."""
    cuda = torch.cuda.is_available()
    index = rank % torch.cuda.device_count() if cuda else 0
    device = torch.device("cuda", index) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(index)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        for impl in PROMISE:
            counts: dict[str, float | None] = {}
            waits, gates = EventWaits(), ""
            for name in ("baseline", "sentinel"):
                torch.manual_seed(0)
                net = torch.nn.Sequential(
                    *[torch.nn.Linear(width, width) for _ in range(8)]).to(device)
                model = DDP(net, device_ids=[index] if cuda else None)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{impl: True})
                sentinel = None
                if name == "sentinel":
                    sentinel = nansentinel.Sentinel(
                        model, opt, metrics_port=0, env={}, report_dir=f"{out}/reports",
                        fingerprint_every=FINGERPRINT_EVERY)
                    gates = "device" if sentinel.device_gate is not None else "host"
                with waits:
                    counts[name] = count_syncs(model, opt, sentinel, device, width, steps)
                if sentinel is not None:
                    sentinel.close()
            results[impl] = {"counts": counts, "gate": gates, "waited": waits.waited,
                             "decisions": waits.total}
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def run(backend: str, world: int, width: int, steps: int) -> list[dict[str, Any]]:
    """Every rank's results of one path (``world`` processes, spawned)."""
    with tempfile.TemporaryDirectory(prefix="nansentinel-syncs-") as out:
        init = f"file://{out}/store"
        mp.start_processes(measure, args=(world, backend, init, width, steps, out),
                           nprocs=world, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def report(path: str, ranks: list[dict[str, Any]], promise: dict[str, float], steps: int
           ) -> bool:
    """Print one line per optimizer (the worst rank's counts); False if a promise broke."""
    ok = True
    for impl in PROMISE:
        rows = [r[impl] for r in ranks]
        gates = "/".join(sorted({row["gate"] for row in rows}))
        waited = sum(row["waited"] for row in rows)
        decisions = sum(row["decisions"] for row in rows)
        share = f"{waited}/{decisions}" if decisions else "none"
        if any(row["counts"]["sentinel"] is None for row in rows):
            print(f"{path}: {impl} AdamW ({gates} gate): {steps} steps ran with and without the "
                  f"sentinel on {len(rows)} rank(s); no CUDA, so no sync was counted")
            continue
        base = max(row["counts"]["baseline"] for row in rows)
        ours = max(row["counts"]["sentinel"] for row in rows)
        extra = max(row["counts"]["sentinel"] - row["counts"]["baseline"] for row in rows)
        ok = ok and extra <= promise[impl] + 1e-9
        print(f"{path}: {impl} AdamW ({gates} gate): host syncs per step (worst rank): "
              f"baseline {base:.1f}, sentinel {ours:.1f}, added by the sentinel {extra:.1f} "
              f"(promise: <= {promise[impl]:g}); decisions that waited on their event: {share}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/gpu_syncs.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--width", type=int, default=1024, help="the model's width (default 1024)")
    p.add_argument("--steps", type=int, default=STEPS, help="measured steps (default 10)")
    p.add_argument("--only", choices=("nccl", "gloo"), help="one path (default both)")
    args = p.parse_args(argv)
    os.environ.setdefault("NANSENTINEL_METRICS_PORT", "0")
    cuda = torch.cuda.is_available()
    ok = True
    if args.only != "gloo":
        if cuda and dist.is_nccl_available():
            ranks = run("nccl", 1, args.width, args.steps)
            ok = report("nccl, world size 1", ranks, PROMISE, args.steps) and ok
        else:
            print("gpu_syncs.py: the NCCL path needs a CUDA device and NCCL: not run here",
                  file=sys.stderr)
    if args.only != "nccl":
        where = "CUDA tensors" if cuda else "the CPU (no CUDA)"
        ranks = run("gloo", args.world, args.width, args.steps)
        ok = report(f"gloo over {where}, world size {args.world}", ranks, PROMISE_GLOO,
                    args.steps) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
