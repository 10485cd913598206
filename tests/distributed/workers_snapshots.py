"""Training loops for the sharded-snapshot tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel.effects.recovery import MemorySnapshots
from nansentinel.wire.collectives import Peers
from nansentinel.wire.context import Watched

#: A weight of 301 x 299 = 89,999 elements: above the sharding threshold, and a multiple of
#: none of 2, 3, 4, so the last slice is padded.
IN, HIDDEN = 299, 301


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, IN, generator=g)
    return x, x[:, :1] * 0.5


def flat_state(net: nn.Module, opt: torch.optim.Optimizer, buffers: bool = True
               ) -> torch.Tensor:
    """Weights, buffers (unless ``buffers`` is False: BatchNorm's differ per rank) and AdamW's
    moments and steps as one float64 vector."""
    tensors = net.state_dict().values() if buffers else net.parameters()
    parts = [t.detach().double().reshape(-1) for t in tensors]
    for p in net.parameters():
        parts += [opt.state[p][k].detach().double().reshape(-1)
                  for k in ("exp_avg", "exp_avg_sq", "step")]
    return torch.cat(parts)


def rollback(rank: int, world: int, *, steps: int, bad_step: int, report_dir: str
             ) -> dict[str, Any]:
    """DDP + AdamW under the Sentinel with policy rollback; rank 1's gradients go non-finite
    at ``bad_step``. Returns the state recorded before and after every step's update, the
    rollback's result, and the state at the end."""
    net = _net()
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sentinel = nansentinel.Sentinel(
        model, opt, policy="rollback", snapshot_every=3, rollback_skip_batches=0,
        inject=f"kind=grad,rank=1,step={bad_step}", report_dir=report_dir,
    )
    after: dict[int, torch.Tensor] = {}
    before: dict[int, torch.Tensor] = {}
    rolled: list[tuple[int, int | None]] = []
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(sentinel.check_batch(x)), y)
        sentinel.check_loss(loss)
        loss.backward()
        if opt.state:  # AdamW's moments exist from the first update on
            before[step] = flat_state(net, opt)
        result = sentinel.step()
        opt.zero_grad()
        if result.outcome == "rolled_back":
            rolled.append((step, result.rolled_back_to))
            break
        after[step] = flat_state(net, opt)
    snaps = sentinel.snapshots
    assert isinstance(snaps, MemorySnapshots)
    return {"after": after, "before": before, "rolled": rolled, "final": flat_state(net, opt),
            "replicated": flat_state(net, opt, buffers=False),
            "bytes": snaps.bytes, "unsharded_bytes": snaps.unsharded_bytes}


def buffers_and_refusal(rank: int, world: int) -> dict[str, Any]:
    """MemorySnapshots used directly over the default group, everything sharded that may be
    (threshold 1): BatchNorm's running statistics, which differ per rank, must come back as
    this rank's own; then a refusal on rank 1 alone must raise on every rank."""
    net = _net()
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    peers = Peers(None, torch.device("cpu"))
    snaps = MemorySnapshots(Watched(net, net, opt), peers=peers, replicas=peers, shard_min_numel=1,
                            hostname=f"host{rank}")
    for step in range(3):
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    snaps.save(2)
    saved = flat_state(net, opt)
    for step in range(3, 5):
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    changed = not torch.equal(flat_state(net, opt), saved)
    snaps.load()
    restored = torch.equal(flat_state(net, opt), saved)
    tight = MemorySnapshots(Watched(net, net, opt), peers=peers, replicas=peers,
                            hostname=f"host{rank}",
                            available=(lambda: 0) if rank == 1 else (lambda: 1 << 40))
    try:
        tight.save(7)
        refusal = None
    except nansentinel.SnapshotMemoryError as exc:
        refusal = str(exc)
    return {"changed": changed, "restored": restored, "running_mean": net[1].running_mean,
            "refusal": refusal, "tight_bytes": tight.bytes}
