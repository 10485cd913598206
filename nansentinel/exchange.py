"""The exchange: each rank's health row in, the same cluster view out on every rank.

Rank ``r`` writes its row into slot ``r`` of a zero vector of ``world_size * FIELDS`` floats and
the vector is summed across ranks. A sum is element-wise, so a NaN loss in rank 1's slot stays
in rank 1's slot: every rank learns who is poisoned, which is what a gradient all-reduce alone
loses. With DDP the vector is launched asynchronously from inside the last gradient bucket's
communication hook, so it leaves together with the gradients and costs no round trip after
backward; without DDP it is one small collective at ``step()``. With no process group (one
process) the same code runs and the "collective" is the identity.

The vector is fp32 (flags as 0/1 floats): NCCL reduces no bool, and one dtype keeps it one
collective. The only host synchronisation of a step is :meth:`HealthExchange.wait`.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading

import torch
import torch.distributed as dist

from nansentinel.collectives import Peers
from nansentinel.result import ExchangeTimeoutError, RankIdentity
from nansentinel.view import FIELDS, ClusterView, unpack_view

log = logging.getLogger("nansentinel")

_STORE_PREFIX = "nansentinel/arrived"


class HealthExchange:
    """Sums per-rank health rows across a process group, or passes them through alone.

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
        #: detection (gathers for the report, the replay's batch), which are not the exchange.
        self.peers = peers = Peers(group, device)
        self.distributed, self.group = peers.distributed, group
        self.rank, self.world_size = peers.rank, peers.world_size
        self.timeout = timeout
        self.device = device
        self.comm_device = peers.comm_device
        self.supports_avg = peers.supports_avg
        self._vector: torch.Tensor | None = None
        self._work: dist.Work | None = None
        self._step = -1
        self._diagnosed: tuple[int, ExchangeTimeoutError] | None = None
        self._checked_in: str | None = None
        self._checkin_lock = threading.Lock()
        self._lock = threading.Lock()
        # Check-in keys must not collide with an earlier attempt of the same job.
        self._attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    @property
    def launched(self) -> bool:
        return self._vector is not None

    def settled(self) -> bool:
        """True when this step's exchange was launched and its collective has completed."""
        work = self._work
        return self._vector is not None and (work is None or work.is_completed())

    def launch(self, step: int, row: torch.Tensor) -> None:
        """Start summing this rank's ``row`` across the group (asynchronous)."""
        # Zeros around this rank's slot, in one op.
        before, after = self.rank * FIELDS, (self.world_size - self.rank - 1) * FIELDS
        vector = torch.nn.functional.pad(row.to(self.comm_device), (before, after))
        self._vector, self._step = vector, step
        if not self.peers.alone:
            self._work = dist.all_reduce(vector, group=self.group, async_op=True)

    def wait(self, identities: list[RankIdentity]) -> ClusterView:
        """Wait for the sum (bounded by the timeout) and return the cluster view.

        This is the step's one host synchronisation.
        """
        step, vector, work = self._pop("wait")
        self._bounded_wait(step, work, identities)
        return unpack_view(step, vector.tolist(), identities)

    def take(self, identities: list[RankIdentity]) -> tuple[int, torch.Tensor]:
        """This step's summed vector, still where it was summed, without reading it.

        On NCCL the current CUDA stream waits for the collective and the host does not (no
        timeout is passed: with one, NCCL would block the host; the watchdog bounds a hang).
        Elsewhere (gloo, one process) the host waits, bounded by the timeout, as in
        :meth:`wait`: there is no device to overlap with.
        """
        step, vector, work = self._pop("take")
        if work is not None and vector.device.type == "cuda":
            work.wait()
        else:
            self._bounded_wait(step, work, identities)
        return step, vector

    def _pop(self, caller: str) -> tuple[int, torch.Tensor, dist.Work | None]:
        """This step's launched vector and its collective, handed over once."""
        if self._vector is None:
            raise RuntimeError(f"HealthExchange.{caller}() before launch()")
        vector, work, step = self._vector, self._work, self._step
        self._vector, self._work = None, None
        return step, vector, work

    def _bounded_wait(
        self, step: int, work: dist.Work | None, identities: list[RankIdentity]
    ) -> None:
        """Wait for ``work`` at most the timeout; a failure or a timeout is diagnosed."""
        if work is None:
            return
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            raise self.diagnose(step, identities, exc) from exc
        if done is False:
            raise self.diagnose(step, identities, None)

    def diagnose(
        self, step: int, identities: list[RankIdentity], cause: BaseException | None
    ) -> ExchangeTimeoutError:
        """The error for a collective of ``step`` that failed or timed out, naming the ranks
        (and hosts) that did not answer. Diagnosed once per step: DDP may report the same
        failure once per gradient bucket."""
        with self._lock:
            if self._diagnosed is None or self._diagnosed[0] != step:
                self._diagnosed = (step, self._diagnose(step, identities, cause))
            return self._diagnosed[1]

    def diagnosed(
        self, future: torch.futures.Future, step: int, identities: list[RankIdentity]
    ) -> torch.futures.Future:
        """``future`` (a gradient bucket's all-reduce) with a failure turned into the one
        diagnosis of ``step``: DDP then reports, from ``backward()``, the same message naming
        the missing ranks and hosts as the exchange wait and the watchdog do."""

        def reduced(fut: torch.futures.Future) -> torch.Tensor:
            try:
                return fut.value()[0]
            except RuntimeError as exc:  # a peer died: say which one, not just "reset by peer"
                raise self.diagnose(step, identities, exc) from exc

        return future.then(reduced)

    def _diagnose(
        self, step: int, identities: list[RankIdentity], cause: BaseException | None
    ) -> ExchangeTimeoutError:
        missing = self._missing_ranks(step)
        me = identities[self.rank] if identities else None
        where = f"rank {self.rank}" + (f" on host {me.hostname}" if me else "")
        if missing is None:
            who = "could not tell which ranks are missing (the rendezvous store is unreachable)"
        elif missing:
            names = ", ".join(
                f"rank {r} ({identities[r].hostname})" if r < len(identities) else f"rank {r}"
                for r in missing
            )
            who = f"no answer from {names}"
        else:
            who = "every rank checked in, so the failure is in the transport itself"
        detail = f" (cause: {cause})" if cause else ""
        return ExchangeTimeoutError(
            f"nansentinel: the collectives of step {step} failed or timed out after "
            f"{self.timeout:g} s on {where}; {who}. This rank stops here; torchrun restarts "
            f"or ends the job as configured{detail}",
            missing or [],
        )

    def check_in(self, step: int) -> None:
        """Say at the rendezvous store that this rank is alive in ``step``.

        Called by the diagnosis and, for a step that is merely slow, by the watchdog thread
        (see watchdog.py): a live rank blocked in C++ behind a live peer must not be named as
        missing because it noticed the failure late. Keeps one key per rank: the previous
        step's key is removed. A store that is gone is logged, not raised.
        """
        store = _default_store()
        if store is None:
            return
        key = f"{_STORE_PREFIX}/{self._attempt}/{step}/{self.rank}"
        try:
            store.set(key, "1")
            with self._checkin_lock:  # not self._lock: diagnose() holds that while it calls here
                previous, self._checked_in = self._checked_in, key
            if previous is not None and previous != key:
                store.delete_key(previous)
        except RuntimeError as exc:  # the store itself may be gone with rank 0
            log.debug("nansentinel: check-in for step %d failed: %s", step, exc)

    def _missing_ranks(self, step: int) -> list[int] | None:
        """After a failure, find the ranks that are not alive with us in the same step.

        Every live rank checks in at the rendezvous store: the one that diagnoses, at once;
        one still blocked in a collective, from its watchdog thread once the step is late.
        Ranks that have not checked in within the grace period are dead or frozen. This costs
        nothing on the normal step. None: no store to ask.
        """
        store = _default_store()
        if store is None:
            return None
        prefix = f"{_STORE_PREFIX}/{self._attempt}/{step}"
        self.check_in(step)
        try:
            grace = diagnosis_grace(self.timeout)
            keys = [f"{prefix}/{r}" for r in range(self.world_size)]
            try:
                store.wait(keys, datetime.timedelta(seconds=grace))
                return []
            except RuntimeError:
                pass
            return [r for r in range(self.world_size) if not store.check([f"{prefix}/{r}"])]
        except RuntimeError as exc:  # the store itself may be gone with rank 0
            log.warning("nansentinel: rendezvous store unreachable after a timeout: %s", exc)
            return None


def _default_store() -> dist.Store | None:
    """The default process group's store (torchrun's agent store, or the init_method's)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def diagnosis_grace(timeout: float) -> float:
    """Seconds the live ranks give each other to check in after a failed collective.

    It must cover :func:`late_after` (when a live rank blocked in a collective checks in from
    its watchdog thread), the watchdog's poll, and the spread between the moments live ranks
    entered the step: at least 5 s, and up to 10 s for long timeouts.
    """
    return min(10.0, max(5.0, timeout / 2))


def late_after(timeout: float) -> float:
    """Seconds a step may stay unfinished before the watchdog checks its rank in as alive.

    Half the diagnosis grace (2.5 to 5 s): early enough that a peer's diagnosis, which waits
    the whole grace after its own failure, sees the check-in; late enough that a healthy step
    almost never pays the one store write.
    """
    return diagnosis_grace(timeout) / 2
