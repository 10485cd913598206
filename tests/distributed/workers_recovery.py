"""Training loops for the see-it-coming and recovery tests (importable by spawned ranks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel


class _Amplify(torch.autograd.Function):
    """Identity forward, gradient multiplied in backward: a deep net's exploding gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class LogMLP(nn.Module):
    """log features -> MLP; a zero in the input makes log(0) = -inf (finite batch, NaN loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)
        self.gradient_gain = 1.0
        self.faulty = False
        self.count_tokens = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(torch.log(x)))
        if self.count_tokens:  # normalised by the global token count: a collective (finite)
            tokens = torch.tensor(float(x.shape[0]))
            dist.all_reduce(tokens)
            h = h * (x.shape[0] * dist.get_world_size() / tokens)
        h = torch.tanh(self.hidden(h))
        if self.faulty:  # a faulty device: this rank's arithmetic is wrong
            h = h * torch.tensor(float("nan"))
        h = _Amplify.apply(h, self.gradient_gain)
        return self.out(h)


def make_batch(seed: int, poison: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(16, 4, generator=g) + 0.5
    if poison:
        x[0, 0] = 0.0  # e.g. a zero-variance column normalised to 0: finite, but log(0)
    return {"x": x, "y": x.sum(dim=1, keepdim=True)}


def mse(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(module(batch["x"]), batch["y"])


def _record(r: nansentinel.StepResult) -> dict[str, Any]:
    return {"step": r.step, "applied": r.applied, "outcome": str(r.outcome),
            "bad_ranks": r.bad_ranks, "verdict": r.verdict, "spikes": r.spikes,
            "quarantined": r.quarantined, "rolled_back_to": r.rolled_back_to,
            "lr_factor": r.lr_factor, "report_path": r.report_path, "reason": r.reason,
            "kinds": r.kinds, "loss": r.local_loss, "buffers_restored": r.buffers_restored}


def run_steps(sentinel: nansentinel.Sentinel, model: nn.Module, opt: torch.optim.Optimizer,
              steps: int, batch_of: Callable[[int], dict[str, torch.Tensor]]) -> list[dict]:
    """The loop these workers share, as a user writes it: the batch and loss checked, backward,
    ``sentinel.step()`` in place of ``optimizer.step()``. ``batch_of(step)`` makes the step's
    batch (and may spoil it, or set the model's fault for the step); each step's record."""
    records = []
    for step in range(steps):
        batch = sentinel.check_batch(batch_of(step))
        loss = mse(model, batch)
        sentinel.check_loss(loss)
        loss.backward()
        records.append(_record(sentinel.step()))
        opt.zero_grad()
    return records


def blame(rank: int, world: int, *, scenario: str, steps: int, report_dir: str,
          count_tokens: bool = False, **overrides: Any) -> dict[str, Any]:
    """``data``: rank 1 gets a NaN-producing batch at step 3, rank 3 the same batch at step 6.
    ``host``: rank 1's device is faulty at step 3 (also during the replay). ``count_tokens``:
    the forward all-reduces its token count (so does the replay)."""
    torch.manual_seed(0)
    net = LogMLP()
    net.count_tokens = count_tokens
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = nansentinel.Sentinel(model, opt, replay=mse, report_dir=report_dir,
                                    hostname=f"host{rank // 2}", **overrides)

    def batch_of(step: int) -> dict[str, torch.Tensor]:
        poison = scenario == "data" and (rank, step) in ((1, 3), (3, 6))
        net.faulty = scenario == "host" and rank == 1 and step == 3  # and in its replay
        return make_batch(99 if poison else 1000 * step + rank, poison)

    records = run_steps(sentinel, model, opt, steps, batch_of)
    weights = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {"records": records, "weights": weights,
            "strikes": dict(sentinel.history.strikes), "quarantine": sorted(sentinel.quarantine)}


def exploding(rank: int, world: int, *, steps: int, boom: int, report_dir: str) -> list[dict]:
    """At step ``boom`` the gradient explodes (x1000) on every rank; the spike detector sees
    the gradient norm first, the loss one step later (after the wrecking update)."""
    torch.manual_seed(0)
    net = LogMLP()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, spike_warmup=10,
                                    spike_window=20)

    def batch_of(step: int) -> dict[str, torch.Tensor]:
        net.gradient_gain = 1000.0 if step == boom else 1.0
        return make_batch(1000 * step + rank)

    return run_steps(sentinel, model, opt, steps, batch_of)


def regression_data(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-rank least-squares data and the critical learning rate 2 / lambda_max of the
    averaged loss (what DDP's gradient averaging optimises)."""
    shards = []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        x = torch.randn(64, 8, generator=g) * torch.linspace(0.2, 2.0, 8)
        y = x @ torch.ones(8, 1) + 0.1 * torch.randn(64, 1, generator=g)
        shards.append((x, y))
    all_x = torch.cat([x for x, _ in shards])
    hessian = 2 * all_x.T @ all_x / all_x.shape[0]
    lam = float(torch.linalg.eigvalsh(hessian).max())
    x, y = shards[rank]
    return x, y, 2.0 / lam


def divergence(rank: int, world: int, *, steps: int, jump: int, report_dir: str,
               **overrides: Any) -> dict[str, Any]:
    """Least squares with SGD; at step ``jump`` the user's schedule sets the learning rate to
    1.5x the critical one (every rank diverges). Policy rollback should catch the spike,
    restore the snapshot, halve the LR, and the run should then converge."""
    x, y, lr_crit = regression_data(rank, world)
    torch.manual_seed(0)
    net = nn.Linear(8, 1, bias=False)
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.3 * lr_crit)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, **overrides)
    records = []
    first_loss = None
    for step in range(steps):
        for group in opt.param_groups:  # the user's schedule, set every step
            group["lr"] = (1.5 if step >= jump else 0.3) * lr_crit
        batch = sentinel.check_batch({"x": x, "y": y})
        loss = F.mse_loss(model(batch["x"]), batch["y"])
        first_loss = first_loss if first_loss is not None else float(loss.detach())
        sentinel.check_loss(loss)
        loss.backward()
        records.append(_record(sentinel.step()))
        opt.zero_grad()
    final = float(F.mse_loss(net(x), y))
    return {"records": records, "first_loss": first_loss, "final_loss": final,
            "weights": net.weight.detach().clone()}


def one_rank_spikes(rank: int, world: int, *, steps: int, bad: list[int], report_dir: str,
                    corrupt: str = "flip", **overrides: Any) -> dict[str, Any]:
    """Under spikes="recover", rank 1's batches at the steps in ``bad`` carry corrupt targets:
    its loss spikes, the others' does not. ``flip``: negated (the batch's norm as usual: the
    sentinel cannot tell it from ruined weights); ``scale``: 30x too large (an unnormalised
    column: the batch's norm spikes too, the data's)."""
    torch.manual_seed(0)
    net = LogMLP()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, spikes="recover",
                                    **overrides)

    def batch_of(step: int) -> dict[str, torch.Tensor]:
        batch = make_batch(1000 * step + rank)
        if rank == 1 and step in bad:
            batch["y"] = batch["y"] * (30 if corrupt == "scale" else -1)
        return batch

    records = run_steps(sentinel, model, opt, steps, batch_of)
    sentinel.close()
    return {"records": records, "weights": net.out.weight.detach().clone()}
