"""The small collectives a detection needs beside the step's exchange.

After a detection (never on a healthy step) the flagged ranks tell every rank their rows and
details (only they speak: the bytes grow with the flagged ranks, not with the world), the
replay moves one batch between two ranks and sums its flags, and the stop path waits for
everyone's files to be on disk. :class:`Peers` runs those on the exchange's process group;
the exchange itself (exchange.py) keeps only the health vector of each step and its failure
diagnosis.
"""

from __future__ import annotations

import bisect
import ctypes
import io
import json
import logging
from typing import Any

import torch
import torch.distributed as dist

from nansentinel.common import torch_insides as insides

log = logging.getLogger("nansentinel")


class Peers:
    """This rank among its peers in one process group (or alone, without one).

    Args:
        group: the process group; None means the default group when one is initialised,
            else no collective at all (world size 1).
        device: this rank's device; the collectives run there for NCCL, on CPU for gloo.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        nccl = self.distributed and "nccl" in str(dist.get_backend(group))
        #: Where collective tensors live: the CUDA device under NCCL, else the CPU.
        self.comm_device = device if nccl and device.type == "cuda" else torch.device("cpu")

    @property
    def alone(self) -> bool:
        """No peer to talk to: every collective is the identity."""
        return not (self.distributed and self.world_size > 1)

    def barrier(self) -> None:
        """A tiny collective used after an incident, so that rank 0's report is on disk
        before any rank raises and torchrun tears the job down. Its result is read on the
        host: on NCCL a synchronous all-reduce only makes the stream wait, and a rank that
        raised at once could end the job before rank 0 has written anything."""
        if not self.alone:
            flag = torch.zeros(1, device=self.comm_device)
            dist.all_reduce(flag, group=self.group)
            flag.item()  # blocks the host until every rank has arrived

    def gather_from(self, speakers: list[int], payload: object | None) -> dict[int, object]:
        """Every rank learns one JSON-able object from each rank in ``speakers`` (sorted, the
        same list on every rank); ``payload`` is this rank's, ignored unless it speaks.

        Two sum all-reduces, whatever the world size: one of ``len(speakers)`` sizes, one of
        the speakers' bytes, each speaker writing at its own offset of a zero buffer (a sum
        with zeros is exact, in uint8 too). The bytes are those of the speakers alone, so a
        detection with one bad rank costs the same at 8 ranks as at 100,000. Speakers that
        must not be silent: a speaker whose payload is None sends ``null``.
        """
        if not speakers:
            return {}
        mine = bisect.bisect_left(speakers, self.rank)
        speaking = mine < len(speakers) and speakers[mine] == self.rank
        text = _dumps(payload, self.rank) if speaking else b""
        if self.alone:
            return {self.rank: json.loads(text)} if speaking else {}
        sizes = torch.zeros(len(speakers), dtype=torch.int64, device=self.comm_device)
        if speaking:
            sizes[mine] = len(text)
        dist.all_reduce(sizes, group=self.group)
        lengths = sizes.tolist()
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        data = torch.zeros(offsets[-1], dtype=torch.uint8, device=self.comm_device)
        if speaking and text:
            data[offsets[mine]: offsets[mine + 1]] = torch.frombuffer(
                bytearray(text), dtype=torch.uint8).to(self.comm_device)
        dist.all_reduce(data, group=self.group)
        raw = host_bytes(data)
        # One parse of one JSON array, not one per speaker: 131,072 rows parse in a fraction
        # of a second. A silent speaker (no bytes) reads as null.
        array = b"[" + b",".join(raw[offsets[i]: offsets[i + 1]] or b"null"
                                 for i in range(len(speakers))) + b"]"
        return dict(zip(speakers, json.loads(array), strict=True))

    def flagged(self, flag: bool) -> list[int]:
        """The ranks whose ``flag`` is set, on every rank: one sum all-reduce of a byte per
        rank (a detection with several flagged ranks only; one is named by the exchange)."""
        if self.alone:
            return [self.rank] if flag else []
        slots = torch.zeros(self.world_size, dtype=torch.uint8, device=self.comm_device)
        if flag:
            slots[self.rank] = 1
        dist.all_reduce(slots, group=self.group)
        return slots.nonzero().flatten().tolist()

    def max_floats(self, values: list[float]) -> list[float]:
        """Element-wise maximum of a short float list across ranks (identity alone)."""
        return self._reduce(values, dist.ReduceOp.MAX, torch.float32)

    def sum_floats(self, values: list[float]) -> list[float]:
        """Element-wise sum of a short float list across ranks (identity alone)."""
        return self._reduce(values, dist.ReduceOp.SUM, torch.float32)

    def min_ints(self, values: list[int]) -> list[int]:
        """Element-wise minimum of a short int list across ranks (identity alone), in int64:
        a place in an order times the world size plus a rank stays exact, where fp32 would
        round it beyond 2**24. Used only on the rare path (where a replay's collective input
        first went non-finite, trace.py and replay.py)."""
        return self._reduce(values, dist.ReduceOp.MIN, torch.int64)

    def members(self) -> list[int]:
        """The job's ranks of this group, sorted (this rank alone without one)."""
        if not self.distributed:
            return [0]
        if self.group is None:
            return list(range(dist.get_world_size()))
        return sorted(dist.get_process_group_ranks(self.group))

    @property
    def global_rank(self) -> int:
        """This rank in the whole job (the default group), 0 without one."""
        return dist.get_rank() if self.distributed else 0

    def max_in_place(self, t: torch.Tensor) -> None:
        """Element-wise maximum of ``t`` (on :attr:`comm_device`) across the group, in place."""
        if not self.alone:
            dist.all_reduce(t, dist.ReduceOp.MAX, group=self.group)

    def broadcast_in_place(self, t: torch.Tensor, src: int) -> None:
        """``t`` (on :attr:`comm_device`) from the job's rank ``src``, in place, on every
        rank of the group."""
        if not self.alone:
            dist.broadcast(t, src=src, group=self.group)

    def all_gather_into(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        """Every rank's ``mine`` concatenated into ``out`` (the group's size times larger)."""
        if self.alone:
            out.copy_(mine)
            return
        insides.all_gather_into()(out, mine, group=self.group)

    def _reduce(self, values: list[Any], op: Any, dtype: torch.dtype) -> list[Any]:
        """One all-reduce of a short list as ``dtype`` on the group's device (the list itself
        when this rank is alone)."""
        t = torch.tensor(values, dtype=dtype, device=self.comm_device)
        if not self.alone:
            dist.all_reduce(t, op, group=self.group)
        return t.tolist()

    def send_object(self, obj: object, src: int, dst: int) -> object | None:
        """Move one batch-like object from rank ``src`` to rank ``dst``; called on every rank,
        only ``dst`` gets it (None elsewhere). Used only by the replay after a detection.

        What travels is :func:`plain` of ``obj`` (tensors, strings, numbers, and dicts, lists
        and tuples of them), and the receiver loads it with ``weights_only=True``: a rank never
        executes what another rank sends. Bytes that are not such data are refused (logged,
        None returned), so the replay is skipped rather than anything run.

        It travels by collectives that every rank issues: a sum of its size, then one
        ``all_to_all_single`` in which only ``src`` sends and only ``dst`` receives (every
        other pair moves nothing; NCCL posts no send of zero bytes). A send and a receive
        between the two ranks alone would advance only their groups' sequence numbers (gloo
        counts them), and under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` the detection's next
        collective was refused on every rank as a mismatch.
        """
        if self.alone or src == dst:
            return obj if self.rank == dst else None
        data = b""
        if self.rank == src:
            try:
                buf = io.BytesIO()
                torch.save(plain(obj)[0], buf)
                data = buf.getvalue()
            except Exception as exc:  # the receiver refuses the empty payload (logged there)
                log.warning("nansentinel: rank %d could not pack its batch for the replay "
                            "(%s: %s)", self.rank, type(exc).__name__, exc)
        got = self._move_bytes(data, src, dst)
        if got is None:
            return None
        try:
            return torch.load(io.BytesIO(got), weights_only=True)
        except Exception as exc:  # UnpicklingError and whatever a hostile payload raises
            log.warning(
                "nansentinel: rank %d refused the batch rank %d sent for replay (not plain data: "
                "%s: %s); the replay is skipped", self.rank, src, type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return None

    def _move_bytes(self, data: bytes, src: int, dst: int) -> bytes | None:
        """``data`` of rank ``src`` on rank ``dst`` (None elsewhere): a sum of its size, then
        one ``all_to_all_single`` where only that pair moves bytes. Every rank calls it."""
        size = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
        if self.rank == src:
            size[0] = len(data)
        dist.all_reduce(size, group=self.group)
        n = int(size.item())
        sends, recvs = [0] * self.world_size, [0] * self.world_size
        if self.rank == src:
            sends[dst] = n
        if self.rank == dst:
            recvs[src] = n
        given = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.comm_device)
                 if self.rank == src and n else
                 torch.empty(0, dtype=torch.uint8, device=self.comm_device))
        got = torch.empty(n if self.rank == dst else 0, dtype=torch.uint8,
                          device=self.comm_device)
        dist.all_to_all_single(got, given, recvs, sends, group=self.group)
        return host_bytes(got) if self.rank == dst else None


