"""The Sentinel: the one path of a step, composed from the layers.

::

    check_batch ─┐
    check_loss ──┤ local flags, kept on the device
    backward ────┤ the gradient path (gradpaths/, chosen once): each DDP bucket or FSDP group
                 │ is checked before its reduction; the health exchange leaves with the last
                 │ DDP bucket, or at step() (FSDP, local gradients)
    step() ──────┘ wait for the totals (the one host sync) → [flagged: name them] → decide → act

Everything expensive (naming ranks and parameters, the replay, saving the batch, writing the
report) runs only after a detection, in detection.py; the healthy step pays for a few fused
reductions and one fixed-size collective that travels beside the gradients.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nansentinel import checks, gradpaths, incident, pipeline, skip_list, stop
from nansentinel.collectives import ForwardCollectives, Peers
from nansentinel.config import SentinelConfig, resolve_hostname
from nansentinel.curves import Curves
from nansentinel.deepspeed import adapt as adapt_engine
from nansentinel.detection import Detector
from nansentinel.exchange import HealthExchange, late_after
from nansentinel.gate import DeviceGate, Pending, PendingResult, device_gate_refusal, held_grads
from nansentinel.inject import Injector, parse_inject
from nansentinel.local import LocalHealth, to_device
from nansentinel.policy import ROLLBACK, Decision, History, blamed, decide
from nansentinel.quarantine import Quarantine
from nansentinel.recovery import Cooldown, MemorySnapshots, SnapshotStore, UserSnapshots
from nansentinel.replay import ReplayFn
from nansentinel.replicas import ReplicaCheck, replica_check
from nansentinel.result import (
    RankIdentity,
    ResultPending,
    SentinelUsageError,
    StepResult,
)
from nansentinel.scaling import record_skip
from nansentinel.spikes import SpikeDetector, Spikes
from nansentinel.view import ClusterView, OwnRow, Totals, pack
from nansentinel.watchdog import TimeoutFit, Watchdog, watchdog_deadline

log = logging.getLogger("nansentinel")


class Sentinel:
    """Watches one rank's batch, loss and gradients; decides each step with every other rank.

    Args:
        model: the module being trained: plain, wrapped in ``DistributedDataParallel``, or an
            FSDP2 (``fully_shard``) root module, 1-D or HSDP. With DDP a communication hook is
            registered, with FSDP2 a custom reduce-scatter on every FSDP module (construct the
            sentinel before the first backward, and register no other comm hook / custom
            reduce-scatter). Or a ``deepspeed.DeepSpeedEngine`` (ZeRO 0-3, nansentinel/
            deepspeed.py): its optimizer and loss scale are the engine's, and :meth:`step`
            drives ``engine.step()``.
        optimizer: stepped by :meth:`step` only when every rank is healthy (none for a
            DeepSpeed engine).
        scaler: a ``torch.amp.GradScaler``; :meth:`step` then calls ``scaler.step`` and
            ``scaler.update``, and non-finite gradients alone count as fp16 overflow.
        group: the process group (default: DDP's, else the default group if initialised,
            else none: one process).
        registry: a ``prometheus_client.CollectorRegistry`` for the metrics (tests inject one).
        replay: ``fn(module, batch) -> loss``, the forward and loss of one step on the
            unwrapped module; with it, a detection is replayed to tell data, host and
            transient faults apart and to find the first non-finite module and parameter.
            Every rank replays in lockstep, so collectives inside ``fn`` pair up. Off under
            FSDP2 (its backward would reduce-scatter through the gradient path being judged).
        snapshots: ``(save, load)`` — the user's own checkpoint pair for rollbacks
            (``save(step)``; ``load() -> step``) — or a ``SnapshotStore``; default: host memory.
        stages: this rank's ``torch.distributed.pipelining`` ``PipelineStage`` (or a list of
            them, for an interleaved schedule; ``model`` is then the list of their modules, in
            any wrapping the gradient path accepts, e.g. each ``fully_shard``-ed). Each stage's
            boundaries are checked (pipeline.py), so the rank where a NaN began is named alone
            and the ranks it reached go to ``StepResult.reached``; hand the schedule
            :meth:`wrap_loss`. The exchange then spans the whole job (the default group), so
            every rank of every stage takes the same decision.
        env: environment to read ``NANSENTINEL_*`` from (default ``os.environ``).
        **overrides: fields of :class:`SentinelConfig`; keyword > env > default.
    """

    def __init__(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scaler: Any = None,
        group: dist.ProcessGroup | None = None,
        registry: Any = None,
        env: dict[str, str] | None = None,
        replay: ReplayFn | None = None,
        snapshots: tuple[Any, Any] | SnapshotStore | None = None,
        stages: Any = None,
        **overrides: Any,
    ) -> None:
        self.config = cfg = SentinelConfig.from_env(env, **overrides)
        #: A DeepSpeed engine's optimizer, loss scale and micro-batches (deepspeed.py); None.
        self.engine = adapt_engine(model, optimizer, cfg, os.environ if env is None else env,
                                   scaler=scaler, group=group, replay=replay,
                                   snapshots=snapshots, stages=stages)
        if self.engine is not None:
            optimizer, scaler = self.engine.optimizer, self.engine.scaler
        elif optimizer is None:
            raise SentinelUsageError("nansentinel: Sentinel(model, optimizer) needs the optimizer "
                                     "(only a DeepSpeed engine brings its own)")
        if isinstance(model, list | tuple):  # a pipeline rank's model parts
            model = torch.nn.ModuleList(model)
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        is_ddp = isinstance(model, DistributedDataParallel)
        pipelined = pipeline.stages_of(stages) if stages is not None else []
        if group is None and is_ddp and not pipelined:
            group = model.process_group  # under a pipeline: the whole job (the default group)
        params = list(model.parameters())
        self.device = _local_device(params[0]) if params else torch.device("cpu")
        self.exchange = HealthExchange(group, self.device, cfg.exchange_timeout)
        self.rank = self.exchange.rank
        self.world_size = self.exchange.world_size
        environ = os.environ if env is None else env
        self.identity = _identity(
            self.rank, self.world_size, resolve_hostname(cfg.hostname, environ),
            int(environ.get("LOCAL_RANK", "0") or 0), self.device,
        )
        # Nothing is gathered at start: a detection names the flagged ranks when it happens,
        # and a failed collective reads the missing ranks' identities from the store.
        self.exchange.publish(self.identity)
        self.job_id = cfg.job_id or environ.get("TORCHELASTIC_RUN_ID")
        faults = parse_inject(cfg.inject) if cfg.inject else []
        self.injector = Injector(faults, self.rank, self.identity.hostname)
        self.history = History()
        self.step_index = 0
        self.module = model.module if is_ddp or self.engine is not None else model
        self.spikes = SpikeDetector(
            window=cfg.spike_window, warmup=cfg.spike_warmup, ratio=cfg.spike_ratio,
            zscore=cfg.spike_zscore,
        )
        self._thresholds = to_device(self.spikes.thresholds(), self.device)
        self._thresholds_version = self.spikes.version
        self.snapshots: SnapshotStore | None
        if isinstance(snapshots, tuple):
            self.snapshots = UserSnapshots(*snapshots)
        elif snapshots is not None:
            self.snapshots = snapshots
        elif "rollback" in (cfg.policy, cfg.loss_spike_action, cfg.grad_spike_action):
            # Under DDP every replica holds the same weights and optimizer state: each rank
            # keeps 1/W of them (recovery.py), over DDP's own group.
            replicas = None
            if is_ddp:
                replicas = (self.exchange.peers if group is model.process_group
                            else Peers(model.process_group, self.device))
            self.snapshots = MemorySnapshots(
                self.module, optimizer, scaler, peers=self.exchange.peers, replicas=replicas,
                unreplicated=getattr(model, "parameters_to_ignore", ()),
                hostname=self.identity.hostname,
            )
        else:
            self.snapshots = None  # no rollback possible: no copies made
        self.cooldown = Cooldown()
        #: The last steps' loss and gradient norm, this rank's and the cluster's (reports).
        self.curves = Curves()
        self._after_step: tuple[Any, ClusterView] | None = None
        self._post_hook: Any = None
        #: Batches with a ``data`` verdict, recognised on the device (quarantine.py).
        self.quarantine = Quarantine(
            self.device, size=cfg.quarantine_size, steps=cfg.quarantine_steps
        )
        self.incidents = incident.IncidentWriter(
            cfg, self.identity, self.exchange.peers, self.job_id
        )
        #: Where the gradients are checked before their reduction: ``ddp``, ``fsdp``, ``local``.
        self.gradients: gradpaths.GradPath = gradpaths.attach(model, self)
        self.detector = Detector(
            self.exchange.peers, self.identity, amp=scaler is not None,
            gradients=self.gradients, incidents=self.incidents, module=self.module,
            replay=replay if cfg.replay and self.gradients.name != "fsdp" else None,
            anomaly=cfg.replay_anomaly, guarded=self._guarded,
        )
        #: The replica fingerprint check (replicas.py); None: off, alone, or pure FSDP.
        self.replicas: ReplicaCheck | None = replica_check(
            model, self.module, optimizer, path=self.gradients.name, config=cfg,
            peers=self.exchange.peers, device=self.device, identity=self.identity,
            inject=lambda step: self.injector.due("bitflip", step), pipelined=bool(pipelined),
        )
        self._params = params
        self._pending: tuple[Pending, PendingResult] | None = None
        #: Set when poisoned steps are skipped on the device (see gate.py); None: host gate.
        self.device_gate = self._choose_gate(optimizer, scaler)
        #: The pipeline boundaries this rank checks (pipeline.py), one per stage it holds.
        self.stages = [pipeline.StageWatch(s, self.device) for s in pipelined]
        #: The process groups that ran a collective in the forward (origins.py).
        self.forward = ForwardCollectives(exclude=_quiet_groups(self.gradients, pipelined))
        self._reset()
        if self.gradients.name == "fsdp" and replay is not None and cfg.replay:
            log.info(
                "nansentinel: replay is off under FSDP2 (its backward would reduce-scatter "
                "through the gradient path being judged); detections get verdict None"
            )
        self.watchdog: Watchdog | None = None
        if self.world_size > 1:
            self.watchdog = Watchdog(
                watchdog_deadline(cfg.exchange_timeout), self._on_timeout, settled=self._settled,
                on_late=self.exchange.check_in, late_after=late_after(cfg.exchange_timeout),
            )
            # Inside the group's own timeout, now and whenever it changes (watchdog.py).
            fit = TimeoutFit(self.exchange, cfg.exchange_timeout, self.watchdog,
                             speak=self.rank == 0)
            self.watchdog.on_poll = fit.check
        self.metrics = None
        if cfg.metrics_port:
            self.metrics = _start_metrics(self, registry)
            self.incidents.failed = self.metrics.observe_report_failure

    # --- the three calls of a training loop -------------------------------------------------

    def check_batch(self, batch: Any, *, ids: Any = None) -> Any:
        """Check every floating-point tensor of ``batch`` (any nesting of dict/list/tuple).

        Non-float parts (ints, bools, strings, None) are ignored; a batch without float tensors
        is harmless and checks nothing. Returns ``batch`` (with a drill fault written into it
        when one is due). Call it before ``backward``.

        ``ids``: one sample id per row of the batch's leading dimension (dataset indices, or
        ``(shard, offset)`` pairs; a list or a tensor, read only after a detection). A
        detection then names the rows at fault, and the skip list keeps them across restarts
        (``nansentinel.skip_list``).
        """
        self._resolve()
        started = time.perf_counter()
        self._require_open("check_batch")
        if self.local.batch is None and self.local.loss_count == 0:
            self.forward.start()  # the forward begins after the step's first batch check
        if ids is not None:
            self.local.ids = skip_list.check_ids(ids, batch, rank=self.rank, step=self.step_index)
        first = next(checks.float_tensors(batch), None)
        if self.injector.poison("batch", self.step_index, first):
            self.local.injected = True
        quarantined = self.quarantine.match(batch, self.step_index)
        if quarantined is not None:
            self.local.add_quarantined(quarantined)
        self.local.add_batch(batch, checks.batch_norms(batch, self.device))
        self._seconds += time.perf_counter() - started
        return batch

    def check_loss(self, loss: torch.Tensor | float) -> None:
        """Check the loss (a tensor or a number; a non-scalar loss is checked element-wise and
        its mean recorded). Call it before ``backward`` so the result can travel with the
        gradient all-reduce."""
        self._add_loss(loss)

    def _add_loss(self, loss: torch.Tensor | float) -> torch.Tensor:
        """:meth:`check_loss`; returns the 0-d value it recorded (on the device)."""
        self._resolve()
        started = time.perf_counter()
        self._require_open("check_loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            loss = torch.full((), float(loss), device=self.device)  # no host copy on CUDA
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"nansentinel: check_loss expects a tensor or a number, got {type(loss).__name__} "
                f"(rank {self.rank}, step {self.step_index})"
            )
        if not (loss.is_floating_point() or loss.is_complex()) or loss.numel() == 0:
            raise TypeError(
                f"nansentinel: check_loss expects a non-empty floating-point loss, got dtype "
                f"{loss.dtype} with {loss.numel()} elements "
                f"(rank {self.rank}, step {self.step_index})"
            )
        if self.injector.poison("loss", self.step_index, loss.detach()):
            self.local.injected = True
        if self.local.loss_count == 0:
            self.local.forward_groups = self.forward.stop()
        value = checks.loss_scalar(loss)
        self.local.add_loss(value)
        self._seconds += time.perf_counter() - started
        return value

    def wrap_loss(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``loss_fn`` checked: the loss function to hand a pipeline schedule
        (``ScheduleGPipe(stage, n, loss_fn=sentinel.wrap_loss(loss_fn))``).

        Each micro-batch's loss is checked (:meth:`check_loss`) before its backward, and paired
        with the activations it came from, so a loss that went non-finite on the last stage
        from finite received activations is named there and one that arrived non-finite is
        not; the targets (the arguments after the output) are checked as a batch. The
        schedule's shape-inference call on its first step, made on uninitialised values, is
        passed through unchecked.
        """
        watch = next((w for w in self.stages if w.last), None)

        @functools.wraps(loss_fn)
        def checked(output: Any, *args: Any, **kwargs: Any) -> Any:
            loss = loss_fn(output, *args, **kwargs)
            if pipeline.shape_inference(self.stages):
                return loss
            value = self._add_loss(loss)
            started = time.perf_counter()
            targets = checks.batch_norms((args, kwargs), self.device)
            self.local.batch_norms.extend(targets)
            if watch is not None:
                watch.pair_loss(value, targets)
            self._seconds += time.perf_counter() - started
            return loss

        return checked

    def check_grads(self) -> None:
        """Check this rank's local gradients now and start the health exchange.

        DDP and FSDP2 users never call this (their gradient path does it before each
        reduction). Call it yourself only if you reduce gradients by hand: after ``backward``
        and *before* your own all-reduce, or blame is lost. ``step()`` calls it when nothing
        else did.
        """
        self._resolve()
        self._require_open("check_grads")
        self.gradients.check_now()
        if not self.exchange.launched:  # DeepSpeed's path launches it before its all-reduce
            self.launch_exchange()

    def step(self, *, optimizer_step: bool = True) -> StepResult | None:
        """Decide this step with every rank and act on it.

        Applies the optimizer (or GradScaler) step only when every rank is healthy; otherwise
        discards the gradients on every rank, rolls every rank back to the last-good snapshot,
        or raises :class:`NonFiniteError` on every rank when the policy aborts (or
        :class:`HostExcludedError` when a host is excluded).

        Args:
            optimizer_step: ``False`` when the caller steps the optimizer itself right after
                (a framework such as Lightning or the Hugging Face Trainer). On apply the
                sentinel then only scales the LR for a rollback cooldown; the cooldown is undone
                and the snapshot kept from an optimizer step post-hook, after the caller's
                update. On a skip or rollback every gradient is set to ``None``, so the
                caller's step leaves weights and optimizer state exactly as they are. Such a
                step always takes the host gate.

        With the device gate (``gate="device"``: a fused optimizer on CUDA, see ``gate.py``)
        the optimizer step is launched at once, skipped on the device when any rank is
        poisoned, and a :class:`~nansentinel.gate.PendingResult` is returned: its fields are
        decided on first read, else at the next sentinel call (where an abort is then raised).

        With a DeepSpeed engine this replaces ``engine.step()``; under gradient accumulation
        it returns None for each micro-batch before the boundary (counted by ``engine.step()``,
        decided with the rest at the boundary).
        """
        self._resolve()
        if self.engine is not None and self.engine.accumulating(
                optimizer_step=optimizer_step, step=self.step_index):
            return None
        if self._after_step is not None:  # the caller did not step (its GradScaler skipped)
            self.cooldown.undo(self.optimizer, self._after_step[0])
            self._after_step = None
        if not self.exchange.launched:
            self.check_grads()
        if optimizer_step and self.device_gate is not None and self.device_gate.ready():
            return self._gate_on_device()
        started = time.perf_counter()
        step, values = self.exchange.wait()
        self._disarm()
        # Waiting for the exchange is waiting for the gradient all-reduce beside it: not ours.
        seconds = self._seconds - (time.perf_counter() - started)
        result, decision = self._judge(
            step, values, self.local, seconds, started, optimizer_step=optimizer_step
        )
        self._reset()
        self.step_index += 1
        self._stop_if(decision, result)
        return result

    def _gate_on_device(self) -> StepResult:
        """Launch the optimizer step gated by a device-side found_inf; decide later."""
        started = time.perf_counter()
        gate = self.device_gate
        assert gate is not None
        step, vector = self.exchange.take()
        skip = self.history.skip_batches > 0  # known on the host: no need to look
        found_inf = gate.found_inf(vector, skip)
        host, event = gate.to_host(vector)  # queued before the optimizer, so it lands early
        saved_lr = self.cooldown.apply(self.optimizer)
        opt_started = time.perf_counter()
        gate.step(found_inf)
        opt_seconds = time.perf_counter() - opt_started
        self.cooldown.restore(self.optimizer, saved_lr)  # counted at the decision, if applied
        grads = held_grads(self._params)
        seconds = self._seconds + time.perf_counter() - started - opt_seconds
        pending = Pending(step, self.local, seconds, host, event, grads, skip)
        self._reset()
        self.step_index += 1
        result = PendingResult(self._decide_if_local, pending.early)
        self._pending = (pending, result)
        return result  # type: ignore[return-value]

    def _needs_detection(self, totals: Totals) -> bool:
        """The step flagged a rank or the cluster mean spiked: naming it takes collectives."""
        return totals.flagged > 0 or self.spikes.cluster_spikes(totals)

    def _decide_if_local(self) -> None:
        """A read of a pending result: decide it now if that needs no collective (nothing
        was flagged), else say when it will be decided. Never starts a collective."""
        if self._pending is None:
            return
        pending, _ = self._pending
        if self._needs_detection(Totals.from_values(pending.values())):
            raise ResultPending(
                f"nansentinel: step {pending.step} found a non-finite value or a spike; rank "
                f"{self.rank} names and decides it with every other rank at its next sentinel "
                "call (check_batch, check_loss, step or close), where an abort is raised. "
                "Until then only step, applied (the device already skipped it), injected and "
                "local_* can be read."
            )
        self._resolve()

    def _resolve(self) -> None:
        """The fixed point of the device gate: decide the step pending there, if any (raises
        its abort). Called on every rank at its next sentinel call, so that a detection's
        collectives run at the same point everywhere."""
        if self._pending is None:
            return
        pending, result = self._pending
        self._pending = None
        started = time.perf_counter()
        with self._guarded():
            values = pending.values()
        # Waiting for the copy is waiting for the gradient all-reduce: not ours.
        seconds = pending.seconds - (time.perf_counter() - started)
        if self.exchange.launched:  # resolved at the next step(): its collectives are armed
            self._arm()
        try:
            decided, decision = self._judge(
                pending.step, values, pending.local, seconds, started, pending
            )
            result.set(decided)
            self._stop_if(decision, decided)
        except BaseException as exc:
            result.set(exc)
            raise

    def _judge(
        self, step: int, values: list[float], local: LocalHealth, seconds: float,
        started: float, pending: Pending | None = None, *, optimizer_step: bool = True,
    ) -> tuple[StepResult, Decision]:
        """Decide one step from its exchanged vector and act on it (report, metrics,
        optimizer or rollback). ``pending``: the optimizer step already ran gated on the
        device. A healthy step reads the totals alone; a flagged one runs the detection."""
        totals, own = Totals.from_values(values), OwnRow.from_values(values)
        view = ClusterView(step, self.world_size, totals)
        if self._needs_detection(totals):
            with self._guarded():
                view = self.detector.view(step, totals, own, self.spikes.ratios(own),
                                          local.forward_groups)
        spikes = self.spikes.judge(view)
        self.spikes.record(own, totals, spikes)
        self.curves.add(step, own, totals)
        self._send_thresholds()
        amp = self.scaler is not None
        bad = blamed(view, amp=amp)
        verdict, detail = self.detector.evidence(
            view, bad, spikes, batch=local.batch,
            grads_restored=pending.grads_restored if pending else contextlib.nullcontext,
        ) if bad or spikes else (None, {})
        snapshot_step = self.snapshots.step if self.snapshots is not None else None
        decision = decide(
            view, self.history, self.config, amp=amp, spikes=spikes, verdict=verdict,
            snapshot_step=snapshot_step,
        )
        self.history.record(
            view, decision, self.config, verdict=verdict, snapshot_step=snapshot_step
        )
        rolled_back_to = None
        not_ours = 0.0
        if decision.applies and not optimizer_step:
            # The caller steps the optimizer right after: the cooldown is undone and the
            # snapshot taken from the optimizer's post-hook (_callers_step).
            self._after_step = (self.cooldown.apply(self.optimizer), view)
            if self._post_hook is None:  # once: a hook cannot remove itself while it runs
                self._post_hook = self.optimizer.register_step_post_hook(self._callers_step)
        elif decision.applies:
            if pending is None:  # the host gate; the device gate has stepped already
                opt_started = time.perf_counter()
                saved_lr = self.cooldown.apply(self.optimizer)
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                else:
                    self.optimizer.step()
                self.cooldown.undo(self.optimizer, saved_lr)
                not_ours = time.perf_counter() - opt_started
            else:
                self.cooldown.count()
            self._maybe_snapshot(view)
        else:
            if pending is None:
                # Discard the poisoned gradients on every rank: weights never take them. (The
                # device gate skipped them already; by now they may be the next step's.)
                self.optimizer.zero_grad(set_to_none=True)
                if not optimizer_step and self.scaler is not None:
                    record_skip(self.scaler, self.optimizer)  # the caller's scaler.step
            if decision.action == ROLLBACK and self.snapshots is not None:
                rolled_back_to = self.snapshots.load()
                self.cooldown.start(self.config.rollback_lr_factor, self.config.rollback_lr_steps)
        result = self._result(view, own, decision, spikes, verdict, rolled_back_to)
        if decision.bad or spikes or decision.action == ROLLBACK:
            result = self.detector.record(
                view, decision, result, spikes, detail=detail, batch=local.batch,
                ids=local.ids, quarantine=self.quarantine, curves=self.curves,
            )
        if self.replicas is not None and not decision.stops:  # after the optimizer step
            result, decision = self.replicas.check(
                step, result, decision, self.history, config=self.config, guarded=self._guarded
            )
        seconds += time.perf_counter() - started - not_ours
        if self.metrics is not None:
            self.metrics.observe_step(result, seconds)
        return result, decision

    def _send_thresholds(self) -> None:
        """Hand this rank's spike thresholds to the device when its references changed (every
        tenth of a window): the next step's own verdict is taken there."""
        if self.spikes.version != self._thresholds_version:
            self._thresholds = to_device(self.spikes.thresholds(), self.device)
            self._thresholds_version = self.spikes.version

    def _stop_if(self, decision: Decision, result: StepResult) -> None:
        if decision.stops:
            if self.metrics is not None:  # the final state is served at once, not a second late
                self.metrics.flush()
            stop.stop(
                decision, result, incident.describe_abort(decision, result), config=self.config,
                identity=self.identity, exchange=self.exchange, job_id=self.job_id,
                guarded=self._guarded, lingering=self.metrics is not None,
            )

    def _callers_step(self, *_: Any) -> None:
        """Optimizer step post-hook for ``step(optimizer_step=False)``: undo the cooldown and
        keep the snapshot after the caller's own update, as :meth:`step` does after its own."""
        pending, self._after_step = self._after_step, None
        if pending is not None:
            saved_lr, view = pending
            self.cooldown.undo(self.optimizer, saved_lr)
            self._maybe_snapshot(view)

    def _maybe_snapshot(self, view: ClusterView) -> None:
        """Keep the state after a healthy, quiet step as the last good one, every N steps."""
        snaps = self.snapshots
        if snaps is None or self.history.skip_batches > 0 or not self.spikes.quiet(view.totals):
            return
        if snaps.step is None or view.step - snaps.step >= self.config.snapshot_every:
            snaps.save(view.step)

    # --- state for checkpoints ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step counter, policy history, spike references, cooldown and quarantine, to be saved
        with the training checkpoint so that a restarted job carries on where it left off.

        Never runs a collective, so it may be called on one rank alone. A step still pending
        on the device gate is decided first when it found nothing; one that found something
        is decided with every rank at the next sentinel call, so the state saved now holds
        the history before it (its skip has happened on the device already)."""
        try:
            self._decide_if_local()
        except ResultPending:
            log.warning(
                "nansentinel: state_dict() on rank %d while step %d's detection is pending "
                "(decided at the next sentinel call on every rank); the saved history is the "
                "one before it", self.rank, self.step_index - 1,
            )
        return {
            "step": self.step_index,
            **self.history.state_dict(),
            "spikes": self.spikes.state_dict(),
            "cooldown": self.cooldown.state_dict(),
            "quarantine": self.quarantine.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.step_index = int(state["step"])
        self.history = History.from_state_dict(state)
        if "spikes" in state:
            self.spikes.load_state_dict(state["spikes"], self.rank)
            self._send_thresholds()
        if "cooldown" in state:
            self.cooldown.load_state_dict(state["cooldown"])
        self.quarantine.load_state_dict(state.get("quarantine", []), self.step_index)

    def close(self) -> None:
        """Decide a step still pending on the device gate (its report and metrics are
        written; call it on every rank), then stop the metrics server and the watchdog (the
        gradient path stays: DDP cannot unregister a comm hook)."""
        try:
            self._resolve()
        finally:
            self._shut()

    def _shut(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
        release = getattr(self.gradients, "release", None)
        if release is not None:  # DeepSpeed: the engine reduces on its own again
            release()

    def __enter__(self) -> Sentinel:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the loop failed: no collective now, the other ranks may be gone
            self._pending = None
            self._shut()

    # --- what the gradient paths report to (gradpaths.GradientSink) -------------------------

    def before_reduction(self, local_grads: torch.Tensor) -> None:
        """The step's first local gradients are about to be reduced: arm the watchdog on the
        step's collectives and write a due grad drill into them (before the reduction, as a
        real fault would be)."""
        self._arm()
        if self.injector.poison("grad", self.step_index, local_grads):
            self.local.injected = True

    @property
    def inferring(self) -> bool:
        return any(w.inferring for w in self.stages)

    def reducing(self) -> None:
        if self.watchdog is not None:
            self.watchdog.restart(self.step_index)

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        self.local.add_grads(norm)

    def launch_exchange(self) -> None:
        """Pack this rank's health vector and start summing it across ranks (asynchronous)."""
        self.reducing()
        for watch in self.stages:  # the pipeline boundaries' norms become the row's flags
            watch.fold(self.local)
        vector = pack(self.local.row(), self._thresholds, self.rank, amp=self.scaler is not None)
        self.exchange.launch(self.step_index, vector)

    def diagnosed(
        self, future: torch.futures.Future, step: int, reduced_in_place: torch.Tensor
    ) -> torch.futures.Future:
        return self.exchange.diagnosed(future, step, reduced_in_place)

    def spent(self, seconds: float) -> None:
        self._seconds += seconds

    # --- internals ---------------------------------------------------------------------------

    def _choose_gate(self, optimizer: torch.optim.Optimizer, scaler: Any) -> DeviceGate | None:
        """The device gate where ``config.gate`` and the run allow it; said once at start."""
        mode = self.config.gate
        if mode == "host" or (mode == "auto" and self.device.type != "cuda"):
            return None
        refusal = device_gate_refusal(
            optimizer, scaler=scaler, config=self.config, path=self.gradients.name
        )
        if refusal is None:
            return DeviceGate(optimizer, self.device)
        if self.rank == 0:
            log.info(
                "nansentinel: host gate (one host sync before every optimizer step): %s",
                refusal,
            )
        return None

    def _settled(self) -> bool:
        """The armed collectives have completed (the watchdog asks before it fires)."""
        pending = self._pending
        return self.exchange.settled() or (pending is not None and pending[0].settled())

    def _reset(self) -> None:
        self.local = LocalHealth(self.device)
        self._seconds = 0.0
        self.gradients.reset()
        for watch in self.stages:
            watch.reset()
        self.forward.start()  # no check_batch this step: the forward begins now

    def _arm(self) -> None:
        if self.watchdog is not None:
            self.watchdog.arm(self.step_index)

    def _disarm(self) -> None:
        if self.watchdog is not None:
            self.watchdog.disarm()

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """The watchdog armed around a collective outside the step's own (replay, gather,
        barrier), so that a rank that dies there is named too."""
        self._arm()
        try:
            yield
        finally:
            self._disarm()

    def _on_timeout(self, step: int) -> None:
        stop.on_timeout(step, config=self.config, identity=self.identity, exchange=self.exchange)

    def _require_open(self, what: str) -> None:
        if self.exchange.launched:
            raise SentinelUsageError(
                f"nansentinel: {what}() called on rank {self.rank} at step {self.step_index} "
                "after this step's health exchange already left with the gradients; call "
                "check_batch/check_loss before loss.backward(), then step()"
            )

    def _result(
        self, view: ClusterView, mine: OwnRow, decision: Decision, spikes: Spikes,
        verdict: str | None, rolled_back_to: int | None,
    ) -> StepResult:
        return StepResult(
            step=view.step,
            applied=decision.applies,
            outcome=decision.outcome,
            bad_ranks=decision.bad_ranks,
            bad_hosts=decision.bad_hosts,
            kinds=decision.kinds,
            local_kinds=list(mine.kinds),
            local_loss=mine.loss,
            local_grad_norm=mine.grad_norm,
            consecutive_skips=self.history.consecutive_skips,
            injected=view.injected,
            overflow=decision.overflow,
            excluded_hosts=list(self.history.excluded),
            verdict=verdict,
            spikes={k: list(v) for k, v in spikes.ranks.items()},
            local_spikes=spikes.of_rank(self.rank),
            quarantined=view.quarantined,
            rolled_back_to=rolled_back_to,
            lr_factor=self.cooldown.lr_factor,
            reason=decision.reason,
            reached=view.reached,
        )


