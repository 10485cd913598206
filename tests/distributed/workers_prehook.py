"""Hand-written reduction loops on gloo ranks, checked by the pre-hook path (torch >= 2.14).

Each loop runs a small MLP, no ``check_grads()``: the gradients leave through the loop's own
collectives, per parameter (``all_reduce``), as one flattened bucket (``all_reduce``), or as a
flattened bucket reduce-scattered into shards then gathered back (``reduce_scatter_tensor``,
``all_gather_into_tensor``). Rank 1's gradient of ``1.weight`` is poisoned after backward,
before the reduction, at the steps in ``FAULTS``; with ``host_strikes=2`` the second strike
excludes its host. ``checked`` runs the older contract beside them: ``check_grads()`` before
the loop's own all-reduce.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from torch import nn

import nansentinel
from nansentinel.effects.metrics import SentinelMetrics

FAULTS = (2, 4)
STEPS = 6
LOOPS = ("per_param", "bucket", "reduce_scatter", "checked")
#: The loop of issue 59, run on its own: rank 1's NaN lands in rank 0's shard, so rank 0's
#: norm all-reduce sends a NaN too; the reduce-scatter came first and names rank 1 alone.
SHARDED_CLIP = "sharded_clip"


def _reduce(loop: str, params: list[nn.Parameter], world: int) -> None:
    """The loop's own gradient reduction: an average across ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    if loop in ("per_param", "checked"):
        for g in grads:
            dist.all_reduce(g)
            g.div_(world)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if loop == "bucket":
        dist.all_reduce(flat)
    elif loop == SHARDED_CLIP:
        # A ZeRO-style loop with global clipping: reduce-scatter, the shard's squared norm
        # all-reduced into the global norm, the shard clipped, then gathered back.
        pad = (-flat.numel()) % world
        flat = torch.cat([flat, flat.new_zeros(pad)])
        shard = flat.new_empty(flat.numel() // world)
        dist.reduce_scatter_tensor(shard, flat)
        shard.div_(world)
        norm2 = shard.double().pow(2).sum().reshape(1)
        dist.all_reduce(norm2)
        shard.mul_((1.0 / (norm2.sqrt() + 1e-6)).clamp(max=1.0).to(shard.dtype))
        dist.all_gather_into_tensor(flat, shard)
        flat.mul_(world)
    else:
        pad = (-flat.numel()) % world
        flat = torch.cat([flat, flat.new_zeros(pad)])
        shard = flat.new_empty(flat.numel() // world)
        dist.reduce_scatter_tensor(shard, flat)
        dist.all_gather_into_tensor(flat, shard)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def run(rank: int, world: int, *, loop: str, report_dir: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, env={},
                                    hostname=f"node{rank}", host_strikes=2, metrics_port=0,
                                    metrics_linger=0,
                                    exclusion_file=f"{report_dir}/excluded-{loop}.jsonl")
    registry = CollectorRegistry()
    sentinel.metrics = SentinelMetrics(sentinel.identity, registry=registry)
    records, error = [], None
    try:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 1, generator=g)
            sentinel.check_batch(x)
            loss = nn.functional.mse_loss(model(x), y)
            sentinel.check_loss(loss)
            loss.backward()
            if rank == 1 and step in FAULTS:  # sharded_clip: in rank 0's shard
                (params[0].grad if loop == SHARDED_CLIP else params[2].grad)[0, 3] = math.nan
            local = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
            if loop == "checked":
                sentinel.check_grads()
            _reduce(loop, params, world)
            r = sentinel.step()
            opt.zero_grad(set_to_none=True)
            records.append({"step": r.step, "outcome": str(r.outcome), "applied": r.applied,
                            "bad_ranks": r.bad_ranks, "bad_hosts": r.bad_hosts,
                            "kinds": r.kinds, "parameters": r.parameters,
                            "excluded": list(r.excluded_hosts),
                            "norm": r.local_grad_norm, "local": local})
    except nansentinel.HostExcludedError as exc:
        error = {"type": type(exc).__name__, "step": exc.result.step,
                 "excluded": list(exc.result.excluded_hosts)}
    skipped = registry.get_sample_value("nansentinel_steps_total", {"outcome": "skipped"})
    blamed = registry.get_sample_value("nansentinel_blamed_steps_total")
    grad_faults = registry.get_sample_value("nansentinel_nonfinite_total", {"kind": "grad"})
    sentinel.metrics = None
    sentinel.close()
    return {"records": records, "error": error, "skipped": skipped, "blamed": blamed,
            "grad_faults": grad_faults,
            "path": sentinel.gradients.caps.label,
            "weights": torch.cat([p.detach().reshape(-1) for p in params])}


def scenarios(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """Every loop in one process group (one spawn), one Sentinel after the other."""
    out = {loop: run(rank, world, loop=loop, report_dir=report_dir) for loop in LOOPS}
    dist.barrier()
    return out


def sharded_clip(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    out = run(rank, world, loop=SHARDED_CLIP, report_dir=report_dir)
    dist.barrier()
    return out


def refused(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """Below torch 2.14: each loop that reduces before any check is refused at its first
    step; the loop that calls ``check_grads()`` first still runs."""
    out: dict[str, Any] = {}
    for loop in LOOPS:
        try:
            got = run(rank, world, loop=loop, report_dir=report_dir)
            out[loop] = {"records": len(got["records"]), "error": got["error"],
                         "path": got["path"]}
        except nansentinel.SentinelUsageError as exc:
            out[loop] = {"refused": type(exc).__name__, "message": str(exc)}
            dist.barrier()  # every rank refused at the same step: leave together
    dist.barrier()
    return out


class _SumRanks(torch.autograd.Function):
    """Row-parallel's all-reduce of partial outputs (Megatron's "reduce from the tensor
    parallel region"): a sum across ranks forward, the gradient as it is backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class RowParallel(nn.Module):
    """Each rank's half of a hidden layer; the partial outputs are summed in the forward.
    ``faulty``: this rank's hidden activations hold a NaN (a device fault inside the forward,
    before the all-reduce)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 8), nn.Linear(8, 1)
        self.faulty = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x))
        if self.faulty:
            h = h.index_fill(1, torch.tensor([2]), math.nan)
        return _SumRanks.apply(self.down(h))


def _mse(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).pow(2).mean()


def forward_origin(rank: int, world: int, *, report_dir: str, persistent: bool,
                   fault_at: int = 1, steps: int = 3) -> dict[str, Any]:
    """A fault on rank 1 before a forward all-reduce: only at ``fault_at`` (transient), with
    no replay function; or from ``fault_at`` on (``persistent``: a faulty device), with one
    (which today's trace replays, below torch 2.14)."""
    torch.manual_seed(rank)
    model = RowParallel()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, env={},
                                    hostname=f"node{rank}", metrics_port=0, metrics_linger=0,
                                    replay=_mse if persistent else None)
    records = []
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(4, 6, generator=g)
        sentinel.check_batch(x)
        model.faulty = rank == 1 and (step >= fault_at if persistent else step == fault_at)
        loss = _mse(model, x)
        sentinel.check_loss(loss)
        loss.backward()
        r = sentinel.step()
        opt.zero_grad(set_to_none=True)
        records.append({"step": r.step, "outcome": str(r.outcome), "bad_ranks": r.bad_ranks,
                        "reached": r.reached, "verdict": r.verdict, "kinds": r.kinds,
                        "bad_hosts": r.bad_hosts, "report": r.report_path})
    sentinel.close()
    dist.barrier()
    return {"records": records, "path": sentinel.gradients.caps.label,
            "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
