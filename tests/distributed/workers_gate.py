"""Training loops for the device-gate tests (importable by spawned gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel.demo import VOCAB, TinyTransformer, synthetic_batch

#: Fused optimizers the device gate takes (torch 2.13 runs their kernels on CPU too).
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 3e-3}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
}


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Weights and every optimizer state tensor (moments, step counters), by name: copies."""
    module = model.module if isinstance(model, DDP) else model
    out = {f"w/{n}": p.detach().clone() for n, p in module.named_parameters()}
    names = {id(p): n for n, p in module.named_parameters()}
    for p, st in opt.state.items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                out[f"s/{names[id(p)]}/{key}"] = value.detach().clone()
    return out


def gated(rank: int, world: int, *, optimizer: str, steps: int, report_dir: str,
          read_late: bool = False, **overrides: Any) -> dict[str, Any]:
    """Train with a fused optimizer; return every step's result fields, the state before and
    after each step() (taken on the host: on CPU the gated kernel has run by then), the final
    state, which gate each step took, and the abort if one was raised (and where).

    ``read_late``: keep the results unread until the loop ends, so that each step is decided
    at the next sentinel call rather than on first read.
    """
    torch.manual_seed(0)
    model = DDP(TinyTransformer())
    cls, kwargs = OPTIMIZERS[optimizer]
    opt = cls(model.parameters(), fused=True, **kwargs)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, **overrides)
    loss_fn = nn.CrossEntropyLoss()
    results: list[Any] = []
    before: list[dict[str, torch.Tensor]] = []
    after: list[dict[str, torch.Tensor]] = []
    gates: list[str] = []
    error = None
    where = ""
    try:
        for step in range(steps):
            where = f"check_batch {step}"
            batch = sentinel.check_batch(synthetic_batch(rank, step))
            where = f"forward {step}"
            loss = loss_fn(model(batch["tokens"], batch["scale"]).reshape(-1, VOCAB),
                           batch["targets"].reshape(-1))
            sentinel.check_loss(loss)
            loss.backward()
            before.append(state_of(model, opt))
            device = sentinel.device_gate is not None and sentinel.device_gate.ready()
            gates.append("device" if device else "host")
            where = f"step {step}"
            r = sentinel.step()
            after.append(state_of(model, opt))
            opt.zero_grad(set_to_none=True)
            results.append(r)
            if not read_late:  # the user reads the result: exact, and no collective starts
                assert r.applied == (step not in poisoned_steps(overrides)), (step, r.applied)
        where = "close"
        sentinel.close()
    except nansentinel.NonFiniteError as exc:
        error = {"type": type(exc).__name__, "message": str(exc), "step": exc.result.step,
                 "where": where, "report_path": exc.result.report_path}
    records = []
    for r in results:
        try:
            records.append(_fields(r))
        except nansentinel.NonFiniteError:
            records.append(None)
    return {"records": records, "before": before, "after": after, "gates": gates,
            "final": state_of(model, opt), "error": error,
            "hostname": sentinel.identity.hostname}


def poisoned_steps(overrides: dict[str, Any]) -> set[int]:
    """The steps the drill in ``overrides`` poisons (a single ``step=S`` per fault)."""
    faults = nansentinel.parse_inject(overrides.get("inject", ""))
    return {s for f in faults for s in range(f.first, f.last + 1)}


def _fields(r: Any) -> dict[str, Any]:
    return {
        "step": r.step, "applied": r.applied, "outcome": r.outcome, "bad_ranks": r.bad_ranks,
        "bad_hosts": r.bad_hosts, "kinds": r.kinds, "local_kinds": r.local_kinds,
        "injected": r.injected, "parameters": r.parameters, "local_loss": r.local_loss,
        "local_grad_norm": r.local_grad_norm, "consecutive_skips": r.consecutive_skips,
        "reason": r.reason, "has_report": r.report_path is not None,
    }


def every_optimizer(rank: int, world: int, *, steps: int, inject: str,
                    report_dir: str) -> dict[str, dict[str, Any]]:
    """:func:`gated` for every optimizer under both gates, in one process group (spawning
    ranks is the slow part on a small CI machine): ``"{optimizer}/{gate}"`` -> its run."""
    return {
        f"{name}/{gate}": gated(rank, world, optimizer=name, steps=steps, inject=inject,
                                gate=gate, report_dir=f"{report_dir}/{name}-{gate}")
        for name in sorted(OPTIMIZERS) for gate in ("device", "host")
    }


def read_points(rank: int, world: int, *, report_dir: str, poisoned: int, steps: int,
                **overrides: Any) -> dict[str, Any]:
    """Device gate, one rank reading at other points than the rest: after each step, rank 0
    alone reads ``outcome`` (and, after the poisoned step, saves ``state_dict()``), then every
    rank all-reduces a metric of its own, as a loop that logs on rank 0 does. A read that ran
    the detection's collectives there would pair them with the other ranks' metric."""
    import torch.distributed as dist

    from tests.distributed.workers import demo_step

    torch.manual_seed(0)
    model = DDP(TinyTransformer())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    sentinel = nansentinel.Sentinel(
        model, opt, report_dir=report_dir, gate="device",
        inject=f"kind=loss,rank=1,step={poisoned},value=nan", **overrides)
    loss_fn = nn.CrossEntropyLoss()
    results, early, metrics = [], [], []
    saved: dict[str, Any] | None = None
    for step in range(steps):
        r = demo_step(sentinel, model, loss_fn, rank, step)
        opt.zero_grad(set_to_none=True)
        results.append(r)
        if rank == 0:
            try:
                early.append(("outcome", r.step, str(r.outcome)))
            except nansentinel.ResultPending as exc:
                early.append(("pending", r.step, r.applied, str(exc)))
            if step == poisoned:
                saved = sentinel.state_dict()
        metric = torch.full((3,), float(rank + step))
        dist.all_reduce(metric)
        metrics.append(metric.tolist())
    sentinel.close()
    return {"records": [_fields(r) for r in results], "early": early, "metrics": metrics,
            "saved": saved, "final": state_of(model, opt)}