def job_rank(fallback: int = 0) -> int:
    """This process's rank in the job, ``fallback`` without a process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else fallback


def job_size() -> int:
    """The job's world size, 1 without a process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def dtensor_from_local(local: torch.Tensor, spec: tuple[Any, Any, Any, Any]) -> torch.Tensor:
    """A DTensor around ``local`` with ``spec`` = (mesh, placements, shape, stride): no
    collective (``run_check=False``); used to rebuild a snapshot's state."""
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=stride)


def host_bytes(data: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor, read on the host in one copy.

    ``bytes(tensor.untyped_storage())`` reads a storage element by element through Python
    (130 s for the 41 MB of rows that 131,072 named ranks send), and ``numpy()`` is not there
    on torch's CPU build without numpy; a memory copy from the tensor's data pointer is.
    """
    host = data.detach().cpu().contiguous()
    if not host.numel():
        return b""
    return ctypes.string_at(host.data_ptr(), host.numel() * host.element_size())


def _dumps(payload: object, rank: int) -> bytes:
    """``payload`` as JSON bytes (NaN allowed on this wire); one that JSON cannot hold becomes
    an ``{"error": …}`` object instead of an exception, since a speaker that raised here would
    leave every other rank waiting in the gather."""
    try:
        return json.dumps(payload).encode()
    except (TypeError, ValueError) as exc:
        log.error("nansentinel: rank %d could not share its detail (%s); sent without it",
                  rank, exc)
        return json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()


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
        if isinstance(x, list | tuple) and type(x) in (list, tuple):
            items = [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]
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


class ForwardCollectives:
    """Which process groups ran a collective during this rank's forward (see origins.py).

    Each group keeps a count of the collectives issued on it (its sequence number, a host
    counter in gloo and NCCL alike); :meth:`start` reads every group's count when the forward
    begins, :meth:`stop` reads them again at the first loss and returns the names of the
    groups whose count moved. Two reads per group and step, host only, nothing per rank; the
    groups are torch's registry (private: read through common/torch_insides.py). A group
    whose backend keeps no count is left out once and for all.

    A wrapper's own collectives in the forward carry nothing from one rank's batch to another
    rank's loss: DDP broadcasts its buffers (BatchNorm statistics, rotary caches) from rank 0
    before it calls the module, and rebuilds its buckets with a broadcast on its second step.
    Counted, they would put DDP's group in every rank's record, and an independent later
    fault on another rank would be taken for one reached (never struck). The gradient path
    brackets them (:meth:`aside` before, :meth:`resume` after: DDP's forward hooks around
    its module's) and they are subtracted, so that a user's own collective on the same group
    inside the module still counts. Two more reads per group, only while a forward is counted.

    Args:
        exclude: names of groups whose forward collectives cannot carry a batch's NaN to
            another rank's loss, or are checked where they land: FSDP's parameter all-gathers,
            a pipeline's send and receive.
    """

    def __init__(self, exclude: frozenset[str] = frozenset()) -> None:
        self.exclude = set(exclude)
        self._start: dict[str, int] | None = None
        self._silent: set[str] = set()
        #: Per group, the collectives counted aside since :meth:`start` (a wrapper's own).
        self._aside: dict[str, int] = {}
        self._aside_from: dict[str, int] | None = None

    def start(self) -> None:
        self._start = self._counts()
        self._aside, self._aside_from = {}, None

    def aside(self) -> None:
        """The collectives from now until :meth:`resume` are a wrapper's own, not the
        forward's (nothing while no forward is counted)."""
        if self._start is not None:
            self._aside_from = self._counts()

    def resume(self) -> None:
        """End the bracket :meth:`aside` opened; what it counted is left out of :meth:`stop`."""
        opened, self._aside_from = self._aside_from, None
        if opened is None or self._start is None:
            return
        for name, count in self._counts().items():
            self._aside[name] = self._aside.get(name, 0) + count - opened.get(name, count)

    def stop(self) -> tuple[str, ...]:
        """The groups that ran a collective since :meth:`start`, less those counted aside
        (once: then empty). A bracket still open counts as the forward's: a wrapper that
        skipped its module's hooks must not hide the user's collectives."""
        before, self._start = self._start, None
        aside, self._aside, self._aside_from = self._aside, {}, None
        if not before:
            return ()
        after = self._counts()
        return tuple(sorted(n for n, c in after.items()
                            if c - before.get(n, c) - aside.get(n, 0) > 0))

    def _counts(self) -> dict[str, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return {}
        counts: dict[str, int] = {}
        for pg, name in insides.named_groups():
            if name in self.exclude or name in self._silent:
                continue
            try:
                counts[name] = insides.sequence_number(pg)
            except (RuntimeError, AttributeError, NotImplementedError):
                self._silent.add(name)
        return counts


def quiet_groups(gradient_groups: list[object], stages: list[object]) -> frozenset[str]:
    """Names of the process groups whose collectives in the forward cannot carry one rank's
    NaN into another rank's loss, or are checked where they land: the gradient path's own
    (FSDP2's parameter all-gathers) and the pipeline stages' sends and receives."""
    groups = list(gradient_groups)
    for stage in stages:
        group = getattr(stage, "group", None)
        groups.append(group if group is not None else dist.group.WORLD)
    return frozenset(g.group_name for g in groups if g is not None and hasattr(g, "group_name"))
