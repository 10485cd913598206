"""A deadline on the step's collectives, so a dead or frozen rank never hangs the others.

Under DDP the gradient all-reduce runs inside ``loss.backward()``, in C++, where no Python
timeout reaches: with one rank frozen (SIGSTOP, a hung GPU) gloo waits for its process-group
timeout (30 minutes by default) and NCCL may wait forever. The watchdog is armed when a step's
first collective is launched and disarmed when the step's exchange completes; if the deadline
passes, it calls ``on_expire`` from its own thread — the sentinel names the missing ranks there
and ends the process, as NCCL's own watchdog does, so that torchrun can restart or end the job.

It also speaks for its rank when the step has stalled. A live rank can be blocked in C++
waiting on a live peer (gloo's ring: rank 0 waits on rank 1, which is busy naming the dead rank
2) and only notice the failure after that peer has given up, so "it noticed in time" cannot be
the test of life. Once a step has been armed ``late_after`` seconds (the exchange's timeout:
``exchange.late_after``) with its collectives still unfinished, the watchdog calls
``on_late(step)`` once — the exchange checks this rank in at the store, from this thread, which
no collective blocks. A killed or frozen (SIGSTOP) process has no running thread to do so. A
step that is merely slow (a long backward, a pause before ``step()``) never gets there, so a
healthy step never talks to the store; the first rank to diagnose a failure waits for that
point, counted from its own arming (:meth:`Watchdog.armed_for`).

Arming and disarming are two attribute writes: the normal step pays nothing else.

The deadline must also end before the process group's own timeout: past it NCCL's watchdog
ends the process, and nobody is named. :class:`TimeoutFit` shortens the exchange's timeout to
fit, at construction and again at each arming, when the group's timeout changed (torchtitan
shortens it to 100 s after the first step): an attribute read a backend, on the thread that
issues the step's collectives.

The watchdog's thread itself never touches a process group (but a work's ``is_completed()``,
which torch locks): ``ProcessGroup.getBackend`` inserts into an unlocked map the first time a
device type is asked for (the CUDA entry of a CPU run's gloo group, the CPU entry of a
``cpu:gloo,cuda:nccl`` group), and that insertion racing a collective on the same group is a
crash, not an error (the likeliest cause of a torchtitan rank's SIGSEGV in CI).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from nansentinel.common import torch_insides as insides
from nansentinel.config import SentinelConfig, env_var
from nansentinel.wire.exchange import diagnosis_grace, late_after

log = logging.getLogger("nansentinel")
#: Seconds kept between the end of the naming and the group's timeout (dump, exit).
_EXIT_MARGIN_S = 1.0
_DEFAULT_EXCHANGE_TIMEOUT = next(
    f.default for f in dataclasses.fields(SentinelConfig) if f.name == "exchange_timeout"
)

#: Watchdogs not yet closed; closed at interpreter exit (see :func:`_close_all`).
_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()


class Watchdog:
    """Calls ``on_expire(step)`` once if a step stays armed longer than ``timeout`` seconds.

    Args:
        timeout: seconds from :meth:`arm` to expiry.
        on_expire: called from the watchdog thread with the armed step.
        settled: says whether the armed collectives have in fact completed; a step whose
            collectives completed but that the loop never decided (it stopped after backward)
            must not kill the process later, so expiry asks this first, and neither is such a
            step late.
        late: ``(seconds, on_late)``: ``on_late(step)`` is called once per armed step, from
            the watchdog thread, when the step has been armed that many seconds (before
            expiry) and is not settled, in a thread of its own so that it cannot delay the
            expiry; exceptions are the callee's to handle.
        clock: monotonic clock (injected by tests).
        poll: how often the thread looks, in seconds.
    """

    def __init__(
        self,
        timeout: float,
        on_expire: Callable[[int], None],
        *,
        settled: Callable[[], bool] = lambda: False,
        late: tuple[float, Callable[[int], None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        poll: float = 0.5,
    ) -> None:
        late_after, on_late = late if late is not None else (0.0, None)
        self.on_expire = on_expire
        self.settled = settled
        self.on_late = on_late
        self.clock = clock
        self._max_poll = poll
        self.retime(timeout, late_after)
        # (step, deadline, time of on_late, time armed)
        self._armed: tuple[int, float, float, float] | None = None
        self._late_done: int | None = None
        self._stop = threading.Event()
        self._late_thread: threading.Thread | None = None
        self._thread = threading.Thread(target=self._run, name="nansentinel-watchdog", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def retime(self, timeout: float, late_after: float) -> None:
        """Use these seconds from the next :meth:`arm` on (a step already armed keeps its own)."""
        self.timeout = timeout
        self.late_after = late_after
        self.poll = min(self._max_poll, timeout / 4,
                        late_after / 4 if self.on_late and late_after else self._max_poll)

    def arm(self, step: int) -> None:
        """Start the deadline for ``step`` unless it is already running."""
        if self._armed is None:
            now = self.clock()
            self._armed = (step, now + self.timeout, now + self.late_after, now)

    @property
    def armed(self) -> bool:
        return self._armed is not None

    def restart(self, step: int) -> None:
        """Count the deadline of ``step`` from now: a collective was just launched. Under
        gradient accumulation FSDP2 reduce-scatters every micro-batch while the exchange leaves
        only at ``step()``; the deadline bounds the wait on the collectives, never the user's
        own time between micro-batches."""
        now = self.clock()
        self._armed = (step, now + self.timeout, now + self.late_after, now)

    def armed_for(self, step: int) -> float | None:
        """Seconds ``step`` has been armed (since its last :meth:`restart`), None when it is
        not the armed step."""
        armed = self._armed
        return self.clock() - armed[3] if armed is not None and armed[0] == step else None

    def disarm(self) -> None:
        self._armed = None

    def close(self) -> None:
        """Stop the thread (and wait, bounded, for a check-in in flight); safe to call twice."""
        self._stop.set()
        _LIVE.discard(self)
        for thread in (self._thread, self._late_thread):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            armed = self._armed
            if armed is None:
                continue
            now = self.clock()
            if (self.on_late is not None and now > armed[2] and self._late_done != armed[0]
                    and not self.settled()):
                self._late_done = armed[0]
                # Its own thread: a store that does not answer must not delay the expiry.
                self._late_thread = threading.Thread(
                    target=self.on_late, args=(armed[0],), name="nansentinel-check-in",
                    daemon=True,
                )
                self._late_thread.start()
            if now > armed[1]:
                if self.settled():
                    self._armed = None
                    continue
                self.on_expire(armed[0])
                return


def watchdog_deadline(timeout: float) -> float:
    """The watchdog's seconds for an exchange ``timeout``: later than the exchange's own
    timeout, so that a wait that can time out by itself raises in the training thread first."""
    return timeout + diagnosis_grace(timeout) + 2.0


def naming_seconds(timeout: float) -> float:
    """Seconds from a step's arming until a rank that noticed nothing has named the missing
    ranks: the watchdog's deadline, then the diagnosis. By the deadline the live ranks have
    checked in (at ``late_after``, the timeout) and the first diagnosing rank's own look is
    due (its arming, the timeout and a grace): it looks at once, and the others wait up to
    one grace for its answer."""
    return watchdog_deadline(timeout) + diagnosis_grace(timeout)


def group_backends(group: dist.ProcessGroup | None) -> list[Any]:
    """The backends of ``group`` (None: the default group), one a device type; empty when
    there is no group (or torch's fake backend).

    Call it on the thread that issues the group's collectives: the first look at a device
    type inserts into the group's unlocked backend map (see the module's docstring)."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    try:
        return insides.group_backends(group if group is not None else insides.default_group())
    except (RuntimeError, ValueError, AttributeError):
        return []


