"""Faults the model makes itself, for the framework tests (no injector involved)."""

from __future__ import annotations

import torch

from tests.support import full_tensor


class PoisonGrad(torch.autograd.Function):
    """Identity forward; NaN in the gradient on the way back: a backward-only fault that the
    loss cannot show, visible only in this rank's gradients before the all-reduce."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return torch.full_like(grad, float("nan"))


def fault(h: torch.Tensor, kind: str | None) -> torch.Tensor:
    """``log0``: a forward ``log(0)`` (-inf in the activations and the loss); ``grad``: the
    backward-only poison; None: unchanged."""
    if kind == "log0":
        return h + torch.log(torch.zeros_like(h[..., :1]))
    if kind == "grad":
        return PoisonGrad.apply(h)
    return h


def parse_faults(spec: str) -> dict[tuple[int, int], str]:
    """``"2:0:log0,4:1:grad"`` → ``{(step, rank): kind}``."""
    out = {}
    for part in filter(None, spec.split(",")):
        step, rank, kind = part.split(":")
        out[(int(step), int(rank))] = kind
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), else the tensor: compared without a collective."""
    return t.to_local() if hasattr(t, "to_local") else t


def weights(model: torch.nn.Module, engine: object = None) -> list[torch.Tensor]:
    """The full weights on every rank, detached copies on the CPU (to compare, and to write).
    Under FSDP2 each DTensor is gathered, under ZeRO-3 the engine's partitions, under FSDP1
    (``engine``: the FSDP1 root around ``model``) its flat shards: collectives, so every rank
    calls this at the same point."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(engine, FSDP1):
        with FSDP1.summon_full_params(engine, writeback=False):
            return [p.detach().float().cpu().clone() for p in model.parameters()]
    params = list(model.parameters())
    if engine is not None and getattr(engine, "zero_optimization_stage", lambda: 0)() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().float().cpu().clone() for p in params]
    return [full_tensor(p).detach().float().cpu().clone()
            for p in params]


def leave_together() -> None:
    """Tear the job's gloo group down at a point every rank passes, before the interpreter
    exits: a group left to the interpreter's exit can abort a rank ("terminate called without
    an active exception", seen on the loaded 2-core CI machine with the HF Trainer and
    Lightning's DeepSpeed workers, as with Accelerate's before)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
