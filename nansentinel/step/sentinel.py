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

The step's states are named in step/record.py. This class builds its collaborators top to
bottom from one Context (wire/context.py) and composes them (docs/design.md).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast, overload

import torch
from torch.nn.parallel import DistributedDataParallel

from nansentinel import engines
from nansentinel.checks import pipeline
from nansentinel.checks.health import identify, local_device
from nansentinel.checks.quarantine import Quarantine
from nansentinel.common import torch_insides as insides
from nansentinel.common.inject import Injector, parse_inject
from nansentinel.config import SentinelConfig, resolve_hostname
from nansentinel.decide.spikes import SpikeDetector
from nansentinel.effects import stop
from nansentinel.effects.recovery import MemorySnapshots, SnapshotStore, snapshot_store
from nansentinel.rare.detection import Detector
from nansentinel.rare.incident import IncidentWriter
from nansentinel.rare.replay import ReplayFn
from nansentinel.rare.replicas import replica_check
from nansentinel.result import ResultPending, StepResult
from nansentinel.step import prepared
from nansentinel.step.current import CurrentStep
from nansentinel.step.gate import GateChoice, GatedSteps, choose_gate, gated_steps
from nansentinel.step.judge import StepJudge, Stepping
from nansentinel.step.record import PendingResult
from nansentinel.wire import watchdog
from nansentinel.wire.context import Context, Watched
from nansentinel.wire.exchange import HealthExchange

if TYPE_CHECKING:
    import torch.distributed as dist

    from nansentinel.engines.deepspeed_step import EngineAdapter

