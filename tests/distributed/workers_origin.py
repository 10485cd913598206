"""Loops for issue 31 (importable by spawned ranks): a faulty device before a collective that
carries values to every rank in the forward — an all-reduce of statistics (SyncBatchNorm's
shape) under DDP, and an MoE layer's all-to-all dispatch and combine — and, behind the same
collectives, a NaN batch and a fault that does not come back in the replay."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel

WIDTH = 8


def _bad_device(flag: list[bool]) -> Any:
    """A forward hook: while ``flag[0]``, the module writes NaN into its output's first
    feature of every row (as a bad SM computing that column would), whatever its input."""

    def hook(_module: nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not flag[0]:
            return None
        out = out.clone()
        out[..., 0] = math.nan
        return out

    return hook


class SyncMean(nn.Module):
    """A layer whose output is centred on its mean over every rank's batch (an all-reduce of
    values, as SyncBatchNorm's statistics), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.out = nn.Linear(WIDTH, 1)
        self.faulty = [False]
        self.inp.register_forward_hook(_bad_device(self.faulty))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        mean = h.detach().mean(0, keepdim=True)
        dist.all_reduce(mean)
        return self.out(torch.tanh(h - mean / dist.get_world_size()))


class MoE(nn.Module):
    """Top-1 routing over one expert per rank: the tokens go to their expert's rank by
    ``all_to_all_single`` (functional, with autograd) and come back by another; the router
    and the head are the same on every rank, each rank's expert its own."""

    def __init__(self, rank: int, world: int, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.world, self.group = world, group
        torch.manual_seed(0)
        self.router = nn.Linear(WIDTH, world)
        self.head = nn.Linear(WIDTH, 1)
        torch.manual_seed(100 + rank)
        self.expert = nn.Linear(WIDTH, WIDTH)
        self.faulty = [False]
        self.expert.register_forward_hook(_bad_device(self.faulty))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        choice = logits.argmax(-1)
        gate = torch.softmax(logits, -1).gather(1, choice[:, None])
        order = torch.argsort(choice, stable=True)
        send = torch.bincount(choice, minlength=self.world)
        recv = funcol.all_to_all_single(send, None, None, self.group)
        out_sizes, in_sizes = recv.tolist(), send.tolist()
        tokens = funcol.all_to_all_single_autograd(x[order], out_sizes, in_sizes, self.group)
        done = funcol.all_to_all_single_autograd(self.expert(tokens), in_sizes, out_sizes,
                                                 self.group)
        combined = torch.empty_like(done).index_copy(0, order, done)
        return self.head(torch.tanh(x + gate * combined))


def mse(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(module(batch["x"]), batch["y"])


def _record(r: nansentinel.StepResult) -> dict[str, Any]:
    return {"step": r.step, "applied": r.applied, "outcome": str(r.outcome),
            "bad_ranks": r.bad_ranks, "bad_hosts": r.bad_hosts, "reached": r.reached,
            "kinds": r.kinds, "verdict": r.verdict, "report": r.report_path,
            "excluded": list(r.excluded_hosts)}


def _run(sentinel: nansentinel.Sentinel, model: nn.Module, module: Any, optimizer: Any,
         steps: int, batch_of: Any, faulty: Any, by_hand: list[nn.Parameter] | None = None
         ) -> dict[str, Any]:
    """``steps`` steps of ``model``; ``faulty(step) -> (in the forward, during the replays)``
    sets ``module.faulty`` (the unwrapped module, which the replays run); ``by_hand``:
    parameters whose gradients the loop all-reduces itself, after ``check_grads()``."""
    records, error = [], None
    try:
        for step in range(steps):
            batch = sentinel.check_batch(batch_of(step))
            during, replayed = faulty(step)
            module.faulty[0] = during
            loss = mse(model, batch)
            module.faulty[0] = replayed
            sentinel.check_loss(loss)
            loss.backward()
            if by_hand is not None:
                sentinel.check_grads()
                for p in by_hand:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            records.append(_record(sentinel.step()))
            optimizer.zero_grad(set_to_none=True)
    except nansentinel.HostExcludedError as exc:
        error = {"type": type(exc).__name__, "step": exc.result.step, "message": str(exc)}
    module.faulty[0] = False
    sentinel.close()
    return {"records": records, "error": error, "strikes": dict(sentinel.history.strikes),
            "weights": [p.detach().clone() for p in module.parameters()]}


def _data(step: int, rank: int, n: int = 16, width: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.rand(n, width, generator=g) + 0.5
    return {"x": x, "y": x.sum(dim=1, keepdim=True)}


def sync_mean(rank: int, world: int, *, scenario: str, steps: int, fault_at: int,
              report_dir: str, host_strikes: int = 3) -> dict[str, Any]:
    """DDP, one host per rank, a replay function. ``device``: from ``fault_at`` on, rank 1's
    first layer writes a NaN into its output every time it runs (its batch is fine);
    ``transient``: only in the forward of step ``fault_at`` (not in the replay); ``batch``:
    rank 1's batch holds a NaN at ``fault_at``."""
    torch.manual_seed(0)
    net = SyncMean()
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sentinel = nansentinel.Sentinel(model, optimizer, replay=mse, hostname=f"node{rank}",
                                    report_dir=report_dir, host_strikes=host_strikes)

    def batch_of(step: int) -> dict[str, torch.Tensor]:
        batch = _data(step, rank)
        if scenario == "batch" and (step, rank) == (fault_at, 1):
            batch["x"][0, 0] = math.nan
        return batch

    def faulty(step: int) -> tuple[bool, bool]:
        if rank != 1 or step < fault_at:
            return False, False
        if scenario == "device":
            return True, True
        return scenario == "transient" and step == fault_at, False

    return _run(sentinel, model, net, optimizer, steps, batch_of, faulty)


def moe(rank: int, world: int, *, steps: int, fault_at: int, report_dir: str
        ) -> dict[str, Any]:
    """The MoE layer on its own process group, the local gradient path (the router's and
    the head's gradients all-reduced by hand); from ``fault_at`` on, rank 1's expert writes
    a NaN into its output every time it runs. At ``fault_at + 1`` rank 1's own tokens all go
    to the other experts: its loss stays finite, only its expert's gradients are not (after
    the others' losses: the order of points alone would call it reached)."""
    group = dist.new_group(list(range(world)))
    net = MoE(rank, world, group)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    sentinel = nansentinel.Sentinel(net, optimizer, replay=mse, hostname=f"node{rank}",
                                    report_dir=report_dir)

    def batch_of(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, WIDTH, generator=g)
        batch = {"x": x, "y": x.sum(dim=1, keepdim=True)}
        if rank == 1 and step == fault_at + 1:
            with torch.no_grad():
                elsewhere = net.router(x).argmax(-1) != 1
            batch = {k: v[elsewhere] for k, v in batch.items()}
        return batch

    shared = [*net.router.parameters(), *net.head.parameters()]
    out = _run(sentinel, net, net, optimizer, steps, batch_of,
               lambda s: (rank == 1 and s >= fault_at,) * 2, by_hand=shared)
    out["group"] = group.group_name
    return out


def suite(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """Every case of the issue in one process group (one start of the ranks)."""
    return {
        "device": sync_mean(rank, world, scenario="device", steps=6, fault_at=3,
                            report_dir=f"{report_dir}/device"),
        "batch": sync_mean(rank, world, scenario="batch", steps=3, fault_at=1,
                           report_dir=f"{report_dir}/batch"),
        "transient": sync_mean(rank, world, scenario="transient", steps=3, fault_at=1,
                               report_dir=f"{report_dir}/transient"),
        "moe": moe(rank, world, steps=3, fault_at=1, report_dir=f"{report_dir}/moe"),
    }