def backends_timeout(backends: list[Any]) -> float | None:
    """The shortest timeout, in seconds, of ``backends`` as ``init_process_group(timeout=)``,
    ``new_group(timeout=)`` or ``_set_pg_timeout`` left it; None when no backend says. One
    attribute read a backend: cheap enough for every step."""
    seconds = [
        t.total_seconds() for b in backends
        if isinstance(t := insides.backend_timeout(b), datetime.timedelta)
    ]
    return min(seconds, default=None)


def group_timeout(group: dist.ProcessGroup | None) -> float | None:
    """:func:`backends_timeout` of :func:`group_backends` (the same thread rule applies)."""
    return backends_timeout(group_backends(group))


def fitted_timeout(configured: float, group_seconds: float | None) -> float | None:
    """The longest exchange timeout, at most ``configured`` and in tenths of a second, whose
    naming (:func:`naming_seconds`) ends a second (the flight recorder's dump, the exit) before
    the group's own timeout; ``configured`` when it fits or the group's is unknown, None when
    none fits (a group timeout under about 13 s)."""
    if group_seconds is None:
        return configured
    limit = group_seconds - _EXIT_MARGIN_S
    if naming_seconds(configured) <= limit:
        return configured
    if naming_seconds(0.1) > limit:
        return None
    low, high = 0.1, configured  # naming_seconds is increasing: bisect to 1 ms
    while high - low > 1e-3:
        mid = (low + high) / 2
        low, high = (mid, high) if naming_seconds(mid) <= limit else (low, mid)
    fitted = math.floor(high * 10) / 10  # the boundary lies in [low, high]
    return fitted if naming_seconds(fitted) <= limit else round(fitted - 0.1, 1)


