"""The exchange: each rank's fixed-size health vector in, the same totals out on every rank.

Each rank packs its flags and values into ``schema.SIZE`` floats (schema.pack): ``T.size`` of them
are summed across ranks, the rest is this rank's own row, read back with the sums in the same
host copy. A sum of flags is a count, and a sum of the flagged ranks' indices names the rank
when one is flagged, so a healthy step exchanges ``schema.EXCHANGE_BYTES`` bytes at any world
size and every rank reads the same numbers. With DDP the sum is launched asynchronously from
inside the last gradient bucket's communication hook, so it leaves together with the gradients
and costs no round trip after backward; without DDP it is one small collective at ``step()``.
With no process group (one process) the same code runs and the "collective" is the identity.

The only host synchronisation of a step is :meth:`HealthExchange.wait` (or, on the device gate,
the later read of the copy :meth:`take` leaves on the device).

When a collective fails or hangs, the live ranks check in at the rendezvous store and one of
them (the first to diagnose) names the ranks that did not: O(world) store requests in all,
never per rank, so a failure at 100,000 ranks does not flood the store. A healthy step never
talks to the store, however long it takes: a live rank checks in on its own (from the
watchdog's thread) only once its step has been armed for the whole timeout with its
collectives unfinished, when the step counts as failed anyway, and the first rank to diagnose
waits for that point (its own step's arming, plus the timeout and a grace) before it looks.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from nansentinel.common import torch_insides as insides
from nansentinel.common.bounded import OneAtATime
from nansentinel.result import NAMED, ExchangeTimeoutError, RankIdentity
from nansentinel.wire.collectives import Peers
from nansentinel.wire.schema import T

log = logging.getLogger("nansentinel")

_STORE_PREFIX = "nansentinel/arrived"
_IDENTITY_PREFIX = "nansentinel/identity"
#: Keys asked at once when the diagnosing rank looks for the ranks that did not check in.
_CHUNK = 1024
#: Seconds a diagnosis gives the store beyond its own waits (a few requests, a slow answer)
#: before it takes the store for unreachable (see :func:`store_bound`).
_STORE_MARGIN_S = 3.0
#: What a collective that failed in its transport says (gloo's TCP pairs, NCCL's
#: communicators), for an error that reached the training thread outside the sentinel's own
#: waits (FSDP's all-gather or reduce-scatter, the user's own collective): ``DistError``
#: and its kinds say so by type; gloo raises a plain ``RuntimeError`` naming its source file.
#: Only the backends' own words: a data loader's "Connection reset by peer" is not one.
_TRANSPORT_FAILURE = re.compile(
    r"gloo/transport|NCCL (error|communicator)|ncclRemoteError|ncclSystemError"
    # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every collective in a monitored barrier first: a
    # dead or cut-off peer fails there, with this wording, before the transport is reached.
    r"|failed to pass monitoredBarrier")


class HealthExchange:
    """Sums per-rank health vectors across a process group, or passes them through alone.

    Args:
        group: the process group; None means the default group when one is initialised,
            else no collective at all (world size 1).
        device: the device of the flags; the collective runs there for NCCL, on CPU for gloo.
        timeout: seconds to wait for the other ranks before naming the missing ones.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, device: torch.device, timeout: float
    ) -> None:
        #: The process group and this rank's place in it; also the small collectives of a
        #: detection (the flagged ranks' rows, the replay's batch), which are not the exchange.
        self.peers = peers = Peers(group, device)
        self.distributed, self.group = peers.distributed, group
        self.rank, self.world_size = peers.rank, peers.world_size
        self.timeout = timeout
        self.device = device
        self.comm_device = peers.comm_device
        #: The group's backend ("" alone): the stop path dumps NCCL's flight recorder.
        self.backend = str(dist.get_backend(group)) if peers.distributed else ""
        #: The collectives run under NCCL, whose works complete at enqueue (see
        #: :meth:`diagnosed`) and whose failures are seen only by a deadline.
        self.nccl = self.comm_device.type == "cuda"
        self._vector: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._step = -1
        self._diagnosed: tuple[int, ExchangeTimeoutError] | None = None
        self._checked_in: str | None = None
        self._checkin_lock = threading.Lock()
        self._lock = threading.Lock()
        #: Who this rank is, for a diagnosis that names it; set by :meth:`publish`.
        self.identity: RankIdentity | None = None
        #: Seconds ``step`` has been armed on this rank (``Watchdog.armed_for``), None when it
        #: is not: a diagnosis waits for the live ranks' late check-ins from that point on.
        self.armed_for: Callable[[int], float | None] | None = None
        #: Called once per diagnosis, with the step and the error, before the error is
        #: raised anywhere: the run leaves its verdict there, so the launcher learns why
        #: whichever path raised it and whatever the user's loop does with the error.
        self.on_diagnosed: Callable[[int, ExchangeTimeoutError], None] | None = None
        #: Called with the step before a diagnosis begins: a rank already asked to stop by a
        #: signal ends there at once (effects/stop.py ``end_if_asked``) instead of spending the
        #: naming's seconds on peers that are gone (a torchrun restart's SIGTERM).
        self.before_diagnosis: Callable[[int], None] | None = None
        # Check-in keys must not collide with an earlier attempt of the same job.
        self._attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def publish(self, identity: RankIdentity) -> None:
        """Leave this rank's identity at the rendezvous store (one write; nothing is gathered),
        so that a diagnosis can name the host of a rank that stopped answering."""
        self.identity = identity
        store = _default_store() if self.world_size > 1 else None
        if store is None:
            return
        try:
            store.set(f"{_IDENTITY_PREFIX}/{self._attempt}/{self.rank}",
                      json.dumps(identity.to_json()))
        except RuntimeError as exc:  # a store that takes no writes (the fake backend's)
            log.debug("nansentinel: rank %d could not publish its identity: %s", self.rank, exc)

    @property
    def launched(self) -> bool:
        return self._vector is not None

    @property
    def failed(self) -> bool:
        """A collective of this exchange failed or timed out (and was diagnosed): the group
        cannot be trusted with another one."""
        return self._diagnosed is not None

    def settled(self) -> bool:
        """True when this step's exchange was launched and its collective has completed.

        On NCCL a work that failed (timed out in NCCL's watchdog, or aborted) also says
        ``is_completed()``; it is not settled, so that the sentinel's watchdog still names the
        missing ranks: nothing else on NCCL will (see :meth:`diagnosed`). On gloo a failed
        work raises in :meth:`wait` in the training thread, which diagnoses it there.
        """
        work = self._work
        if self._vector is None:
            return False
        if work is None:
            return True
        return bool(work.is_completed()) and not (self.nccl and nccl_failed(work))

    def launch(self, step: int, vector: torch.Tensor) -> None:
        """Start summing the totals of this rank's ``vector`` (``schema.pack``) across the group
        (asynchronous); its own part stays as it is."""
        vector = vector.to(self.comm_device)
        self._vector, self._step = vector, step
        if not self.peers.alone:
            self._work = dist.all_reduce(vector[:T.size], group=self.group, async_op=True)

    def wait(self) -> tuple[int, list[float]]:
        """Wait for the sum; the step and the vector as host floats.

        This is the step's one host synchronisation: on NCCL the read itself (``tolist``),
        after the current stream was made to wait for the collective (:meth:`_wait`); on gloo
        the wait, bounded by the timeout.
        """
        step, vector, work = self._pop("wait")
        self._wait(step, work)
        return step, vector.tolist()

    def take(self) -> tuple[int, torch.Tensor]:
        """This step's summed vector, still where it was summed, without reading it.

        On NCCL the current CUDA stream waits for the collective and the host does not
        (:meth:`_wait`). Elsewhere (gloo, one process) the host waits, bounded by the timeout,
        as in :meth:`wait`: there is no device to overlap with.
        """
        step, vector, work = self._pop("take")
        self._wait(step, work)
        return step, vector

    def _wait(self, step: int, work: dist.Work | None) -> None:
        """Order what follows after ``work``. NCCL: the current stream waits for it, with no
        timeout: with one, NCCL blocks the host and polls the work's events with short sleeps
        until it completes, before the read syncs again; the step's deadline (the watchdog)
        already bounds a hang and names the missing ranks. Gloo: the host waits, bounded by the
        timeout (:meth:`_bounded_wait`)."""
        if work is None or not self.nccl:
            self._bounded_wait(step, work)
            return
        try:
            work.wait()
        except RuntimeError as exc:  # NCCL's watchdog already failed it
            raise self.diagnose(step, exc) from exc

    def _pop(self, caller: str) -> tuple[int, torch.Tensor, dist.Work | None]:
        """This step's launched vector and its collective, handed over once."""
        if self._vector is None:
            raise RuntimeError(f"HealthExchange.{caller}() before launch()")
        vector, work, step = self._vector, self._work, self._step
        self._vector, self._work = None, None
        return step, vector, work

    def _bounded_wait(self, step: int, work: dist.Work | None) -> None:
        """Wait for ``work`` at most the timeout; a failure or a timeout is diagnosed."""
        if work is None:
            return
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise self.diagnose(step, exc) from exc
        if done is False:
            raise self.diagnose(step, None)

    def diagnose(self, step: int, cause: BaseException | None) -> ExchangeTimeoutError:
        """The error for a collective of ``step`` that failed or timed out, naming the ranks
        (and hosts) that did not answer. Diagnosed once per step: DDP may report the same
        failure once per gradient bucket."""
        if self.before_diagnosis is not None:
            self.before_diagnosis(step)
        with self._lock:
            if self._diagnosed is None or self._diagnosed[0] != step:
                self._diagnosed = (step, self._diagnose(step, cause))
                if self.on_diagnosed is not None:
                    try:
                        self.on_diagnosed(step, self._diagnosed[1])
                    except Exception as exc:  # the error itself must still be raised
                        log.error("nansentinel: rank %d could not record its diagnosis of "
                                  "step %d: %s", self.rank, step, exc)
            return self._diagnosed[1]

    @property
    def diagnosis(self) -> ExchangeTimeoutError | None:
        """The last diagnosis this rank made (None: no collective of it failed)."""
        diagnosed = self._diagnosed
        return diagnosed[1] if diagnosed is not None else None

    def diagnosed(
        self, future: torch.futures.Future, step: int, reduced_in_place: torch.Tensor
    ) -> torch.futures.Future:
        """``future`` (a gradient bucket's all-reduce of ``reduced_in_place``) resolving to that
        tensor, with a failure turned into the one diagnosis of ``step``.

        Gloo: the future completes when the all-reduce has, with the error of a peer that
        died ("connection reset"); the callback turns it into the diagnosis, and DDP reports
        it from ``backward()``, naming the missing ranks and hosts as the exchange wait and the
        watchdog do.

        NCCL: the future completes as soon as the all-reduce is *enqueued* (the callback's
        stream then waits on the collective's CUDA events), so no error ever reaches it: a
        dead or frozen peer leaves the kernel spinning and the host running on. There the
        error path is the step's deadline: the sentinel's watchdog, armed before the first
        bucket, finds the exchange unsettled (:meth:`settled` does not take a failed NCCL work
        for a finished one) and names the missing ranks (``stop.on_timeout``), before NCCL's
        own timeout ends the process, because :class:`~nansentinel.wire.watchdog.TimeoutFit` keeps
        the deadline inside the group's. The callback below is then only the pass-through
        DDP's Python hook interface requires; the ``except`` cannot fire there.
        """

        def reduced(fut: torch.futures.Future) -> torch.Tensor:
            try:
                fut.wait()
            except RuntimeError as exc:  # a peer died: say which one, not just "reset by peer"
                raise self.diagnose(step, exc) from exc
            return reduced_in_place

        return future.then(reduced)

    def _diagnose(self, step: int, cause: BaseException | None) -> ExchangeTimeoutError:
        bound = self._look_in(step) + store_bound(self.timeout)
        # The store across a partition blocks each request for its own timeout: bounded.
        call = OneAtATime(lambda: self._missing_ranks(step), "nansentinel-diagnosis")
        until = time.monotonic() + bound
        while True:  # in slices: a stop a signal asks meanwhile ends it (before_diagnosis)
            answered, found = call(max(0.0, min(0.5, until - time.monotonic())))
            if answered or time.monotonic() >= until:
                break
            if self.before_diagnosis is not None:
                self.before_diagnosis(step)
        me = self.identity
        where = f"rank {self.rank}" + (f" on host {me.hostname}" if me else "")
        missing: list[int] = []
        if not answered:
            who = (f"could not reach the rendezvous store at {store_address()} (no answer "
                   f"in {bound:.0f} s: this host may be cut off from the others), so could not "
                   f"tell which of the other {self.world_size - 1} rank(s) are missing")
        elif found is None:
            who = "could not tell which ranks are missing (the rendezvous store is unreachable)"
        elif found[0]:
            missing, hosts = found
            names = ", ".join(
                f"rank {r} ({hosts[r]})" if r in hosts else f"rank {r}" for r in missing[:NAMED]
            )
            more = f" and {len(missing) - NAMED} more" if len(missing) > NAMED else ""
            who = f"no answer from {names}{more}"
        else:
            who = "every rank checked in, so the failure is in the transport itself"
        detail = f" (cause: {cause})" if cause else ""
        return ExchangeTimeoutError(
            f"nansentinel: the collectives of step {step} failed or timed out after "
            f"{self.timeout:g} s on {where}; {who}. This rank stops here; torchrun restarts "
            f"or ends the job as configured{detail}",
            missing,
        )

    def check_in(self, step: int) -> None:
        """Say at the rendezvous store that this rank is alive in ``step`` (once per step).

        Called by the diagnosis and, for a step armed the whole timeout with its collectives
        unfinished, by the watchdog thread (see watchdog.py): a live rank blocked in C++ behind
        a live peer must not be named as missing because it noticed the failure late. Two
        writes (this rank's key, and one count shared by all); the rank that completes the
        count says so, so that nobody has to look for the missing. The keys stay bounded for
        the life of the job: a rank's check-in removes its key and the count and answer of
        the step it last checked in for (which it has passed, so nobody diagnoses it any
        more), and a failed step ends the attempt. A store that is gone is logged, not raised.
        """
        store = _default_store()
        if store is None:
            return
        prefix = f"{_STORE_PREFIX}/{self._attempt}/{step}"
        key = f"{prefix}/{self.rank}"
        with self._checkin_lock:  # not self._lock: diagnose() holds that while it calls here
            if self._checked_in == key:
                return
            previous, self._checked_in = self._checked_in, key
        try:
            store.set(key, "1")
            if store.add(f"{prefix}/count", 1) >= self.world_size:
                store.set(f"{prefix}/missing", "[]")
            if previous is not None:
                before = previous.rsplit("/", 1)[0]
                for stale in (previous, f"{before}/count", f"{before}/missing"):
                    store.delete_key(stale)
        except RuntimeError as exc:  # the store itself may be gone with rank 0
            log.debug("nansentinel: check-in for step %d failed: %s", step, exc)

    def _missing_ranks(self, step: int) -> tuple[list[int], dict[int, str]] | None:
        """After a failure, find the ranks that are not alive with us in the same step, and
        their hosts.

        Every live rank checks in at the rendezvous store: the one that diagnoses, at once;
        one still blocked in a collective, from its watchdog thread once the step has been
        armed the whole timeout. When the last rank checks in, the count says so and every
        rank reads "nobody". Otherwise the first rank that diagnosed waits until the blocked
        ones have had their turn (:meth:`_look_in`), then looks for the ranks without a key
        (a thousand keys a request, then one by one within a failed chunk), reads their
        identities, and leaves the answer for the others, who wait for it a grace longer.
        This costs nothing on the normal step. None: no store to ask, or no answer.
        """
        store = _default_store()
        if store is None:
            return None
        prefix = f"{_STORE_PREFIX}/{self._attempt}/{step}"
        self.check_in(step)
        grace = diagnosis_grace(self.timeout)
        answer = f"{prefix}/missing"
        try:
            first = store.add(f"{prefix}/diagnosing", 1) == 1
            try:
                store.wait([answer], datetime.timedelta(seconds=self._look_in(step)))
            except RuntimeError:
                if not first:  # the first to diagnose names them; give it time to look
                    store.wait([answer], datetime.timedelta(seconds=grace))
                else:
                    store.set(answer, json.dumps(self._look_for_missing(store, prefix)))
            found = json.loads(store.get(answer))
        except RuntimeError as exc:  # the store itself may be gone with rank 0
            log.warning("nansentinel: rendezvous store unreachable after a timeout: %s", exc)
            return None
        if not found:
            return [], {}
        return [int(r) for r, _ in found], {int(r): h for r, h in found if h}

    def _look_in(self, step: int) -> float:
        """Seconds from now until the first diagnosing rank may look for the missing: the live
        ranks blocked in ``step`` check in when it has been armed ``late_after`` (the
        timeout), so it waits until this rank's own arming plus the timeout and a grace for
        the spread between ranks (at least a tenth of a second: the count may be complete
        already). A rank whose step is not armed (no watchdog) counts from now."""
        armed = self.armed_for(step) if self.armed_for is not None else None
        until = late_after(self.timeout) + diagnosis_grace(self.timeout)
        return max(0.1, until - (armed if armed is not None else 0.0))

    def _look_for_missing(self, store: dist.Store, prefix: str) -> list[list[object]]:
        """[rank, hostname or ""] for every rank with no check-in key under ``prefix``."""
        missing: list[int] = []
        for start in range(0, self.world_size, _CHUNK):
            ranks = range(start, min(start + _CHUNK, self.world_size))
            if not store.check([f"{prefix}/{r}" for r in ranks]):
                missing.extend(r for r in ranks if not store.check([f"{prefix}/{r}"]))
        out: list[list[object]] = []
        for i, r in enumerate(missing):
            host = ""
            key = f"{_IDENTITY_PREFIX}/{self._attempt}/{r}"
            if i < NAMED and store.check([key]):
                host = json.loads(store.get(key)).get("hostname", "")
            out.append([r, host])
        return out


