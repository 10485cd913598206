"""Build the parts, then run the loop: one assembly of everything a Sentinel calls.

:func:`assemble` builds, from the user's objects and one :class:`SentinelConfig`, one frozen
:class:`Parts`: where the rank runs (its context), what it watches and steps, the step in
progress, the gradient path (and an engine's own step, adapted, where it steps its own
optimizer), the rare path, the judge, the end, the gate, and an ordered tuple of agreement
scopes: the ranks' exchange first (the one every step decides with), then any wider scope an
integration adds (torchft's replica groups: step/group_scope.py). The Sentinel
(sentinel.py) is the loop's calls over these parts; an integration adds a part (a
:class:`Scope`), it does not subclass the Sentinel.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from nansentinel import engines
from nansentinel.checks import pipeline
from nansentinel.checks.health import identify, local_device
from nansentinel.checks.quarantine import Quarantine
from nansentinel.checks.state import constant_buffers
from nansentinel.common import doors
from nansentinel.common import torch_insides as insides
from nansentinel.common.inject import Injector, parse_inject
from nansentinel.config import SentinelConfig, resolve_hostname
from nansentinel.decide.spikes import SpikeDetector
from nansentinel.effects import stop
from nansentinel.effects.recovery import (
    MemorySnapshots,
    SnapshotRing,
    SnapshotStore,
    snapshot_store,
)
from nansentinel.rare.detection import Detector
from nansentinel.rare.incident import IncidentWriter
from nansentinel.rare.replay import ReplayFn
from nansentinel.rare.replicas import replica_check
from nansentinel.rare.state import StateCheck
from nansentinel.result import ArgumentTypeError, NonFiniteError, StepResult
from nansentinel.step import prepared, usage
from nansentinel.step.current import CurrentStep
from nansentinel.step.gate import GateChoice, GatedSteps, choose_gate, gated_steps
from nansentinel.step.judge import StepJudge, Stepping
from nansentinel.wire import watchdog
from nansentinel.wire.context import Context, Watched
from nansentinel.wire.exchange import HealthExchange

if TYPE_CHECKING:
    import torch.distributed as dist

    from nansentinel.engines.deepspeed_step import EngineAdapter


class Scope(Protocol):
    """An agreement wider than the ranks' exchange, added by an integration (torchft's replica
    groups). Its calls, in the order the Sentinel makes them:

    - :meth:`configure`, before anything is built: the run's config as this scope needs it (or
      a refusal, with nothing started);
    - :meth:`bind`, once the parts are built: what it reads of them;
    - each ``step()``: :meth:`begin`, then the ranks' own decision (the optimizer not stepped),
      then :meth:`agree`, which decides the step across the scope (and steps the optimizer);
    - :meth:`leave`, before the error of a step that stops the run is raised."""

    def configure(self, config: SentinelConfig, environ: Mapping[str, str]) -> SentinelConfig:
        """The config the parts are built with (``config`` as the user's keywords, the
        environment and the defaults made it); raises to refuse what the scope cannot do."""

    def bind(self, parts: Parts) -> None:
        """The parts are built: keep what the scope reads of them."""

    def begin(self) -> None:
        """A step begins (before the ranks decide it)."""

    def agree(self, local: StepResult, stopping: NonFiniteError | None, *,
              optimizer_step: bool) -> tuple[StepResult, NonFiniteError | None]:
        """The step as the scope decides it, from the ranks' own ``local`` decision (and the
        error the ranks stop with, if any): the result, and the error to raise (None: go on).
        Steps the optimizer where the scope applies the step and ``optimizer_step`` asks."""

    def leave(self, metrics: Any) -> None:
        """The run stops here on this rank (the error is raised next): leave the scope."""


@dataclasses.dataclass(frozen=True, slots=True)
class Parts:
    """Everything a Sentinel calls, built once by :func:`assemble` (frozen: no part is swapped
    after construction)."""

    ctx: Context
    """Where this rank runs: config, identity, the ranks' exchange, device, deadline."""
    watched: Watched
    """The model as handed in, the module inside it, the optimizer and scaler stepped."""
    current: CurrentStep
    """The step in progress (the gradient path's sink)."""
    gradients: engines.GradPath
    """The gradient path: where the local gradients are checked before their reduction."""
    engine: EngineAdapter | None
    """The step of an engine that steps its own optimizer, adapted (DeepSpeed's: where its
    ``step()`` meets the sentinel's); None: the sentinel steps the optimizer it was given.
    The gradient path's own seam (where it checks: DDP's end of backward or comm hook,
    FSDP2's reduce-scatter, DeepSpeed's bucket reduction) is the path's (``gradients``)."""
    detector: Detector
    """The rare path: naming, replay, incident reports."""
    judge: StepJudge
    """Decides a step from the totals and acts on it."""
    end: stop.RunEnd
    """How the run ends on this rank (close, abandon, a stop)."""
    gate: GateChoice
    """The gate this run took and why."""
    device_gate: GatedSteps | None
    """The device gate's steps (decided on the device, read later); None: the host gate."""
    scopes: tuple[Any, ...]
    """The agreement scopes, in order: the ranks' exchange (``ctx.exchange``), then the
    :class:`Scope` each integration added."""
    usage: usage.Usage
    """The order of the loop's calls (live until close, a backward before each step)."""

    @property
    def wider(self) -> tuple[Scope, ...]:
        """The scopes beyond the ranks' exchange."""
        return cast(tuple[Scope, ...], self.scopes[1:])


