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

import dataclasses
import datetime
import io
import json
import logging
import math
import os
import threading

import torch
import torch.distributed as dist

from nansentinel.result import KINDS, ExchangeTimeoutError, RankIdentity

log = logging.getLogger("nansentinel")

# Layout of one rank's row in the health vector.
# Three values whose finiteness is the check (batch norm, loss, gradient norm), then four
# host-known flags. No flag is computed on the device: a NaN or Inf survives the element-wise
# sum in its own slot (x + 0 = x), so the host reads finiteness after the one sync.
F_BATCH_NORM, F_LOSS_VALUE, F_GRAD_NORM, F_INJECTED, F_HAS_LOSS, F_HAS_GRAD, F_QUARANTINED = (
    range(7)
)
FIELDS = 7
_STORE_PREFIX = "nansentinel/arrived"


@dataclasses.dataclass(frozen=True, slots=True)
class RankHealth:
    """One rank's part of the cluster view."""

    identity: RankIdentity
    kinds: tuple[str, ...]
    injected: bool
    loss: float | None
    grad_norm: float | None
    quarantined: bool = False

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def healthy(self) -> bool:
        return not self.kinds


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterView:
    """Every rank's health at one step; built from identical data on every rank."""

    step: int
    ranks: tuple[RankHealth, ...]

    def bad(self, kinds: tuple[str, ...] = KINDS) -> list[RankHealth]:
        """Ranks with a non-finite value of one of ``kinds``."""
        return [r for r in self.ranks if set(r.kinds) & set(kinds)]

    @property
    def hosts(self) -> list[str]:
        return sorted({r.identity.hostname for r in self.ranks})

    @property
    def injected(self) -> bool:
        return any(r.injected for r in self.ranks)

    @property
    def quarantined(self) -> bool:
        return any(r.quarantined for r in self.ranks)

    def values(self, signal: str) -> list[float | None]:
        """Every rank's ``loss`` or ``grad_norm`` (None where the rank had none)."""
        return [getattr(r, signal) for r in self.ranks]


def pack_row(
    batch_norm: torch.Tensor,
    loss_value: torch.Tensor,
    grad_norm: torch.Tensor,
    host_flags: torch.Tensor,
) -> torch.Tensor:
    """One rank's health row (layout ``F_*``) as an fp32 vector: two kernels.

    ``batch_norm``, ``loss_value`` and ``grad_norm`` are 0-d fp32 tensors on one device (zero
    when absent). ``host_flags`` holds ``injected, has_loss, has_grad, quarantined`` on the same
    device (the caller caches those few constant tensors, since a host-to-device copy per step
    would synchronise the stream).
    """
    return torch.cat([torch.stack([batch_norm, loss_value, grad_norm]), host_flags])