def _quiet_groups(gradients: gradpaths.GradPath, stages: list[Any]) -> frozenset[str]:
    """Names of the process groups whose collectives in the forward cannot carry one rank's
    NaN into another rank's loss, or are checked where they land: the gradient path's own
    (FSDP2's parameter all-gathers) and the pipeline's sends and receives."""
    groups = list(gradients.mesh_groups)
    for stage in stages:
        groups.append(stage.group if stage.group is not None else dist.group.WORLD)
    return frozenset(g.group_name for g in groups if g is not None and hasattr(g, "group_name"))


def _local_device(param: torch.Tensor) -> torch.device:
    """The device this rank computes on, from one of its parameters.

    Usually where the parameter lives (a DTensor's local shard). Under FSDP2 with
    ``CPUOffloadPolicy`` the shard lives in host memory while gradients are computed and
    reduce-scattered on the mesh's device: the sentinel's tensors and collectives belong there
    (an NCCL group cannot gather host tensors, and host norms of device buffers cost a blocking
    copy per FSDP group), so the device is taken from the mesh as FSDP does
    (``_get_device_from_mesh``: the mesh's device type, that backend's current device)."""
    if not hasattr(param, "to_local"):
        return param.device
    local = param.to_local().device
    mesh_type = getattr(getattr(param, "device_mesh", None), "device_type", local.type)
    if mesh_type == local.type or mesh_type == "cpu":
        return local
    return torch.device(mesh_type, torch.get_device_module(mesh_type).current_device())


def _identity(
    rank: int, world_size: int, hostname: str, local_rank: int, device: torch.device
) -> RankIdentity:
    gpu = gpu_uuid = ""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu = str(index)
        gpu_uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    return RankIdentity(rank, local_rank, world_size, hostname, str(device), gpu, gpu_uuid)


def _start_metrics(sentinel: Sentinel, registry: Any) -> Any:
    from nansentinel.metrics import SentinelMetrics

    metrics = SentinelMetrics(sentinel.identity, registry=registry, device=sentinel.device)
    port = sentinel.config.metrics_port + sentinel.identity.local_rank
    metrics.serve(
        sentinel.config.metrics_addr, port, sentinel.config.metrics_certfile,
        sentinel.config.metrics_keyfile,
    )
    return metrics
