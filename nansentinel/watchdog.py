"""A deadline on the step's collectives, so a dead or frozen rank never hangs the others.

Under DDP the gradient all-reduce runs inside ``loss.backward()``, in C++, where no Python
timeout reaches: with one rank frozen (SIGSTOP, a hung GPU) gloo waits for its process-group
timeout (30 minutes by default) and NCCL may wait forever. The watchdog is armed when a step's
first collective is launched and disarmed when the step's exchange completes; if the deadline
passes, it calls ``on_expire`` from its own thread — the sentinel names the missing ranks there
and ends the process, as NCCL's own watchdog does, so that torchrun can restart or end the job.

It also speaks for its rank while the step is merely slow. A live rank can be blocked in C++
waiting on a live peer (gloo's ring: rank 0 waits on rank 1, which is busy naming the dead rank
2) and only notice the failure after that peer has given up, so "it noticed in time" cannot be
the test of life. Once a step has been armed ``late_after`` seconds, the watchdog calls
``on_late(step)`` once — the exchange checks this rank in at the store, from this thread, which
no collective blocks. A killed or frozen (SIGSTOP) process has no running thread to do so.

Arming and disarming are two attribute writes: the normal step pays nothing else.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable

#: Watchdogs not yet closed; closed at interpreter exit (see :func:`_close_all`).
_LIVE: weakref.WeakSet[Watchdog] = weakref.WeakSet()


class Watchdog:
    """Calls ``on_expire(step)`` once if a step stays armed longer than ``timeout`` seconds.

    Args:
        timeout: seconds from :meth:`arm` to expiry.
        on_expire: called from the watchdog thread with the armed step.
        settled: says whether the armed collectives have in fact completed; a step whose
            collectives completed but that the loop never decided (it stopped after backward)
            must not kill the process later, so expiry asks this first.
        on_late: called once per armed step, from the watchdog thread, when the step has been
            armed ``late_after`` seconds (before expiry), in a thread of its own so that it
            cannot delay the expiry; exceptions are the callee's to handle.
        late_after: seconds from :meth:`arm` to ``on_late``.
        clock: monotonic clock (injected by tests).
        poll: how often the thread looks, in seconds.
    """

    def __init__(
        self,
        timeout: float,
        on_expire: Callable[[int], None],
        *,
        settled: Callable[[], bool] = lambda: False,
        on_late: Callable[[int], None] | None = None,
        late_after: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        poll: float = 0.5,
    ) -> None:
        self.timeout = timeout
        self.on_expire = on_expire
        self.settled = settled
        self.on_late = on_late
        self.late_after = late_after
        self.clock = clock
        self.poll = min(poll, timeout / 4, late_after / 4 if on_late and late_after else poll)
        # (step, deadline, time of on_late)
        self._armed: tuple[int, float, float] | None = None
        self._late_done: int | None = None
        self._stop = threading.Event()
        self.expired: int | None = None
        self._late_thread: threading.Thread | None = None
        self._thread = threading.Thread(target=self._run, name="nansentinel-watchdog", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def arm(self, step: int) -> None:
        """Start the deadline for ``step`` unless it is already running."""
        if self._armed is None:
            now = self.clock()
            self._armed = (step, now + self.timeout, now + self.late_after)

    def restart(self, step: int) -> None:
        """Count the deadline of ``step`` from now: a collective was just launched. Under
        gradient accumulation FSDP2 reduce-scatters every micro-batch while the exchange leaves
        only at ``step()``; the deadline bounds the wait on the collectives, never the user's
        own time between micro-batches."""
        now = self.clock()
        self._armed = (step, now + self.timeout, now + self.late_after)

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
            if self.on_late is not None and now > armed[2] and self._late_done != armed[0]:
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
                self.expired = armed[0]
                self.on_expire(armed[0])
                return


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
