"""One rank's health for the step in progress, kept on the device until the decision.

The training loop's checks add to it (several times under gradient accumulation: norms are
collected, losses averaged). The last gradient bucket, or ``step()``, packs it into the row
that the exchange sums across ranks. Nothing here synchronises with the host.

Every value is kept as a plain tensor: a DTensor (tensor parallel) is reduced to its local
tensor on the way in (``checks.local``), since the row's ``stack``/``cat`` with plain tensors
fails on a DTensor ("got mixed torch.Tensor and DTensor") and an operator on it may run a
collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch

from nansentinel.checks import local, moved
from nansentinel.result import RankIdentity


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """This rank's health row as the checks fill it (checks/health.py): three values whose
    finiteness is the check, four flags the host knows, five flags of the boundaries where
    values arrive from other ranks (checks/pipeline.py; 0 without pipeline stages), the
    stop a signal asked for (summed like the rest: no extra collective, nothing O(world)),
    then the model's own state: three max-abs norms of the floating buffers, whose finiteness
    is the check (checks/buffers.py), and whether a hyperparameter is non-finite."""

    batch_norm: float = 0.0
    loss_value: float = 0.0
    """The loss (the mean of the step's micro-batches' losses)."""
    grad_norm_value: float = 0.0
    injected: bool = False
    """A drill wrote into this rank's batch, loss or gradients this step."""
    has_loss: bool = False
    has_grad: bool = False
    quarantined: bool = False
    """A batch checked this step matched a quarantined signature."""
    fwd_origin: bool = False
    """A pipeline stage's forward output went non-finite from finite inputs here."""
    bwd_origin: bool = False
    """A stage's sent gradients went non-finite from finite received gradients here."""
    recv_act: bool = False
    """A non-finite activation arrived from the previous stage."""
    recv_grad: bool = False
    """A non-finite gradient arrived from the next stage."""
    loss_origin: bool = False
    """The last stage's loss went non-finite from finite activations and targets here."""
    stop_term: bool = False
    """SIGTERM reached this rank before its row was packed (effects/stop.py): a scheduler's
    time limit or ``scancel``; every rank stops after the step that carries it."""
    stop_int: bool = False
    """SIGINT reached this rank before its row was packed (Ctrl-C)."""
    buffer_norm: float = 0.0
    """The floating buffers as the step left them (after its forward): max-abs, 0 without."""
    buffer_own: float = 0.0
    """This rank's own buffers before the step's forward (before a buffer broadcast)."""
    buffer_arrived: float = 0.0
    """The buffers as the step's forward began (after DDP's broadcast from its source rank;
    ``buffer_own`` where nothing is broadcast)."""
    hyper_bad: bool = False
    """An optimizer hyperparameter (lr, betas, eps, ...) is non-finite (checks/state.py)."""


#: Fields of a :class:`Row`, in wire order, and its pipeline boundary flags among them
#: (checks/pipeline.py fills them).
ROW = tuple(f.name for f in dataclasses.fields(Row))
BOUNDARY = ROW[ROW.index("fwd_origin"):ROW.index("loss_origin") + 1]
_BUFFERS = ("buffer_norm", "buffer_own", "buffer_arrived")

_CONSTANTS: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}


def constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A small constant tensor on ``device``, made once and reused: a fresh host-to-device
    copy every step would synchronise the CUDA stream."""
    key = (values, device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _CONSTANTS[key]


class LocalHealth:
    """Batch norms, loss and gradient norms of this rank for one step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.batch_norms: list[torch.Tensor] = []
        self.loss_sum: torch.Tensor | None = None
        self.loss_count = 0
        self.batch: Any = None
        """The last batch checked (kept by reference, for the report and the replay)."""
        self.ids: list[tuple[Any, Any]] = []
        """``(batch, sample ids)`` of every batch checked with ids this step (every
        micro-batch under gradient accumulation; kept by reference, read after a detection)."""
        self.grad_norms: list[torch.Tensor] = []
        """One 0-d gradient norm per DDP bucket or (device, dtype) group of parameters."""
        self.injected = False
        self.quarantined: torch.Tensor | None = None
        """A 0-d device flag: some batch checked this step is quarantined (None: none can be)."""
        self.boundary: torch.Tensor | None = None
        """The pipeline boundary flags (``BOUNDARY`` order, fp32 0/1 on the device); None
        without pipeline stages."""
        self.forward_groups: tuple[str, ...] = ()
        """Process groups that ran a collective in this rank's forward (origins.py)."""
        self.seconds = 0.0
        """The sentinel's own time spent on this step so far (``nansentinel_check_seconds``)."""
        self.stop_signal = 0
        """A stop signal this rank received (15 SIGTERM, 2 SIGINT; 0: none), set just before
        the row is packed (step/current.py)."""
        self.dropped: torch.Tensor | None = None
        """``policy="drop"``: a 0-d bool on the device, fixed at the step's first reduction
        (drop.py): this rank's gradients are replaced by zeros in every reduction of the step.
        None: no reduction withheld anything this step."""
        self.buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """The floating buffers' max-abs norms (0-d fp32 on the device): as the step left
        them, this rank's own before its forward, as its forward began (buffers.py); None: the
        model has none."""
        self.hyper_bad = False
        """An optimizer hyperparameter the host reads is non-finite (read as the row is
        packed)."""
        self.hyper_flag: torch.Tensor | None = None
        """The hyperparameters held as tensors on the accelerator: 0-d fp32 on the device, 1
        where one is non-finite (checks/state.py ``nonfinite_flag``: no host sync), raising
        the row's ``hyper_bad`` slot; None: the optimizer holds none there."""
        self.hyper = ""
        """Those hyperparameters in words, as they were then (a report names them after the
        schedule, or a drill, may have written the next step's)."""

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Count the time inside as the sentinel's own, for this step."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started

    def add_boundaries(self, flags: torch.Tensor) -> None:
        """Raise the boundary flags by a stage's (``BOUNDARY`` order; element-wise max)."""
        self.boundary = flags if self.boundary is None else torch.maximum(self.boundary, flags)

    def add_batch(self, batch: Any, norms: list[torch.Tensor]) -> None:
        self.batch_norms.extend(norms)
        self.batch = batch

    def add_quarantined(self, flag: torch.Tensor) -> None:
        """Add one batch's quarantine flag (0-d, on the device: 1 = quarantined)."""
        self.quarantined = flag if self.quarantined is None else torch.maximum(
            self.quarantined, flag
        )

    def add_loss(self, value: torch.Tensor) -> None:
        """Add a loss value (0-d; a DTensor's local value); NaN and Inf propagate through the
        sum into the flag."""
        value = moved(local(value), self.device)
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
        self.loss_count += 1

    def add_grads(self, norm: torch.Tensor) -> None:
        """Add one 0-d gradient norm (a DTensor's local value)."""
        self.grad_norms.append(local(norm))

    def poisoned(self) -> torch.Tensor:
        """0-d bool on the device: the batches or losses checked so far this step hold a
        non-finite value (no host sync). Known before backward, so before the step's first
        gradient reduction: the flag ``policy="drop"`` withholds this rank's gradients by."""
        zero = constant((0.0,), self.device).reshape(())
        loss = zero if self.loss_sum is None else self.loss_sum.to(torch.float32)
        batch = combined(self.batch_norms, zero).to(torch.float32)
        return ~torch.isfinite(torch.stack([batch, loss])).all()

    def row(self) -> torch.Tensor:
        """The health row (a :class:`Row`: batch norm, loss, gradient norm, then the flags) as
        fp32 on the device: no host sync."""
        host = self._host_flags()
        flags = constant((host["injected"], host["has_loss"], host["has_grad"], 0.0), self.device)
        if self.quarantined is not None:
            flags = torch.cat([flags[:3], self.quarantined.reshape(1).to(torch.float32)])
        boundary = (constant((0.0,) * len(BOUNDARY), self.device) if self.boundary is None
                    else moved(self.boundary, self.device, torch.float32))
        stops = constant((host["stop_term"], host["stop_int"], host["hyper_bad"]),
                         self.device)  # cached constants: no host-to-device copy
        if self.hyper_flag is not None:
            stops = torch.cat([stops[:2], torch.maximum(
                stops[2:], moved(self.hyper_flag, self.device, torch.float32).reshape(1))])
        buffers = (constant((0.0, 0.0, 0.0), self.device) if self.buffers is None
                   else torch.stack([moved(b, self.device, torch.float32).reshape(())
                                     for b in self.buffers]))
        return assembled((
            (("batch_norm", "loss_value", "grad_norm_value"), self._values()),
            (("injected", "has_loss", "has_grad", "quarantined"), flags),
            (BOUNDARY, boundary),
            (("stop_term", "stop_int", "hyper_bad"), stops),
            (_BUFFERS, buffers),
        ), ROW)

    def host_row(self) -> list[float]:
        """The same row as :meth:`row`, as host floats: where the device is the CPU, reading
        the values syncs nothing, and the row's flags are the host's own (the pack then runs on
        floats, ``wire.schema.pack``, instead of a dozen small tensor operations here)."""
        named = self._host_flags()
        if self.hyper_flag is not None:
            named["hyper_bad"] = max(named["hyper_bad"], _host_float(self.hyper_flag))
        named["batch_norm"] = _host_float(combined(self.batch_norms, None))
        named["loss_value"] = _host_float(self._loss())
        named["grad_norm_value"] = _host_float(combined(self.grad_norms, None))
        named["quarantined"] = 0.0 if self.quarantined is None else float(self.quarantined)
        boundary = ([0.0] * len(BOUNDARY) if self.boundary is None
                    else self.boundary.to(torch.float32).tolist())
        named.update(zip(BOUNDARY, boundary, strict=True))
        named.update(zip(_BUFFERS, [0.0, 0.0, 0.0] if self.buffers is None
                         else [_host_float(b) for b in self.buffers], strict=True))
        return [named[name] for name in ROW]

    def _values(self) -> torch.Tensor:
        """Batch norm, loss (the micro-batches' mean) and gradient norm, fp32 on the device."""
        zero = constant((0.0,), self.device).reshape(())
        batch = combined(self.batch_norms, zero)
        loss = self._loss()
        grad = combined([moved(n, self.device) for n in self.grad_norms], zero)
        return torch.stack([batch, zero if loss is None else loss, grad]).to(torch.float32)

    def _loss(self) -> torch.Tensor | None:
        """The micro-batches' mean loss (one division only for several); None: none checked."""
        if self.loss_sum is None:
            return None
        return self.loss_sum if self.loss_count == 1 else self.loss_sum / self.loss_count

    def _host_flags(self) -> dict[str, float]:
        """The row's flags the host knows, as 0.0/1.0."""
        return {"injected": float(self.injected), "has_loss": float(self.loss_sum is not None),
                "has_grad": float(bool(self.grad_norms)),
                "stop_term": float(self.stop_signal == signal.SIGTERM),
                "stop_int": float(self.stop_signal == signal.SIGINT),
                "hyper_bad": float(self.hyper_bad)}


