"""Rank functions for the DDP averaging test (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel

#: (dtype, gradient_as_bucket_view, zero_grad's set_to_none): every way DDP's default scales.
CASES = [(dtype, as_view, to_none)
         for dtype in ("float32", "bfloat16", "float16")
         for as_view, to_none in ((False, True), (True, True), (True, False))]


def _run(rank: int, dtype: torch.dtype, as_view: bool, to_none: bool, sentinel: bool,
         report_dir: str, steps: int) -> list[torch.Tensor]:
    """The reduced gradients of each step, then the weights, with or without the sentinel."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)
    # Small buckets: several per step, so the first and the last bucket differ.
    ddp = DDP(model, gradient_as_bucket_view=as_view, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    s = nansentinel.Sentinel(ddp, opt, report_dir=report_dir) if sentinel else None
    seen = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        x = x.to(dtype)
        if s is not None:
            x = s.check_batch(x)
        loss = ddp(x).float().pow(2).mean()
        if s is not None:
            s.check_loss(loss)
        loss.backward()
        seen.append(torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()]))
        if s is not None:
            assert s.step().applied
        else:
            opt.step()
        opt.zero_grad(set_to_none=to_none)
    if s is not None:
        s.close()
    return [*seen, torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])]


def ddp_against_plain(rank: int, world: int, *, report_dir: str, steps: int = 3) -> list[Any]:
    """For each case of :data:`CASES`: whether every step's averaged gradients and the final
    weights with the sentinel equal plain DDP's bit for bit (compared as integers, so a
    signed zero or a NaN cannot pass for another value)."""
    out: list[Any] = []
    for name, as_view, to_none in CASES:
        dtype = getattr(torch, name)
        plain = _run(rank, dtype, as_view, to_none, False, report_dir, steps)
        ours = _run(rank, dtype, as_view, to_none, True, report_dir, steps)
        ints = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
        same = [torch.equal(a.view(ints), b.view(ints)) for a, b in zip(plain, ours, strict=True)]
        out.append([name, as_view, to_none, same])
    return out
