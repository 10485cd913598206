"""DDP loops for test_ddp_last_bucket.py (importable by spawned gloo ranks)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel


def backward_only(rank: int, world: int, *, report_dir: str, poisoned: int,
                  gate: str) -> dict[str, Any]:
    """Rank ``poisoned`` writes NaN into one gradient in backward at step 1 (its forward and
    loss stay finite): only a check of its local gradients before their all-reduce can tell
    it from the others, whose ``.grad`` hold the NaN too once DDP copies the reduced buckets
    back. Each step's result, and the weights before and after the poisoned step."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
    model = DDP(net, bucket_cap_mb=0.001)  # about a layer a bucket
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    s = nansentinel.Sentinel(model, opt, report_dir=report_dir, gate=gate)
    records, weights = [], []
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank * 10 + step))
        s.check_batch({"x": x})
        handle = None
        if step == 1 and rank == poisoned:
            handle = net[3].weight.register_hook(lambda g: g * math.nan)
        loss = model(x).pow(2).mean()
        s.check_loss(loss)
        loss.backward()
        if handle is not None:
            handle.remove()
        weights.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        r = s.step()
        opt.zero_grad(set_to_none=True)
        records.append(r)
    s.close()
    out = [{"applied": r.applied, "bad_ranks": r.bad_ranks, "kinds": r.kinds,
            "parameters": r.parameters} for r in records]
    weights.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    return {"records": out, "weights": weights}


def every_gate(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """Both gates on the comm hook gloo takes, then on the seam NCCL takes (no comm hook: a
    callback at the end of backward, ddp_seam.py), forced here on gloo."""
    from nansentinel.engines import ddp, ddp_seam

    runs = {gate: backward_only(rank, world, report_dir=f"{report_dir}/{gate}", poisoned=1,
                                gate=gate) for gate in ("host", "device")}
    seam = ddp.seam_for
    ddp.seam_for = lambda *a, **k: ddp_seam.END_OF_BACKWARD  # type: ignore[assignment]
    try:
        for gate in ("host", "device"):
            runs[f"{gate}, end of backward"] = backward_only(
                rank, world, report_dir=f"{report_dir}/{gate}-end", poisoned=1, gate=gate)
    finally:
        ddp.seam_for = seam  # type: ignore[assignment]
    return runs
