"""The stop path: how a rank ends the run when the cluster decided so, or when the step's
collectives never completed.

Kept apart from the step flow because it is the one place with process-wide side effects —
the exclusion record, the verdict file for ``nansentinel run``, the final scrape, the exit —
and because each of them must happen in a fixed order: the record and rank 0's report are on
disk before any rank raises, and torchrun tears the job down only after that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from nansentinel.common import torch_insides as insides
from nansentinel.common.verdicts import (
    CLOSED,
    EXCHANGE_TIMEOUT,
    STOPPED,
    RankVerdict,
    send_verdict,
    stop_cause,
    verdict_path,
    write_verdict,
)
from nansentinel.config import SentinelConfig
from nansentinel.decide.policy import EXCLUDE, STATE, Decision, exclusion_reason
from nansentinel.result import (
    ExchangeTimeoutError,
    HostExcludedError,
    NonFiniteError,
    NonFiniteStateError,
    RankIdentity,
    StepResult,
    StopRequested,
)
from nansentinel.wire.collectives import job_rank
from nansentinel.wire.context import Context
from nansentinel.wire.exchange import HealthExchange, diagnosis_grace, is_transport_failure

if TYPE_CHECKING:
    from nansentinel.rare.state import StateCheck

log = logging.getLogger("nansentinel")

#: The signals a rank turns into a stop at the next step boundary (where it may).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Seconds after the first stop signal within which another is a copy of it, not a second
#: request: one scheduler's SIGTERM reaches a worker up to three times within moments (Slurm
#: signals every process of the step, ``nansentinel run`` forwards it at once, torchrun's agent
#: once its main thread runs Python). Later, a second signal ends the process at once.
REPEAT_WINDOW_S = 5.0
#: ``(signal, monotonic time)`` of the first stop signal received.
_received: list[tuple[int, float]] = []
#: The wakeup pipe's ``(read end, write end)`` while this module holds Python's wakeup fd.
_wakeup: list[tuple[int, int]] = []


def _note(signum: int) -> None:
    """A stop signal arrived: the first is the request; a copy within
    :data:`REPEAT_WINDOW_S` is the same one; a later one ends the process at once."""
    now = time.monotonic()
    if not _received:
        _received.append((signum, now))
    elif now - _received[0][1] > REPEAT_WINDOW_S:
        _flush()
        os._exit(128 + signum)


def _on_stop_signal(signum: int, frame: Any) -> None:
    """The Python-level handler: only a note (none at all while the wakeup thread notes: it
    sees each signal at once, even while the main thread is blocked in a C++ collective,
    where this handler cannot run)."""
    if not _wakeup:
        _note(signum)


def _listen(read_end: int, taken: frozenset[int]) -> None:
    """The wakeup thread: Python's C-level handler writes each signal's number to the pipe
    at once, whatever the main thread is blocked in; note the stop signals."""
    with contextlib.suppress(OSError):
        while data := os.read(read_end, 64):
            for signum in data:
                if signum in taken:
                    _note(signum)
    with contextlib.suppress(OSError):
        os.close(read_end)


def _forget_in_child() -> None:
    """After a fork (a DataLoader's workers): the child is not the rank. It must not write its
    own signals into the rank's wakeup pipe nor take them as stop requests: Python's wakeup fd
    and the defaults back, the pipe's ends closed, nothing noted."""
    if _wakeup:
        read_end, write_end = _wakeup.pop()
        with contextlib.suppress(ValueError, OSError):
            now = signal.set_wakeup_fd(-1)
            if now not in (-1, write_end):  # not ours any more: leave it as it was
                signal.set_wakeup_fd(now)
        for fd in (read_end, write_end):
            with contextlib.suppress(OSError):
                os.close(fd)
    for signum in STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError):  # ValueError: forked off another thread
            if signal.getsignal(signum) is _on_stop_signal:
                signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT
                              else signal.SIG_DFL)
    _received.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _untouched(signum: int) -> bool:
    """The process still has Python's default for ``signum`` (SIGINT's is
    ``default_int_handler``, which raises KeyboardInterrupt), or our own handler."""
    current = signal.getsignal(signum)
    default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
    return current is default or current is _on_stop_signal