def store_bound(timeout: float) -> float:
    """Seconds a diagnosis waits for the rendezvous store beyond the point where it may look
    for the missing ranks (:meth:`HealthExchange._look_in`): the other ranks' grace for the
    answer, and a margin for the requests themselves. Past it the store counts as
    unreachable, and the rank ends anyway, saying so (the cut-off side of a partition)."""
    return diagnosis_grace(timeout) + _STORE_MARGIN_S


def store_address() -> str:
    """``host:port`` of the default group's store, for a message; "?" where it has none
    (a file or hash store)."""
    store = _default_store()
    while store is not None and hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None and port is not None else "?"


def is_transport_failure(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an error it was raised from, is a collective that failed in its
    transport (a peer died or is cut off), as opposed to an error of the training loop."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ExchangeTimeoutError | dist.DistError) or (
                isinstance(exc, RuntimeError) and _TRANSPORT_FAILURE.search(str(exc))):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def nccl_failed(work: dist.Work) -> bool:
    """Whether NCCL's watchdog failed ``work`` (timed out, or a communicator error): its
    result future (``get_future_result``, NCCL only) holds a ``WorkResult`` other than
    ``SUCCESS`` (0). Not ``work.exception()``: deprecated, it warns on every call, and it is
    called from the watchdog's thread."""
    result = work.get_future_result()  # type: ignore[attr-defined]  # NCCL's Work only
    return bool(result.done()) and int(result.value()) != 0


def _default_store() -> dist.Store | None:
    """The default process group's store (torchrun's agent store, or the init_method's)."""
    try:
        return insides.default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def diagnosis_grace(timeout: float) -> float:
    """Seconds the live ranks give each other around a failed collective's check-ins.

    It must cover the spread between the moments live ranks armed the step (a live rank
    blocked in a collective checks in once its own step has been armed :func:`late_after`),
    the watchdog's poll and the store's latency: at least 5 s, and up to 10 s for long
    timeouts.
    """
    return min(10.0, max(5.0, timeout / 2))


def late_after(timeout: float) -> float:
    """Seconds a step may stay armed with its collectives unfinished before the watchdog
    checks its rank in as alive: the whole exchange timeout.

    Earlier, a step that is merely slow (5 to 15 s steps are normal for large models) would
    talk to the store: measured, 12 requests in 2 healthy 7 s steps on 2 ranks, and at
    131,072 ranks about 393,000 a step on one TCPStore. At the timeout the step counts as
    failed anyway, and the first diagnosing rank waits for this point (``_look_in``).
    """
    return timeout
