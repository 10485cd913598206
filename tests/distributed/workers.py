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

    from nansentinel.common import report

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


#: Seconds _SlowBackward sleeps in the backward, and what it calls first (a probe).
_SLOW: list[Any] = [0.0, None]


class _SlowBackward(torch.autograd.Function):
    """Sleeps ``_SLOW[0]`` seconds in the backward: a slow backward between two buckets."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        import time

        if _SLOW[1] is not None:
            _SLOW[1]()
        time.sleep(_SLOW[0])
        return grad


def slow_steps(rank: int, world: int, *, exchange_timeout: float, pause: float,
               report_dir: str) -> dict[str, Any]:
    """Healthy steps made ``pause`` seconds slow, once inside the backward (between two
    gradient buckets: armed, the exchange not launched yet) and once between backward and
    ``step()`` (armed, the collectives done): every store request the sentinel makes after
    its construction is counted."""
    import collections

    from nansentinel.wire import exchange

    class Counting:
        def __init__(self, store: Any) -> None:
            self.store = store

        def __getattr__(self, name: str) -> Any:
            method = getattr(self.store, name)

            def counted(*args: Any, **kwargs: Any) -> Any:
                requests[name] += 1
                return method(*args, **kwargs)

            return counted

    requests: collections.Counter[str] = collections.Counter()
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # The last layer fills DDP's first bucket (1 MB) alone: the pause comes after it.
            self.first, self.last = nn.Linear(64, 600), nn.Linear(600, 600)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.last(_SlowBackward.apply(torch.relu(self.first(x))))

    model = DDP(Net(), bucket_cap_mb=0.01)  # a bucket per layer: the pause lies between them
    armed: list[bool] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir,
                                    exchange_timeout=exchange_timeout)
    real = exchange._default_store
    exchange._default_store = lambda: (lambda s: Counting(s) if s is not None else None)(real())
    late_after = exchange.late_after(sentinel.exchange.timeout)
    outcomes = []
    try:
        for step in range(4):
            _SLOW[0] = pause if step == 1 else 0.0
            probe = lambda: armed.append(sentinel.watchdog._armed is not None)  # noqa: E731
            _SLOW[1] = probe if step == 1 else None
            seed = torch.Generator().manual_seed(step * world + rank)
            x = sentinel.check_batch(torch.randn(8, 64, generator=seed))
            loss = model(x).square().mean()
            sentinel.check_loss(loss)
            loss.backward()
            if step == 2:
                import time

                time.sleep(pause)
            outcomes.append(str(sentinel.step().outcome))
            opt.zero_grad()
        sentinel.close()
    finally:
        exchange._default_store = real
        _SLOW[:] = [0.0, None]
    return {"requests": dict(requests), "outcomes": outcomes, "late_after": late_after,
            "armed_in_backward": armed}
