"""The Sentinel: the one path of a step, as the training loop calls it.

::

    check_batch ─┐
    check_loss ──┤ this rank's flags, kept on the device (step/current.py, checks/)
    backward ────┤ the gradient path (engines/): each DDP bucket or FSDP group checked
                 │ before its reduction; the health exchange leaves with the last one
    step() ──────┘ the totals (wire/exchange.py: the one host sync) → step/judge.py:
                   [flagged: name them, rare/detection.py] → decide (decide/policy.py) → act;
                   on the device gate the optimizer step is queued first, then the host
                   reads and decides (gate="device": at the next call; step/gate.py)

The step's states are named in step/record.py. The parts are built once, top to bottom, by
step/assembly.py; this class is the loop's calls over them (docs/design.md). A scope wider
than the ranks' exchange (torchft's replica groups) is a part an integration adds: ``step()``
then asks it after the ranks' own decision (:meth:`Sentinel._agree`).
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from nansentinel.checks import pipeline
from nansentinel.common import doors
from nansentinel.effects import stop
from nansentinel.effects.recovery import SnapshotStore
from nansentinel.rare.replay import ReplayFn
from nansentinel.result import NonFiniteError, ResultPending, StepResult
from nansentinel.step import assembly, usage
from nansentinel.step.assembly import Asked, Parts, Scope
from nansentinel.step.record import PendingResult

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("nansentinel")


@functools.cache
def _argument_hints() -> dict[str, Any]:
    """``Sentinel.__init__``'s annotations, resolved once: the types its arguments are held
    to (``dist`` is imported for type checking only; torch has it as an attribute)."""
    try:
        return doors.hints(Sentinel.__init__, dist=torch.distributed)
    except (NameError, AttributeError):  # a torch built without torch.distributed
        return {}


def _read(path: str, doc: str) -> Any:
    """A read-only property of the Sentinel: ``path`` (``"ctx.config"``) read in its parts."""
    get = operator.attrgetter(path)
    return property(lambda self: get(self._parts), doc=doc)


class Sentinel:
    """Watches one rank's batch, loss and gradients; decides each step with every other rank.

    Args:
        model: plain, ``DistributedDataParallel``, an FSDP2 root (1-D, HSDP) or a DeepSpeed
            engine (ZeRO 0-3: its optimizer, engines/deepspeed_step.py); with ``stages`` the
            list of a pipeline rank's stage modules. Construct the sentinel before the first
            backward.
        optimizer: stepped by :meth:`step` only when every rank is healthy (none for engines).
        scaler: a ``torch.amp.GradScaler``, stepped and updated by :meth:`step`.
        group: the process group (default: DDP's, else the default group, else none).
        registry: a ``prometheus_client.CollectorRegistry`` for the metrics.
        replay: ``fn(module, batch) -> loss``: a detection is replayed in lockstep to tell data,
            host and transient faults apart (off under FSDP2); ``False``: the replay off.
        snapshots: ``(save, load)`` or a ``SnapshotStore`` for rollbacks (default: host memory).
        stages: this rank's ``PipelineStage`` (or a list): its boundaries are checked.
        env: where ``NANSENTINEL_*`` is read (default ``os.environ``).
        scopes: agreements wider than the ranks' exchange, each an
            :class:`~nansentinel.step.assembly.Scope` (an integration's:
            ``nansentinel.torchft.Sentinel`` adds torchft's replica groups).
        **overrides: :class:`SentinelConfig` fields; keyword > env > default.

    Its parts are built once (step/assembly.py) and private; what the loop may read is the
    short surface at the end of the class (:attr:`config`, :attr:`identity`, :attr:`rank`,
    :attr:`step_index`, ...).
    """

    _parts: Parts

    def __init__(
        self, model: torch.nn.Module | list[torch.nn.Module],
        optimizer: torch.optim.Optimizer | None = None, *, scaler: Any = None,
        group: dist.ProcessGroup | None = None, registry: Any = None,
        env: Mapping[str, str] | None = None, replay: ReplayFn | bool | None = None,
        snapshots: tuple[Any, Any] | SnapshotStore | None = None, stages: Any = None,
        scopes: Sequence[Scope] = (), **overrides: Any,
    ) -> None:
        usage.check_objects(model, optimizer)  # the wrong objects, named at once
        usage.check_arguments(_argument_hints(), {
            "scaler": scaler, "group": group, "registry": registry, "env": env,
            "replay": replay, "snapshots": snapshots, "stages": stages, "scopes": scopes})
        if isinstance(replay, bool):  # the config field (keyword > env), not a function
            overrides["replay"], replay = replay, None
        cfg, environ = assembly.configure(env, scopes, overrides)
        asked = Asked(optimizer, scaler, group, replay, snapshots, stages, tuple(scopes))
        self._parts = parts = assembly.assemble(model, asked, cfg, environ, self._rearm)
        try:
            for scope in parts.wider:
                scope.bind(parts)
            assembly.serve(parts, registry)
        except BaseException:  # the model given back as it was (what its paths installed)
            parts.end.shut()
            raise
        # SIGTERM/SIGINT become a stop after a step every rank agrees on (effects/stop.py).
        parts.end.signals = stop.take_stop_signals()

    # --- the calls of a training loop --------------------------------------------------------

    def check_batch(self, batch: Any, *, ids: Any = None) -> Any:
        """Check every floating-point tensor of ``batch`` (any nesting) before ``backward``;
        returns it. ``ids``: a sample id per row, read after a detection (the skip list)."""
        self._parts.usage.live("check_batch", self.rank, self.step_index)
        self._resolve()
        self._parts.current.check_batch(batch, ids)
        return batch

    def check_loss(self, loss: torch.Tensor | float) -> None:
        """Check the loss (a tensor, a number; a non-scalar one element-wise) before
        ``backward``, so that its flag leaves with the gradients."""
        self._parts.usage.live("check_loss", self.rank, self.step_index)
        self._parts.usage.loss_checked(self.rank, self.step_index)
        self._resolve()
        self._parts.current.add_loss(loss)

    def wrap_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn`` checked, for a pipeline schedule (``loss_fn=sentinel.wrap_loss(fn)``)."""

        def add_loss(loss: Any) -> torch.Tensor:
            self._resolve()
            return self._parts.current.add_loss(loss)

        return pipeline.wrap_loss(loss_fn, self._parts.current.stages, add_loss,
                                  lambda: self._parts.current.local, self.device)

    def check_grads(self) -> None:
        """Check the local gradients now and start the exchange: only if you reduce
        gradients by hand, after ``backward`` and *before* your all-reduce (DDP and FSDP2
        check them themselves; ``step()`` calls this when nothing did)."""
        self._parts.usage.live("check_grads", self.rank, self.step_index)
        self._resolve()
        self._parts.current.require_open("check_grads")
        self._parts.gradients.check_now()
        if not self._parts.ctx.exchange.launched:  # DeepSpeed's launches it before its own
            self._parts.current.launch_exchange()

    @overload
    def step(self, *, optimizer_step: Literal[False]) -> StepResult | None: ...
    @overload
    def step(self, *, optimizer_step: bool = True) -> StepResult | PendingResult | None: ...

    def step(self, *, optimizer_step: bool = True) -> StepResult | PendingResult | None:
        """Decide this step with every rank and act: the optimizer (or GradScaler) steps only
        when every rank is healthy; otherwise every rank skips, rolls back, or raises
        :class:`NonFiniteError` (:class:`HostExcludedError`). ``optimizer_step=False``: the
        caller (a framework) steps the optimizer itself right after; on a skip the gradients
        are then ``None``. On ``gate="device"`` a
        :class:`~nansentinel.step.record.PendingResult` comes back, decided at the next
        sentinel call (or on a read that needs no collective); the default ``gate="auto"``
        decides within this call after queueing the optimizer step, and returns a
        ``StepResult``. With a DeepSpeed engine it
        replaces ``engine.step()``, and returns None on a micro-batch before the accumulation
        boundary (counted, decided at the boundary)."""
        self._parts.usage.live("step", self.rank, self.step_index)
        self._resolve()
        engine = self._parts.engine
        if engine is not None and engine.accumulating(optimizer_step=optimizer_step,
                                                      step=self.step_index):
            return None
        if self._parts.wider:
            return self._agree(optimizer_step=optimizer_step)
        return self._decide(optimizer_step=optimizer_step)

    def _decide(self, *, optimizer_step: bool, alone: bool = True,
                ) -> StepResult | PendingResult:
        """The ranks' decision of this step (the exchange's), and its effects; ``alone``: no
        wider scope decides after it, so this decision is observed (metrics) and served (the
        exporter's last scrape before a stop) here."""
        parts = self._parts
        ctx, current, device_gate = parts.ctx, parts.current, parts.device_gate
        parts.judge.caller_did_not_step()
        if not ctx.exchange.launched:
            parts.usage.stepping(self.rank, self.step_index)  # a backward since the last step
            self.check_grads()
        parts.usage.stepped()
        record = current.record
        if optimizer_step and device_gate is not None and device_gate.ready():
            _, vector = ctx.exchange.take()  # no host read: found_inf comes from it
            pending = device_gate.launch(record, vector, parts.gradients.take_norms())
            current.next()
            if device_gate.deferred:
                return pending
            # The optimizer step is queued on the device: the host now waits for the end of
            # backward (the copy's event) while the GPU runs the optimizer, not the other way.
            device_gate.resolve()
            return pending.resolve()
        _, record.values = ctx.exchange.wait()  # waiting for the all-reduce beside it
        ctx.deadline.disarm()
        parts.judge.decide(record, optimizer_step=optimizer_step)
        parts.judge.finish(record, observe=alone)
        current.next()
        assert record.decision is not None and record.decided is not None
        parts.end.stop_if(record.decision, record.decided, serve=alone)
        return record.decided

    def _agree(self, *, optimizer_step: bool) -> StepResult:
        """The step decided by the ranks (without stepping the optimizer, and unobserved: a
        step a wider scope vetoes is not "applied"), then by each wider scope in order, which
        steps the optimizer where it applies the step; observed once, as the scopes decided
        it, and a stop raised only after every scope agreed on it."""
        parts = self._parts
        for scope in parts.wider:
            scope.begin()
        metrics = parts.judge.metrics
        spent, started = parts.current.record.spent, time.perf_counter()
        stopping: NonFiniteError | None = None
        try:
            local = self._decide(optimizer_step=False, alone=False)
        except NonFiniteError as exc:  # the ranks' abort (max_consecutive_skips, policy)
            local, stopping = exc.result, exc
        spent += time.perf_counter() - started
        assert isinstance(local, StepResult)
        result = local
        for scope in parts.wider:
            result, stopping = scope.agree(result, stopping, optimizer_step=optimizer_step)
        if metrics is not None:  # the step as every scope decided it, observed once
            metrics.observe_step(result, spent)
        if stopping is not None:
            for scope in parts.wider:
                scope.leave(metrics)
            raise stopping
        return result

    # --- state for checkpoints, and the end ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step counter, policy history, spike references, cooldown and quarantine, to save
        with the checkpoint. Never runs a collective (it may be called on one rank): a step
        pending on the device gate that found something is decided later, and the history
        saved now is the one before it (its skip has happened on the device already)."""
        try:
            if self._parts.device_gate is not None:
                self._parts.device_gate.decide_if_local()
        except ResultPending:
            log.warning("nansentinel: state_dict() on rank %d while step %d's detection is "
                        "pending (decided at the next sentinel call on every rank); the saved "
                        "history is the one before it", self.rank, self.step_index - 1)
        return {"step": self.step_index, **self._parts.judge.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, then :meth:`check_state` (call it on every
        rank, after the model and the optimizer are restored). A ``state`` that is not one
        (another object's state dict, a hand-edited one) is an :class:`ArgumentTypeError`
        naming what was wrong, and the sentinel keeps the state it had."""
        assembly.restore(self._parts, state)
        self.check_state()

    def check_state(self) -> None:
        """Read the model's whole state once on every rank (weights, floating buffers,
        optimizer state and hyperparameters): after a restore of your own, call it on every
        rank before the next step. A non-finite value on any rank raises
        :class:`NonFiniteStateError` on every rank, naming the tensor, rank, host and count
        (``nansentinel run`` exits 6): nothing is applied from a poisoned checkpoint."""
        self._resolve()
        if self._parts.judge.state is not None:
            stop.refuse_state(self._parts.ctx, self._parts.judge.state, "after a restore",
                              self.step_index)

    def close(self) -> None:
        """End the run on this rank; call it on every rank. Decides a step still pending,
        waits for every rank at one barrier (so that a finished job exits 0: torch 2.13's gloo
        aborts a process that tears its group down while a peer still uses it), leaves the
        launcher a ``closed`` verdict (a full or read-only disk costs one line naming its
        file, never an exception: a rank that trained every step exits 0), and stops the
        exporter and the watchdog. A second call does nothing; after a loop that raised on
        this rank, :meth:`abandon` instead."""
        self._parts.end.close(self._resolve, self.step_index - 1)

    def abandon(self) -> None:
        """Stop the exporter and the watchdog without a collective (the loop failed here)."""
        if self._parts.device_gate is not None:
            self._parts.device_gate.abandon()
        self._parts.end.shut()

    def __enter__(self) -> Sentinel:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close() if exc_type is None else self.abandon()

    # --- what the loop may read ------------------------------------------------------------

    config = _read("ctx.config", "The validated config.")
    identity = _read("ctx.identity", "This rank: host, device, GPU.")
    rank = _read("ctx.rank", "This rank in the exchange's group.")
    world_size = _read("ctx.world_size", "The ranks that decide together.")
    device = _read("ctx.device", "Where this rank computes.")
    job_id = _read("ctx.job_id", "The job's id, in file names.")
    exchange = _read("ctx.exchange", "The step's health exchange (the first scope).")
    watchdog = _read("ctx.deadline.dog", "The deadline's watchdog; None alone.")
    model = _read("watched.model", "The model as handed in.")
    module = _read("watched.module", "The module inside it (DDP's, the engine's).")
    step_index = _read("current.index", "The step in progress.")
    local = _read("current.local", "This step's health so far.")
    stages = _read("current.stages", "The pipeline stages watched.")
    forward = _read("current.forward", "This step's forward collectives, counted (origins).")
    buffers = _read("current.buffers", "The floating buffers a skipped step puts back.")
    gradients = _read("gradients", "The gradient path; its ``caps`` say what it supports.")
    engine = _read("engine", "A DeepSpeed engine's adapter (its own step); None otherwise.")
    gate = _read("gate", "The gate this run took and why (step/gate.GateChoice).")
    device_gate = _read("device_gate", "The device gate's steps; None: the host gate.")
    scopes = _read("scopes", "The agreement scopes: the exchange, then any integration's.")
    optimizer = _read("judge.optimizer", "What a step applies with.")
    scaler = _read("judge.scaler", "Its loss scale, if any.")
    history = _read("judge.history", "The policy's history.")
    cooldown = _read("judge.cooldown", "The rollback LR cooldown.")
    lr_guard = _read("judge.lr", "The learning-rate rules; lr_guard.reset() takes a deliberate "
                     "LR change (docs/recovery.md).")
    spikes = _read("judge.spikes", "The spike references.")
    snapshots = _read("judge.snapshots", "The last good state.")
    replicas = _read("judge.replicas", "The replica fingerprint check; None: none.")
    curves = _read("detector.curves", "The last steps' loss and gradient norm (reports).")
    quarantine = _read("detector.quarantine", "Batches a data verdict blamed.")
    replays = property(lambda self: self._parts.detector.replay is not None,
                       doc="A detection is replayed (a function given, the path allows it).")
    metrics = property(lambda self: self._parts.judge.metrics,
                       lambda self, value: setattr(self._parts.judge, "metrics", value),
                       doc="The exporter (metrics.py); None without ``metrics_port``, or once "
                           "closed. Settable: a test or a host process may attach its own.")

    # --- internals ---------------------------------------------------------------------------

    def _resolve(self) -> None:
        """Decide a step pending on the device gate (at a call every rank makes); after a
        step decided with a stop request, end here (:class:`StopRequested`, every rank at
        the same call)."""
        if self._parts.device_gate is not None:
            self._parts.device_gate.resolve()
        self._parts.end.end_if_stopping()

    def _rearm(self) -> None:
        """A step decided inside the next step's armed collectives re-arms the watchdog."""
        if self._parts.ctx.exchange.launched:
            self._parts.ctx.deadline.arm()