def take_stop_signals() -> tuple[int, ...]:
    """Turn SIGTERM and SIGINT into a stop at the next step boundary on this rank: installed
    only from the main thread and only where the process still has the default handler (a
    framework's or the user's own handler is never replaced: that signal then does what its
    handler does). Returns the signals taken. SIG_IGN (a process started with the signal
    ignored) is left ignored. Where nobody holds Python's wakeup fd (``signal.set_wakeup_fd``:
    asyncio's loop would), a thread of its own hears the signals through it."""
    if threading.current_thread() is not threading.main_thread():
        return ()
    taken = []
    for signum in STOP_SIGNALS:
        if _untouched(signum):
            signal.signal(signum, _on_stop_signal)
            taken.append(int(signum))
    if taken and not _wakeup:
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        theirs = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        if theirs == -1:
            _wakeup.append((read_end, write_end))
            threading.Thread(target=_listen, args=(read_end, frozenset(taken)),
                             name="nansentinel-signals", daemon=True).start()
        else:  # someone else's: theirs back, and the handler notes alone
            signal.set_wakeup_fd(theirs)
            os.close(read_end)
            os.close(write_end)
    return tuple(taken)


def give_back_stop_signals(taken: tuple[int, ...]) -> None:
    """The defaults back where this rank took them and nobody replaced ours since, the wakeup
    fd released; any request not yet acted on is forgotten (a later Sentinel in this process
    starts clean)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in taken:
        if signal.getsignal(signum) is _on_stop_signal:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT
                          else signal.SIG_DFL)
    if _wakeup and taken:
        _, write_end = _wakeup.pop()
        now = signal.set_wakeup_fd(-1)
        if now not in (-1, write_end):  # replaced since: keep theirs
            signal.set_wakeup_fd(now)
        os.close(write_end)  # the thread reads its end of file and ends
    _received.clear()


def end_if_asked(step: int, *, config: SentinelConfig, identity: RankIdentity) -> None:
    """Before a failed collective is diagnosed: a rank a signal already asked to stop ends at
    once with 128 + the signal and a ``stopped`` verdict, not at a common step (its peers never
    reached one: a dead peer, or torchrun stopping the survivors for a restart, which must not
    wait for the naming). Otherwise nothing."""
    signum = stop_requested()
    if not signum:
        return
    outcome, why = stop_cause(config.run_dir) or (
        STOPPED, f"{signal.Signals(signum).name} asked the run to stop")
    message = (f"{why}, and step {step}'s collectives failed (a peer is gone): this rank "
               "stopped at once, not at a step every rank agreed on; resume from the last "
               "checkpoint")
    log.error("nansentinel: rank %d: %s", identity.rank, message)
    try:
        leave_verdict(config, identity, step, outcome, message, signal=signum)
    finally:
        _flush()
        os._exit(128 + signum)


def _flush() -> None:
    """The logs and the standard streams out before an ``os._exit``."""
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def stop_requested() -> int:
    """The first stop signal this rank received (0: none): read when its row is packed."""
    return _received[0][0] if _received else 0


def leave_verdict(
    config: SentinelConfig, identity: RankIdentity, step: int, outcome: str, message: str,
    **details: Any,
) -> None:
    """Leave this rank's verdict where ``nansentinel run`` looks for it (if launched so):
    its file in the run directory, and the launcher's verdict socket, which needs no disk.
    ``details``: the other fields of :class:`~nansentinel.common.verdicts.RankVerdict`.

    Never raises: a full or read-only disk costs one line naming the file, not the job (a
    rank that trained every step still exits 0, and one that stops still raises its own
    error, not an ``OSError``)."""
    if not config.run_dir:
        return
    verdict = RankVerdict(
        rank=identity.rank, outcome=str(outcome), step=step, message=message,
        hostname=identity.hostname, local_rank=identity.local_rank, **details,
    )
    try:
        write_verdict(config.run_dir, verdict)
        problem = None
    except OSError as exc:
        problem = exc.strerror or str(exc) or type(exc).__name__
    sent = send_verdict(config.run_dir, verdict)
    if problem is not None:
        log.error(
            "nansentinel: rank %d could not write its %s verdict %s (%s); %s", identity.rank,
            outcome, verdict_path(config.run_dir, identity.rank), problem,
            "its launcher got it by socket" if sent
            else "its launcher has only this rank's exit status",
        )


def stop(
    ctx: Context, decision: Decision, result: StepResult, message: str, *, lingering: bool,
) -> None:
    """Raise :class:`NonFiniteError` (or :class:`HostExcludedError`) on this rank, after the
    exclusion record (rank 0), this rank's verdict and a barrier (armed by the watchdog), so
    that every rank raises with everything on disk. ``lingering`` keeps the exporter up
    ``config.metrics_linger`` seconds first.

    An exclusion record that cannot be written (a read-only or full filesystem) changes no
    rank's decision: rank 0 tells every rank what failed before anyone raises, every rank's
    error and verdict name it, and the host still leaves (its launcher runs ``--on-exclude``
    and exits 4); rank 0 logs the record as one JSON line to append once the file is
    writable."""
    config, identity = ctx.config, ctx.identity
    problem = None
    leaving = [host for host, _ in decision.exclusions]
    if leaving:  # the decision, not a rank's config, says who joins this one
        failed = (record_exclusion(ctx, decision, result)
                  if identity.rank == 0 and config.exclusion_file else None)
        # Rank 0's records (and report) are on disk, or every rank knows they are not.
        with ctx.guarded():
            problem = ctx.peers.gather_from([0], failed).get(0)
        if isinstance(problem, str):
            hosts, its = ((f"host {leaving[0]}", "its launcher") if len(leaving) == 1
                          else (f"hosts {', '.join(leaving)}", "each one's launcher"))
            message = (f"{message.rstrip('.')}. The exclusion of {hosts} could not be "
                       f"recorded: {problem}; it holds for this launch only ({its} runs "
                       "--on-exclude and exits 4), and rank 0 logged the record to append "
                       "once the file is writable.")
    leave_verdict(
        config, identity, result.step, result.outcome, message, bad_ranks=result.bad_ranks,
        bad_hosts=result.bad_hosts, kinds=result.kinds, excluded_host=decision.exclude_host,
        excluded_hosts=leaving, report_path=result.report_path,
        record_error=problem if isinstance(problem, str) else None,
    )
    # Every rank's verdict is left before anyone raises (torchrun stops a host's workers
    # as soon as one of them exits).
    with ctx.guarded():
        ctx.peers.barrier()
    if lingering and config.metrics_linger > 0:
        log.info(
            "nansentinel: rank %d keeps its exporter up %g s for the final scrape",
            identity.rank, config.metrics_linger,
        )
        time.sleep(config.metrics_linger)
    error = (HostExcludedError if decision.action == EXCLUDE
             else NonFiniteStateError if decision.cause == STATE else NonFiniteError)
    raise error(message, result)


def refuse_state(ctx: Context, check: StateCheck, when: str, step: int) -> None:
    """Read the model's whole state on every rank (rare/state.py) and, where any rank holds a
    non-finite value, leave this rank's verdict (``nansentinel run`` exits 6) and raise
    :class:`NonFiniteStateError` on every rank, once every rank's verdict is left."""
    try:
        check.refuse(when, step)
    except NonFiniteStateError as exc:
        result = exc.result
        leave_verdict(ctx.config, ctx.identity, step, result.outcome, str(exc),
                      bad_ranks=result.bad_ranks, bad_hosts=result.bad_hosts, kinds=result.kinds)
        with ctx.guarded():
            ctx.peers.barrier()
        if ctx.rank == 0:
            log.error("%s", exc)
        raise


