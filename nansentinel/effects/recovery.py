"""Recovery: restore the last good state, cool the learning rate down, skip ahead.

This is the playbook people follow by hand after a spike or a NaN (PaLM's remedy among them):
stop before the weights are ruined, restore the last good state, lower the learning rate near
the spike, skip the batches that led into it. Every rank takes its snapshot at the same healthy
step and restores it at the same step, so the replicas stay identical.

A snapshot of a large model does not fit as a full copy per rank (a 7 B model with Adam is
about 112 GB: 0.9 TB per 8-GPU node), so :class:`MemorySnapshots` keeps, under DDP, only this
rank's 1/W slice of what every replica holds identically (the parameters DDP reduces and their
optimizer state) and gathers the slices back on a rollback; it copies into host buffers
allocated once, asynchronously, and refuses with the numbers when even that does not fit.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import socket
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import psutil
import torch

from nansentinel.checks import local as _local
from nansentinel.common import torch_insides as insides
from nansentinel.engines.base import EXCHANGE
from nansentinel.result import NanSentinelError
from nansentinel.wire.collectives import dtensor_from_local

if TYPE_CHECKING:
    from nansentinel.engines.base import Capabilities
    from nansentinel.wire.collectives import Peers
    from nansentinel.wire.context import Context, Watched

log = logging.getLogger("nansentinel")

#: Tensors smaller than this (elements) are kept whole on every rank: a slice of them saves
#: next to nothing and would cost one more collective on a rollback.
SHARD_MIN_NUMEL = 1 << 16


class SnapshotStore(Protocol):
    """Where last-good state goes: host memory by default, or the user's own checkpoints."""

    def save(self, step: int) -> None:
        """Save the current (healthy) state as of ``step``."""

    def load(self) -> int:
        """Restore the last saved state; return its step."""

    @property
    def step(self) -> int | None:
        """Step of the last saved state (None: nothing saved yet)."""


class SnapshotMemoryError(NanSentinelError, RuntimeError):
    """A rollback snapshot does not fit in host memory, on this rank or on another one.

    Raised on every rank at the same save (the ranks agree on it in one small collective), so
    that no rank waits for another that stopped; nothing has been allocated.
    """