class TimeoutFit:
    """Keeps the exchange's timeout, and with it the watchdog's deadline, inside the process
    group's own timeout: the group's backends are found once, here, and their timeout read
    again at each arming (:meth:`check`), on the thread that issues the collectives.

    Clamped rather than only warned about: a group timeout shorter than the deadline is the
    normal case under torchtitan (100 s after the first step, against the 300 s default), and
    there the warning alone would leave every such run unnamed until the user acts, whereas
    the clamp costs nothing but an earlier stop that NCCL would have made anyway. Every rank
    reads the same group timeout, so every rank clamps alike. Rank 0 (``speak``) says so once
    per change, naming both values and the field and env var to set: a warning when the
    user chose ``exchange_timeout``, information when its default was shortened.

    Args:
        exchange: its ``group`` is read, its ``timeout`` set.
        configured: ``exchange_timeout`` as configured; the clamp never lengthens it.
        watchdog: retimed with :func:`watchdog_deadline` and :func:`late_after`.
        speak: log the clamp (rank 0).
    """

    def __init__(self, exchange: Any, configured: float, watchdog: Watchdog, *,
                 speak: bool) -> None:
        self.exchange = exchange
        self.configured = configured
        self.watchdog = watchdog
        self.speak = speak
        self._seen: float | None = None
        self._backends = group_backends(exchange.group)
        self.check()

    def check(self) -> None:
        """Read the group's timeout; refit if it changed since the last look."""
        seconds = backends_timeout(self._backends)
        if seconds is None or seconds == self._seen:
            return
        self._seen = seconds
        fitted = fitted_timeout(self.configured, seconds)
        timeout = self.configured if fitted is None else fitted
        if timeout != self.exchange.timeout:
            self.exchange.timeout = timeout
            self.watchdog.retime(watchdog_deadline(timeout), late_after(timeout))
        if self.speak and timeout != self.configured:
            # The default shortened is the sentinel adapting: said, not warned about. A value
            # the user chose and does not get is a warning.
            chosen = self.configured != _DEFAULT_EXCHANGE_TIMEOUT
            log.log(
                logging.WARNING if chosen else logging.INFO,
                "nansentinel: the process group's timeout (%g s) is shorter than "
                "exchange_timeout=%g s and the naming of missing ranks after it (%g s in all): "
                "NCCL would end the process first and nobody would be named. The sentinel now "
                "waits %g s for the other ranks; set exchange_timeout (%s) to at most %g s, or "
                "lengthen the group's timeout, to keep your own value",
                seconds, self.configured, naming_seconds(self.configured), timeout,
                env_var("exchange_timeout"), timeout,
            )
        elif self.speak and fitted is None:
            log.warning(
                "nansentinel: the process group's timeout (%g s) is too short for the sentinel "
                "to name missing ranks before it (that takes at least %g s); exchange_timeout "
                "stays %g s (%s). Lengthen the group's timeout to get the ranks named",
                seconds, naming_seconds(0.0), self.configured, env_var("exchange_timeout"),
            )