def record_exclusion(ctx: Context, decision: Decision, result: StepResult) -> str | None:
    """Rank 0: append one exclusion record for each host the step excludes; what failed
    (one line naming the file), or None. A failure is logged with the records themselves, as
    the JSON lines the file would have held."""
    from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore

    store = ExclusionStore(str(ctx.config.exclusion_file))
    problem = None
    leaving = decision.exclusions
    for host, strikes in leaving:
        alone = len(leaving) == 1  # several hosts: each record says why that one leaves
        record = ExclusionRecord(
            host=host,
            reason=decision.reason if alone else exclusion_reason(host, strikes, ctx.config),
            step=result.step,
            evidence={
                "bad_ranks": result.bad_ranks if alone else sorted(
                    r.rank for r in decision.bad if r.identity.hostname == host),
                "kinds": result.kinds,
                "strikes": strikes,
                "report_path": result.report_path,
            },
            time=time.time(),
            job_id=ctx.job_id,
        )
        try:
            if problem is None:
                store.add(record)
                continue
        except Exception as exc:  # any failure: every rank must still hear of it and raise
            problem = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        log.error("nansentinel: rank 0 could not record the exclusion of host %s (%s); the "
                  "record, to append to %s once it is writable: %s", record.host, problem,
                  ctx.config.exclusion_file, record.to_json())
    return problem


