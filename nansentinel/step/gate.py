"""The device gate: a fused optimizer skips a poisoned step on the device; the host decides later.

Waiting on the host for the cluster view before ``optimizer.step()`` idles the GPU while the
host decides and launches the optimizer (measured 1-2.6 % of a step on an H200). torch's fused
Adam, AdamW, Adagrad and SGD need no such wait: like GradScaler, the sentinel sets
``optimizer.found_inf`` (a 0-d fp32 tensor on the device, 1 = skip) and the fused kernel leaves
weights and moments untouched and takes its step counter back. ``found_inf`` comes from the
all-reduced health vector, which is already on the device: it is 1 when any rank had a
non-finite batch, loss or gradient, or a quarantined batch, or when the host has already
decided to skip (batches discarded after a rollback). That is exactly when the host policy
skips, as long as no spike action can skip (spikes need the host's history), so the device
and the host always agree.

The vector then goes to pinned host memory behind a CUDA event; the host decides (reports,
metrics, spikes, replay, strikes, rollback, abort) at the next sentinel call, on every rank at
the same point, because a detection's naming and report are collectives. Reading the result
earlier never starts one (see :class:`PendingResult`). An abort is raised on every rank at the
next sentinel call and names the step it judged.

Every other optimizer keeps the host gate: one host read of the view, then step or not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from nansentinel.checks.health import LocalHealth
from nansentinel.result import ResultPending, StepResult
from nansentinel.wire.schema import OwnRow, Totals, skip_count

log = logging.getLogger("nansentinel")

if TYPE_CHECKING:
    from nansentinel.checks.buffers import FloatingBuffers
    from nansentinel.decide.policy import Decision
    from nansentinel.engines import Capabilities
    from nansentinel.step.judge import StepJudge, Tail


def device_gate_refusal(
    optimizer: torch.optim.Optimizer, *, scaler: Any, config: Any, caps: Capabilities,
) -> str | None:
    """Why the device gate cannot take this run (None: it can).

    The gate needs an optimizer that reads ``found_inf`` (torch's fused ones set
    ``_step_supports_amp_scaling``), a decision the device can take (no spike action other than
    ``warn``), no GradScaler (its own ``found_inf`` would have to be merged), a policy other
    than ``drop`` (whose dropped steps are rescaled on the host first), and a gradient path
    that allows it (``caps.device_gate``: FSDP2's sharded optimizer state is not measured yet,
    DeepSpeed decides on the host; under a pipeline the stages make their next call at
    different points of the schedule, where a detection's collectives would not pair up; that
    one is said first).
    """
    if caps.pipelined:
        return caps.device_gate
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return (
            f"{type(optimizer).__name__} is not fused (it cannot skip a step on the device); "
            "use fused=True to avoid the host sync before every optimizer step"
        )
    if scaler is not None:
        return "a GradScaler is in use (its found_inf decides the step)"
    if "skip" in (config.loss_spike_action, config.grad_spike_action) or "rollback" in (
        config.loss_spike_action, config.grad_spike_action
    ):
        return "a spike action can skip the step, and spikes are judged on the host"
    if config.policy == "drop":
        return ("policy drop rescales a dropped step's gradients on the host, after the "
                "decision, before the optimizer steps")
    return caps.device_gate


class DeviceGate:
    """Runs the optimizer step with a device-side ``found_inf`` taken from the health vector."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.device = device
        self._one = torch.ones((), dtype=torch.float32, device=device)
        self._host: torch.Tensor | None = None
        # Fused SGD with momentum leaves its momentum buffers uninitialised (empty_like) when
        # its first step is skipped, so it joins the gate only once they exist.
        self._needs_buffers = isinstance(optimizer, torch.optim.SGD) and any(
            g.get("momentum", 0) for g in optimizer.param_groups
        )

    def ready(self) -> bool:
        """True when a skipped step is an exact no-op for this optimizer now."""
        if not self._needs_buffers:
            return True
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and state.get(p, {}).get("momentum_buffer") is None:
                    return False
        self._needs_buffers = False
        return True

    def found_inf(self, vector: torch.Tensor, skip: bool) -> torch.Tensor:
        """1.0 when some rank's checked value is non-finite or its batch quarantined, or when
        the host already decided to ``skip``; else 0.0 (0-d fp32 on the optimizer's device)."""
        if skip:
            return self._one
        bad = skip_count(vector)  # the host gate's rule (view.py), on the device
        return (bad > 0).to(device=self.device, dtype=torch.float32, non_blocking=True)

    def step(self, found_inf: torch.Tensor) -> None:
        """``optimizer.step()``, skipped on the device where ``found_inf`` is 1, exactly as
        GradScaler drives a fused optimizer."""
        opt = self.optimizer
        opt.grad_scale = None  # type: ignore[attr-defined]
        opt.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            opt.step()
        finally:
            del opt.grad_scale  # type: ignore[attr-defined]
            del opt.found_inf  # type: ignore[attr-defined]

    def to_host(self, vector: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``vector`` to host memory; return the host tensor and the event that
        says the copy is done (None where the vector already is on the host).

        The copy and the event are both on the current stream of ``vector``'s device, which
        need not be the current device: DDP with ``device_ids`` runs without
        ``torch.cuda.set_device``, and an event recorded on cuda:0's stream would fire before
        a copy queued on cuda:1's, so the host would read the reused buffer early and judge
        step N with step N-1's values. (torch queues a device-to-host copy on the current
        stream of the source's device, so the copy needs no stream context.)
        """
        if vector.device.type != "cuda":
            return vector, None
        if self._host is None or self._host.numel() != vector.numel():
            self._host = _pinned(vector.numel(), vector.dtype)
        stream = torch.cuda.current_stream(vector.device)
        self._host.copy_(vector, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        return self._host, event


def _pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host buffer, so that the device-to-host copy is asynchronous."""
    return torch.empty(numel, dtype=dtype, pin_memory=True)


@dataclasses.dataclass(slots=True)
class Pending:
    """A step gated on the device whose host decision has not run yet."""

    step: int
    local: LocalHealth
    """The step's own health record (its ``seconds`` the sentinel's time so far)."""
    host: torch.Tensor
    event: Any
    grads: list[tuple[torch.Tensor, torch.Tensor | None]]
    """Every parameter with the gradient it had at ``step()``: naming a poisoned parameter
    reads them even when the user has already zeroed (set to None) the gradients."""
    skipped: bool = False
    """The host had decided to skip already (batches discarded after a rollback)."""
    buffers: int = 0
    """Floating buffers put back on the device if the step was skipped (buffers.py)."""

    def values(self) -> list[float]:
        """The summed vector as host floats. Waits for the copy only if it has not landed
        yet (the event is asked first, which is no sync); it was queued right after the last
        gradient all-reduce, so by the next sentinel call it has usually landed."""
        if self.event is not None and not self.event.query():
            self.event.synchronize()
        return self.host.tolist()

    def settled(self) -> bool:
        return self.event is None or bool(self.event.query())

    def early(self, name: str) -> Any:
        """A field of :data:`EARLY_FIELDS`, from the vector alone (no collective): ``applied``
        is what the device did, which is the decision's own."""
        values = self.values()
        totals, own = Totals.from_values(values), OwnRow.from_values(values)
        if name == "step":
            return self.step
        if name == "applied":
            return not (totals.device_skips or self.skipped)
        if name == "injected":
            return totals.injected > 0
        return {"local_kinds": list(own.kinds), "local_loss": own.loss,
                "local_grad_norm": own.grad_norm}[name]

    def drop_grads(self) -> None:
        """Let go of the held gradients once the parameters are named: a replay that follows
        then needs no more memory than a training step (the user may hold them still)."""
        self.grads = [(p, None) for p, _ in self.grads]

    @contextlib.contextmanager
    def grads_restored(self) -> Iterator[None]:
        """The gradients as they were at ``step()``, for the parameter naming."""
        current = [(p, p.grad) for p, _ in self.grads]
        try:
            for p, g in self.grads:
                p.grad = g
            yield
        finally:
            for p, g in current:
                p.grad = g


def held_grads(params: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    return [(p, p.grad) for p in params]


#: What a device-gated result answers before its step is decided: known without a collective.
EARLY_FIELDS = frozenset({"step", "applied", "injected", "local_kinds", "local_loss",
                          "local_grad_norm"})


class PendingResult:
    """A :class:`StepResult` whose host decision runs at the next sentinel call.

    Reading a field never runs a collective. The first read waits for the cluster's totals
    (one host sync, by the caller's choice): a step that found nothing is then decided on the
    spot, locally, and every field answers. A step that found something is named and decided
    with every rank at the next sentinel call (``check_batch``, ``check_loss``, ``step``,
    ``close``), where an abort is raised; before that only :data:`EARLY_FIELDS` answer (its
    ``applied`` is exact: the device already skipped it) and the others raise
    :class:`~nansentinel.result.ResultPending`. :meth:`resolve` returns the plain
    ``StepResult`` once decided.
    """

    __slots__ = ("_early", "_resolve", "_result")

    def __init__(
        self, resolve: Callable[[], None], early: Callable[[str], Any] | None = None
    ) -> None:
        self._resolve: Callable[[], None] | None = resolve
        self._early = early
        self._result: StepResult | BaseException | None = None

    def set(self, value: StepResult | BaseException) -> None:
        self._result = value
        self._resolve = None
        self._early = None

    def resolve(self) -> StepResult:
        """The decided result (decided now if that needs no collective; raises the abort the
        decision raised, or :class:`ResultPending` before a detection's decision)."""
        if self._result is None and self._resolve is not None:
            self._resolve()
        if isinstance(self._result, BaseException):
            raise self._result
        if self._result is None:
            raise RuntimeError("nansentinel: a deferred step result was never decided")
        return self._result

    @property
    def resolved(self) -> bool:
        return self._result is not None

    def __getattr__(self, name: str) -> Any:
        if self._result is None and self._early is not None and name in EARLY_FIELDS:
            return self._early(name)
        return getattr(self.resolve(), name)

    def __repr__(self) -> str:
        if self._result is None:
            return "PendingResult(<decided at the next sentinel call>)"
        return f"PendingResult({self._result!r})"

    def __eq__(self, other: object) -> bool:
        other = other.resolve() if isinstance(other, PendingResult) else other
        return self.resolve() == other

    __hash__ = None  # type: ignore[assignment]


class GatedSteps:
    """The steps of the device gate: launched on the device, decided at the next sentinel call.

    :meth:`launch` runs the optimizer step gated by a device-side ``found_inf`` and hands back
    a :class:`PendingResult`; :meth:`resolve`, called on every rank at its next sentinel call,
    decides it with every other rank. A read of the result decides it earlier only when that
    needs no collective (:meth:`decide_if_local`), and then leaves the step's collective tail
    (the replica check, a snapshot) for the next sentinel call.

    Args:
        gate: the device gate. judge: decides a step (judge.py).
        buffers: the floating buffers, put back on the device when a step is skipped.
        params: every parameter, whose gradients are held until the decision.
        guarded: a context manager arming the watchdog around a collective.
        rearm: re-arms the watchdog when a step is decided inside the next step's collectives.
        stop_if: raises the decision's abort (the stop path).
    """

    def __init__(
        self, gate: DeviceGate, judge: StepJudge, *, buffers: FloatingBuffers,
        params: list[torch.Tensor], guarded: Callable[[], Any], rearm: Callable[[], None],
        stop_if: Callable[[Decision, StepResult], None],
    ) -> None:
        self.gate, self.judge, self.buffers, self.params = gate, judge, buffers, params
        self.guarded, self.rearm, self.stop_if = guarded, rearm, stop_if
        self._pending: tuple[Pending, PendingResult] | None = None
        self._tail: Callable[[], None] | None = None

    def ready(self) -> bool:
        return self.gate.ready()

    def launch(self, step: int, vector: torch.Tensor, local: LocalHealth) -> PendingResult:
        """Launch the optimizer step gated by a device-side found_inf; decide later."""
        judge, opt = self.judge, self.gate.optimizer
        with local.timed():
            skip = judge.history.skip_batches > 0  # known on the host: no need to look
            found_inf = self.gate.found_inf(vector, skip)
            host, event = self.gate.to_host(vector)  # queued before the optimizer: lands early
            saved_lr = judge.cooldown.apply(opt)
        self.gate.step(found_inf)  # the optimizer's time is not the sentinel's
        with local.timed():
            judge.cooldown.restore(opt, saved_lr)  # counted at the decision, if applied
            self.buffers.restore_where(found_inf)  # a skipped step's forward leaves no trace
            pending = Pending(step, local, host, event, held_grads(self.params), skip,
                              buffers=self.buffers.copied)
        result = PendingResult(self.decide_if_local, pending.early)
        self._pending = (pending, result)
        return result

    def settled(self) -> bool:
        return self._pending is not None and self._pending[0].settled()

    def decide_if_local(self) -> None:
        """A read of a pending result: decide it now if that needs no collective (nothing
        was flagged), else say when it will be decided. Never starts a collective."""
        if self._pending is None:
            return
        pending, _ = self._pending
        if self.judge.needs_detection(Totals.from_values(pending.values())):
            raise ResultPending(
                f"nansentinel: step {pending.step} found a non-finite value or a spike; rank "
                f"{self.judge.rank} names and decides it with every other rank at its next "
                "sentinel call (check_batch, check_loss, step or close), where an abort is "
                "raised. Until then only step, applied (the device already skipped it), "
                "injected and local_* can be read."
            )
        self.resolve(reading=True)

    def resolve(self, *, reading: bool = False) -> None:
        """Decide the step pending here, if any (raises its abort). Called on every rank at
        its next sentinel call, so that a detection's collectives run at the same point
        everywhere; ``reading``: from a read on this rank alone (the tail then waits)."""
        if not reading and self._tail is not None:
            tail, self._tail = self._tail, None
            tail()
        if self._pending is None:
            return
        pending, result = self._pending
        self._pending = None
        with self.guarded():
            values = pending.values()
        self.rearm()
        try:
            decided, decision, tail = self.judge.judge(pending.step, values, pending.local,
                                                       pending)
            result.set(decided)
            if reading:  # the tail's collectives run at the next sentinel call, everywhere
                self._tail = functools.partial(self._deferred, tail, result)
                return
            self._finish(tail, decided, decision, result)
        except BaseException as exc:
            result.set(exc)
            raise

    def _deferred(self, tail: Tail, result: PendingResult) -> None:
        try:
            self._finish(tail, result.resolve(), None, result)
        except BaseException as exc:
            result.set(exc)
            raise

    def _finish(self, tail: Tail, decided: StepResult, decision: Decision | None,
                result: PendingResult) -> None:
        decided, final = tail(decided, decision)
        result.set(decided)
        self.stop_if(final, decided)

    def abandon(self) -> None:
        """Forget the pending step and its tail (the loop failed: no collective now)."""
        self._pending = None
        self._tail = None


def gated_steps(
    config: Any, optimizer: torch.optim.Optimizer, device: torch.device, *, scaler: Any,
    caps: Capabilities, speak: bool, judge: StepJudge, buffers: FloatingBuffers,
    params: list[torch.Tensor], guarded: Callable[[], Any], rearm: Callable[[], None],
    stop_if: Callable[[Decision, StepResult], None],
) -> GatedSteps | None:
    """The device gate where ``config.gate`` and the run allow it, else None (the host gate);
    a refusal is said once, by rank 0 (``speak``)."""
    mode = config.gate
    if mode == "host" or (mode == "auto" and device.type != "cuda"):
        return None
    refusal = device_gate_refusal(optimizer, scaler=scaler, config=config, caps=caps)
    if refusal is not None:
        if speak:
            log.info("nansentinel: host gate (one host sync before every optimizer step): %s",
                     refusal)
        return None
    return GatedSteps(DeviceGate(optimizer, device), judge, buffers=buffers, params=params,
                      guarded=guarded, rearm=rearm, stop_if=stop_if)