class StepDeadline:
    """The deadline on a run's collectives, as the step flow uses it: armed when a step's
    first collective leaves, restarted at each reduction, disarmed when the step's exchange
    completes, and around the rare path's own collectives (:meth:`guarded`). Alone (world
    size 1) there is nothing to wait for, and every call is a no-op.

    The step flow tells it which step is in progress (:attr:`step`), and what else may hold
    armed collectives that completed (:meth:`also_settled`: the device gate's pending step).

    Args:
        exchange: the run's exchange (its world, check-in, group timeout, and whether its
            collectives have completed).
        configured: ``exchange_timeout``; the watchdog is kept inside the group's own timeout
            (:class:`TimeoutFit`, now and whenever it changes).
        on_expire: ``fn(step)`` from the watchdog's thread when the deadline passes.
        speak: rank 0 says when the timeout is clamped.
    """

    def __init__(self, exchange: Any, configured: float, *,
                 on_expire: Callable[[int], None], speak: bool) -> None:
        #: The step in progress (the step flow's counter).
        self.step = 0
        self._settled: list[Callable[[], bool]] = [exchange.settled]
        self.dog: Watchdog | None = None
        self.fit: TimeoutFit | None = None
        if exchange.world_size > 1:
            self.dog = Watchdog(watchdog_deadline(configured), on_expire, settled=self.settled,
                                late=(late_after(configured), exchange.check_in))
            self.fit = TimeoutFit(exchange, configured, self.dog, speak=speak)
            # A diagnosis waits for the live ranks' check-ins from the step's arming on.
            exchange.armed_for = self.dog.armed_for

    def also_settled(self, settled: Callable[[], bool]) -> None:
        """``settled()`` says too whether the armed collectives have completed."""
        self._settled.append(settled)

    def settled(self) -> bool:
        """The armed collectives have completed (the watchdog asks before it fires)."""
        return any(s() for s in self._settled)

    def arm(self) -> None:
        if self.dog is not None:
            if not self.dog.armed and self.fit is not None:
                self.fit.check()  # the group's timeout, as the step about to be armed has it
            self.dog.arm(self.step)

    def restart(self) -> None:
        if self.dog is not None:
            self.dog.restart(self.step)

    def disarm(self) -> None:
        if self.dog is not None:
            self.dog.disarm()

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """Armed around a collective outside the step's own (replay, gather, barrier), so
        that a rank that dies there is named too."""
        self.arm()
        try:
            yield
        finally:
            self.disarm()

    def close(self) -> None:
        if self.dog is not None:
            self.dog.close()
            self.dog = None


@atexit.register
def _close_all() -> None:
    """Stop every watchdog before the interpreter finalizes.

    A daemon thread still running at finalization is stopped wherever it stands; inside a
    call into torch (a store write that released the GIL) that ends the process with
    "terminate called without an active exception", which torchrun counts as a failed
    worker. A script that just returns, without ``Sentinel.close()``, must exit 0.
    """
    for dog in list(_LIVE):
        dog.close()