def assembled(pieces: Sequence[tuple[tuple[str, ...], torch.Tensor]],
              wire: tuple[str, ...]) -> torch.Tensor:
    """One fp32 tensor of the ``pieces`` (names, 1-D values) laid out as ``wire`` names its
    slots: one ``cat``, and one gather only where the computed order differs from the wire's.
    Whoever computes a value names it; where it lies is the schema's."""
    names = tuple(name for group, _ in pieces for name in group)
    vector = torch.cat([t.reshape(-1) for _, t in pieces])
    order = _placement(names, wire)
    return vector if order is None else vector[positions(order, vector.device)]


_POSITIONS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def positions(at: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A constant index tensor on ``device``, made once and reused (as :func:`constant`): one
    gather of several slots of a small vector is one kernel, not one per slot."""
    key = (at, device)
    if key not in _POSITIONS:
        _POSITIONS[key] = torch.tensor(at, dtype=torch.long, device=device)
    return _POSITIONS[key]


@functools.cache
def _placement(computed: tuple[str, ...], wire: tuple[str, ...]) -> tuple[int, ...] | None:
    """:func:`placement` of a layout, checked once; None where it is already the wire's."""
    order = placement(computed, wire)
    return None if order == tuple(range(len(wire))) else order


def placement(computed: tuple[str, ...], wire: tuple[str, ...],
              same: dict[str, str] | None = None) -> tuple[int, ...]:
    """Where each wire slot's value lies among the ``computed`` ones; ``same`` names wire slots
    that repeat another slot's value (the gather copies it). A slot not computed, computed
    twice, or computed but placed nowhere is an error naming it, before any vector is built."""
    same = same or {}
    placed = {same.get(name, name) for name in wire}
    missing = sorted(placed - set(computed))
    extra = sorted(set(computed) - placed)
    if missing or extra or len(computed) != len(set(computed)):
        raise AssertionError(f"nansentinel: the values computed and the wire schema disagree: "
                             f"not computed {missing}, not in the schema {extra}, "
                             f"computed {list(computed)}")
    at = {name: i for i, name in enumerate(computed)}
    return tuple(at[same.get(name, name)] for name in wire)


_Zero = TypeVar("_Zero", torch.Tensor, None)


def combined(norms: list[torch.Tensor], zero: _Zero) -> torch.Tensor | _Zero:
    """One L2 norm from several (NaN and Inf propagate); no kernel for zero or one; ``zero``
    where there are none (None: the host row reads it as 0.0)."""
    if not norms:
        return zero
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack(norms))