@dataclasses.dataclass(frozen=True, slots=True)
class Asked:
    """What the user handed the Sentinel, beside the model and config (as given)."""

    optimizer: torch.optim.Optimizer | None = None
    scaler: Any = None
    group: dist.ProcessGroup | None = None
    replay: ReplayFn | None = None
    snapshots: tuple[Any, Any] | SnapshotStore | None = None
    stages: Any = None
    scopes: Sequence[Scope] = ()


def configure(env: Mapping[str, str] | None, scopes: Sequence[Scope],
              overrides: dict[str, Any]) -> tuple[SentinelConfig, Mapping[str, str]]:
    """The run's config (keyword > env > default, then each scope's), and where the rest of
    ``NANSENTINEL_*``-free settings (``LOCAL_RANK``, the run id) are read."""
    cfg = SentinelConfig.from_env(env, **overrides)
    environ = os.environ if env is None else env
    for scope in scopes:
        cfg = scope.configure(cfg, environ)
    return cfg, environ


def assemble(model: torch.nn.Module | list[torch.nn.Module], asked: Asked,
             cfg: SentinelConfig, environ: Mapping[str, str],
             rearm: Callable[[], None]) -> Parts:
    """Every part of one rank's sentinel, built top to bottom (see the module docstring).
    ``rearm`` is the Sentinel's: the device gate re-arms the watchdog through it when it
    decides a step inside the next step's collectives."""
    insides.require("torch")  # below the oldest release CI tests: our error, not torch's
    prepared.refuse_misprepared(asked.optimizer)  # the framework helpers' refusals hold here
    # What it watches and steps (a DeepSpeed engine brings its own optimizer).
    model = torch.nn.ModuleList(model) if isinstance(model, list | tuple) else model
    given = engines.Given(model, asked.optimizer, asked.scaler, asked.group, asked.replay,
                          asked.snapshots, asked.stages)
    engine, optimizer, scaler = engines.steps_of(given, cfg, environ)
    wrapped = engines.recognize(model).CAPS.wraps
    inner = cast(torch.nn.Module, model.module) if wrapped else model
    watched = Watched(model, inner, optimizer, scaler)
    # Where this rank runs, who it is, and the deadline on its collectives.
    pipelined = pipeline.stages_of(asked.stages) if asked.stages is not None else []
    ctx = context(cfg, watched, asked.group, pipelined, environ)
    # The step in progress, its gradient path, the rare path, the judge, the end, the gate.
    loss_ratio = cfg.loss_spike_ratio or cfg.spike_ratio
    spikes = SpikeDetector(window=cfg.spike_window, warmup=cfg.spike_warmup,
                           ratio={"loss": loss_ratio, "grad_norm": cfg.spike_ratio},
                           zscore=cfg.spike_zscore)
    quarantine = Quarantine(ctx.device, size=cfg.quarantine_size, steps=cfg.quarantine_steps)
    injector = Injector(parse_inject(cfg.inject) if cfg.inject else [], ctx.rank,
                        ctx.identity.hostname)
    current = CurrentStep(ctx, injector, quarantine, watched.module, spikes)
    current.optimizer = optimizer  # its hyperparameters travel with each row (checks/state.py)
    current.constants = constant_buffers(watched.module)  # a -inf attention mask is no fault
    gradients = engines.attach(model, current, staged=bool(pipelined))
    # Installed on the model from here: a refusal below gives it back as it was (the
    # user may fix the setting and build a Sentinel on the same model).
    undo = [getattr(gradients, "release", None)]
    try:
        current.attach(gradients, pipelined)
        incidents = IncidentWriter(ctx)
        replayer = Detector.replayer_for(ctx, gradients, watched.module, asked.replay)
        detector = Detector(ctx, gradients, incidents, replayer, quarantine)
        snaps = snapshot_store(asked.snapshots, ctx, watched, gradients.caps)
        replicas = replica_check(ctx, watched, gradients.caps,
                                 inject=functools.partial(injector.due, "bitflip"),
                                 incidents=incidents)
        state = StateCheck(ctx, watched, gradients.caps, constants=current.constants)
        if isinstance(snaps, MemorySnapshots | SnapshotRing):  # a repair waits for the copies
            state.before_write = snaps.copies.hold
            if replicas is not None:
                replicas.before_write = snaps.copies.hold
        stepping = Stepping(optimizer, scaler, current.buffers, snaps, replicas, state)
        judge = StepJudge(ctx, stepping, detector, spikes)
        end: stop.RunEnd  # the usage reads whether it closed; it removes the usage's hooks
        use = usage.Usage(watched.module, gradients.caps, lambda: end.closed)
        undo.append(use.release)
        end = stop.RunEnd(ctx, judge, usage.chained(*undo))
        if ctx.exchange.world_size > 1:
            failed = functools.partial(stop.end_failed, config=ctx.config,
                                       identity=ctx.identity, exchange=ctx.exchange)
            stop.exit_on_failure(ctx.exchange, lambda: ctx.deadline.step, failed,
                                 lambda: end.clean)
        gate = choose_gate(cfg, ctx.device, optimizer, scaler=scaler, caps=gradients.caps)
        device_gate = gated_steps(ctx, judge, gate, rearm=rearm, stop_if=end.stop_if)
        if device_gate is not None:  # decided later: name from norms, hold no gradient
            gradients.keep_norms = True
            ctx.deadline.also_settled(device_gate.settled)
        # What the model holds is read once now: a NaN restored with it stops every rank here.
        stop.refuse_state(ctx, state, "at construction", current.index)
        return Parts(ctx, watched, current, gradients, engine, detector, judge, end, gate,
                     device_gate, (ctx.exchange, *asked.scopes), use)
    except BaseException:
        usage.chained(*undo)()
        raise


