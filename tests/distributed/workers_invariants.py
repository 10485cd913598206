"""The combination matrix's training loop (issue 26): one combination of what users combine,
run with its faults and once more without the faulty steps, on gloo ranks.

A combination is a plain dict (``Combo``), so that the test can sample them with a printed
seed and ship them to spawned ranks. Every rank runs the same list of combinations in one
process group, one after the other, and returns per combination what the invariants are
checked on (tests/distributed/test_invariants.py).
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel.result import ResultPending

#: The dimensions of the matrix and their values.
DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "policy": ("skip", "rollback", "abort", "drop"),
    "gate": ("host", "device"),
    "optimizer": ("adamw_fused", "adamw_foreach", "sgd"),
    "scaler": ("none", "plain", "clip"),
    "batchnorm": (False, True),
    "accumulate": (1, 2),
    "replay": (False, True),
    "fingerprint": (False, True),
    "rank0_reads": (False, True),
    "fault": ("batch", "loss", "activation", "backward"),
    "faulty_ranks": (1, 2),
}
STEPS = 8
#: The steps a combination's fault hits (each followed by healthy steps).
FAULT_STEPS = (3, 5)
#: Rollbacks need a snapshot before the first fault.
SNAPSHOT_EVERY = 2

Combo = dict[str, Any]


def every_combo() -> list[Combo]:
    names = list(DIMENSIONS)
    return [dict(zip(names, values, strict=True))
            for values in itertools.product(*DIMENSIONS.values())]


class _NanGrad(torch.autograd.Function):
    """Identity forward; a NaN in the gradient it sends back (a fault made in the backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class Net(nn.Module):
    """Linear -> (BatchNorm) -> ReLU -> Linear. ``fault``: ``activation`` writes NaN into the
    forward before the BatchNorm (so its running statistics take it), ``backward`` into the
    gradient flowing back through the same point."""

    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.out = nn.Linear(16, 1)
        self.fault: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.fault == "activation":
            h = h * float("nan")
        elif self.fault == "backward":
            h = _NanGrad.apply(h)
        return self.out(torch.relu(self.norm(h)))


def batch_for(rank: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(8, 8, generator=g)
    return {"x": x, "y": x.sum(dim=1, keepdim=True)}


def sample_id(rank: int, step: int, micro: int, row: int) -> int:
    """The dataset index of a row: unique per rank, step, micro-batch and row."""
    return ((rank * 100 + step) * 10 + micro) * 10 + row


def loss_of(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(module(batch["x"]), batch["y"])


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-2, foreach=True)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def drops(combo: Combo) -> bool:
    """Under ``policy="drop"`` the faulty steps are dropped: a fault known before the
    gradients leave (batch, loss, a NaN forward: the loss), on one rank of 3 (``max_dropped``
    1/8: one rank), not GradScaler's overflow; two ranks, or a NaN made in the backward, skip."""
    return (combo["policy"] == "drop" and combo["faulty_ranks"] == 1
            and combo["fault"] in ("batch", "loss", "activation"))


def faults_of(combo: Combo, world: int) -> dict[int, list[int]]:
    """step -> the ranks its fault hits."""
    ranks = list(range(combo["faulty_ranks"]))
    ranks = [(r + 1) % world for r in ranks]  # rank 1 (and 2): not only rank 0
    return {step: ranks for step in FAULT_STEPS}


def _inject_spec(combo: Combo, faults: dict[int, list[int]]) -> str:
    if combo["fault"] not in ("batch", "loss"):
        return ""
    return ";".join(f"kind={combo['fault']},rank={r},step={s}"
                    for s, ranks in faults.items() for r in ranks)


def _state(model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> dict[str, Any]:
    module = model.module if isinstance(model, DDP) else model
    params = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    buffers = [b.detach().clone() for b in module.buffers() if b.is_floating_point()]
    opt_tensors = []
    for group in opt.param_groups:
        for p in group["params"]:
            for key in sorted(opt.state.get(p, {}), key=str):
                value = opt.state[p][key]
                if isinstance(value, torch.Tensor):
                    opt_tensors.append(value.detach().reshape(-1).double().clone())
    return {
        "params": params.clone(),
        "buffers": torch.cat([b.reshape(-1) for b in buffers]) if buffers else torch.zeros(0),
        "optimizer": torch.cat(opt_tensors) if opt_tensors else torch.zeros(0),
        "scale": float(scaler.get_scale()) if scaler is not None else None,
    }


def _outcome(result: Any) -> dict[str, Any]:
    return {"step": result.step, "outcome": str(result.outcome), "applied": result.applied,
            "bad_ranks": list(result.bad_ranks), "buffers_restored": result.buffers_restored,
            "report_path": result.report_path, "reason": result.reason}


def run_one(rank: int, world: int, combo: Combo, report_dir: Path, *, faulty: bool,
            stop_before: int | None = None) -> dict[str, Any]:
    """Train one combination: with its faults (``faulty``), or as the reference that never
    saw the faulty steps (and, after an abort, stops before the aborted step)."""
    torch.manual_seed(0)
    net = Net(combo["batchnorm"])
    model = DDP(net)
    opt = _optimizer(combo["optimizer"], model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if combo["scaler"] != "none" else None
    faults = faults_of(combo, world)
    sentinel = nansentinel.Sentinel(
        model, opt, scaler=scaler, report_dir=str(report_dir), env={},
        policy=combo["policy"], gate=combo["gate"],
        replay=loss_of if combo["replay"] else None,
        fingerprint_every=1 if combo["fingerprint"] else 0,
        snapshot_every=SNAPSHOT_EVERY, hostname=f"host{rank}", metrics_port=0,
        inject=(_inject_spec(combo, faults) or None) if faulty else None,
        max_consecutive_skips=10, rollback_skip_batches=1,
    )
    results: list[Any] = []
    reads: list[str] = []
    error = None
    steps = [s for s in range(STEPS) if faulty or s not in faults]
    if stop_before is not None:
        steps = [s for s in steps if s < stop_before]
    try:
        for step in steps:
            hit = faulty and rank in faults.get(step, ()) and combo["fault"] in (
                "activation", "backward")
            net.fault = combo["fault"] if hit else None
            for micro in range(combo["accumulate"]):
                last = micro == combo["accumulate"] - 1
                batch = sentinel.check_batch(batch_for(rank, step, micro),
                                             ids=[sample_id(rank, step, micro, i)
                                                  for i in range(8)])
                with model.no_sync() if not last else _nothing():
                    loss = loss_of(model, batch) / combo["accumulate"]
                    sentinel.check_loss(loss)
                    (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None and combo["scaler"] == "clip":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            result = sentinel.step()
            net.fault = None
            results.append(result)
            if rank == 0 and combo["rank0_reads"]:  # a loop that logs on rank 0 alone
                try:
                    reads.append(str(result.outcome))
                except ResultPending:
                    reads.append("pending")
                sentinel.state_dict()
            opt.zero_grad(set_to_none=True)
        sentinel.close()
    except nansentinel.NonFiniteError as exc:
        error = {"type": type(exc).__name__, "step": exc.result.step}
        sentinel.close()
    outcomes = []
    for step, r in zip(steps, results, strict=False):
        try:
            outcomes.append(_outcome(r))
        except nansentinel.NonFiniteError:  # a device-gated step whose decision aborted
            outcomes.append({"step": step, "outcome": "aborted", "applied": False,
                             "bad_ranks": None, "buffers_restored": None,
                             "report_path": None})
    out = {"outcomes": outcomes, "error": error, "state": _state(model, opt, scaler),
           "gate": "device" if sentinel.device_gate is not None else "host", "reads": reads}
    # Usable the next step: one more healthy step on the same optimizer and scaler.
    if error is None:
        out["next"] = _one_more_step(rank, model, opt, scaler, sentinel, combo)
    if rank == 0:
        out["reports"] = _reports(report_dir)
        skip_list = next(report_dir.glob("*skip*"), None)
        out["skip_list"] = ([json.loads(line) for line in skip_list.read_text().splitlines()]
                            if skip_list is not None else [])
    return out


def _one_more_step(rank: int, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any,
                   sentinel: nansentinel.Sentinel, combo: Combo) -> bool:
    """A plain step after the run (the sentinel closed): the optimizer and scaler still work."""
    before = [p.detach().clone() for p in model.parameters()]
    loss = loss_of(model, batch_for(rank, 99, 0))
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        if combo["scaler"] == "clip":
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)
    changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return changed and finite


def _reports(directory: Path) -> list[dict[str, Any]]:
    """Rank 0's incident reports of one combination, parsed (``None`` for one that is not
    valid JSON)."""
    out = []
    for path in sorted(directory.glob("incident-*.json")):
        try:
            content = json.loads(path.read_text())
        except ValueError:
            content = None
        out.append({"name": path.name, "content": content})
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run_combos(rank: int, world: int, *, combos: list[Combo], report_dir: str
               ) -> list[dict[str, Any]]:
    """Every combination with its faults, then its reference; in one process group."""
    outs = []
    for i, combo in enumerate(combos):
        base = Path(report_dir) / f"c{i}"
        faulty = run_one(rank, world, combo, base / "faulty", faulty=True)
        stop = faulty["error"]["step"] if faulty["error"] else None
        reference = run_one(rank, world, combo, base / "reference", faulty=False,
                            stop_before=stop)
        outs.append({"faulty": faulty, "reference": reference})
        dist.barrier()
    return outs


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) if t.numel() else True


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))


def close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b))
