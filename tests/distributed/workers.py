"""Training loops run on gloo ranks by the distributed tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel.demo import VOCAB, TinyTransformer, synthetic_batch


def train(rank: int, world: int, *, steps: int, report_dir: str, ddp: bool = True,
          manual_reduce: bool = False, accumulate: int = 1, fused: bool = False,
          **overrides: Any) -> dict[str, Any]:
    """Train the demo model; return each step's result and the final weights.

    ``manual_reduce``: no DDP; the loop all-reduces gradients itself after check_grads(),
    as a user with their own reducer would. ``accumulate``: micro-batches per step, the
    first ones under DDP's no_sync(). ``fused``: fused AdamW (the device gate can take it).
    """
    torch.manual_seed(0)
    model: nn.Module = TinyTransformer()
    if ddp:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused or None)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, **overrides)
    loss_fn = nn.CrossEntropyLoss()
    results: list[Any] = []
    error = None
    try:
        for step in range(steps):
            for micro in range(accumulate):
                batch = sentinel.check_batch(synthetic_batch(rank, step * accumulate + micro))
                sync = micro == accumulate - 1 or not ddp
                ctx = model.no_sync() if (ddp and not sync) else _null()
                with ctx:
                    logits = model(batch["tokens"], batch["scale"])
                    loss = loss_fn(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))
                    sentinel.check_loss(loss / accumulate)
                    (loss / accumulate).backward()
            if manual_reduce:
                sentinel.check_grads()
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world
            # Read once decided: on the device gate that is at the next sentinel call.
            results.append(sentinel.step())
            opt.zero_grad(set_to_none=True)
        sentinel.close()
    except nansentinel.NonFiniteError as exc:
        error = {"type": type(exc).__name__, "message": str(exc), "step": exc.result.step,
                 "report_path": exc.result.report_path}
    records = [_record(r) for r in results if _decided(r)]
    module = model.module if isinstance(model, DDP) else model
    weights = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return {"records": records, "weights": weights, "error": error,
            "hostname": sentinel.identity.hostname,
            "gate": "host" if sentinel.device_gate is None else "device"}


def demo_step(sentinel: nansentinel.Sentinel, model: nn.Module, loss_fn: nn.Module, rank: int,
              step: int) -> Any:
    """One step of the demo model on this rank's synthetic batch, with the three calls."""
    batch = sentinel.check_batch(synthetic_batch(rank, step))
    loss = loss_fn(model(batch["tokens"], batch["scale"]).reshape(-1, VOCAB),
                   batch["targets"].reshape(-1))
    sentinel.check_loss(loss)
    loss.backward()
    return sentinel.step()


def _decided(r: Any) -> bool:
    """False for a device-gated step whose decision raised (the abort)."""
    try:
        _ = r.outcome
    except nansentinel.NonFiniteError:
        return False
    return True


def _record(r: Any) -> dict[str, Any]:
    return {
        "step": r.step, "applied": r.applied, "outcome": r.outcome,
        "bad_ranks": r.bad_ranks, "bad_hosts": r.bad_hosts, "kinds": r.kinds,
        "local_kinds": r.local_kinds, "injected": r.injected,
        "report_path": r.report_path, "parameters": r.parameters,
        "local_loss": r.local_loss, "local_grad_norm": r.local_grad_norm,
    }


def late_loss_check(rank: int, world: int, *, report_dir: str) -> str:
    """check_loss after backward under DDP: the exchange already left; must be a clear error."""
    torch.manual_seed(0)
    model = DDP(TinyTransformer())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir)
    batch = synthetic_batch(rank, 0)
    loss = model(batch["tokens"], batch["scale"]).float().mean()
    loss.backward()
    try:
        sentinel.check_loss(loss)
    except nansentinel.SentinelUsageError as exc:
        return str(exc)
    return "no error"


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def stall(rank: int, world: int, *, victim: int, at_step: int, how: str, report_dir: str,
          run_dir: str, exchange_timeout: float) -> dict[str, Any]:
    """Train until rank ``victim`` kills or freezes itself at ``at_step``, before its backward;
    the others must end, naming it, instead of hanging."""
    import os
    import signal
    import time

    torch.manual_seed(0)
    model = DDP(TinyTransformer())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, run_dir=run_dir,
                                    exchange_timeout=exchange_timeout, hostname=f"host{rank}")
    loss_fn = nn.CrossEntropyLoss()
    started = None
    try:
        for step in range(at_step + 3):
            if rank == victim and step == at_step:
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            if step == at_step:
                started = time.monotonic()
            demo_step(sentinel, model, loss_fn, rank, step)
            opt.zero_grad()
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - (started or time.monotonic())}
    return {"error": None}


def slow_report(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """An abort at step 1 (rank 1's loss) while rank 0 takes 2 s to write its report: what
    each rank finds on disk at the moment it raises."""
    import pathlib
    import time

    from nansentinel import report

    if rank == 0:
        write_json = report.write_json

        def slow(path: Any, payload: Any) -> Any:
            time.sleep(2.0)
            return write_json(path, payload)

        report.write_json = slow  # type: ignore[assignment]
    torch.manual_seed(0)
    model = DDP(TinyTransformer())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, policy="abort",
                                    inject="kind=loss,rank=1,step=1,value=nan")
    loss_fn = nn.CrossEntropyLoss()
    try:
        for step in range(3):
            demo_step(sentinel, model, loss_fn, rank, step)
            opt.zero_grad()
    except nansentinel.NonFiniteError as exc:
        on_disk = sorted(p.name for p in pathlib.Path(report_dir).glob("incident-*step*.json"))
        return {"step": exc.result.step, "reports_on_disk": on_disk}
    return {"step": None, "reports_on_disk": []}