def context(cfg: SentinelConfig, watched: Watched, group: Any, pipelined: list[Any],
            environ: Mapping[str, str]) -> Context:
    """Where this rank runs: its device, process group and identity (left at the store:
    nothing is gathered at start), and the deadline on its collectives."""
    model = watched.model
    if group is None and not pipelined:
        # under a pipeline: the whole job (the default group); a wrapper may name its own
        group = engines.exchange_group(model)
    device = local_device(list(model.parameters()))
    exchange = HealthExchange(group, device, cfg.exchange_timeout)
    identity = identify(exchange.rank, exchange.world_size,
                        resolve_hostname(cfg.hostname, environ),
                        int(environ.get("LOCAL_RANK", "0") or 0), device)
    exchange.publish(identity)
    # Whichever path raises a diagnosis, the launcher finds this rank's verdict first.
    exchange.on_diagnosed = functools.partial(stop.leave_timeout_verdict, config=cfg,
                                              identity=identity)
    # A rank a signal asked to stop does not wait for the naming of peers that are gone.
    exchange.before_diagnosis = functools.partial(stop.end_if_asked, config=cfg,
                                                  identity=identity)
    deadline = watchdog.StepDeadline(
        exchange, cfg.exchange_timeout, speak=identity.rank == 0,
        on_expire=functools.partial(stop.on_timeout, config=cfg, identity=identity,
                                    exchange=exchange))
    return Context(cfg, identity, exchange, device,
                   cfg.job_id or environ.get("TORCHELASTIC_RUN_ID"), deadline,
                   amp=watched.scaler is not None)


def serve(parts: Parts, registry: Any) -> None:
    """The metrics exporter, where ``metrics_port`` is set (prometheus imported only then)."""
    config = parts.ctx.config
    if not config.metrics_port:
        return
    from nansentinel.effects.metrics import serve_rank

    metrics = serve_rank(parts.ctx.identity, config, registry, parts.ctx.device)
    parts.judge.metrics = metrics
    parts.detector.incidents.failed = metrics.observe_report_failure
    parts.detector.suppressed = metrics.observe_suppressed_report


def restore(parts: Parts, state: Any) -> None:
    """``Sentinel.load_state_dict``: the step counter and the judge's state from ``state``, or
    an :class:`ArgumentTypeError` naming what was wrong with everything as it was."""
    step = state.get("step") if isinstance(state, Mapping) else None
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**62:
        raise ArgumentTypeError(
            "nansentinel: load_state_dict(state) needs what Sentinel.state_dict() saved, a "
            f"dict with a whole 'step' of 0 or more; got {doors.given(state)}"
            + (f" whose 'step' is {doors.given(step)}" if isinstance(state, Mapping) else ""))
    judge, current = parts.judge, parts.current
    before, at = judge.state_dict(), current.index
    try:
        current.restart_at(step)
        judge.load_state_dict(dict(state), current.index)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError,
            OverflowError) as exc:
        current.restart_at(at)
        judge.load_state_dict(before, at)
        what = f"no key {exc}" if isinstance(exc, KeyError) else str(exc)[:200]
        raise ArgumentTypeError(
            "nansentinel: load_state_dict(state) needs what Sentinel.state_dict() saved; "
            f"this state does not load ({type(exc).__name__}: {what}); the sentinel keeps "
            "the state it had") from None