def on_timeout(
    step: int,
    *,
    config: SentinelConfig,
    identity: RankIdentity,
    exchange: HealthExchange,
) -> None:
    """Watchdog thread: the step's collectives are stuck (a rank froze or died where no
    Python timeout reaches, or this host is cut off). Name the missing ranks, leave a
    verdict for the launcher and end the process, as NCCL's watchdog does; torchrun restarts
    or ends the job. The training thread may be blocked in C++ for good (gloo waits out
    the group's timeout, a cut-off link never resets): this thread ends the process from
    outside it."""
    error = exchange.diagnose(step, None)
    log.error("%s", error)
    end_failed(step, error, config=config, identity=identity, exchange=exchange)


def leave_timeout_verdict(
    step: int, error: ExchangeTimeoutError, *, config: SentinelConfig, identity: RankIdentity,
) -> None:
    """This rank's verdict for a failed or stuck collective of ``step``: the diagnosis."""
    leave_verdict(config, identity, step, EXCHANGE_TIMEOUT, str(error), missing=error.missing)


def end_failed(
    step: int,
    error: ExchangeTimeoutError,
    *,
    config: SentinelConfig,
    identity: RankIdentity,
    exchange: HealthExchange,
) -> NoReturn:
    """End this process with exit code 5 after a diagnosed collective failure: the verdict
    (again: it is cheap and the diagnosis may have had no run directory to write to yet),
    NCCL's flight recorder, the logs, and on rank 0 a grace for the others' diagnosis."""
    try:
        leave_timeout_verdict(step, error, config=config, identity=identity)
    except Exception as exc:  # a full or read-only disk: the exit must still come
        log.error("nansentinel: rank %d could not leave its verdict in %s: %s", identity.rank,
                  config.run_dir, exc)
    # os._exit skips NCCL's own dump of its flight recorder (the last collectives of every
    # group, which tell a hang from a desync): write it first, where torch would.
    dumped = dump_flight_recorder(exchange.backend, job_rank(identity.rank))
    if dumped is not None:
        log.error("nansentinel: rank %d left NCCL's flight recorder in %s",
                  identity.rank, dumped)
    _flush()
    if identity.rank == 0:
        # Without torchrun's agent store, rank 0 hosts the rendezvous store: linger so the
        # other live ranks can finish their own diagnosis before it goes away.
        time.sleep(diagnosis_grace(exchange.timeout))
    from nansentinel.common.exitcodes import EXIT_EXCHANGE_TIMEOUT

    os._exit(EXIT_EXCHANGE_TIMEOUT)


