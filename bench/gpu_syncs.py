"""Count the host synchronisations the sentinel adds per healthy step on CUDA.

``torch.cuda.set_sync_debug_mode("warn")`` makes PyTorch warn at every operation that
synchronises the host with the GPU. This script runs the same step with and without the
sentinel (every default: ``gate="auto"``), for DDP and FSDP2, each with a foreach and a fused
AdamW, and reports the warnings per step of each and the difference. The promise follows the
gate the run took (``sentinel.gate``, which the run prints), on two paths:

- **NCCL at world size 1** (one GPU; ``--only nccl``). The promises:

  - the device gate (the default on CUDA with a fused optimizer, DDP or FSDP2): **0** added
    syncs per healthy step. ``step()`` queues the optimizer step, gated by a ``found_inf``
    taken on the device, before the host reads anything; it then waits for the CUDA event
    recorded behind the health vector's copy to pinned memory (the end of backward), while
    the GPU runs the optimizer. That wait is no sync torch's debug mode sees (no blocking
    copy, no stream or device synchronisation); it is counted apart, as the share of
    decisions whose event was not yet done when the host got there;
  - the host gate (a foreach optimizer): at most 1 (reading the health vector before the
    optimizer).

  Alone, the exchange, its watchdog and the replica check are off, so this path cannot show
  what the multi-rank path costs; FSDP2 on one rank reduce-scatters nothing (its gradients are
  checked at ``step()``).
- **gloo over CUDA tensors on several ranks** (``--world``, default 2, sharing the GPUs there
  are; ``--only gloo``; DDP only: gloo has no reduce-scatter of CUDA tensors): the multi-rank
  path, with the health exchange, its watchdog and the replica fingerprints (every
  :data:`FINGERPRINT_EVERY` steps) as at scale. Gloo reduces on the host, so the exchange
  copies the vector to the host when it leaves (where NCCL would not) and the replica check
  reads its comparison there: the promise is at most 1 a step on either gate, plus one per
  replica check.

``--gates auto,device,host`` runs each of those gates too (``device``: the decision left to
the next sentinel call). Without CUDA (CI) the gloo path runs the same loops on the CPU (DDP
and FSDP2), on the same ranks, and says that nothing was counted
(``tests/e2e/test_bench_smoke.py`` runs it so, so that it cannot rot between GPU loans);
``bench/run_gpu.sh`` runs it on a lent GPU machine. It exits 1 when a promise is broken, 0
otherwise.
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
IMPLS = ("foreach", "fused")
ENGINES = ("DDP", "FSDP2")
#: Added host syncs per healthy step, at most: NCCL at world size 1, by the gate taken.
PROMISE = {"device": 0.0, "host": 1.0}
#: On gloo over CUDA tensors, either gate: the vector's one copy to the host, plus the replica
#: checks' reads of their comparison (one per check).
PROMISE_GLOO = 1.0 + 1.0 / FINGERPRINT_EVERY


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


def build(engine: str, width: int, device: torch.device, index: int) -> torch.nn.Module:
    """Eight Linear layers under DDP, or each ``fully_shard``-ed and the root (FSDP2)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(device)
    if engine == "DDP":
        return DDP(net, device_ids=[index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in net:
        fully_shard(layer, mesh=mesh)
    return fully_shard(net, mesh=mesh)


def measure(rank: int, world: int, backend: str, init: str, width: int, steps: int,
            out: str, gates: list[str]) -> None:
    """One rank: every engine, optimizer and gate, with and without the sentinel; its counts
    into ``out``."""
    cuda = torch.cuda.is_available()
    index = rank % torch.cuda.device_count() if cuda else 0
    device = torch.device("cuda", index) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(index)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    engines = [e for e in ENGINES if not (e == "FSDP2" and backend == "gloo" and cuda)]
    results: dict[str, Any] = {}
    try:
        for engine in engines:
            for impl in IMPLS:
                baseline: float | None = None
                for gate in gates:
                    waits = EventWaits()
                    counts: dict[str, float | None] = {}
                    names = ("sentinel",) if baseline is not None else ("baseline", "sentinel")
                    taken = ""
                    for name in names:
                        model = build(engine, width, device, index)
                        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{impl: True})
                        sentinel = None
                        if name == "sentinel":
                            sentinel = nansentinel.Sentinel(
                                model, opt, metrics_port=0, env={}, gate=gate,
                                report_dir=f"{out}/reports", fingerprint_every=FINGERPRINT_EVERY)
                            taken = sentinel.gate.name
                        with waits:
                            counts[name] = count_syncs(model, opt, sentinel, device, width,
                                                       steps)
                        if sentinel is not None:
                            sentinel.close()
                    if baseline is None:
                        baseline = counts["baseline"]
                    counts["baseline"] = baseline
                    results[f"{engine}/{impl}/{gate}"] = {
                        "counts": counts, "gate": taken, "waited": waits.waited,
                        "decisions": waits.total}
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def run(backend: str, world: int, width: int, steps: int, gates: list[str]
        ) -> list[dict[str, Any]]:
    """Every rank's results of one path (``world`` processes, spawned)."""
    with tempfile.TemporaryDirectory(prefix="nansentinel-syncs-") as out:
        init = f"file://{out}/store"
        mp.start_processes(measure, args=(world, backend, init, width, steps, out, gates),
                           nprocs=world, start_method="spawn")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def report(path: str, ranks: list[dict[str, Any]], gloo: bool, steps: int) -> bool:
    """Print one line per engine, optimizer and gate asked (the worst rank's counts); False
    if the promise of the gate the run took broke."""
    ok = True
    for key in ranks[0]:
        engine, impl, asked = key.split("/")
        rows = [r[key] for r in ranks]
        gates = "/".join(sorted({row["gate"] for row in rows}))
        waited = sum(row["waited"] for row in rows)
        decisions = sum(row["decisions"] for row in rows)
        share = f"{waited}/{decisions}" if decisions else "none"
        what = f"{path}: {engine}, {impl} AdamW, gate={asked!r} took the {gates} gate"
        if any(row["counts"]["sentinel"] is None for row in rows):
            print(f"{what}: {steps} steps ran with and without the sentinel on {len(rows)} "
                  "rank(s); no CUDA, so no sync was counted")
            continue
        promise = PROMISE_GLOO if gloo else max(
            PROMISE["host" if row["gate"] == "host" else "device"] for row in rows)
        base = max(row["counts"]["baseline"] for row in rows)
        ours = max(row["counts"]["sentinel"] for row in rows)
        extra = max(row["counts"]["sentinel"] - row["counts"]["baseline"] for row in rows)
        ok = ok and extra <= promise + 1e-9
        print(f"{what}: host syncs per step (worst rank): baseline {base:.1f}, sentinel "
              f"{ours:.1f}, added by the sentinel {extra:.1f} (promise: <= {promise:g}); "
              f"device-gated decisions that waited on their event: {share}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/gpu_syncs.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--width", type=int, default=1024, help="the model's width (default 1024)")
    p.add_argument("--steps", type=int, default=STEPS, help="measured steps (default 10)")
    p.add_argument("--only", choices=("nccl", "gloo"), help="one path (default both)")
    p.add_argument("--gates", default="auto",
                   help="the gates asked for, comma-separated (default: auto, the default)")
    args = p.parse_args(argv)
    gates = [g for g in args.gates.split(",") if g]
    os.environ.setdefault("NANSENTINEL_METRICS_PORT", "0")
    cuda = torch.cuda.is_available()
    ok = True
    if args.only != "gloo":
        if cuda and dist.is_nccl_available():
            ranks = run("nccl", 1, args.width, args.steps, gates)
            ok = report("nccl, world size 1", ranks, False, args.steps) and ok
        else:
            print("gpu_syncs.py: the NCCL path needs a CUDA device and NCCL: not run here",
                  file=sys.stderr)
    if args.only != "nccl":
        where = "CUDA tensors" if cuda else "the CPU (no CUDA)"
        ranks = run("gloo", args.world, args.width, args.steps, gates)
        ok = report(f"gloo over {where}, world size {args.world}", ranks, True,
                    args.steps) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