def unpack_view(step: int, values: list[float], identities: list[RankIdentity]) -> ClusterView:
    """Turn the summed vector (as host floats) into a :class:`ClusterView`."""
    ranks = []
    for r, ident in enumerate(identities):
        row = values[r * FIELDS : (r + 1) * FIELDS]
        checked = (F_BATCH_NORM, F_LOSS_VALUE, F_GRAD_NORM)
        kinds = tuple(
            k for k, f in zip(KINDS, checked, strict=True) if not math.isfinite(row[f])
        )
        ranks.append(
            RankHealth(
                identity=ident,
                kinds=kinds,
                injected=bool(row[F_INJECTED]),
                loss=row[F_LOSS_VALUE] if row[F_HAS_LOSS] else None,
                grad_norm=row[F_GRAD_NORM] if row[F_HAS_GRAD] else None,
                quarantined=bool(row[F_QUARANTINED]),
            )
        )
    return ClusterView(step, tuple(ranks))


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
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.timeout = timeout
        self.device = device
        nccl = self.distributed and "nccl" in str(dist.get_backend(group))
        self.comm_device = device if nccl and device.type == "cuda" else torch.device("cpu")
        #: The gradient averaging can use ReduceOp.AVG (NCCL) instead of scale-then-sum.
        self.supports_avg = bool(nccl and device.type == "cuda")
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
        if self.distributed and self.world_size > 1:
            self._work = dist.all_reduce(vector, group=self.group, async_op=True)

    def wait(self, identities: list[RankIdentity]) -> ClusterView:
        """Wait for the sum (bounded by the timeout) and return the cluster view.

        This is the step's one host synchronisation.
        """
        if self._vector is None:
            raise RuntimeError("HealthExchange.wait() before launch()")
        vector, work, step = self._vector, self._work, self._step
        self._vector, self._work = None, None
        if work is not None:
            try:
                done = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            except RuntimeError as exc:
                raise self.diagnose(step, identities, exc) from exc
            if done is False:
                raise self.diagnose(step, identities, None)
        return unpack_view(step, vector.tolist(), identities)

    def take(self, identities: list[RankIdentity]) -> tuple[int, torch.Tensor]:
        """This step's summed vector, still where it was summed, without reading it.

        On NCCL the current CUDA stream waits for the collective and the host does not (no
        timeout is passed: with one, NCCL would block the host; the watchdog bounds a hang).
        Elsewhere (gloo, one process) the host waits, bounded by the timeout, as in
        :meth:`wait`: there is no device to overlap with.
        """
        if self._vector is None:
            raise RuntimeError("HealthExchange.take() before launch()")
        vector, work, step = self._vector, self._work, self._step
        self._vector, self._work = None, None
        if work is not None:
            if vector.device.type == "cuda":
                work.wait()
            else:
                try:
                    done = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
                except RuntimeError as exc:
                    raise self.diagnose(step, identities, exc) from exc
                if done is False:
                    raise self.diagnose(step, identities, None)
        return step, vector

    def barrier(self) -> None:
        """A tiny collective used after an incident, so that rank 0's report is on disk
        before any rank raises and torchrun tears the job down."""
        if self.distributed and self.world_size > 1:
            flag = torch.zeros(1, device=self.comm_device)
            dist.all_reduce(flag, group=self.group)

    def gather_json(self, payload: object) -> list[object]:
        """All-gather one JSON-able object per rank (used once at start and after incidents).

        Built on tensors rather than ``all_gather_object`` (which needs numpy on some CPU
        builds) so that it runs wherever the training does.
        """
        text = json.dumps(payload).encode()
        if not (self.distributed and self.world_size > 1):
            return [json.loads(text)]
        data = torch.tensor(list(text), dtype=torch.uint8, device=self.comm_device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.comm_device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        lengths = [int(s) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self.comm_device)
        padded[: data.numel()] = data
        out = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(out, padded, group=self.group)
        return [json.loads(bytes(t[:n].tolist())) for t, n in zip(out, lengths, strict=True)]

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

    def send_object(self, obj: object, src: int, dst: int) -> object | None:
        """Move one batch-like object from rank ``src`` to rank ``dst``; other ranks do nothing.
        Used only by the replay after a detection.

        What travels is :func:`plain` of ``obj`` (tensors, strings, numbers, and dicts, lists
        and tuples of them), and the receiver loads it with ``weights_only=True``: a rank never
        executes what another rank sends. Bytes that are not such data are refused (logged,
        None returned), so the replay is skipped rather than anything run.
        """
        if not (self.distributed and self.world_size > 1) or src == dst:
            return obj if self.rank == dst else None
        if self.rank not in (src, dst):
            return None
        other = dst if self.rank == src else src
        peer = dist.get_global_rank(self.group, other) if self.group is not None else other
        if self.rank == src:
            buf = io.BytesIO()
            torch.save(plain(obj)[0], buf)
            self._send_bytes(buf.getvalue(), peer)
            return None
        payload = self._recv_bytes(peer)
        try:
            return torch.load(io.BytesIO(payload), weights_only=True)
        except Exception as exc:  # UnpicklingError and whatever a hostile payload raises
            log.warning(
                "nansentinel: rank %d refused the batch rank %d sent for replay (not plain data: "
                "%s: %s); the replay is skipped", self.rank, src, type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return None

    def _send_bytes(self, data: bytes, peer: int) -> None:
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([tensor.numel()], dtype=torch.int64)
        dist.send(size.to(self.comm_device), peer, group=self.group)
        dist.send(tensor.to(self.comm_device), peer, group=self.group)

    def _recv_bytes(self, peer: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
        dist.recv(size, peer, group=self.group)
        data = torch.empty(int(size), dtype=torch.uint8, device=self.comm_device)
        dist.recv(data, peer, group=self.group)
        return bytes(data.cpu().contiguous().untyped_storage())

    def sum_floats(self, values: list[float]) -> list[float]:
        """Element-wise sum of a short float list across ranks (identity alone)."""
        t = torch.tensor(values, dtype=torch.float32, device=self.comm_device)
        if self.distributed and self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t.tolist()

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


#: Leaf types that travel between ranks and load with ``torch.load(weights_only=True)``.
_PLAIN_LEAVES = (torch.Tensor, str, bytes, int, float, bool, type(None))


def plain(obj: object, where: str = "batch") -> tuple[object, list[str]]:
    """``obj`` reduced to plain data (tensors, strings, numbers, None, and dicts with string
    or integer keys, lists and tuples of them), and the places of what was left out.

    Anything else (a user's class, a named tuple's type) would need unpickling code on the
    receiving rank: it is dropped (a dict entry removed, a list item replaced by None) and its
    place and type named, so the report can say what the replay ran without.
    """
    dropped: list[str] = []

    def walk(x: object, path: str) -> object:
        if isinstance(x, _PLAIN_LEAVES):
            return x
        if type(x) is dict:
            out = {}
            for k, v in x.items():
                sub = f"{path}[{k!r}]"
                if not isinstance(k, str | int) or isinstance(k, bool):
                    dropped.append(f"{sub} (key of type {type(k).__name__})")
                    continue
                value = walk(v, sub)
                if value is not _DROPPED:
                    out[k] = value
            return out
        if type(x) in (list, tuple):
            items = [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]  # type: ignore[attr-defined]
            return type(x)(None if v is _DROPPED else v for v in items)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple: values kept
            dropped.append(f"{path} (the {type(x).__name__} type; sent as a plain tuple)")
            return tuple(None if v is _DROPPED else v for v in (walk(v, f"{path}.{f}")
                         for f, v in zip(x._fields, x, strict=True)))
        dropped.append(f"{path} ({type(x).__module__}.{type(x).__qualname__})")
        return _DROPPED

    out = walk(obj, where)
    return (None if out is _DROPPED else out), dropped


_DROPPED = object()


def nan_to_none(x: float | None) -> float | str | None:
    """JSON has no NaN/Inf; reports spell them as strings."""
    if x is None or math.isfinite(x):
        return x
    return str(x)