log = logging.getLogger("nansentinel")


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
        **overrides: :class:`SentinelConfig` fields; keyword > env > default.

    Its collaborators are private; what the loop may read is the short surface at the end of
    the class (:attr:`config`, :attr:`identity`, :attr:`rank`, :attr:`step_index`, ...).
    """

    _ctx: Context
    _watched: Watched
    _current: CurrentStep
    _gradients: engines.GradPath
    _detector: Detector
    _judge: StepJudge
    _end: stop.RunEnd
    _gate: GatedSteps | None
    _gate_choice: GateChoice
    _engine: EngineAdapter | None

    def __init__(
        self, model: torch.nn.Module | list[torch.nn.Module],
        optimizer: torch.optim.Optimizer | None = None, *, scaler: Any = None,
        group: dist.ProcessGroup | None = None, registry: Any = None,
        env: dict[str, str] | None = None, replay: ReplayFn | bool | None = None,
        snapshots: tuple[Any, Any] | SnapshotStore | None = None, stages: Any = None,
        **overrides: Any,
    ) -> None:
        insides.require("torch")  # below the oldest release CI tests: our error, not torch's
        prepared.refuse_misprepared(optimizer)  # the framework helpers' refusals hold here too
        if isinstance(replay, bool):  # the config field (keyword > env), not a function
            overrides["replay"], replay = replay, None
        cfg = SentinelConfig.from_env(env, **overrides)
        environ = os.environ if env is None else env
        # What it watches and steps (a DeepSpeed engine brings its own optimizer).
        model = torch.nn.ModuleList(model) if isinstance(model, list | tuple) else model
        given = engines.Given(model, optimizer, scaler, group, replay, snapshots, stages)
        self._engine, optimizer, scaler = engines.steps_of(given, cfg, environ)
        wrapped = isinstance(model, DistributedDataParallel) or self._engine is not None
        inner = cast(torch.nn.Module, model.module) if wrapped else model
        self._watched = watched = Watched(model, inner, optimizer, scaler)
        # Where this rank runs, who it is, and the deadline on its collectives.
        pipelined = pipeline.stages_of(stages) if stages is not None else []
        self._ctx = ctx = self._context(cfg, watched, group, pipelined, environ)
        # The step in progress, its gradient path, the rare path, the judge, the end, the gate.
        loss_ratio = cfg.loss_spike_ratio or cfg.spike_ratio
        spikes = SpikeDetector(window=cfg.spike_window, warmup=cfg.spike_warmup,
                               ratio={"loss": loss_ratio, "grad_norm": cfg.spike_ratio},
                               zscore=cfg.spike_zscore)
        quarantine = Quarantine(ctx.device, size=cfg.quarantine_size,
                                steps=cfg.quarantine_steps)
        injector = Injector(parse_inject(cfg.inject) if cfg.inject else [], ctx.rank,
                            ctx.identity.hostname)
        self._current = CurrentStep(ctx, injector, quarantine, watched.module, spikes)
        self._gradients = engines.attach(model, self._current, staged=bool(pipelined))
        self._current.attach(self._gradients, pipelined)
        incidents = IncidentWriter(ctx)
        replayer = Detector.replayer_for(ctx, self._gradients, watched.module, replay)
        self._detector = Detector(ctx, self._gradients, incidents, replayer, quarantine)
        snaps = snapshot_store(snapshots, ctx, watched)
        replicas = replica_check(ctx, watched, self._gradients.caps,
                                 inject=functools.partial(injector.due, "bitflip"),
                                 incidents=incidents)
        if replicas is not None and isinstance(snaps, MemorySnapshots):
            replicas.before_write = snaps.copies.hold  # a repair waits for the copies
        stepping = Stepping(optimizer, scaler, self._current.buffers, snaps, replicas)
        self._judge = StepJudge(ctx, stepping, self._detector, spikes)
        self._end = stop.RunEnd(ctx, self._judge, getattr(self._gradients, "release", None))
        self._gate_choice = choose_gate(cfg, ctx.device, optimizer, scaler=scaler,
                                        caps=self._gradients.caps)
        self._gate = gated_steps(ctx, self._judge, self._gate_choice, rearm=self._rearm,
                                 stop_if=self._end.stop_if)
        if self._gate is not None:  # decided later: name from norms, hold no gradient
            self._gradients.keep_norms = True
            ctx.deadline.also_settled(self._gate.settled)
        self._serve(registry)

    @staticmethod
    def _context(cfg: SentinelConfig, watched: Watched, group: Any, pipelined: list[Any],
                 environ: Mapping[str, str]) -> Context:
        """Where this rank runs: its device, process group and identity (left at the store:
        nothing is gathered at start), and the deadline on its collectives."""
        model = watched.model
        if group is None and isinstance(model, DistributedDataParallel) and not pipelined:
            # under a pipeline: the whole job (the default group); a wrapper may name its own
            group = getattr(model, "sentinel_group", model.process_group)
        device = local_device(list(model.parameters()))
        exchange = HealthExchange(group, device, cfg.exchange_timeout)
        identity = identify(exchange.rank, exchange.world_size,
                            resolve_hostname(cfg.hostname, environ),
                            int(environ.get("LOCAL_RANK", "0") or 0), device)
        exchange.publish(identity)
        deadline = watchdog.StepDeadline(
            exchange, cfg.exchange_timeout, speak=identity.rank == 0,
            on_expire=functools.partial(stop.on_timeout, config=cfg, identity=identity,
                                        exchange=exchange))
        return Context(cfg, identity, exchange, device,
                       cfg.job_id or environ.get("TORCHELASTIC_RUN_ID"), deadline,
                       amp=watched.scaler is not None)

    def _serve(self, registry: Any) -> None:
        if not self.config.metrics_port:
            return
        from nansentinel.effects.metrics import serve_rank  # prometheus only where metrics are on

        metrics = serve_rank(self.identity, self.config, registry, self.device)
        self._judge.metrics = metrics
        self._detector.incidents.failed = metrics.observe_report_failure
        self._detector.suppressed = metrics.observe_suppressed_report

    # --- the calls of a training loop --------------------------------------------------------

    def check_batch(self, batch: Any, *, ids: Any = None) -> Any:
        """Check every floating-point tensor of ``batch`` (any nesting) before ``backward``;
        returns it. ``ids``: a sample id per row, read after a detection (the skip list)."""
        self._resolve()
        self._current.check_batch(batch, ids)
        return batch

    def check_loss(self, loss: torch.Tensor | float) -> None:
        """Check the loss (a tensor, a number; a non-scalar one element-wise) before
        ``backward``, so that its flag leaves with the gradients."""
        self._resolve()
        self._current.add_loss(loss)

    def wrap_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn`` checked, for a pipeline schedule (``loss_fn=sentinel.wrap_loss(fn)``)."""

        def add_loss(loss: Any) -> torch.Tensor:
            self._resolve()
            return self._current.add_loss(loss)

        return pipeline.wrap_loss(loss_fn, self._current.stages, add_loss,
                                  lambda: self._current.local, self.device)

    def check_grads(self) -> None:
        """Check the local gradients now and start the exchange: only if you reduce
        gradients by hand, after ``backward`` and *before* your all-reduce (DDP and FSDP2
        check them themselves; ``step()`` calls this when nothing did)."""
        self._resolve()
        self._current.require_open("check_grads")
        self._gradients.check_now()
        if not self._ctx.exchange.launched:  # DeepSpeed's path launches it before its all-reduce
            self._current.launch_exchange()

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
        self._resolve()
        if self._engine is not None and self._engine.accumulating(
                optimizer_step=optimizer_step, step=self.step_index):
            return None
        self._judge.caller_did_not_step()
        if not self._ctx.exchange.launched:
            self.check_grads()
        record = self._current.record
        if optimizer_step and self._gate is not None and self._gate.ready():
            _, vector = self._ctx.exchange.take()  # no host read: found_inf comes from it
            pending = self._gate.launch(record, vector, self._gradients.take_norms())
            self._current.next()
            if self._gate.deferred:
                return pending
            # The optimizer step is queued on the device: the host now waits for the end of
            # backward (the copy's event) while the GPU runs the optimizer, not the other way.
            self._gate.resolve()
            return pending.resolve()
        _, record.values = self._ctx.exchange.wait()  # waiting for the all-reduce beside it
        self._ctx.deadline.disarm()
        self._judge.decide(record, optimizer_step=optimizer_step)
        self._judge.finish(record)
        self._current.next()
        assert record.decision is not None
        self._end.stop_if(record.decision, record.decided)
        return record.decided

    # --- state for checkpoints, and the end ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step counter, policy history, spike references, cooldown and quarantine, to save
        with the checkpoint. Never runs a collective (it may be called on one rank): a step
        pending on the device gate that found something is decided later, and the history
        saved now is the one before it (its skip has happened on the device already)."""
        try:
            if self._gate is not None:
                self._gate.decide_if_local()
        except ResultPending:
            log.warning("nansentinel: state_dict() on rank %d while step %d's detection is "
                        "pending (decided at the next sentinel call on every rank); the saved "
                        "history is the one before it", self.rank, self.step_index - 1)
        return {"step": self.step_index, **self._judge.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self._current.restart_at(int(state["step"]))
        self._judge.load_state_dict(state, self.step_index)

    def close(self) -> None:
        """End the run on this rank; call it on every rank. Decides a step still pending,
        waits for every rank at one barrier (so that a finished job exits 0: torch 2.13's gloo
        aborts a process that tears its group down while a peer still uses it), leaves the
        launcher a ``closed`` verdict, and stops the exporter and the watchdog. A second call
        does nothing; after a loop that raised on this rank, :meth:`abandon` instead."""
        self._end.close(self._resolve, self.step_index - 1)

    def abandon(self) -> None:
        """Stop the exporter and the watchdog without a collective (the loop failed here)."""
        if self._gate is not None:
            self._gate.abandon()
        self._end.shut()

    def __enter__(self) -> Sentinel:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close() if exc_type is None else self.abandon()

    # --- what the loop may read ------------------------------------------------------------

    config = property(lambda self: self._ctx.config, doc="The validated config.")
    identity = property(lambda self: self._ctx.identity, doc="This rank: host, device, GPU.")
    rank = property(lambda self: self._ctx.rank, doc="This rank in the exchange's group.")
    world_size = property(lambda self: self._ctx.world_size,
                          doc="The ranks that decide together.")
    device = property(lambda self: self._ctx.device, doc="Where this rank computes.")
    job_id = property(lambda self: self._ctx.job_id, doc="The job's id, in file names.")
    exchange = property(lambda self: self._ctx.exchange, doc="The step's health exchange.")
    model = property(lambda self: self._watched.model, doc="The model as handed in.")
    module = property(lambda self: self._watched.module,
                      doc="The module inside it (DDP's, the engine's).")
    step_index = property(lambda self: self._current.index, doc="The step in progress.")
    local = property(lambda self: self._current.local, doc="This step's health so far.")
    stages = property(lambda self: self._current.stages, doc="The pipeline stages watched.")
    forward = property(lambda self: self._current.forward,
                       doc="This step's forward collectives, counted (origins).")
    buffers = property(lambda self: self._current.buffers,
                       doc="The floating buffers a skipped step puts back.")
    gradients = property(lambda self: self._gradients,
                         doc="The gradient path; its ``caps`` say what it supports.")
    device_gate = property(lambda self: self._gate,
                           doc="The device gate's steps; None: the host gate.")
    gate = property(lambda self: self._gate_choice,
                    doc="The gate this run took and why (step/gate.GateChoice).")
    engine = property(lambda self: self._engine,
                      doc="A DeepSpeed engine's adapter; None for any other model.")
    optimizer = property(lambda self: self._judge.optimizer, doc="What a step applies with.")
    scaler = property(lambda self: self._judge.scaler, doc="Its loss scale, if any.")
    history = property(lambda self: self._judge.history, doc="The policy's history.")
    cooldown = property(lambda self: self._judge.cooldown, doc="The rollback LR cooldown.")
    lr_guard = property(lambda self: self._judge.lr, doc="The learning-rate rules; "
                        "lr_guard.reset() takes a deliberate LR change (docs/recovery.md).")
    spikes = property(lambda self: self._judge.spikes, doc="The spike references.")
    snapshots = property(lambda self: self._judge.snapshots, doc="The last good state.")
    replicas = property(lambda self: self._judge.replicas,
                        doc="The replica fingerprint check; None: none.")
    curves = property(lambda self: self._detector.curves,
                      doc="The last steps' loss and gradient norm (reports).")
    replays = property(lambda self: self._detector.replay is not None,
                       doc="A detection is replayed (a function given, the path allows it).")
    quarantine = property(lambda self: self._detector.quarantine,
                          doc="Batches a data verdict blamed.")
    watchdog = property(lambda self: self._ctx.deadline.dog,
                        doc="The deadline's watchdog; None alone.")
    metrics = property(lambda self: self._judge.metrics,
                       lambda self, value: setattr(self._judge, "metrics", value),
                       doc="The exporter (metrics.py); None without ``metrics_port``, or once "
                           "closed. Settable: a test or a host process may attach its own.")

    # --- internals ---------------------------------------------------------------------------

    def _resolve(self) -> None:
        """Decide a step pending on the device gate (at a call every rank makes)."""
        if self._gate is not None:
            self._gate.resolve()

    def _rearm(self) -> None:
        """A step decided inside the next step's armed collectives re-arms the watchdog."""
        if self._ctx.exchange.launched:
            self._ctx.deadline.arm()


