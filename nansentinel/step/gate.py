"""The device gate: a fused optimizer skips a poisoned step on the device, queued before the
host reads anything.

Waiting on the host for the cluster view before ``optimizer.step()`` idles the GPU while the
host decides and launches the optimizer (on an H200: 1.040 of a 625 M bf16 step, against
1.023 on this gate). torch's fused Adam, AdamW, Adagrad and SGD need no such wait: like
GradScaler, the sentinel sets ``optimizer.found_inf`` (a 0-d fp32 tensor on the device,
1 = skip) and the fused kernel leaves weights and moments untouched and takes its step counter
back. ``found_inf`` comes from the all-reduced health vector, which is already on the device:
it is 1 when any rank had a non-finite batch, loss or gradient, or a quarantined batch, or when
the host has already decided to skip (batches discarded after a rollback). That is exactly
when the host policy skips, as long as no spike action can skip (spikes need the host's
history), so the device and the host always agree.

The vector then goes to pinned host memory behind a CUDA event queued before the optimizer,
and the host decides (reports, metrics, spikes, replay, strikes, rollback, abort) from it, on
every rank at the same point, because a detection's naming and report are collectives. When
is the gate's second choice (:class:`GateChoice`). ``gate="auto"``, the default, decides
inside the same ``step()``, once the optimizer step is queued: the host waits for the end of
backward while the GPU runs the optimizer, and ``step()`` returns the host gate's
:class:`StepResult` (every field, an abort raised there), so a loop written for the host gate
runs unchanged. ``gate="device"`` leaves it to the next sentinel call, so that the host may run
further ahead: ``step()`` returns a :class:`PendingResult`, whose reads never start a
collective, and an abort is raised on every rank at the next sentinel call, naming the step
it judged.

Every other optimizer keeps the host gate: one host read of the view, then step or not.

One word per thing: ``config.gate`` (``NANSENTINEL_GATE``) is the gate asked for; the *gate*
(:class:`GateChoice`, ``Sentinel.gate``) is the one taken and why; the *device gate*
(:class:`GatedSteps`, ``Sentinel.device_gate``) is its steps, launched now and decided later;
the *gated optimizer* (:class:`GatedOptimizer`) is the device-side ``found_inf`` and the
optimizer step it gates.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from nansentinel.common import torch_insides as insides
from nansentinel.result import ResultPending, StepResult
from nansentinel.step.record import PendingResult, Stage, StepRecord
from nansentinel.wire.schema import skip_count

log = logging.getLogger("nansentinel")

if TYPE_CHECKING:
    from nansentinel.checks.buffers import FloatingBuffers
    from nansentinel.decide.policy import Decision
    from nansentinel.engines import Capabilities, KeptNorms
    from nansentinel.step.judge import StepJudge
    from nansentinel.wire.context import Context


@dataclasses.dataclass(frozen=True, slots=True)
class GateChoice:
    """Which gate a run takes, and why (chosen once, at construction: :func:`choose_gate`).

    ``device``: the optimizer step is launched gated by a device-side ``found_inf``, before
    the host reads anything. ``deferred``: the step is then decided at the next sentinel call
    (``gate="device"``, a :class:`PendingResult`); else inside the same ``step()``, after the
    launch (``gate="auto"`` on CUDA). ``why``: the reason in words, said once by rank 0."""

    device: bool
    deferred: bool
    why: str

    @property
    def name(self) -> str:
        """``host``, ``device`` (decided in ``step()``) or ``device, deferred``."""
        return "host" if not self.device else "device, deferred" if self.deferred else "device"


def choose_gate(config: Any, device: torch.device, optimizer: torch.optim.Optimizer, *,
                scaler: Any, caps: Capabilities) -> GateChoice:
    """The gate for ``config.gate`` on ``device`` with this optimizer, scaler and gradient
    path: a pure function of them (``device`` may be a CUDA device on a machine without one:
    nothing here touches it), so the choice for every engine and optimizer is testable on the
    CPU.

    ``auto`` takes the device gate on CUDA wherever :func:`device_gate_refusal` allows it,
    and decides in ``step()``; off CUDA it keeps the host gate: there the read is no idle
    accelerator, and the host gate costs nothing the device gate would save."""
    mode = config.gate
    if mode == "host":
        return GateChoice(False, False, "gate='host' was asked for")
    if mode == "auto" and device.type != "cuda":
        return GateChoice(False, False, f"the model is on {device.type}, not CUDA: reading "
                          "the totals there idles no accelerator")
    refusal = device_gate_refusal(optimizer, scaler=scaler, config=config, caps=caps)
    if refusal is not None:
        return GateChoice(False, False, refusal)
    if mode == "device":
        return GateChoice(True, True, "gate='device': decided at the next sentinel call")
    return GateChoice(True, False, f"{type(optimizer).__name__} is fused and the "
                      f"{caps.label} path allows a skip on the device")


def device_gate_refusal(
    optimizer: torch.optim.Optimizer, *, scaler: Any, config: Any, caps: Capabilities,
) -> str | None:
    """Why the device gate cannot take this run (None: it can).

    The gate needs an optimizer that reads ``found_inf`` (torch's fused ones set
    ``_step_supports_amp_scaling``), a decision the device can take (no spike or collapse
    action other than ``warn``), no GradScaler (its own ``found_inf`` would have to be
    merged), a policy other than ``drop`` (whose dropped steps are rescaled on the host
    first), and a gradient path that allows it (``caps.device_gate``: DeepSpeed decides on the
    host; under a pipeline the stages make their next call at different points of the
    schedule, where a detection's collectives would not pair up; that one is said first).
    """
    if caps.pipelined:
        return caps.device_gate
    if not insides.skips_on_device(optimizer) and any(
            g.get("fused") for g in optimizer.param_groups):
        return (  # fused Adagrad before torch 2.13: its kernel is not known to skip
            f"fused {type(optimizer).__name__} on torch {torch.__version__} does not say it "
            "skips a step on the device (docs/torch-support.md)"
        )
    if not insides.skips_on_device(optimizer):
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
    if config.collapse_action != "warn":  # a collapse skipped, a stretch rolled back over
        return (f"collapse_action={config.collapse_action!r} can skip or roll back the step, "
                "and collapses are judged on the host")
    if config.policy == "drop":
        return ("policy drop rescales a dropped step's gradients on the host, after the "
                "decision, before the optimizer steps")
    return caps.device_gate


class GatedOptimizer:
    """Runs the optimizer step with a device-side ``found_inf`` taken from the health vector
    (the device-side gating: what :class:`GatedSteps` launches each step)."""

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


class GatedSteps:
    """The steps of the device gate: launched on the device, decided at the next sentinel call.

    :meth:`launch` runs the optimizer step gated by a device-side ``found_inf`` and hands back
    a :class:`~nansentinel.step.record.PendingResult`; :meth:`resolve`, called on every rank at
    its next sentinel call, decides it with every other rank and finishes it. A read of the
    result decides it earlier only when that needs no collective (:meth:`decide_if_local`),
    and then leaves the record ``DECIDED`` until the next sentinel call, where what it owes
    every rank together (the replica check, a snapshot) runs (step/record.py).

    No gradient is held until the decision: the gradient path keeps the step's per-parameter
    norms instead (``keep_norms``), so a loop that frees or zeroes its gradients after
    ``step()`` carries one set of gradients through the next forward, not two, and a
    detection still names the poisoned parameters.

    Args:
        gated: the optimizer, gated on the device. judge: decides and finishes a step.
        buffers: the floating buffers, put back on the device when a step is skipped.
        guarded: a context manager arming the watchdog around a collective.
        rearm: re-arms the watchdog when a step is decided inside the next step's collectives.
        stop_if: raises the decision's abort (the stop path).
    """

    def __init__(self, gated: GatedOptimizer, judge: StepJudge, buffers: FloatingBuffers, *,
                 guarded: Callable[[], Any], rearm: Callable[[], None],
                 stop_if: Callable[[Decision, StepResult], None]) -> None:
        self.gated, self.judge, self.buffers = gated, judge, buffers
        #: Decided at the next sentinel call (``gate="device"``); False: :meth:`launch`'s
        #: caller decides at once with :meth:`resolve`, the optimizer step being queued
        #: (``gate="auto"``). Set from the :class:`GateChoice` by :func:`gated_steps`.
        self.deferred = True
        self.guarded, self.rearm, self.stop_if = guarded, rearm, stop_if
        #: The step launched and not yet finished, and the result handed out for it.
        self._pending: tuple[StepRecord, PendingResult] | None = None

    def ready(self) -> bool:
        return self.gated.ready()

    def launch(self, record: StepRecord, vector: torch.Tensor, kept: KeptNorms | None
               ) -> PendingResult:
        """Launch the optimizer step gated by a device-side found_inf; decide later."""
        judge, local = self.judge, record.local
        with local.timed():
            skip = judge.history.skip_batches > 0  # known on the host: no need to look
            found_inf = self.gated.found_inf(vector, skip)
            host, event = self.gated.to_host(vector)  # queued before the optimizer: lands early
            saved_lr = judge.lr.apply(record.index)
        self.gated.step(found_inf)  # the optimizer's time is not the sentinel's
        with local.timed():
            judge.lr.restore(saved_lr)  # counted at the decision, if applied
            self.buffers.restore_where(found_inf)  # a skipped step's forward leaves no trace
            record.gated, record.host, record.event, record.skipped = True, host, event, skip
            record.buffers, record.kept = self.buffers.copied, kept
        result = PendingResult(self.decide_if_local, functools.partial(_early, record))
        self._pending = (record, result)
        return result

    def settled(self) -> bool:
        return self._pending is not None and self._pending[0].landed()

    def decide_if_local(self) -> None:
        """A read of a pending result: decide it now if that needs no collective (nothing
        was flagged), else say when it will be decided. Never starts a collective."""
        if self._pending is None:
            return
        record, result = self._pending
        if record.stage is Stage.DECIDED:
            return
        if self.judge.needs_detection(record.totals):
            raise ResultPending(
                f"nansentinel: step {record.index} found a non-finite value or a spike; rank "
                f"{self.judge.rank} names and decides it with every other rank at its next "
                "sentinel call (check_batch, check_loss, step or close), where an abort is "
                "raised. Until then only step, applied (the device already skipped it), "
                "injected and local_* can be read."
            )
        self._decide(record, result)

    def resolve(self) -> None:
        """Decide and finish the step pending here, if any (raises its abort). Called on every
        rank at its next sentinel call, so that a detection's collectives, and the replica
        check and snapshot a decided step owes, run at the same point everywhere."""
        if self._pending is None:
            return
        record, result = self._pending
        self._pending = None
        if record.stage is Stage.LAUNCHED:
            with self.guarded():
                record.read()
            self.rearm()
            self._decide(record, result)
        try:
            self.judge.finish(record)
            result.set(record.decided)
            assert record.decision is not None
            self.stop_if(record.decision, record.decided)
        except BaseException as exc:
            result.set(exc)
            raise

    def _decide(self, record: StepRecord, result: PendingResult) -> None:
        """``LAUNCHED``/``READ`` -> ``DECIDED``: the decision and its acts (collectives only
        if something was flagged: never from a read that :meth:`decide_if_local` allowed)."""
        try:
            self.judge.decide(record)
            result.set(record.decided)
        except BaseException as exc:
            result.set(exc)
            raise

    def abandon(self) -> None:
        """Forget the pending step (the loop failed: no collective now)."""
        if self._pending is not None:
            self._pending[0].to(Stage.ABANDONED)
        self._pending = None


def _early(record: StepRecord, name: str) -> Any:
    """An early field of a pending result, from the vector alone (no collective): ``applied``
    is what the device did, which is the decision's own."""
    if name == "step":
        return record.index
    totals, own = record.totals, record.own
    if name == "applied":
        return not (totals.device_skips or record.skipped)
    if name == "injected":
        return totals.injected > 0
    return {"local_kinds": list(own.kinds), "local_loss": own.loss,
            "local_grad_norm": own.grad_norm}[name]


def gated_steps(ctx: Context, judge: StepJudge, choice: GateChoice, *,
                rearm: Callable[[], None],
                stop_if: Callable[[Decision, StepResult], None]) -> GatedSteps | None:
    """The device gate's steps for ``choice`` (:func:`choose_gate`), else None (the host
    gate). The choice is said once, by rank 0: at INFO the host gate where it costs a GPU
    (on CUDA, or ``gate="device"`` refused), with the reason; at DEBUG anything else."""
    if ctx.rank == 0 and ctx.config.gate != "host":
        costs = ctx.device.type == "cuda" or ctx.config.gate == "device"
        if choice.device or not costs:
            log.debug("nansentinel: %s gate: %s", choice.name, choice.why)
        else:
            log.info("nansentinel: host gate (one host read of the totals before every "
                     "optimizer step): %s", choice.why)
    if not choice.device:
        return None
    steps = GatedSteps(GatedOptimizer(judge.optimizer, ctx.device), judge, judge.buffers,
                       guarded=ctx.guarded, rearm=rearm, stop_if=stop_if)
    steps.deferred = choice.deferred
    return steps
