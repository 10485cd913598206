"""FSDP2 / HSDP training loops run on gloo ranks by the FSDP tests (importable by spawned ranks).

Faults are the test's own, made by the model and the data rather than by NANSENTINEL_INJECT:
``batch`` writes NaN into the batch's float input (so the forward, loss and gradients turn
non-finite), ``loss`` multiplies the loss by NaN, and ``backward`` passes the forward through a
function that is the identity forward and writes NaN into the gradient in backward (forward and
loss stay finite: only a check of the local gradients before the reduce-scatter can see it);
``pos`` and ``embed`` do the same to the gradient of the position table alone, or of the
embedding alone (two parameters of the root FSDP group).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import nansentinel
from nansentinel.demo import VOCAB, TinyTransformer, synthetic_batch
from tests.support import full_tensor

#: (step, rank) -> kind of fault, set per step by the loop.
Faults = dict[tuple[int, int], str]


class _PoisonGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = math.nan
        return grad


#: The backward-only poisons: the embedding output (``backward``), the position table alone
#: (``pos``), the embedding alone (``embed``).
POISONS = ("backward", "pos", "embed")


class PoisonableTransformer(TinyTransformer):
    """The demo model with a switch that poisons a gradient in backward (one of POISONS)."""

    poison: str | None = None

    def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        embedded, pos = self.embed(tokens), self.pos
        if self.poison == "embed":
            embedded = _PoisonGrad.apply(embedded)
        if self.poison == "pos":
            pos = _PoisonGrad.apply(pos)
        h = embedded * scale + pos
        if self.poison == "backward":
            h = _PoisonGrad.apply(h)
        return self.head(self.encoder(h))


def build(world: int, hsdp: bool, **shard: Any) -> nn.Module:
    """The model, sharded like torchtitan does: each encoder layer, then the root.
    ``shard``: more keywords of ``fully_shard`` (``mp_policy``, ``offload_policy``)."""
    torch.manual_seed(0)
    model = PoisonableTransformer()
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh, **shard)
    fully_shard(model, mesh=mesh, **shard)
    return model


#: What a refusal scenario returns where this torch cannot build its setup at all.
NO_SUCH_SETUP = "no such setup on this torch"


def full_weights(model: nn.Module) -> torch.Tensor:
    """Every parameter gathered whole (a collective: every rank calls it)."""
    return torch.cat([full_tensor(p).detach().reshape(-1) for p in model.parameters()])


def train_fsdp(rank: int, world: int, *, steps: int, report_dir: str, hsdp: bool = False,
               faults: Faults | None = None, sentinel: bool = True, accumulate: int = 1,
               shard: dict[str, Any] | None = None, fused: bool = False,
               **overrides: Any) -> dict[str, Any]:
    """Train the sharded model; return each step's result and the full final weights.

    ``accumulate``: micro-batches per step, all but the last without gradient sync;
    ``shard``: more keywords of ``fully_shard``; ``fused``: a fused AdamW."""
    faults = faults or {}
    model = build(world, hsdp, **(shard or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused or None)
    watcher = (nansentinel.Sentinel(model, opt, report_dir=report_dir, **overrides)
               if sentinel else None)
    loss_fn = nn.CrossEntropyLoss()
    records, error = [], None
    try:
        for step in range(steps):
            kind = faults.get((step, rank))
            for micro in range(accumulate):
                # Micro-batches before the last accumulate unsharded gradients without a
                # reduce-scatter; the fault sits in the first one.
                model.set_requires_gradient_sync(micro == accumulate - 1)
                batch = synthetic_batch(rank, step * accumulate + micro)
                hit = kind if micro == 0 else None
                if hit == "batch":
                    batch["scale"][0, 0, 0] = math.nan
                if watcher is not None:
                    watcher.check_batch(batch)
                model.poison = hit if hit in POISONS else None
                logits = model(batch["tokens"], batch["scale"])
                loss = loss_fn(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))
                if hit == "loss":
                    loss = loss * math.nan
                if watcher is not None:
                    watcher.check_loss(loss / accumulate)
                (loss / accumulate).backward()
            if watcher is None:
                opt.step()
                opt.zero_grad()
                continue
            r = watcher.step()
            opt.zero_grad(set_to_none=True)
            records.append({
                "step": r.step, "applied": r.applied, "outcome": r.outcome,
                "bad_ranks": r.bad_ranks, "kinds": r.kinds, "local_kinds": r.local_kinds,
                "parameters": r.parameters, "report_path": r.report_path,
                "rolled_back_to": r.rolled_back_to, "verdict": r.verdict,
                "local_grad_norm": r.local_grad_norm,
            })
    except nansentinel.NonFiniteError as exc:
        error = {"type": type(exc).__name__, "message": str(exc), "step": exc.result.step,
                 "report_path": exc.result.report_path}
    finally:
        if watcher is not None:
            watcher.close()
    return {"records": records, "weights": full_weights(model), "error": error,
            "path": watcher.gradients.caps.label if watcher is not None else None,
            "gate": watcher.gate.name if watcher is not None else None,
            "device": str(watcher.device) if watcher is not None else None}


#: Faults of the matrix: a backward-only poison at step 0, a batch fault, two ranks at once (a
#: loss and a backward-only poison), healthy steps between them; and a fire drill at step 5.
MATRIX: Faults = {(0, 1): "backward", (2, 3): "batch", (4, 0): "loss", (4, 2): "backward"}
DRILL = "kind=grad,rank=3,step=5"


def scenarios(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """Every FSDP scenario of the tests in one process group (spawning ranks is the slow part
    on a small CI machine): the fault matrix on a 1-D mesh and on a 2x2 HSDP mesh, healthy
    runs with and without the sentinel, an abort, a rollback and its reference, and the
    refused setups."""
    runs: dict[str, Any] = {}
    for mesh, hsdp in (("fsdp", False), ("hsdp", True)):
        runs[f"matrix-{mesh}"] = train_fsdp(
            rank, world, steps=7, faults=MATRIX, hsdp=hsdp, inject=DRILL,
            report_dir=f"{report_dir}/matrix-{mesh}",
        )
        for watched in (False, True):
            runs[f"healthy-{mesh}-{'watched' if watched else 'plain'}"] = train_fsdp(
                rank, world, steps=4, hsdp=hsdp, sentinel=watched, report_dir=report_dir,
            )
    runs["abort"] = train_fsdp(rank, world, steps=4, faults={(2, 3): "backward"},
                               policy="abort", report_dir=f"{report_dir}/abort")
    # A snapshot at step 0 only, taken before its update; the rollback at step 3 must bring
    # back exactly the weights the run started from.
    runs["rollback"] = train_fsdp(rank, world, steps=4, faults={(3, 1): "backward"},
                                  policy="rollback", snapshot_every=100,
                                  report_dir=f"{report_dir}/rollback")
    runs["no-step"] = train_fsdp(rank, world, steps=0, sentinel=False, report_dir=report_dir)
    runs["accumulate"] = train_fsdp(rank, world, steps=3, accumulate=2, hsdp=True,
                                    faults={(1, 2): "backward"}, report_dir=report_dir)
    runs["refused"] = {s: refused(rank, world, setup=s)
                       for s in ("replicate-only", "unsharded-root", "placement-fn")}
    # The refused setups build gloo groups and issue no collective on them, and building a
    # gloo group is not a synchronisation point: a rank that returned first would tear its
    # groups down while a slower peer still reads its half of a connection ("Connection reset
    # by peer" in that peer's ProcessGroupGloo, seen once in CI's 2.11 lane). Leave together.
    dist.barrier()
    return runs


def refused(rank: int, world: int, *, setup: str) -> str:
    """Build an unsupported FSDP setup and return the Sentinel's error message."""
    torch.manual_seed(0)
    model = TinyTransformer()
    if setup == "replicate-only":
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh)
    elif setup == "unsharded-root":
        for layer in model.encoder.layers:
            fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    elif setup == "placement-fn":
        mesh = init_device_mesh("cpu", (world,))
        from torch.distributed.fsdp import FSDPModule  # noqa: F401 - import check only

        fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = model._get_fsdp_state()  # a second param group, as shard_placement_fn makes
        if not hasattr(state, "_fsdp_param_groups"):
            return NO_SUCH_SETUP  # torch 2.9-2.12: one param group per FSDP state
        state._fsdp_param_groups.append(state._fsdp_param_groups[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        nansentinel.Sentinel(model, opt)
    except nansentinel.SentinelUsageError as exc:
        return str(exc)
    return "no error"


def one_process(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """FSDP2 on a world of one: FSDP reduces nothing (no reduce-scatter is called), so the
    sentinel checks the local gradients at ``step()``."""
    return train_fsdp(rank, world, steps=3, faults={(1, 0): "backward"}, report_dir=report_dir)


def slow_micro_batches(rank: int, world: int, *, report_dir: str, pause: float,
                       **overrides: Any) -> list[str]:
    """FSDP2 with 3 micro-batches a step, each reduce-scattered, each followed by ``pause``
    seconds of the user's own work (data loading, logging): outcomes of 2 steps."""
    import time

    model = build(world, hsdp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    watcher = nansentinel.Sentinel(model, opt, report_dir=report_dir, **overrides)
    loss_fn = nn.CrossEntropyLoss()
    outcomes = []
    for step in range(2):
        for micro in range(3):
            batch = watcher.check_batch(synthetic_batch(rank, step * 3 + micro))
            loss = loss_fn(model(batch["tokens"], batch["scale"]).reshape(-1, VOCAB),
                           batch["targets"].reshape(-1))
            watcher.check_loss(loss / 3)
            (loss / 3).backward()
            time.sleep(pause)
        outcomes.append(str(watcher.step().outcome))
        opt.zero_grad(set_to_none=True)
    watcher.close()
    return outcomes


def reference_grad_norm(rank: int, step: int = 0) -> float:
    """This rank's local gradient norm at ``step`` of a fresh model without FSDP, on the batch
    train_fsdp gives it: what the sentinel must report, whatever FSDP divides by."""
    torch.manual_seed(0)
    model = PoisonableTransformer()
    batch = synthetic_batch(rank, step)
    logits = model(batch["tokens"], batch["scale"])
    nn.CrossEntropyLoss()(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1)).backward()
    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat(grads)))


def precision_and_naming(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """The gradient norm under each reduce dtype (1-D and HSDP), CPU offload with a fault,
    and two ranks poisoned in different parameters of one FSDP group."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    runs: dict[str, Any] = {"reference": reference_grad_norm(rank)}
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16),
                        ("bf16", torch.bfloat16)):
        for hsdp in (False, True):
            out = train_fsdp(rank, world, steps=1, hsdp=hsdp, report_dir=report_dir,
                             shard={"mp_policy": MixedPrecisionPolicy(reduce_dtype=dtype)})
            runs[f"norm-{name}-{'hsdp' if hsdp else 'fsdp'}"] = out["records"][0]
    # pin_memory needs an accelerator; the offloaded shards live in (unpinned) host memory.
    runs["offload"] = train_fsdp(
        rank, world, steps=3, faults={(1, 1): "backward"}, report_dir=f"{report_dir}/offload",
        shard={"offload_policy": CPUOffloadPolicy(pin_memory=False)},
    )
    runs["two-in-one-group"] = train_fsdp(
        rank, world, steps=2, faults={(1, 1): "pos", (1, 2): "embed"},
        report_dir=f"{report_dir}/two",
    )
    return runs
