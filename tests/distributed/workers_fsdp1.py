"""FSDP1 training loops run on gloo ranks by tests/distributed/test_fsdp1.py (importable by
spawned ranks). Faults are the model's and the data's, as in workers_fsdp: ``batch`` (NaN in
the float input), ``loss`` (the loss times NaN), ``backward`` / ``pos`` / ``embed`` (a NaN
written into a gradient inside the backward: forward and loss stay finite).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import nansentinel
from nansentinel.demo import VOCAB, TinyTransformer, synthetic_batch
from tests.distributed.workers_fsdp import POISONS, PoisonableTransformer, reference_grad_norm

Faults = dict[tuple[int, int], str]

#: The strategies of the matrix, each with the ``use_orig_params`` it runs under (both values
#: are covered, and the hybrid strategy with each).
SETUPS: dict[str, tuple[str, bool]] = {
    "full": ("FULL_SHARD", False),
    "grad-op": ("SHARD_GRAD_OP", True),
    "no-shard": ("NO_SHARD", False),
    "hybrid": ("HYBRID_SHARD", True),
    "hybrid-flat": ("HYBRID_SHARD", False),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def build(world: int, setup: str = "full", *, mixed: str | None = None,
          **fsdp: Any) -> nn.Module:
    """The demo model wrapped like Lightning's and Accelerate's FSDP1 do: each encoder layer
    its own unit (an auto-wrap policy), the rest in the root's. ``mixed``: a reduce dtype
    (and parameter dtype) from DTYPES."""
    torch.manual_seed(0)
    strategy, orig = SETUPS[setup]
    kw: dict[str, Any] = {"use_orig_params": orig, **fsdp}
    if strategy == "HYBRID_SHARD":
        kw["device_mesh"] = init_device_mesh("cpu", (2, world // 2))
    if mixed is not None:
        kw["mixed_precision"] = MixedPrecision(param_dtype=DTYPES[mixed],
                                               reduce_dtype=DTYPES[mixed])
    return FSDP(PoisonableTransformer(), sharding_strategy=ShardingStrategy[strategy],
                device_id=torch.device("cpu"),
                auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}), **kw)


def full_weights(model: nn.Module) -> torch.Tensor:
    """Every parameter gathered whole (a collective: every rank calls it)."""
    with FSDP.summon_full_params(model, writeback=False):
        return torch.cat([p.detach().reshape(-1).float().clone() for p in model.parameters()])


def _set_poison(model: nn.Module, poison: str | None) -> None:
    for m in model.modules():
        if isinstance(m, PoisonableTransformer):
            m.poison = poison


def train(rank: int, world: int, *, steps: int, report_dir: str, setup: str = "full",
          faults: Faults | None = None, sentinel: bool = True, accumulate: int = 1,
          mixed: str | None = None, clip: float | None = None,
          drop_reference: dict[int, int] | None = None, fsdp: dict[str, Any] | None = None,
          **overrides: Any) -> dict[str, Any]:
    """Train the FSDP1 model; return each step's result and the full final weights.

    ``accumulate``: micro-batches per step, all but the last under ``no_sync``; ``clip``:
    FSDP1's own ``clip_grad_norm_`` before the step; ``drop_reference``: step -> rank, the
    hand reference of a dropped step (no sentinel: that rank's loss times 0, the reduced
    gradients times W/(W-1))."""
    faults = faults or {}
    model = build(world, setup, mixed=mixed, **(fsdp or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    watcher = (nansentinel.Sentinel(model, opt, report_dir=report_dir, **overrides)
               if sentinel else None)
    loss_fn = nn.CrossEntropyLoss()
    records, error, clipped = [], None, []
    try:
        for step in range(steps):
            kind = faults.get((step, rank))
            for micro in range(accumulate):
                batch = synthetic_batch(rank, step * accumulate + micro)
                hit = kind if micro == 0 else None
                if hit == "batch":
                    batch["scale"][0, 0, 0] = math.nan
                if watcher is not None:
                    watcher.check_batch(batch)
                _set_poison(model, hit if hit in POISONS else None)
                sync = micro == accumulate - 1
                with model.no_sync() if not sync else _nothing():
                    logits = model(batch["tokens"], batch["scale"])
                    loss = loss_fn(logits.float().reshape(-1, VOCAB),
                                   batch["targets"].reshape(-1))
                    if hit == "loss":
                        loss = loss * math.nan
                    if drop_reference and drop_reference.get(step) == rank:
                        loss = loss * 0.0
                    if watcher is not None:
                        watcher.check_loss(loss / accumulate)
                    (loss / accumulate).backward()
            if drop_reference and step in drop_reference:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(world / (world - 1))
            if clip is not None:
                clipped.append(float(model.clip_grad_norm_(clip)))
            if watcher is None:
                opt.step()
                opt.zero_grad()
                continue
            r = watcher.step()
            opt.zero_grad(set_to_none=True)
            records.append({
                "step": r.step, "applied": r.applied, "outcome": r.outcome,
                "bad_ranks": r.bad_ranks, "kinds": r.kinds, "parameters": r.parameters,
                "report_path": r.report_path, "local_grad_norm": r.local_grad_norm,
                "rolled_back_to": r.rolled_back_to,
            })
    except nansentinel.NonFiniteError as exc:
        error = {"type": type(exc).__name__, "message": str(exc), "step": exc.result.step,
                 "report_path": exc.result.report_path}
    finally:
        if watcher is not None:
            watcher.close()
    return {"records": records, "weights": full_weights(model), "error": error,
            "clipped": clipped,
            "path": watcher.gradients.caps.label if watcher is not None else None}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: Any) -> None:
        return None


#: A backward-only poison at step 0, a batch fault, two ranks at once (a loss and a
#: backward-only poison), healthy steps between them; a fire drill at step 5.
MATRIX: Faults = {(0, 1): "backward", (2, 3): "batch", (4, 0): "loss", (4, 2): "backward"}
DRILL = "kind=grad,rank=3,step=5"
MATRIX_STEPS = 6


def scenarios(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """Every FSDP1 scenario of the tests in one process group: the fault matrix and a healthy
    run with and without the sentinel per strategy, mixed precision, FSDP1's own
    clip_grad_norm_, abort, drop and its hand reference, no_sync accumulation, rollback,
    replica fingerprints, and the refusals. (FSDP1's CPU offload pins memory, which needs an
    accelerator: not here.)"""
    runs: dict[str, Any] = {}
    for setup in SETUPS:
        runs[f"matrix-{setup}"] = train(rank, world, steps=MATRIX_STEPS, faults=MATRIX,
                                        setup=setup, inject=DRILL,
                                        report_dir=f"{report_dir}/matrix-{setup}")
        for watched in (False, True):
            runs[f"healthy-{setup}-{watched}"] = train(
                rank, world, steps=3, setup=setup, sentinel=watched, report_dir=report_dir)
    runs["reference"] = reference_grad_norm(rank)
    for mixed in DTYPES:
        for watched in (False, True):
            runs[f"mixed-{mixed}-{watched}"] = train(
                rank, world, steps=3, mixed=mixed, sentinel=watched, setup="hybrid",
                report_dir=report_dir)
        runs[f"mixed-{mixed}-fault"] = train(rank, world, steps=2, mixed=mixed,
                                             faults={(1, 2): "pos"}, report_dir=report_dir)
    for watched in (False, True):
        runs[f"clip-{watched}"] = train(rank, world, steps=3, clip=0.5, sentinel=watched,
                                        setup="grad-op", report_dir=report_dir)
    runs["abort"] = train(rank, world, steps=3, faults={(1, 3): "backward"}, policy="abort",
                          report_dir=f"{report_dir}/abort")
    runs["drop"] = train(rank, world, steps=3, faults={(1, 2): "batch"}, policy="drop",
                         report_dir=f"{report_dir}/drop")
    runs["drop-reference"] = train(rank, world, steps=3, sentinel=False,
                                   drop_reference={1: 2}, report_dir=report_dir)
    runs["accumulate"] = train(rank, world, steps=3, accumulate=2, setup="hybrid",
                               faults={(1, 2): "backward"}, report_dir=report_dir)
    runs["rollback"] = train(rank, world, steps=3, faults={(2, 1): "backward"},
                             policy="rollback", snapshot_every=100,
                             report_dir=f"{report_dir}/rollback")
    runs["no-step"] = train(rank, world, steps=0, sentinel=False, report_dir=report_dir)
    for setup in ("no-shard", "hybrid"):  # the replicas: NO_SHARD's group, HYBRID's replicate
        runs[f"fingerprint-{setup}"] = train(
            rank, world, steps=3, setup=setup, fingerprint_every=1,
            inject="kind=bitflip,rank=1,step=1", report_dir=f"{report_dir}/fp-{setup}")
    runs["refused"] = {s: refused(rank, world, setup=s) for s in ("own-hook", "outside", "twice")}
    dist.barrier()  # leave together: see workers_fsdp.scenarios
    return runs


def refused(rank: int, world: int, *, setup: str) -> str:
    """Build an unsupported FSDP1 setup and return the Sentinel's error message."""
    model: nn.Module
    if setup == "outside":
        torch.manual_seed(0)
        model = TinyTransformer()
        for i, layer in enumerate(model.encoder.layers):
            model.encoder.layers[i] = FSDP(layer, device_id=torch.device("cpu"))
    else:
        model = build(world)
        if setup == "own-hook":
            from torch.distributed.algorithms._comm_hooks import default_hooks

            model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD),
                                     default_hooks.reduce_scatter_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = None
    try:
        first = nansentinel.Sentinel(model, opt)
        if setup == "twice":
            nansentinel.Sentinel(model, opt)
    except nansentinel.SentinelUsageError as exc:
        return str(exc)
    finally:
        if first is not None:
            first.close()
    return "no error"


def one_process(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """FSDP1 on a world of one (FSDP1 then runs NO_SHARD): still checked in the hook."""
    return train(rank, world, steps=3, faults={(1, 0): "backward"}, report_dir=report_dir)
