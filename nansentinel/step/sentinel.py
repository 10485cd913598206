"""The Sentinel: the one path of a step, as the training loop calls it.

::

    check_batch ─┐
    check_loss ──┤ this rank's flags, kept on the device (current.py, local.py, checks.py)
    backward ────┤ the gradient path (gradpaths/): each DDP bucket or FSDP group checked
                 │ before its reduction; the health exchange leaves with the last one
    step() ──────┘ the totals (exchange.py: the one host sync) → judge.py: [flagged: name
                   them, detection.py] → decide (policy.py) → act; on the device gate the
                   optimizer steps at once and the host decides at the next call (gate.py)

Each layer builds and wires itself; this class composes them (docs/design.md).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from nansentinel import engines
from nansentinel.checks import pipeline
from nansentinel.checks.health import identify, local_device
from nansentinel.checks.quarantine import Quarantine
from nansentinel.common.inject import Injector, parse_inject
from nansentinel.config import SentinelConfig, resolve_hostname
from nansentinel.effects import stop
from nansentinel.effects.recovery import SnapshotStore, snapshot_store
from nansentinel.engines.deepspeed_step import steps_of
from nansentinel.rare import incident
from nansentinel.rare.detection import Detector
from nansentinel.rare.replay import ReplayFn
from nansentinel.rare.replicas import replica_check
from nansentinel.result import ResultPending, StepResult
from nansentinel.step.current import CurrentStep
from nansentinel.step.gate import gated_steps
from nansentinel.step.judge import StepJudge
from nansentinel.wire import watchdog
from nansentinel.wire.exchange import HealthExchange

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("nansentinel")


class Sentinel:
    """Watches one rank's batch, loss and gradients; decides each step with every other rank.

    Args:
        model: plain, ``DistributedDataParallel``, an FSDP2 root (1-D, HSDP) or a DeepSpeed
            engine (ZeRO 0-3: its optimizer, deepspeed.py); with ``stages`` the list of a
            pipeline rank's stage modules. Construct the sentinel before the first backward.
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
    """

    def __init__(
        self, model: torch.nn.Module | list[torch.nn.Module],
        optimizer: torch.optim.Optimizer | None = None, *, scaler: Any = None,
        group: dist.ProcessGroup | None = None, registry: Any = None,
        env: dict[str, str] | None = None, replay: ReplayFn | bool | None = None,
        snapshots: tuple[Any, Any] | SnapshotStore | None = None, stages: Any = None,
        **overrides: Any,
    ) -> None:
        if isinstance(replay, bool):  # the config field (keyword > env), not a function
            overrides["replay"], replay = replay, None
        self.config = cfg = SentinelConfig.from_env(env, **overrides)
        pipelined = pipeline.stages_of(stages) if stages is not None else []
        self._place(model, optimizer, scaler, group, pipelined, os.environ if env is None else env,
                    replay=replay, snapshots=snapshots, stages=stages)
        peers, model, opt, scaler = self.exchange.peers, self.model, self.optimizer, self.scaler
        self.snapshots = snapshot_store(
            snapshots, cfg, model=model, module=self.module, optimizer=opt, scaler=scaler,
            peers=peers, device=self.device, hostname=self.identity.hostname)
        self.quarantine = Quarantine(self.device, size=cfg.quarantine_size,
                                     steps=cfg.quarantine_steps)
        self.current = CurrentStep(
            device=self.device, rank=self.rank, exchange=self.exchange, injector=self.injector,
            quarantine=self.quarantine, module=self.module, deadline=self.deadline,
            thresholds=lambda: self.judge.thresholds(), amp=scaler is not None, policy=cfg.policy)
        self.gradients: engines.GradPath = engines.attach(model, self.current)
        self.current.attach(self.gradients, pipelined)
        self.incidents = incident.IncidentWriter(cfg, self.identity, peers, self.job_id)
        self.detector = Detector.for_run(
            cfg, peers, self.identity, gradients=self.gradients, incidents=self.incidents,
            module=self.module, amp=scaler is not None, replay=replay,
            guarded=self.deadline.guarded)
        self.replicas = replica_check(
            model, self.module, opt, path=self.gradients.name, config=cfg, peers=peers,
            device=self.device, identity=self.identity, pipelined=bool(pipelined),
            inject=lambda step: self.injector.due("bitflip", step), incidents=self.incidents)
        self.judge = StepJudge(
            cfg, world_size=self.world_size, rank=self.rank, device=self.device,
            optimizer=opt, scaler=scaler, detector=self.detector, snapshots=self.snapshots,
            buffers=self.current.buffers, replicas=self.replicas, quarantine=self.quarantine,
            guarded=self.deadline.guarded)
        self.end = stop.RunEnd(cfg, self.identity, self.exchange, self.job_id,
                               deadline=self.deadline, judge=self.judge,
                               release=getattr(self.gradients, "release", None))
        #: The device gate's steps (gate.py); None: the host gate.
        self.device_gate = gated_steps(
            cfg, opt, self.device, scaler=scaler, path=self.gradients.name,
            pipelined=bool(pipelined), speak=self.rank == 0, judge=self.judge,
            buffers=self.current.buffers, params=self._params, guarded=self.deadline.guarded,
            rearm=self._rearm, stop_if=self.end.stop_if)
        self._serve(registry)

    def _place(self, model: Any, optimizer: Any, scaler: Any, group: Any, pipelined: list[Any],
               environ: Any, **engine_args: Any) -> None:
        """Where this rank runs: what it steps (a DeepSpeed engine's own optimizer), its model
        (and the module inside DDP or the engine), device, process group and identity (left at
        the store: nothing is gathered at start), its drills, the deadline on its
        collectives."""
        cfg = self.config
        #: A DeepSpeed engine's adapter (its optimizer, loss scale, micro-batches); else None.
        self.engine, optimizer, scaler = steps_of(model, optimizer, cfg, environ, scaler=scaler,
                                                  group=group, **engine_args)
        self.model = model = torch.nn.ModuleList(model) if isinstance(model, list | tuple) \
            else model
        self.optimizer, self.scaler = optimizer, scaler
        ddp = isinstance(model, DistributedDataParallel)
        self.module = model.module if ddp or self.engine is not None else model
        if group is None and ddp and not pipelined:
            group = model.process_group  # under a pipeline: the whole job (the default group)
        self._params = list(model.parameters())
        self.device = local_device(self._params)
        self.exchange = HealthExchange(group, self.device, cfg.exchange_timeout)
        self.rank, self.world_size = self.exchange.rank, self.exchange.world_size
        self.identity = identify(self.rank, self.world_size,
                                 resolve_hostname(cfg.hostname, environ),
                                 int(environ.get("LOCAL_RANK", "0") or 0), self.device)
        self.exchange.publish(self.identity)
        self.job_id = cfg.job_id or environ.get("TORCHELASTIC_RUN_ID")
        self.injector = Injector(parse_inject(cfg.inject) if cfg.inject else [], self.rank,
                                 self.identity.hostname)
        self.deadline = watchdog.StepDeadline(
            self.exchange, cfg.exchange_timeout, step=lambda: self.step_index,
            settled=self._settled, speak=self.rank == 0,
            on_expire=functools.partial(stop.on_timeout, config=cfg, identity=self.identity,
                                        exchange=self.exchange))

    def _serve(self, registry: Any) -> None:
        if not self.config.metrics_port:
            return
        from nansentinel.effects.metrics import serve_rank  # prometheus only where metrics are on

        self.metrics = serve_rank(self.identity, self.config, registry, self.device)
        self.incidents.failed = self.metrics.observe_report_failure
        self.detector.suppressed = self.metrics.observe_suppressed_report

    # --- the calls of a training loop --------------------------------------------------------

    def check_batch(self, batch: Any, *, ids: Any = None) -> Any:
        """Check every floating-point tensor of ``batch`` (any nesting) before ``backward``;
        returns it. ``ids``: a sample id per row, read after a detection (the skip list)."""
        self._resolve()
        self.current.check_batch(batch, ids)
        return batch

    def check_loss(self, loss: torch.Tensor | float) -> None:
        """Check the loss (a tensor, a number; a non-scalar one element-wise) before
        ``backward``, so that its flag leaves with the gradients."""
        self._resolve()
        self.current.add_loss(loss)

    def wrap_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn`` checked, for a pipeline schedule (``loss_fn=sentinel.wrap_loss(fn)``)."""

        def add_loss(loss: Any) -> torch.Tensor:
            self._resolve()
            return self.current.add_loss(loss)

        return pipeline.wrap_loss(loss_fn, self.current.stages, add_loss,
                                  lambda: self.current.local, self.device)

    def check_grads(self) -> None:
        """Check the local gradients now and start the exchange: only if you reduce
        gradients by hand, after ``backward`` and *before* your all-reduce (DDP and FSDP2
        check them themselves; ``step()`` calls this when nothing did)."""
        self._resolve()
        self.current.require_open("check_grads")
        self.gradients.check_now()
        if not self.exchange.launched:  # DeepSpeed's path launches it before its all-reduce
            self.current.launch_exchange()

    def step(self, *, optimizer_step: bool = True) -> StepResult | None:
        """Decide this step with every rank and act: the optimizer (or GradScaler) steps only
        when every rank is healthy; otherwise every rank skips, rolls back, or raises
        :class:`NonFiniteError` (:class:`HostExcludedError`). ``optimizer_step=False``: the
        caller (a framework) steps the optimizer itself right after; on a skip the gradients
        are then ``None``. On the device gate a :class:`~nansentinel.step.gate.PendingResult` comes
        back, decided at the next sentinel call (or on a read that needs no collective). With
        a DeepSpeed engine it replaces ``engine.step()``, and returns None on a micro-batch
        before the accumulation boundary (counted, decided at the boundary)."""
        self._resolve()
        if self.engine is not None and self.engine.accumulating(
                optimizer_step=optimizer_step, step=self.step_index):
            return None
        self.judge.caller_did_not_step()
        if not self.exchange.launched:
            self.check_grads()
        local = self.current.local
        if optimizer_step and self.device_gate is not None and self.device_gate.ready():
            step, vector = self.exchange.take()
            pending: Any = self.device_gate.launch(step, vector, local)
            self.current.next()
            return pending
        step, values = self.exchange.wait()  # waiting for the all-reduce beside it: not ours
        self.deadline.disarm()
        result, decision, tail = self.judge.judge(step, values, local,
                                                  optimizer_step=optimizer_step)
        result, decision = tail(result, decision)
        self.current.next()
        self.end.stop_if(decision, result)
        return result

    # --- state for checkpoints, and the end ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step counter, policy history, spike references, cooldown and quarantine, to save
        with the checkpoint. Never runs a collective (it may be called on one rank): a step
        pending on the device gate that found something is decided later, and the history
        saved now is the one before it (its skip has happened on the device already)."""
        try:
            if self.device_gate is not None:
                self.device_gate.decide_if_local()
        except ResultPending:
            log.warning("nansentinel: state_dict() on rank %d while step %d's detection is "
                        "pending (decided at the next sentinel call on every rank); the saved "
                        "history is the one before it", self.rank, self.step_index - 1)
        return {"step": self.step_index, **self.judge.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.current.index = int(state["step"])
        self.judge.load_state_dict(state, self.step_index)

    def close(self) -> None:
        """End the run on this rank; call it on every rank. Decides a step still pending,
        waits for every rank at one barrier (so that a finished job exits 0: torch 2.13's gloo
        aborts a process that tears its group down while a peer still uses it), leaves the
        launcher a ``closed`` verdict, and stops the exporter and the watchdog. A second call
        does nothing; after a loop that raised on this rank, :meth:`abandon` instead."""
        self.end.close(self._resolve, self.step_index - 1)

    def abandon(self) -> None:
        """Stop the exporter and the watchdog without a collective (the loop failed here)."""
        if self.device_gate is not None:
            self.device_gate.abandon()
        self.end.shut()

    def __enter__(self) -> Sentinel:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.close() if exc_type is None else self.abandon()

    # --- the layers' state, read here as before ------------------------------------------------

    step_index = property(lambda self: self.current.index)
    local = property(lambda self: self.current.local)
    stages = property(lambda self: self.current.stages)
    forward = property(lambda self: self.current.forward)
    history = property(lambda self: self.judge.history)
    cooldown = property(lambda self: self.judge.cooldown)
    spikes = property(lambda self: self.judge.spikes)
    curves = property(lambda self: self.judge.curves)
    watchdog = property(lambda self: self.deadline.dog)
    buffers = property(lambda self: self.current.buffers)

    #: The exporter (metrics.py); None without ``metrics_port``, or once closed.
    metrics = property(lambda self: self.judge.metrics,
                       lambda self, value: setattr(self.judge, "metrics", value))

    # --- internals ---------------------------------------------------------------------------

    def _resolve(self) -> None:
        """Decide a step pending on the device gate (at a call every rank makes)."""
        if self.device_gate is not None:
            self.device_gate.resolve()

    def _rearm(self) -> None:
        """A step decided inside the next step's armed collectives re-arms the watchdog."""
        if self.exchange.launched:
            self.deadline.arm()

    def _settled(self) -> bool:
        """The armed collectives have completed (the watchdog asks before it fires)."""
        gated = self.device_gate
        return self.exchange.settled() or (gated is not None and gated.settled())

