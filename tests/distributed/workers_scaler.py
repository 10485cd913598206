"""A framework's loop (it steps the optimizer through its own GradScaler) for the scaler seam
test (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel


def _state(net: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in net.parameters()]
    for p in net.parameters():
        out += [v.detach().clone() for v in opt.state.get(p, {}).values()
                if isinstance(v, torch.Tensor)]
    return out


def callers_scaler(rank: int, world: int, *, fused: bool, unscale_first: bool, steps: int,
                   bad: int, report_dir: str) -> dict[str, Any]:
    """``sentinel.step(optimizer_step=False)``, then the caller's ``scaler.step(opt)`` and
    ``scaler.update()`` (the HF Trainer's fp16 without clipping; ``unscale_first``: Lightning's
    16-mixed, which unscales before the callback). Rank 1's batch holds a NaN at ``bad``."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    sentinel = nansentinel.Sentinel(model, opt, scaler=scaler, report_dir=report_dir, env={},
                                    metrics_port=0)
    records = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 4, generator=g)
        if rank == 1 and step == bad:
            x[0, 0] = float("nan")
        sentinel.check_batch({"x": x})
        loss = model(x).pow(2).mean()
        sentinel.check_loss(loss)
        scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(opt)
        result = sentinel.step(optimizer_step=False)
        before, scale = _state(net, opt), scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        after = _state(net, opt)
        unchanged = len(before) == len(after) and all(
            torch.equal(a, b) for a, b in zip(before, after, strict=True)
        )
        records.append({"step": step, "applied": result.applied, "unchanged": unchanged,
                        "scale_before": scale, "scale_after": scaler.get_scale()})
        opt.zero_grad(set_to_none=True)
    sentinel.close()
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {"records": records, "weights": weights, "scale": scaler.get_scale()}