def exit_on_failure(
    exchange: HealthExchange,
    step: Callable[[], int],
    end: Callable[[int, ExchangeTimeoutError], None],
    closed: Callable[[], bool],
) -> None:
    """Make a failed collective end the process with exit code 5 whichever path saw it first.

    A dead peer reaches the training thread in many shapes: the exchange's
    :class:`ExchangeTimeoutError` from ``step()``, the same error wrapped by torch as
    ``RuntimeError: Got the following error when running the callback`` when DDP's hook
    future raised it inside ``backward()``, or gloo's own ``Connection closed by peer`` from a
    collective the sentinel does not wait on (FSDP2's all-gather and reduce-scatter, the
    user's own). A loop that catches it decides for itself; one that lets it escape would
    exit 1, which says "a worker failed" where the truth is "a rank stopped answering". So an
    uncaught error goes through the previous ``sys.excepthook`` (the traceback, as ever), and
    then, when this rank diagnosed a failed collective or the error is a transport failure
    (diagnosed now: the missing ranks named, the verdict left), ``end(step, error)`` exits 5.
    ``closed()``: the run closed cleanly (every rank met at its last barrier); a transport
    error after it is not the run's. A diagnosis made before stays one, even when the loop's
    ``finally`` closed the sentinel on its way out.
    """
    # A later Sentinel in the same process replaces an earlier one's hook, never stacks on it.
    previous = getattr(sys.excepthook, "nansentinel_previous", sys.excepthook)

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)  # the traceback first: the naming may take the timeout
        error = exchange.diagnosis
        if (error is None and not closed() and exchange.world_size > 1
                and is_transport_failure(value)):
            error = exchange.diagnose(step(), value)
        if error is not None:
            log.error("%s", error)
            end(step(), error)

    hook.nansentinel_previous = previous  # type: ignore[attr-defined]
    sys.excepthook = hook


def dump_flight_recorder(
    backend: str, rank: int, env: Mapping[str, str] | None = None
) -> Path | None:
    """Write NCCL's flight recorder for this process where torch's own dump goes; the path,
    or None where there is nothing to dump (not NCCL, a torch without the recorder, the
    buffer turned off with ``TORCH_FR_BUFFER_SIZE``/``TORCH_NCCL_TRACE_BUFFER_SIZE=0``) or
    the dump failed (logged: the exit must not wait on a diagnostic).

    The place is torch 2.13's ``DebugInfoWriter``'s: ``TORCH_FR_DUMP_TEMP_FILE``, else
    ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, else ``$XDG_CACHE_HOME`` (or ``$HOME/.cache``)
    ``/torch/comm_lib_trace_rank_``, followed by the global rank; with
    ``TORCH_FR_DUMP_DYNAMIC_FILE_NAME`` set, ``TORCH_FR_DUMP_TEMP_FILE`` itself. The content is
    the same pickle (``_dump_nccl_trace()``), so torch's ``fr_trace`` tool reads it. Written
    atomically: torch's watchdog may be writing the same file on its own timeout.
    """

    env = os.environ if env is None else env
    dump = insides.nccl_trace_dump()
    size = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", ""))
    if "nccl" not in backend or dump is None or size.strip() == "0":
        return None
    path = flight_recorder_path(rank, env)
    try:
        trace = dump()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as out:
            out.write(trace)
        os.replace(tmp, path)
    except Exception as exc:  # any failure: the process still has to exit now
        log.warning("nansentinel: could not dump NCCL's flight recorder to %s: %s", path, exc)
        return None
    return path


def flight_recorder_path(rank: int, env: Mapping[str, str]) -> Path:
    """Where torch's ``DebugInfoWriter`` writes ``rank``'s flight recorder (see
    :func:`dump_flight_recorder`)."""
    dynamic = env.get("TORCH_FR_DUMP_DYNAMIC_FILE_NAME", "").lower() in ("1", "true", "yes", "y")
    if dynamic and env.get("TORCH_FR_DUMP_TEMP_FILE"):
        return Path(env["TORCH_FR_DUMP_TEMP_FILE"])
    prefix = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if not prefix:
        cache = env.get("XDG_CACHE_HOME") or env.get("HOME", "/tmp") + "/.cache"
        prefix = f"{cache}/torch/comm_lib_trace_rank_"
    return Path(f"{prefix}{rank}")




