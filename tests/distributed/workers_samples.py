"""A loader-driven loop with sample ids, for the skip list test (importable by spawned ranks)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import nansentinel
from nansentinel import skip_list

BAD_ID = 137


class Samples(Dataset):
    """400 samples; sample 137 holds a NaN (e.g. a zero-variance column normalised)."""

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, generator=g)
        if i == BAD_ID:
            x[2] = float("nan")
        return {"x": x, "y": x.sum().reshape(1), "id": i}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train(rank: int, world: int, *, report_dir: str, checkpoint: str, steps: int,
          resume: bool) -> dict[str, Any]:
    """One epoch's first ``steps`` batches of 8 (rank 1 meets sample 137 at its 9th batch:
    DistributedSampler without shuffling gives it the odd indices). ``resume``: load the
    checkpoint, honour the skip list, run again from the start of the epoch."""
    lines = _Lines()
    logging.getLogger("nansentinel").addHandler(lines)
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, env={}, metrics_port=0,
                                    job_id="samples")
    if resume:
        state = torch.load(checkpoint, weights_only=False)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sentinel.load_state_dict(state["sentinel"])
    skip = skip_list.load(skip_list.default_path(report_dir, "samples"))
    sampler = skip_list.SkipSampler(
        DistributedSampler(Samples(), num_replicas=world, rank=rank, shuffle=False), skip
    )
    seen: list[int] = []
    records = []
    for i, batch in enumerate(DataLoader(Samples(), batch_size=8, sampler=sampler)):
        if i == steps:
            break
        seen += batch["id"].tolist()
        sentinel.check_batch(batch, ids=batch["id"])
        loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
        sentinel.check_loss(loss)
        loss.backward()
        r = sentinel.step()
        records.append({"step": r.step, "applied": r.applied, "bad_ranks": r.bad_ranks,
                        "report_path": r.report_path})
        opt.zero_grad()
    if not resume and rank == 0:
        path = Path(checkpoint)
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                    "sentinel": sentinel.state_dict()}, path)
    sentinel.close()
    logging.getLogger("nansentinel").removeHandler(lines)
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {"records": records, "seen": seen, "log": lines.lines, "weights": weights,
            "skip": sorted(skip)}