def _host_float(value: torch.Tensor | None) -> float:
    """A 0-d value of a CPU row as the fp32 float the device row holds (0.0 for none): one
    read, no tensor made (the values are fp32 already but for a loss of another dtype)."""
    if value is None:
        return 0.0
    return float(value if value.dtype == torch.float32 else value.to(torch.float32))


def to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """A small fp32 tensor of ``values`` on ``device`` without synchronising a CUDA stream
    (staged through pinned memory; the copy is queued, not waited for)."""
    host = torch.tensor(values, dtype=torch.float32)
    return moved(host.pin_memory() if device.type == "cuda" else host, device)


def local_device(params: list[torch.Tensor]) -> torch.device:
    """The device this rank computes on, from its parameters (CPU without any).

    Usually where a parameter lives (a DTensor's local shard). Under FSDP2 with
    ``CPUOffloadPolicy`` the shard lives in host memory while gradients are computed and
    reduce-scattered on the mesh's device: the sentinel's tensors and collectives belong there
    (an NCCL group cannot gather host tensors, and host norms of device buffers cost a blocking
    copy per FSDP group), so the device is taken from the mesh as FSDP does
    (``_get_device_from_mesh``: the mesh's device type, that backend's current device)."""
    if not params:
        return torch.device("cpu")
    param = params[0]
    if not hasattr(param, "to_local"):
        return param.device
    here = param.to_local().device
    mesh_type = getattr(getattr(param, "device_mesh", None), "device_type", here.type)
    if mesh_type == here.type or mesh_type == "cpu":
        return here
    return torch.device(mesh_type, torch.get_device_module(mesh_type).current_device())


def identify(rank: int, world_size: int, hostname: str, local_rank: int,
             device: torch.device) -> RankIdentity:
    """Who this rank is, with its GPU's index and UUID on CUDA (the DCGM join key)."""
    gpu = gpu_uuid = ""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gpu = str(index)
        gpu_uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    return RankIdentity(rank, local_rank, world_size, hostname, str(device), gpu, gpu_uuid)