class RunEnd:
    """How this rank's run ends: stopped by a decision (:meth:`stop_if`), closed at a common
    point of every rank (:meth:`close`), or abandoned after this rank's loop failed.

    Args:
        ctx: the run (its deadline arms the barriers and is closed last).
        judge: holds the exporter (``judge.metrics``), flushed before a stop and closed last.
        release: gives the model back as its framework made it (DeepSpeed's all-reduce
            switch), once the run is over.
    """

    def __init__(self, ctx: Context, judge: Any,
                 release: Callable[[], None] | None = None) -> None:
        self.ctx, self.judge, self.release = ctx, judge, release
        self.closed = False
        self.stopped = False
        """The run was stopped here: this rank's verdict is left already."""
        self.clean = False
        """Every rank met at the closing barrier: the run ended well."""
        self.stopping: tuple[int, int] | None = None
        """``(signal, step)``: a step decided with a stop request; the next call ends here."""
        self.signals: tuple[int, ...] = ()
        """The stop signals this rank took (:func:`take_stop_signals`), given back at the end."""

    def stop_if(self, decision: Decision, result: StepResult, *, serve: bool = True) -> None:
        """Raise the decision's abort (or exclusion) on this rank, everything on disk first.
        ``serve``: flush the exporter and linger for a last scrape first; False where a wider
        scope still decides the step (it leaves, and serves the end, once it has agreed)."""
        if not decision.stops:
            if result.stop_signal and self.stopping is None:
                self.stopping = (result.stop_signal, result.step)
            return
        self.stopped = True
        metrics = self.judge.metrics if serve else None
        if metrics is not None:  # the final state is served at once, not a second late
            metrics.flush()
        from nansentinel.rare.incident import describe_abort

        stop(self.ctx, decision, result, describe_abort(decision, result),
             lingering=metrics is not None)

    def end_if_stopping(self) -> None:
        """At a sentinel call after a step decided with a stop request (the same step on
        every rank): leave the ``stopped`` verdict, shut, and raise :class:`StopRequested`
        (exit 128 + the signal). No collective: every rank decided the same from the same
        sums, and the loop had that step's result to checkpoint."""
        if self.stopping is None:
            return
        signum, step = self.stopping
        self.stopped = True
        # The launcher that sent the signal may have said why (the rendezvous store is gone):
        # then that is the verdict, not a signal the user never sent.
        outcome, why = stop_cause(self.ctx.config.run_dir) or (
            STOPPED, f"{signal.Signals(signum).name} asked the run to stop")
        leave_verdict(self.ctx.config, self.ctx.identity, step, outcome,
                      f"{why}; every rank stopped after step {step}", signal=signum)
        log.warning("nansentinel: rank %d stops after step %d: %s",
                    self.ctx.identity.rank, step, why)
        self.shut()
        raise StopRequested(signum, step)

    def close(self, resolve: Callable[[], None], last_step: int) -> None:
        """``resolve()`` the pending step, meet every rank at one barrier (unless a collective
        failed: the group cannot be trusted with another), leave a ``closed`` verdict, shut.
        Once only. After a step decided with a stop request: the ``stopped`` verdict, and
        :class:`StopRequested` raised (exit 128 + the signal)."""
        if self.closed:
            return
        self.closed = True
        try:
            resolve()
            if not self.ctx.exchange.failed:
                with self.ctx.guarded():
                    self.ctx.peers.barrier()
                self.clean = True
                if not self.stopped and self.stopping is None:
                    leave_verdict(self.ctx.config, self.ctx.identity, last_step, CLOSED,
                                  "the sentinel closed cleanly: training finished")
        finally:
            self.shut()
        self.end_if_stopping()

    def shut(self) -> None:
        """Stop the exporter and the watchdog (no collective)."""
        self.closed = True
        metrics, self.judge.metrics = self.judge.metrics, None
        if metrics is not None:
            metrics.close()
        self.ctx.deadline.close()
        signals, self.signals = self.signals, ()
        give_back_stop_signals(signals)
        release, self.release = self.release, None
        if release is not None:
            release()
