"""Loops for the trust tests (issues 26 and 27): the rare path on gloo ranks, and reads on one
rank under the device gate (importable by spawned ranks)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from tests.distributed.workers_recovery import LogMLP, _record, make_batch, mse, run_steps


def nan_batch_replay(rank: int, world: int, *, steps: int, report_dir: str,
                     oom_rank: int | None = None) -> dict[str, Any]:
    """DDP, a replay function, a forward that all-reduces its token count (a collective in
    every replay too); rank 1's batch holds a NaN at step 3. ``oom_rank``: that rank's replay
    runs out of memory (the replay function raises as CUDA would)."""
    torch.manual_seed(0)
    net = LogMLP()
    net.count_tokens = True
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def replay(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if rank == oom_rank:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return mse(module, batch)

    sentinel = nansentinel.Sentinel(model, opt, replay=replay, report_dir=report_dir,
                                    hostname=f"host{rank // 2}")

    def batch_of(step: int) -> dict[str, torch.Tensor]:
        batch = make_batch(1000 * step + rank)
        if rank == 1 and step == 3:
            batch["x"][0, 0] = math.nan
        return batch

    with sentinel:
        records = run_steps(sentinel, model, opt, steps, batch_of)
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {"records": records, "weights": weights}


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))


def batchnorm_ddp(rank: int, world: int, *, steps: int, report_dir: str) -> dict[str, Any]:
    """DDP with a BatchNorm; rank 0's batch holds a NaN at step 3 (DDP broadcasts rank 0's
    buffers at the next forward)."""
    torch.manual_seed(0)
    net = BNNet()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir)
    records = []
    with sentinel:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(16, 4, generator=g)
            if rank == 0 and step == 3:
                x[5, 2] = math.nan
            batch = sentinel.check_batch({"x": x})
            loss = model(batch["x"]).pow(2).mean()
            sentinel.check_loss(loss)
            loss.backward()
            records.append(_record(sentinel.step()))
            opt.zero_grad()
    net.eval()
    out = net(torch.randn(4, 4))
    return {"records": records, "eval_finite": bool(torch.isfinite(out).all()),
            "buffers": torch.cat([net.norm.running_mean, net.norm.running_var])}


def late_close(rank: int, world: int, *, late: float, report_dir: str) -> dict[str, float]:
    """Two DDP steps, then ``close()``, which the last rank reaches ``late`` seconds after the
    others: when each rank entered and left it (one machine, one clock)."""
    import time

    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir)
    for step in range(2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(sentinel.check_batch(x)).pow(2).mean()
        sentinel.check_loss(loss)
        loss.backward()
        sentinel.step()
        opt.zero_grad()
    if rank == world - 1:
        time.sleep(late)
    entered = time.time()
    sentinel.close()
    return {"entered": entered, "left": time.time()}


def reads_on_rank0(rank: int, world: int, *, steps: int, report_dir: str, gate: str,
                   fault_step: int | None) -> dict[str, Any]:
    """Rank 0 alone reads each result and saves state_dict() (a loop that logs and
    checkpoints on rank 0), then every rank all-reduces a metric: under the device gate with
    replica fingerprints every step and rollback snapshots."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    inject = f"kind=loss,rank=1,step={fault_step}" if fault_step is not None else None
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, gate=gate,
                                    fingerprint_every=1, loss_spike_action="warn",
                                    policy="rollback", snapshot_every=1, inject=inject,
                                    rollback_skip_batches=0)
    reads, results = [], []
    with sentinel:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(8, 4, generator=g)
            batch = sentinel.check_batch({"x": x})
            loss = model(batch["x"]).pow(2).mean()
            sentinel.check_loss(loss)
            loss.backward()
            result = sentinel.step()
            results.append(result)
            if rank == 0:
                try:
                    reads.append(str(result.outcome))
                except nansentinel.ResultPending:
                    reads.append("pending")
                sentinel.state_dict()
            metric = torch.tensor([float(step)])
            dist.all_reduce(metric)  # every rank, right after: pairs only if nobody ran one
            opt.zero_grad(set_to_none=True)
    return {"reads": reads, "outcomes": [str(r.outcome) for r in results],
            "gate": "device" if sentinel.device_gate is not None else "host",
            "weights": torch.cat([p.detach().reshape(-1) for p in net.parameters()])}


def mismatched(rank: int, world: int) -> str:
    """Under DDP, ranks all-reduce tensors of different shapes: DETAIL names the mismatch."""
    DDP(nn.Linear(2, 2))  # DDP builds under DETAIL (harness.py spares torch's usage log)
    try:
        dist.all_reduce(torch.ones(3 if rank == 0 else 4))
    except RuntimeError as exc:
        return str(exc)
    return "no error"
