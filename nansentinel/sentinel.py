"""The Sentinel: the one path of a step, composed from the layers.

::

    check_batch ─┐
    check_loss ──┤ local flags, kept on the device
    backward ────┤ DDP comm hook: each bucket's norm before its all-reduce;
                 │ the last bucket launches the health exchange
    step() ──────┘ wait for the cluster view (the one host sync) → decide → act

Everything expensive (naming parameters, saving the batch, writing the report) runs only after
a detection; the healthy step pays for a few fused reductions and one small collective that
travels beside the gradients.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nansentinel import checks, incident, report
from nansentinel.config import SentinelConfig, resolve_hostname
from nansentinel.exchange import (
    ClusterView,
    HealthExchange,
    diagnosis_grace,
    late_after,
)
from nansentinel.inject import Injector, parse_inject
from nansentinel.local import LocalHealth
from nansentinel.policy import (
    ABORT,
    APPLY,
    EXCLUDE,
    OVERFLOW,
    ROLLBACK,
    Decision,
    History,
    blamed,
    decide,
)
from nansentinel.recovery import Cooldown, MemorySnapshots, SnapshotStore, UserSnapshots
from nansentinel.replay import ReplayFn, blame, fingerprint
from nansentinel.result import (
    HostExcludedError,
    NonFiniteError,
    RankIdentity,
    SentinelUsageError,
    StepResult,
)
from nansentinel.spikes import SIGNALS, SpikeDetector, Spikes
from nansentinel.watchdog import Watchdog

log = logging.getLogger("nansentinel")

_OUTCOME = {
    APPLY: "applied", OVERFLOW: "overflow", ABORT: "aborted", EXCLUDE: "excluded",
    ROLLBACK: "rolled_back",
}


class Sentinel:
    """Watches one rank's batch, loss and gradients; decides each step with every other rank.

    Args:
        model: the module being trained, plain or wrapped in ``DistributedDataParallel``.
            With DDP a communication hook is registered (construct the sentinel before the
            first backward, and do not register another comm hook).
        optimizer: stepped by :meth:`step` only when every rank is healthy.
        scaler: a ``torch.amp.GradScaler``; :meth:`step` then calls ``scaler.step`` and
            ``scaler.update``, and non-finite gradients alone count as fp16 overflow.
        group: the process group (default: DDP's, else the default group if initialised,
            else none: one process).
        registry: a ``prometheus_client.CollectorRegistry`` for the metrics (tests inject one).
        replay: ``fn(module, batch) -> loss``, the forward and loss of one step on the
            unwrapped module; with it, a detection is replayed to tell data, host and
            transient faults apart and to find the first non-finite module and parameter.
        snapshots: ``(save, load)`` — the user's own checkpoint pair for rollbacks
            (``save(step)``; ``load() -> step``) — or a ``SnapshotStore``; default: host memory.
        env: environment to read ``NANSENTINEL_*`` from (default ``os.environ``).
        **overrides: fields of :class:`SentinelConfig`; keyword > env > default.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: Any = None,
        group: dist.ProcessGroup | None = None,
        registry: Any = None,
        env: dict[str, str] | None = None,
        replay: ReplayFn | None = None,
        snapshots: tuple[Any, Any] | SnapshotStore | None = None,
        **overrides: Any,
    ) -> None:
        self.config = SentinelConfig.from_env(env, **overrides)
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        is_ddp = isinstance(model, DistributedDataParallel)
        if group is None and is_ddp:
            group = model.process_group
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self.exchange = HealthExchange(group, self.device, self.config.exchange_timeout)
        self.rank = self.exchange.rank
        self.world_size = self.exchange.world_size
        environ = os.environ if env is None else env
        self.identity = _identity(
            self.rank, self.world_size, resolve_hostname(self.config.hostname, environ),
            int(environ.get("LOCAL_RANK", "0") or 0), self.device,
        )
        # Gathered once, so that every later detection can name host, local rank and device.
        gathered = self.exchange.gather_json(_identity_json(self.identity))
        self.identities = [RankIdentity(**d) for d in gathered]  # type: ignore[arg-type]
        self.job_id = self.config.job_id or environ.get("TORCHELASTIC_RUN_ID")
        faults = parse_inject(self.config.inject) if self.config.inject else []
        self.injector = Injector(faults, self.rank, self.identity.hostname)
        prefix = "module." if is_ddp else ""
        self._names = {id(p): n.removeprefix(prefix) for n, p in model.named_parameters()}
        self.history = History()
        self.step_index = 0
        self.module = model.module if is_ddp else model
        self.replay_fn = replay
        cfg = self.config
        self.spikes = SpikeDetector(
            self.world_size, window=cfg.spike_window, warmup=cfg.spike_warmup,
            ratio=cfg.spike_ratio, zscore=cfg.spike_zscore,
        )
        self.snapshots: SnapshotStore | None
        if isinstance(snapshots, tuple):
            self.snapshots = UserSnapshots(*snapshots)
        elif snapshots is not None:
            self.snapshots = snapshots
        elif "rollback" in (cfg.policy, cfg.loss_spike_action, cfg.grad_spike_action):
            self.snapshots = MemorySnapshots(self.module, optimizer, scaler)
        else:
            self.snapshots = None  # no rollback possible: no copies made
        self.cooldown = Cooldown()
        self.quarantine: set[str] = set()
        self._reset()
        if is_ddp:
            try:
                model.register_comm_hook(None, self._comm_hook)
            except RuntimeError as exc:
                raise SentinelUsageError(
                    f"nansentinel: cannot register its DDP communication hook on rank "
                    f"{self.rank} ({self.identity.hostname}): {exc}. Construct the Sentinel "
                    "before the first backward and do not register another comm hook."
                ) from exc
        self.watchdog: Watchdog | None = None
        if self.world_size > 1:
            # Later than the exchange's own timeout, so that a wait() that can time out by
            # itself raises in the training thread first.
            deadline = self.config.exchange_timeout + diagnosis_grace(self.config.exchange_timeout)
            self.watchdog = Watchdog(
                deadline + 2.0, self._on_timeout, settled=self.exchange.settled,
                on_late=self.exchange.check_in, late_after=late_after(self.config.exchange_timeout),
            )
        self.metrics = None
        if self.config.metrics_port:
            self.metrics = _start_metrics(self, registry)

    # --- the three calls of a training loop -------------------------------------------------

    def check_batch(self, batch: Any) -> Any:
        """Check every floating-point tensor of ``batch`` (any nesting of dict/list/tuple).

        Non-float parts (ints, bools, strings, None) are ignored; a batch without float tensors
        is harmless and checks nothing. Returns ``batch`` (with a drill fault written into it
        when one is due). Call it before ``backward``.
        """
        started = time.perf_counter()
        self._require_open("check_batch")
        first = next(checks.float_tensors(batch), None)
        if self.injector.poison("batch", self.step_index, first):
            self.local.injected = True
        if self.quarantine and fingerprint(batch) in self.quarantine:
            self.local.quarantined = True
        self.local.add_batch(batch, checks.batch_norms(batch, self.device))
        self._seconds += time.perf_counter() - started
        return batch

    def check_loss(self, loss: torch.Tensor | float) -> None:
        """Check the loss (a tensor or a number; a non-scalar loss is checked element-wise and
        its mean recorded). Call it before ``backward`` so the result can travel with the
        gradient all-reduce."""
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
        self.local.add_loss(checks.loss_scalar(loss))
        self._seconds += time.perf_counter() - started

    def check_grads(self) -> None:
        """Check this rank's local gradients now and start the health exchange.

        DDP users never call this (the comm hook does it). Call it yourself only if you reduce
        gradients by hand: after ``backward`` and *before* your own all-reduce, or blame is lost.
        ``step()`` calls it when nothing else did.
        """
        started = time.perf_counter()
        self._require_open("check_grads")
        first = next((p for p in self.model.parameters() if p.grad is not None), None)
        if first is not None and self.injector.poison("grad", self.step_index, first.grad):
            self.local.injected = True
        for _, norms in checks.param_grad_norms(list(self.model.parameters())):
            self.local.add_grads(torch.linalg.vector_norm(norms))
        self._launch()
        self._seconds += time.perf_counter() - started

    def step(self) -> StepResult:
        """Decide this step with every rank and act on it.

        Applies the optimizer (or GradScaler) step only when every rank is healthy; otherwise
        discards the gradients on every rank, rolls every rank back to the last-good snapshot,
        or raises :class:`NonFiniteError` on every rank when the policy aborts (or
        :class:`HostExcludedError` when a host is excluded).
        """
        if not self.exchange.launched:
            self.check_grads()
        started = time.perf_counter()
        view = self.exchange.wait(self.identities)
        self._disarm()
        # Waiting for the exchange is waiting for the gradient all-reduce beside it, and the
        # optimizer step is the user's: neither is the sentinel's own cost.
        not_ours = time.perf_counter() - started
        current = {s: view.values(s) for s in SIGNALS}
        spikes = self.spikes.judge(current)
        self.spikes.record(current, spikes)
        bad = blamed(view, amp=self.scaler is not None)
        # Name the parameters now, before the gradients are discarded: after the all-reduce
        # a NaN sits where any rank had one, so this rank's scan shows its own (and, with
        # several poisoned ranks, theirs too). Only after a detection.
        poisoned = None
        if any(r.rank == self.rank and "grad" in r.kinds for r in bad):
            poisoned = self._nonfinite_parameters()
        verdict, replays = None, []
        if bad or spikes:
            self._arm()
            verdict, replays = blame(
                view, list(bad), spikes, exchange=self.exchange, module=self.module,
                batch=self.local.batch, fn=self.replay_fn if self.config.replay else None,
                anomaly=self.config.replay_anomaly,
            )
            self._disarm()
        snapshot_step = self.snapshots.step if self.snapshots is not None else None
        decision = decide(
            view, self.history, self.config, amp=self.scaler is not None, spikes=spikes,
            verdict=verdict, snapshot_step=snapshot_step,
        )
        self.history.record(
            view, decision, self.config, verdict=verdict, snapshot_step=snapshot_step
        )
        rolled_back_to = None
        if decision.action in (APPLY, OVERFLOW):
            opt_started = time.perf_counter()
            saved_lr = self.cooldown.apply(self.optimizer)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.cooldown.undo(self.optimizer, saved_lr)
            not_ours += time.perf_counter() - opt_started
            self._maybe_snapshot(view, current)
        else:
            # Discard the poisoned gradients on every rank: weights never take them.
            self.optimizer.zero_grad(set_to_none=True)
            if decision.action == ROLLBACK and self.snapshots is not None:
                rolled_back_to = self.snapshots.load()
                self.cooldown.start(self.config.rollback_lr_factor, self.config.rollback_lr_steps)
        if verdict == "data":
            self.quarantine.update(r["fingerprint"] for r in replays if r.get("fingerprint"))
        result = self._result(view, decision, spikes, verdict, rolled_back_to)
        if decision.bad or spikes or decision.action == ROLLBACK:
            result = self._incident(view, decision, result, spikes, replays, poisoned)
        self._seconds += time.perf_counter() - started - not_ours
        if self.metrics is not None:
            self.metrics.observe_step(result, self._seconds)
        self._reset()
        self.step_index += 1
        if decision.action in (ABORT, EXCLUDE):
            self._raise(decision, result)
        return result

    def _maybe_snapshot(self, view: ClusterView, current: dict[str, list[float | None]]) -> None:
        """Keep the state after a healthy, quiet step as the last good one, every N steps."""
        snaps = self.snapshots
        if snaps is None or self.history.skip_batches > 0 or not self.spikes.quiet(current):
            return
        if snaps.step is None or view.step - snaps.step >= self.config.snapshot_every:
            snaps.save(view.step)

    # --- state for checkpoints ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Step counter, policy history, spike references, cooldown and quarantine, to be saved
        with the training checkpoint so that a restarted job carries on where it left off."""
        h = self.history
        return {
            "step": self.step_index,
            "consecutive_skips": h.consecutive_skips,
            "strikes": {host: list(s) for host, s in h.strikes.items()},
            "excluded": list(h.excluded),
            "rollbacks": dict(h.rollbacks),
            "skip_batches": h.skip_batches,
            "spikes": self.spikes.state_dict(),
            "cooldown": [self.cooldown.factor, self.cooldown.steps_left],
            "quarantine": sorted(self.quarantine),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.step_index = int(state["step"])
        self.history = History(
            consecutive_skips=int(state.get("consecutive_skips", 0)),
            strikes={h: [int(s) for s in v] for h, v in state.get("strikes", {}).items()},
            excluded=list(state.get("excluded", [])),
            rollbacks={int(k): int(v) for k, v in state.get("rollbacks", {}).items()},
            skip_batches=int(state.get("skip_batches", 0)),
        )
        if "spikes" in state:
            self.spikes.load_state_dict(state["spikes"])
        if "cooldown" in state:
            self.cooldown.factor, self.cooldown.steps_left = state["cooldown"]
        self.quarantine = set(state.get("quarantine", []))

    def close(self) -> None:
        """Stop the metrics server and the watchdog (the DDP hook stays: DDP cannot
        unregister one)."""
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None

    def __enter__(self) -> Sentinel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------------------

    def _reset(self) -> None:
        self.local = LocalHealth(self.device)
        self._seconds = 0.0

    def _arm(self) -> None:
        if self.watchdog is not None:
            self.watchdog.arm(self.step_index)

    def _disarm(self) -> None:
        if self.watchdog is not None:
            self.watchdog.disarm()

    def _on_timeout(self, step: int) -> None:
        """Watchdog thread: the step's collectives are stuck (a rank froze or died where no
        Python timeout reaches). Name the missing ranks, leave a verdict for the launcher and
        end the process, as NCCL's watchdog does; torchrun restarts or ends the job."""
        error = self.exchange.diagnose(step, self.identities, None)
        log.error("%s", error)
        self._write_verdict(step, "exchange_timeout", str(error), missing=error.missing)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        if self.rank == 0:
            # Without torchrun's agent store, rank 0 hosts the rendezvous store: linger so the
            # other live ranks can finish their own diagnosis before it goes away.
            time.sleep(diagnosis_grace(self.config.exchange_timeout))
        from nansentinel.exitcodes import EXIT_EXCHANGE_TIMEOUT

        os._exit(EXIT_EXCHANGE_TIMEOUT)

    def _write_verdict(self, step: int, outcome: str, message: str, **extra: Any) -> None:
        """Leave this rank's verdict where ``nansentinel run`` looks for it (if launched so)."""
        if not self.config.run_dir:
            return
        from nansentinel.verdicts import write_verdict

        payload = {
            "rank": self.rank,
            "local_rank": self.identity.local_rank,
            "hostname": self.identity.hostname,
            "step": step,
            "outcome": outcome,
            "message": message,
            "bad_ranks": [],
            "bad_hosts": [],
            "kinds": [],
            "excluded_host": None,
            "report_path": None,
        }
        payload.update(extra)
        write_verdict(self.config.run_dir, self.rank, payload)

    def _require_open(self, what: str) -> None:
        if self.exchange.launched:
            raise SentinelUsageError(
                f"nansentinel: {what}() called on rank {self.rank} at step {self.step_index} "
                "after this step's health exchange already left with the gradients; call "
                "check_batch/check_loss before loss.backward(), then step()"
            )

    def _comm_hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """DDP comm hook: check the bucket on this rank, then average it across ranks as DDP's
        default does (NCCL: one AVG all-reduce; gloo: scale by 1/world, then sum); the last
        bucket launches the exchange.

        Deliberately unannotated: DDP inspects the annotations and rejects the string forms
        that ``from __future__ import annotations`` produces."""
        started = time.perf_counter()
        self._arm()
        buffer = bucket.buffer()
        first = not self.local.grad_norms
        if first and self.injector.poison("grad", self.step_index, buffer):
            self.local.injected = True
        # One norm over the flat bucket: one read of contiguous memory, one kernel.
        self.local.add_grads(checks.tensor_norm(buffer))
        if self.exchange.supports_avg:
            work = dist.all_reduce(buffer, dist.ReduceOp.AVG, self.exchange.group, async_op=True)
        else:  # gloo has no AVG: scale first, as DDP's own path does
            buffer.mul_(1.0 / self.world_size)
            work = dist.all_reduce(buffer, group=self.exchange.group, async_op=True)
        future = self.exchange.diagnosed(work.get_future(), self.step_index, self.identities)
        if bucket.is_last():
            self._launch()
        self._seconds += time.perf_counter() - started
        return future

    def _launch(self) -> None:
        self._arm()
        self.exchange.launch(self.step_index, self.local.row())

    def _result(
        self, view: ClusterView, decision: Decision, spikes: Spikes, verdict: str | None,
        rolled_back_to: int | None,
    ) -> StepResult:
        mine = view.ranks[self.rank]
        return StepResult(
            step=view.step,
            applied=decision.action in (APPLY, OVERFLOW),
            outcome=_OUTCOME.get(decision.action, "skipped"),
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
            lr_factor=self.cooldown.factor if self.cooldown.steps_left > 0 else 1.0,
            reason=decision.reason,
        )

    def _incident(
        self, view: ClusterView, decision: Decision, result: StepResult, spikes: Spikes,
        replays: list[dict[str, Any]], poisoned: list[str] | None,
    ) -> StepResult:
        """After a detection (or a spike, or a rollback): the poisoned ranks name their
        parameters and save their batch, every rank shares that detail (one gather, only now),
        rank 0 writes the report."""
        stem = report.incident_stem(self.job_id, view.step)
        base = Path(self.config.report_dir)
        detail: dict[str, Any] = {}
        mine = view.ranks[self.rank]
        batch = self.local.batch
        failed = self.metrics.observe_report_failure if self.metrics is not None else None
        if self.rank in decision.bad_ranks:
            if poisoned:
                detail["parameters"] = poisoned
            if batch is not None and not self.config.save_batches:
                detail["batch_not_saved"] = "save_batches=False"
            elif batch is not None:
                path, error = report.attempt(
                    "batch", lambda: report.save_batch(base / f"{stem}-rank{self.rank}-batch.pt",
                                                       batch),
                    rank=self.rank, step=view.step, failed=failed,
                )
                detail.update({"batch_path": str(path)} if path else {"batch_error": error})
        self._arm()
        details: list[dict[str, Any]] = self.exchange.gather_json(detail)  # type: ignore[assignment]
        self._disarm()
        parameters = {r: d["parameters"] for r, d in enumerate(details) if d.get("parameters")}
        result = dataclasses.replace(result, parameters=parameters)
        for d, r in zip(details, replays or [{}] * len(details), strict=True):
            d.update(r)
        message = incident.describe(view, decision, result, spikes)
        if self.rank == 0:
            payload = incident.payload(
                view, decision, result, spikes, details, message, job_id=self.job_id,
                policy=self.config.policy, world_size=self.world_size,
            )
            path, _ = report.attempt("report", lambda: report.write_json(base / f"{stem}.json",
                                     payload), rank=self.rank, step=view.step, failed=failed)
            if path is not None:
                result = dataclasses.replace(result, report_path=str(path))
            log.log(
                logging.ERROR if decision.action in (ABORT, EXCLUDE) else logging.WARNING,
                "%s%s", message, f"; report: {result.report_path}" if result.report_path else "",
            )
        if self.rank in decision.bad_ranks:
            params, batch_path = detail.get("parameters"), detail.get("batch_path")
            log.warning(
                "nansentinel: rank %d on host %s (local rank %d, %s): non-finite %s at step %d%s%s",
                self.rank, self.identity.hostname, self.identity.local_rank, self.identity.device,
                ", ".join(mine.kinds), view.step,
                f"; parameters: {incident.first(params, 8)}" if params else "",
                f"; batch saved to {batch_path}" if batch_path else "",
            )
        return result

    def _nonfinite_parameters(self) -> list[str]:
        """Names of the parameters whose gradient holds a non-finite value: one fused norm per
        (device, dtype) group and one host copy — paid only after a detection."""
        names = []
        for group, norms in checks.param_grad_norms(list(self.model.parameters())):
            for i in (~torch.isfinite(norms)).nonzero().flatten().tolist():
                names.append(self._names.get(id(group[i]), f"<unnamed {i}>"))
        return names

    def _raise(self, decision: Decision, result: StepResult) -> None:
        message = incident.describe_abort(decision, result)
        if self.config.exclusion_file and decision.exclude_host and self.rank == 0:
            from nansentinel.exclusion import ExclusionRecord, ExclusionStore

            ExclusionStore(self.config.exclusion_file).add(
                ExclusionRecord(
                    host=decision.exclude_host,
                    reason=decision.reason,
                    step=result.step,
                    evidence={
                        "bad_ranks": result.bad_ranks,
                        "kinds": result.kinds,
                        "strikes": decision.strikes,
                        "report_path": result.report_path,
                    },
                    time=time.time(),
                    job_id=self.job_id,
                )
            )
        self._write_verdict(
            result.step, result.outcome, message, bad_ranks=result.bad_ranks,
            bad_hosts=result.bad_hosts, kinds=result.kinds,
            excluded_host=decision.exclude_host, report_path=result.report_path,
        )
        # Rank 0's report and the exclusion record are on disk before anyone raises.
        self._arm()
        self.exchange.barrier()
        self._disarm()
        if self.metrics is not None and self.config.metrics_linger > 0:
            log.info(
                "nansentinel: rank %d keeps its exporter up %g s for the final scrape",
                self.rank, self.config.metrics_linger,
            )
            time.sleep(self.config.metrics_linger)
        error = HostExcludedError if decision.action == EXCLUDE else NonFiniteError
        raise error(message, result)


def _identity(
    rank: int, world_size: int, hostname: str, local_rank: int, device: torch.device
) -> RankIdentity:
    gpu = gpu_uuid = ""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu = str(index)
        gpu_uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    return RankIdentity(rank, local_rank, world_size, hostname, str(device), gpu, gpu_uuid)


def _identity_json(ident: RankIdentity) -> dict[str, Any]:
    return {f: getattr(ident, f) for f in RankIdentity.__slots__}  # type: ignore[attr-defined]


def _start_metrics(sentinel: Sentinel, registry: Any) -> Any:
    from nansentinel.metrics import SentinelMetrics

    metrics = SentinelMetrics(sentinel.identity, registry=registry, device=sentinel.device)
    port = sentinel.config.metrics_port + sentinel.identity.local_rank
    metrics.serve(
        sentinel.config.metrics_addr, port, sentinel.config.metrics_certfile,
        sentinel.config.metrics_keyfile,
    )
    return metrics
