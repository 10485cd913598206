"""Pipeline-parallel training loops on gloo ranks (importable by spawned ranks).

Faults are made by the model and the data, not by NANSENTINEL_INJECT, at a (step, rank):

- ``forward``: the stage's output is multiplied by NaN in one element (its forward began it);
- ``backward``: the gradient of the stage's hidden activation turns NaN in backward (forward
  and loss stay finite; the stage's parameter gradients and, past the first stage, the
  gradients it sends back are non-finite);
- ``batch``: the first stage's input holds a NaN; ``target``: the last stage's target does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import nansentinel
from tests.distributed.workers_fsdp import _PoisonGrad
from tests.support import full_tensor

WIDTH, BATCH, MICRO = 16, 8, 2


class Block(nn.Module):
    """One stage: two linear layers with a switch for the model-made faults."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.outer = nn.Linear(WIDTH, WIDTH)
        self.poison: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        if self.poison == "backward":
            h = _PoisonGrad.apply(h)
        out = self.outer(torch.tanh(h))
        if self.poison == "forward":
            out = out * torch.where(torch.arange(out.numel()).view_as(out) == 0, math.nan, 1.0)
        return out


def _data(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, torch.tanh(x.flip(1))


def _step(sentinel: nansentinel.Sentinel, sched: Any, optimizer: torch.optim.Optimizer,
          first: bool, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One pipelined training step as a user writes it; what every rank read of it."""
    if first:
        sentinel.check_batch(x)
        sched.step(x)
    else:
        sched.step(target=y, losses=[])
    result = sentinel.step()
    optimizer.zero_grad(set_to_none=True)
    return {"step": result.step, "applied": result.applied, "outcome": result.outcome.value,
            "bad_ranks": result.bad_ranks, "bad_hosts": result.bad_hosts,
            "reached": result.reached, "kinds": result.kinds, "report": result.report_path}


def _full(module: nn.Module) -> list[torch.Tensor]:
    return [full_tensor(p).detach().clone()
            for p in module.parameters()]


def pipelined(rank: int, world: int, *, schedule: str, steps: int,
              faults: dict[tuple[int, int], str], report_dir: str,
              host_strikes: int = 100) -> dict[str, Any]:
    """2 stages x 2 data-parallel replicas, FSDP2 on the dp dimension; hosts by stage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index, replica = rank // 2, rank % 2
    torch.manual_seed(stage_index)
    block = Block()
    fully_shard(block, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-2)
    stage = PipelineStage(block, stage_index, 2, torch.device("cpu"),
                          group=mesh["pp"].get_group())
    sentinel = nansentinel.Sentinel(
        block, optimizer, stages=stage, hostname=f"stage{stage_index}-host",
        report_dir=report_dir, host_strikes=host_strikes, replay=False,
    )
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = kind(stage, MICRO, loss_fn=sentinel.wrap_loss(nn.functional.mse_loss))
    records, error = [], None
    try:
        for step in range(steps):
            fault = faults.get((step, rank))
            block.poison = fault if fault in ("forward", "backward") else None
            x, y = _data(step, replica)
            if fault == "batch":
                x[1, 2] = math.nan
            if fault == "target":
                y[0, 1] = math.inf
            records.append(_step(sentinel, sched, optimizer, stage.is_first, x, y))
    except nansentinel.HostExcludedError as exc:
        error = {"type": "HostExcludedError", "message": str(exc)}
    weights = _full(block)
    sentinel.close()
    # The forward's collectives that cannot carry a batch's NaN: FSDP's all-gathers (dp) and
    # the pipeline's sends and receives (pp); any other group would count (origins.py).
    quiet = sorted(sentinel.forward.exclude) == sorted(
        mesh[d].get_group().group_name for d in ("dp", "pp"))
    return {"records": records, "weights": weights, "stage": stage_index, "error": error,
            "quiet": quiet,
            "finite": all(bool(torch.isfinite(w).all()) for w in weights)}


def interleaved(rank: int, world: int, *, steps: int, faults: dict[tuple[int, int], str],
                report_dir: str) -> dict[str, Any]:
    """4 stages on 2 ranks (rank r holds stages r and r + 2), Interleaved1F1B, no sharding:
    the model is the list of this rank's two stage modules."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    indices = [rank, rank + 2]
    blocks = []
    for i in indices:
        torch.manual_seed(i)
        blocks.append(Block())
    params = [p for b in blocks for p in b.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
    stages = [PipelineStage(b, i, 4, torch.device("cpu")) for b, i in zip(blocks, indices,
                                                                            strict=True)]
    # fingerprint_every=1: the stages are not replicas of each other, so the replica check
    # must stay off here (with it on, every healthy step would "diverge"). gate="device" with
    # a fused optimizer: refused under a pipeline (the stages' next calls differ), host gate.
    sentinel = nansentinel.Sentinel(blocks, optimizer, stages=stages, hostname=f"host{rank}",
                                    report_dir=report_dir, replay=False, fingerprint_every=1,
                                    gate="device")
    sched = ScheduleInterleaved1F1B(stages, MICRO,
                                    loss_fn=sentinel.wrap_loss(nn.functional.mse_loss))
    records = []
    for step in range(steps):
        for i, b in zip(indices, blocks, strict=True):
            b.poison = faults.get((step, i))
        x, y = _data(step, 0)
        records.append(_step(sentinel, sched, optimizer, rank == 0, x, y))
    replicas = sentinel.replicas
    sentinel.close()
    return {"records": records, "finite": all(bool(torch.isfinite(p).all()) for p in params),
            "replica_check": replicas is not None,
            "gate": "host" if sentinel.device_gate is None else "device"}


def forward_collective(rank: int, world: int, *, steps: int, poisoned: tuple[int, int],
                       report_dir: str, centred: bool = True, buffers: bool = False,
                       loss_poisoned: tuple[int, int] | None = None) -> dict[str, Any]:
    """DDP on ``world`` ranks (one host each) with a model that subtracts the mean over every
    rank's batch in its forward, as SyncBatchNorm's statistics do (``centred=False``: it does
    not); ``poisoned``: (step, rank) whose batch holds a NaN; ``loss_poisoned``: (step, rank)
    whose loss is made NaN. ``buffers``: a BatchNorm after the linear layer, whose buffers DDP
    broadcasts from rank 0 at the start of every forward (a collective on DDP's group)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Centred(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)
            self.norm = nn.BatchNorm1d(WIDTH) if buffers else nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not centred:
                return self.norm(self.lin(x))
            mean = x.mean(0, keepdim=True)
            dist.all_reduce(mean)
            return self.norm(self.lin(x - mean / dist.get_world_size()))

    torch.manual_seed(0)
    model = DDP(Centred())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sentinel = nansentinel.Sentinel(model, optimizer, hostname=f"node{rank}",
                                    report_dir=report_dir)
    records = []
    for step in range(steps):
        x, y = _data(step, rank)
        if (step, rank) == poisoned:
            x[0, 0] = math.nan
        sentinel.check_batch(x)
        loss = nn.functional.mse_loss(model(x), y)
        if (step, rank) == loss_poisoned:
            loss = loss * math.nan
        sentinel.check_loss(loss)
        loss.backward()
        result = sentinel.step()
        optimizer.zero_grad(set_to_none=True)
        records.append({"step": result.step, "applied": result.applied,
                        "bad_ranks": result.bad_ranks, "bad_hosts": result.bad_hosts,
                        "reached": result.reached, "kinds": result.kinds,
                        "verdict": result.verdict, "report": result.report_path})
    sentinel.close()
    return {"records": records,
            "weights": [p.detach().clone() for p in model.parameters()]}


def ddp_buffers(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """DDP with a BatchNorm (its buffers broadcast in every forward), twice in one process
    group: two independent faults at step 1 (the step DDP also rebuilds its buckets with a
    broadcast) with no collective of the user's in the forward, then the forward all-reduce
    of the batch mean with rank 0's batch poisoned."""
    return {
        "independent": forward_collective(rank, world, steps=3, poisoned=(1, 0),
                                          loss_poisoned=(1, 1), centred=False, buffers=True,
                                          report_dir=f"{report_dir}/independent"),
        "centred": forward_collective(rank, world, steps=3, poisoned=(1, 0), buffers=True,
                                      report_dir=f"{report_dir}/centred"),
    }