@dataclasses.dataclass(frozen=True, slots=True)
class _Slot:
    """One tensor of the saved state: where it sits and how this rank keeps it."""

    path: tuple[Any, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]  # a DTensor's: its local shard's
    device: torch.device
    #: Elements this rank keeps of the flat tensor padded to ``chunk * W`` (its slice number
    #: ``rank``); 0: kept whole.
    chunk: int
    dtensor: bool
    #: How a DTensor is rebuilt around a fresh local shard (mesh, placements, shape, stride).
    spec: Any = dataclasses.field(default=None, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Host bytes this rank holds for it."""
        return (self.chunk or self.numel) * self.dtype.itemsize


class _Hole:
    """Where tensor ``index`` of a flattened state goes back."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _flatten(obj: Any, path: tuple[Any, ...], out: list[tuple[tuple[Any, ...], torch.Tensor]]
             ) -> Any:
    """``obj`` with every tensor replaced by a :class:`_Hole` (appended to ``out`` with its
    path) and everything else deep-copied: later changes to the live state (a scheduler's LR)
    must not reach the snapshot. A sparse tensor (SGD's momentum of a sparse embedding) has no
    fixed layout to keep a buffer for: it is copied whole into host memory at each save, and a
    rollback hands the copy back (the optimizer moves it to its parameter's device)."""
    if isinstance(obj, torch.Tensor) and obj.layout != torch.strided:
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
        return _Hole(len(out) - 1)
    if isinstance(obj, dict):
        items = {k: _flatten(v, (*path, k), out) for k, v in obj.items()}
        rebuilt = type(obj)(items) if type(obj) in (dict, OrderedDict) else items
        if hasattr(obj, "_metadata"):  # Module.state_dict's versions, read by load_state_dict
            rebuilt = OrderedDict(rebuilt)
            rebuilt._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
        return rebuilt
    if isinstance(obj, list | tuple):
        values = [_flatten(v, (*path, i), out) for i, v in enumerate(obj)]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    return copy.deepcopy(obj)


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`_flatten`: the holes filled with ``tensors``, the rest copied."""
    if isinstance(obj, _Hole):
        return tensors[obj.index]
    if isinstance(obj, dict):
        items = {k: _fill(v, tensors) for k, v in obj.items()}
        rebuilt = type(obj)(items) if type(obj) in (dict, OrderedDict) else items
        if hasattr(obj, "_metadata"):
            rebuilt._metadata = copy.deepcopy(obj._metadata)  # type: ignore[attr-defined]
        return rebuilt
    if isinstance(obj, list | tuple):
        values = [_fill(v, tensors) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    return copy.deepcopy(obj)


def _available_bytes() -> int:
    return int(psutil.virtual_memory().available)


class MemorySnapshots:
    """Model, optimizer (and GradScaler) state kept in host memory, for a rollback.

    What a rank holds:

    - Under DDP (``replicas`` given, more than one), the parameters DDP keeps identical on
      every replica and their optimizer state are sharded: each floating tensor of at least
      ``shard_min_numel`` elements is flattened, padded to a multiple of W, and this rank keeps
      slice number ``rank`` (1/W of it). A rollback gathers the slices back, one
      ``all_gather`` per such tensor on the replicas' group, in the same order on every rank (a
      rollback is decided identically everywhere, at the same step). Buffers (a BatchNorm's
      running statistics differ per rank), the parameters DDP ignores, small tensors (Adam's
      ``step``) and everything that is not a tensor are kept whole.
    - Otherwise (one process, FSDP2, gradients reduced by hand) every tensor is kept whole: an
      FSDP2 state dict already holds this rank's local shards only (DTensors; their local
      tensors are what is kept).

    How it is copied: the host buffers are allocated once (pinned when the state lives on an
    accelerator) and every save copies into them with ``non_blocking=True``, so a save
    allocates nothing and does not block the host per tensor. On CUDA the parameters and the
    optimizer state are copied on a side stream of their own (:class:`SideCopies`), after the
    step that made them and beside the next forward and backward (a 7 B model under DDP on 8
    ranks copies ~14 GB a snapshot: on the compute stream, or with the next forward waiting
    for it, that is a stall of the GPU every ``snapshot_every`` steps); only their next
    writer waits for them, on the device: the optimizer's next step (a step pre-hook), a
    replica repair (``ReplicaCheck.before_write``). What the forward itself writes — the
    module's buffers (BatchNorm statistics; DDP broadcasts them at its forward) — is small and
    copied on the compute stream, ordered before those writes with no wait at all. A rollback
    waits on the host before it reads the buffers. Not ordered: a write of the caller's own
    into the parameters between ``step()`` and the next optimizer step (clamping weights in
    place); take it on the compute stream after ``sentinel.snapshots.copies.hold()``.
    The buffers are reallocated only when the layout of the state changes (the optimizer's
    state appears at its first step, after a snapshot of the weights alone): only then is the
    fit checked, with one small collective on ``peers`` (every rank changes layout at the same
    save), and a save that does not fit raises :class:`SnapshotMemoryError` on every rank,
    naming the bytes.

    A rollback copies the snapshot into the live tensors in place when their layout is the
    snapshot's (no second copy of the state on the device), or into fresh ones otherwise; the
    snapshot's buffers are never handed to the model or the optimizer, so later steps cannot
    write into them.

    Args:
        watched: the module (DDP's inner module), its optimizer and GradScaler, whose states
            are kept; the model's parameters the replicas do not keep identical (DDP's
            ``parameters_to_ignore``) are kept whole.
        peers: the ranks that decide together (the exchange's); None: this process alone.
        replicas: the data-parallel replicas to shard across (DDP's process group); None: keep
            every tensor whole.
        hostname: this host's name, for the refusal message.
        available: host bytes free now (default: ``psutil.virtual_memory().available``).
        shard_min_numel: tensors with fewer elements are kept whole.
    """

    def __init__(
        self, watched: Watched, *, peers: Peers | None = None, replicas: Peers | None = None,
        hostname: str | None = None, available: Callable[[], int] = _available_bytes,
        shard_min_numel: int = SHARD_MIN_NUMEL,
    ) -> None:
        module = watched.module
        self.module, self.optimizer = module, watched.optimizer
        self.scaler = watched.scaler
        optimizer = self.optimizer
        self.peers = peers
        self.replicas = replicas if replicas is not None and not replicas.alone else None
        self.unreplicated = frozenset(watched.unreplicated)
        self.hostname = hostname or socket.gethostname()
        self.available = available
        self.shard_min_numel = shard_min_numel
        self._layout: tuple[_Slot, ...] | None = None
        self._buffers: list[torch.Tensor] = []
        self._skeleton: dict[str, Any] | None = None
        self._scaler_state: Any = None
        self._step: int | None = None
        #: Where the device-to-host copies run, and the waits that order the next writes.
        self.copies = SideCopies()
        self._hooks = [optimizer.register_step_pre_hook(self.copies.hold)]

    @property
    def step(self) -> int | None:
        return self._step

    @property
    def bytes(self) -> int:
        """Host bytes this rank holds for the snapshot (its buffers), as allocated: a pinned
        buffer takes its size rounded up to a power of two (:func:`pinned_nbytes`)."""
        return sum(_held_nbytes(b) for b in self._buffers)

    @property
    def unsharded_bytes(self) -> int:
        """Host bytes a whole copy of the same state would take on this rank."""
        return sum(s.numel * s.dtype.itemsize for s in self._layout or ())

    def save(self, step: int) -> None:
        skeleton, leaves = self._live()
        layout = self._layout_of(leaves)
        if layout != self._layout:
            self.copies.finish()  # the old buffers are released: no copy may still write them
            self._allocate(layout, step)
        rank = self._rank_of_replicas()
        jobs = list(zip(layout, leaves, self._buffers, strict=True))
        forward_writes = self._forward_writes()
        early = [job for job in jobs if forward_writes(job[1][0])]
        late = [job for job in jobs if not forward_writes(job[1][0])]
        with self.copies.inline([src for _, (_, src), _ in early]):
            for slot, (_, src), buf in early:
                _copy_in(slot, src, buf, rank)
        with self.copies.side([src for _, (_, src), _ in late]):
            for slot, (_, src), buf in late:
                _copy_in(slot, src, buf, rank)
        if self.scaler is not None:
            self._scaler_state = copy.deepcopy(self.scaler.state_dict())
        self._skeleton, self._step = skeleton, step

    def load(self) -> int:
        if self._skeleton is None or self._layout is None or self._step is None:
            raise RuntimeError("no snapshot to roll back to")
        self.copies.finish()  # the host reads the buffers: the last save's copies are done
        _, live = self._live()
        if self._layout_of(live) == self._layout:
            targets = [t for _, t in live]  # written in place: no second copy on the device
        else:
            targets = [_empty_like(slot) for slot in self._layout]
        with torch.no_grad():
            for slot, buf, target in zip(self._layout, self._buffers, targets, strict=True):
                self._restore(slot, buf, target)
        state = _fill(self._skeleton, targets)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and self._scaler_state is not None:
            self.scaler.load_state_dict(copy.deepcopy(self._scaler_state))
        return self._step

    # --- layout -----------------------------------------------------------------------------

    def _live(self) -> tuple[dict[str, Any], list[tuple[tuple[Any, ...], torch.Tensor]]]:
        leaves: list[tuple[tuple[Any, ...], torch.Tensor]] = []
        skeleton = {
            "model": _flatten(self.module.state_dict(), ("model",), leaves),
            "optimizer": _flatten(self.optimizer.state_dict(), ("optimizer",), leaves),
        }
        return skeleton, leaves

    def _forward_writes(self) -> Callable[[tuple[Any, ...]], bool]:
        """Whether a leaf of the state (by its path) is written by the next forward: the
        module's buffers and extra state, not its parameters nor the optimizer's state."""
        params = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        return lambda path: path[0] == "model" and path[1] not in params

    def _rank_of_replicas(self) -> int:
        return self.replicas.rank if self.replicas is not None else 0

    def _layout_of(self, leaves: list[tuple[tuple[Any, ...], torch.Tensor]]
                   ) -> tuple[_Slot, ...]:
        world = self.replicas.world_size if self.replicas is not None else 1
        names, indices = self._replicated() if self.replicas is not None else (set(), set())
        slots = []
        for path, t in leaves:
            dtensor = _is_dtensor(t)
            local = _local(t)
            replicated = not dtensor and (
                (path[0] == "model" and path[1] in names)
                or (path[:2] == ("optimizer", "state") and path[2] in indices)
            )
            chunk = 0
            if replicated and t.is_floating_point() and t.numel() >= self.shard_min_numel:
                chunk = -(-t.numel() // world)
            spec = (getattr(t, "device_mesh", None), getattr(t, "placements", None), t.shape,
                    t.stride()) if dtensor else None
            slots.append(_Slot(path, t.dtype, tuple(local.shape), local.device, chunk, dtensor,
                               spec))
        return tuple(slots)

    def _replicated(self) -> tuple[set[str], set[int]]:
        """The state-dict names of the parameters every replica keeps identical, and the
        optimizer-state indices of those parameters (an optimizer may hold others too)."""
        ids, names = set(), set()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if name not in self.unreplicated:
                ids.add(id(p))
                names.add(name)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return names, {i for i, p in enumerate(params) if id(p) in ids}

    def _allocate(self, layout: tuple[_Slot, ...], step: int) -> None:
        """New buffers for a new layout, once every rank has said its own fit."""
        # The old buffers are dropped first; pinned ones go back to the system only when the
        # host cache is emptied (where it cannot be, old and new blocks coexist).
        held = self.bytes
        needed = sum(_host_nbytes(s) for s in layout)
        available = int(self.available()) + self._releasable()
        short = needed > available
        rank = self.peers.rank if self.peers is not None else 0
        worst = [1.0 if short else 0.0, float(needed) if short else 0.0,
                 float(rank) if short else -1.0]
        if self.peers is not None:
            worst = self.peers.max_floats(worst)  # only when a layout changes, never per step
        if worst[0] > 0:
            if short:
                where = (f"on rank {rank} (host {self.hostname}) at step {step}: it needs "
                         f"{_size(needed)} and {_size(available)} are available")
            else:
                where = (f"on rank {int(worst[2])} at step {step} (about {_size(int(worst[1]))} "
                         f"needed there; this rank, {rank} on {self.hostname}, has "
                         f"{_size(available)} for its {_size(needed)})")
            raise SnapshotMemoryError(
                f"nansentinel: the rollback snapshot does not fit in host memory {where}. "
                "Nothing was allocated and every rank stops here. Free host memory, train with "
                "DDP (its snapshot is sharded across the replicas), turn rollbacks off (policy, "
                "loss_spike_action, grad_spike_action) or pass snapshots=(save, load) to roll "
                "back to your own checkpoints."
            )
        if held:
            log.info("nansentinel: the snapshot's layout changed at step %d: %s of host "
                     "buffers reallocated", step, _size(needed))
        self._release()
        self._buffers = [_new_buffer(slot) for slot in layout]
        self._layout = layout

    def _releasable(self) -> int:
        """Host bytes the current buffers give back to the system when :meth:`_release` drops
        them: all of them, but pinned ones only where the host cache can be emptied."""
        pinned = sum(_held_nbytes(b) for b in self._buffers if _pinned(b))
        return self.bytes - (0 if _host_cache_emptiable() else pinned)

    def _release(self) -> None:
        """Drop the buffers, and give their pinned blocks back to the system: torch's caching
        host allocator keeps a freed pinned block for reuse by a request of the same rounded
        size, so without this the old layout's blocks would stay pinned beside the new ones
        (the copies into them are finished: the caller waited for them)."""
        pinned = any(_pinned(b) for b in self._buffers)
        self._buffers = []
        if pinned and _host_cache_emptiable():
            insides.empty_host_cache()

    # --- restore ----------------------------------------------------------------------------

    def _restore(self, slot: _Slot, buf: torch.Tensor, target: torch.Tensor) -> None:
        local = _local(target)
        if not slot.chunk:
            local.copy_(buf, non_blocking=True)
            return
        replicas = self.replicas
        assert replicas is not None  # a sharded slot exists only with replicas
        comm = replicas.comm_device
        mine = buf.to(comm, non_blocking=True)
        total = slot.chunk * replicas.world_size
        direct = local.device == comm and local.is_contiguous() and local.numel() == total
        out = local.view(-1) if direct else torch.empty(total, dtype=slot.dtype, device=comm)
        replicas.all_gather_into(out, mine)
        if not direct:
            local.copy_(out[: slot.numel].view(slot.shape), non_blocking=True)


class SideCopies:
    """The device-to-host copies of a snapshot, off the compute stream where that helps.

    On CUDA, :meth:`side` runs the copies on a stream of their own that first waits for the
    compute stream (the copies read the state the last step left), records an event after
    them, and marks every source tensor as used on that stream (``record_stream``), so that the
    caching allocator does not hand its memory out again before the copy has read it. Only the
    next writer of that state calls :meth:`hold` first (the optimizer's step, a replica
    repair): the compute stream waits for the event, on the device, without a host sync, so
    the next forward and backward run beside the copies. :meth:`inline` is for the state the
    forward writes (the module's buffers): copied on the compute stream itself, so its writes
    come after the copies in stream order and nothing waits. :meth:`finish` waits on the host
    for both, before the buffers are read there (a rollback) or released. Elsewhere (CPU)
    every call is a no-op: the copies are plain copies and done when they return.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._events: dict[torch.device, Any] = {}
        self._inline: dict[torch.device, Any] = {}

    @contextlib.contextmanager
    def inline(self, sources: list[torch.Tensor]) -> Iterator[None]:
        """Copies on the current (compute) stream; an event after them for :meth:`finish`."""
        yield
        devices = {t.device for t in sources if t.device.type == "cuda"}
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._inline[device] = event

    @contextlib.contextmanager
    def side(self, sources: list[torch.Tensor]) -> Iterator[None]:
        locals_ = [_local(s) for s in sources]
        devices = {t.device for t in locals_ if t.device.type == "cuda"}
        if len(devices) != 1:  # CPU, or a state over several devices: the current stream
            yield
            return
        (device,) = devices
        self.hold()
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield
        for t in locals_:
            if t.device == device:
                t.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
        self._events[device] = event

    def hold(self, *_: Any) -> None:
        """The compute stream waits (on the device) for the last copies; a hook's signature."""
        events, self._events = self._events, {}
        for device, event in events.items():
            torch.cuda.current_stream(device).wait_event(event)

    def finish(self) -> None:
        """The host waits for the last copies (on the side stream and inline)."""
        events, self._events = self._events, {}
        inline, self._inline = self._inline, {}
        for event in [*events.values(), *inline.values()]:
            event.synchronize()


def _copy_in(slot: _Slot, src: torch.Tensor, buf: torch.Tensor, rank: int) -> None:
    """This rank's part of ``src`` into its buffer, without blocking the host (stream-ordered
    on an accelerator; a plain copy on the CPU)."""
    local = _local(src).detach()
    if not slot.chunk:
        buf.copy_(local, non_blocking=True)
        return
    part = local.reshape(-1)[rank * slot.chunk: (rank + 1) * slot.chunk]
    buf[: part.numel()].copy_(part, non_blocking=True)  # the padding stays zero


def pinned_nbytes(nbytes: int) -> int:
    """Host bytes torch's caching host allocator pins for a request of ``nbytes``: the next
    power of two (``CachingHostAllocator.h``: ``c10::llvm::PowerOf2Ceil(size)``, the block
    size it asks ``cudaHostAlloc`` for and keys its free list by), so a 21.5 MB slice takes
    32 MB."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _host_nbytes(slot: _Slot) -> int:
    """Host bytes :func:`_new_buffer` will take for ``slot``: rounded as the pinned allocator
    rounds when the state lives on an accelerator (counted so even where pinning then fails:
    the fit check errs on the safe side)."""
    return pinned_nbytes(slot.nbytes) if slot.device.type != "cpu" else slot.nbytes


def _pinned(buf: torch.Tensor) -> bool:
    return torch.accelerator.is_available() and buf.is_pinned()


def _held_nbytes(buf: torch.Tensor) -> int:
    """Host bytes a buffer holds as allocated (a pinned one: its rounded block)."""
    return pinned_nbytes(buf.nbytes) if _pinned(buf) else buf.nbytes


def _host_cache_emptiable() -> bool:
    """Whether freed pinned blocks can be given back to the system (common/torch_insides.py)."""
    return insides.host_cache_emptiable()


def _new_buffer(slot: _Slot) -> torch.Tensor:
    """A zeroed host buffer for ``slot``: pinned when its tensor lives on an accelerator, so
    that the copies into it and back are asynchronous."""
    shape = (slot.chunk,) if slot.chunk else slot.shape
    if slot.device.type != "cpu":
        try:
            return torch.zeros(shape, dtype=slot.dtype, pin_memory=True)
        except RuntimeError as exc:  # no pinned memory on this accelerator's runtime
            log.debug("nansentinel: pageable snapshot buffer (%s)", exc)
    return torch.zeros(shape, dtype=slot.dtype)


def _empty_like(slot: _Slot) -> torch.Tensor:
    """A fresh tensor for ``slot`` where the live state's layout is not the snapshot's."""
    local = torch.empty(slot.shape, dtype=slot.dtype, device=slot.device)
    if not slot.dtensor:
        return local
    return dtensor_from_local(local, slot.spec)


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)"


class UserSnapshots:
    """The user's own save/load pair, e.g. writing and reading their checkpoints.

    Args:
        save: called with the step of a healthy state worth keeping.
        load: restores the last saved state and returns its step.
    """

    def __init__(self, save: Callable[[int], None], load: Callable[[], int]) -> None:
        self._save, self._load = save, load
        self._step: int | None = None

    @property
    def step(self) -> int | None:
        return self._step

    def save(self, step: int) -> None:
        self._save(step)
        self._step = step

    def load(self) -> int:
        return int(self._load())


class _AllCopies:
    """The side copies of every snapshot of a :class:`SnapshotRing`, held or finished as one."""

    def __init__(self, stores: list[MemorySnapshots]) -> None:
        self._stores = stores

    def hold(self, *_: Any) -> None:
        for store in self._stores:
            store.copies.hold()

    def finish(self) -> None:
        for store in self._stores:
            store.copies.finish()


class SnapshotRing:
    """The last ``len(stores)`` snapshots (``snapshot_keep``, issue 60), each a
    :class:`MemorySnapshots` of its own buffers: a save replaces the oldest, a rollback
    restores the one asked for. When a rollback to the newest did not bring the loss back
    (degenerate data learned before the loss left its band), the older one still holds a
    state from before it. Host memory: ``len(stores)`` times one snapshot's."""

    def __init__(self, stores: list[MemorySnapshots]) -> None:
        self.stores = stores
        self.copies = _AllCopies(stores)

    @property
    def steps(self) -> list[int]:
        """The steps kept, newest first."""
        return sorted((s.step for s in self.stores if s.step is not None), reverse=True)

    @property
    def step(self) -> int | None:
        steps = self.steps
        return steps[0] if steps else None

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.stores)

    @property
    def unsharded_bytes(self) -> int:
        return sum(s.unsharded_bytes for s in self.stores)

    def save(self, step: int, stale: Collection[int] = ()) -> None:
        """Keep the state of ``step`` in place of an empty slot, else of a ``stale`` snapshot
        (one a rollback did not help from: never restored again), else of the oldest."""
        empty = [s for s in self.stores if s.step is None]
        failed = [s for s in self.stores if s.step in stale]
        target = empty[0] if empty else failed[0] if failed else min(
            self.stores, key=lambda s: s.step or 0)
        target.save(step)

    def load(self, step: int | None = None) -> int:
        """Restore the snapshot of ``step`` (None: the newest); return its step."""
        want = self.step if step is None else step
        for store in self.stores:
            if store.step == want and want is not None:
                return store.load()
        raise RuntimeError(f"no snapshot of step {step} to roll back to (kept: {self.steps})")


@dataclasses.dataclass(slots=True)
class Cooldown:
    """A learning-rate factor in force for a number of steps after a rollback.

    Applied around ``optimizer.step()`` and undone right after it, so that it composes with
    any LR scheduler (which sets ``group["lr"]`` itself) instead of compounding with it.
    Rollbacks during a cooldown multiply the factors: a second rollback at 0.5 gives 0.25.
    """

    factor: float = 1.0
    steps_left: int = 0

    def start(self, factor: float, steps: int) -> None:
        self.factor = (self.factor if self.steps_left > 0 else 1.0) * factor
        self.steps_left = steps

    def state_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "steps_left": self.steps_left}

    def load_state_dict(self, state: dict[str, Any] | list[Any] | tuple[Any, ...]) -> None:
        """Restore :meth:`state_dict` (or the ``[factor, steps_left]`` pair older checkpoints
        hold)."""
        if isinstance(state, dict):
            self.factor, self.steps_left = float(state["factor"]), int(state["steps_left"])
        else:
            self.factor, self.steps_left = float(state[0]), int(state[1])

    @property
    def lr_factor(self) -> float:
        """The factor in force now (1 outside a cooldown)."""
        return self.factor if self.steps_left > 0 else 1.0

    def apply(self, optimizer: torch.optim.Optimizer) -> list[float] | None:
        """Scale every group's LR; return the previous values for :meth:`undo`."""
        if self.steps_left <= 0:
            return None
        saved = [g["lr"] for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * self.factor
        return saved

    @contextlib.contextmanager
    def stepping(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Around our own optimizer step: the factor applied, then undone and counted."""
        saved = self.apply(optimizer)
        try:
            yield
        finally:
            self.undo(optimizer, saved)

    def undo(self, optimizer: torch.optim.Optimizer, saved: list[float] | None) -> None:
        """Restore the LRs :meth:`apply` scaled and count one applied step of the cooldown."""
        if saved is None:
            return
        self.restore(optimizer, saved)
        self.count()

    def restore(self, optimizer: torch.optim.Optimizer, saved: list[float] | None) -> None:
        """Restore the LRs only: the device gate does not know yet whether the step applied."""
        if saved is None:
            return
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr

    def count(self) -> None:
        """One applied step of the cooldown has passed."""
        if self.steps_left <= 0:
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.factor = 1.0


def snapshot_store(snapshots: tuple[Any, Any] | SnapshotStore | None, ctx: Context,
                   watched: Watched, caps: Capabilities) -> SnapshotStore | None:
    """Where this run's last good state goes: the user's ``(save, load)`` pair or store, else
    host memory when a rollback is configured, else nowhere (no copies made).

    Under a wrapper whose replicas are a process group of their own (DDP: ``caps.wraps`` and
    ``caps.replica_group``) every replica holds the same weights and optimizer state, so each
    rank keeps 1/W of them (:class:`MemorySnapshots`), over that group."""
    config = ctx.config
    if isinstance(snapshots, tuple):
        return UserSnapshots(*snapshots)
    if snapshots is not None:
        return snapshots
    if not config.rolls_back:
        return None
    from nansentinel.wire.collectives import Peers

    peers, group = ctx.peers, caps.replica_group
    replicas = None
    if caps.wraps and group is not None and group is not EXCHANGE:
        replicas = peers if group is peers.group else Peers(group, ctx.device)
    stores = [MemorySnapshots(watched, peers=peers, replicas=replicas,
                              hostname=ctx.identity.hostname)
              for _ in range(config.snapshot_keep)]
    return stores[0] if len(stores) == 1 else SnapshotRing(stores)
