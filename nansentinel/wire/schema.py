"""The exchange's wire: one schema, from which everything that reads or writes it is generated.

Every rank contributes the same fixed number of floats, whatever the world size. The vector has
two sections:

- **totals** (:class:`Totals`): summed across ranks, the same on every rank afterwards: counts
  of ranks with a non-finite batch, loss or gradient norm, of ranks blamed, spiking,
  quarantined, fired on by a drill, left out of the reduction (``policy="drop"``) or asked to
  stop by a signal (SIGTERM, SIGINT: effects/stop.py), the sums the cluster-mean signals
  need, and the sum of the flagged ranks' indices, which names the flagged rank exactly when
  there is one. Only this section travels.
- **own** (:class:`OwnRow`): this rank's own row (``checks.health.Row``, as the checks fill
  it) and its device-side verdicts, read back in the same host copy as the totals.

The records are the schema: a field's place in its dataclass is its place on the wire. The
positions (:data:`R`, :data:`T`, :data:`O`), the sizes, :func:`pack`'s placement of what it
computes, the records' decoding (``from_values``) and a named row's wire form
(``view.RankHealth.to_wire``) are all generated from them, so a field added to a record is on
the wire everywhere at once (tests/unit/test_exchange.py checks they agree).

:func:`pack` builds a rank's vector on its device with no host sync. Flags are fp32 0/1: the
sum of a flag is a count, and NCCL reduces no bool.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from nansentinel.checks.health import Row, constant, placement, positions
from nansentinel.result import ACTIVATION, BUFFER, HYPERPARAMETER, KINDS

#: The signals a spike is judged on, in the order of the thresholds.
SIGNALS = ("loss", "grad_norm")


@dataclasses.dataclass(frozen=True, slots=True)
class OwnRow(Row):
    """This rank's own part of its vector: its :class:`Row`, then its verdicts taken on the
    device, read back with the totals."""

    spike_loss: bool = False
    spike_grad: bool = False
    spike_batch: bool = False
    """This rank's batch norm spiked against its own reference (see :attr:`Totals.data_spike`)."""
    not_quiet: bool = False
    """A signal above its quiet threshold (or non-finite): the rank is not a calm reference."""
    flagged: bool = False
    reached: bool = False
    """Non-finite only downstream of what arrived from another rank (judged on the device)."""
    dropped: bool = False
    """This rank's gradients were replaced by zeros before their reduction (effects/drop.py)."""

    @classmethod
    def from_values(cls, values: Sequence[float]) -> OwnRow:
        """The own section of a vector read back on the host (the whole vector)."""
        return cls(*_decoded(cls, values[O.start:O.start + O.size]))

    @property
    def kinds(self) -> tuple[str, ...]:
        checked = (self.batch_norm, self.loss_value, self.grad_norm_value)
        kinds = [k for k, x in zip(KINDS, checked, strict=True) if not math.isfinite(x)]
        if self.fwd_origin:
            kinds.append(ACTIVATION)
        if self.bwd_origin and "grad" not in kinds:
            kinds.append("grad")  # the gradients it sent back are gradients too
        if not (math.isfinite(self.buffer_norm) and math.isfinite(self.buffer_own)):
            kinds.append(BUFFER)
        if self.hyper_bad:
            kinds.append(HYPERPARAMETER)
        return tuple(kinds)

    @property
    def boundary(self) -> tuple[str, ...]:
        """Where a pipeline boundary saw a non-finite value on this rank, in words."""
        words = ("forward output from finite inputs", "sent gradients from finite received ones",
                 "received activations", "received gradients",
                 "loss from finite activations and targets", "floating buffers received")
        on = (self.fwd_origin, self.bwd_origin, self.recv_act, self.recv_grad, self.loss_origin,
              not math.isfinite(self.buffer_arrived) and math.isfinite(self.buffer_own))
        return tuple(w for w, f in zip(words, on, strict=True) if f)

    @property
    def loss(self) -> float | None:
        return self.loss_value if self.has_loss else None

    @property
    def grad_norm(self) -> float | None:
        return self.grad_norm_value if self.has_grad else None

    def value(self, signal: str) -> float | None:
        return self.loss if signal == "loss" else self.grad_norm

    def spiked(self) -> list[str]:
        """The signals this rank's own reference saw spike (judged on the device)."""
        return [s for s, on in zip(SIGNALS, (self.spike_loss, self.spike_grad), strict=True)
                if on]


@dataclasses.dataclass(frozen=True, slots=True)
class Totals:
    """The summed part of the exchange: counts and sums over every rank, the same on all."""

    bad_batch: int = 0
    bad_loss: int = 0
    bad_grad: int = 0
    bad_buffer: int = 0
    """Ranks whose floating buffers were non-finite as the step left them (own or received)."""
    bad_hyper: int = 0
    """Ranks whose optimizer holds a non-finite hyperparameter: the step is skipped."""
    blamed: int = 0
    flagged: int = 0
    flagged_rank: float = 0.0
    """Sum of the flagged ranks' indices: the flagged rank itself when ``flagged == 1``."""
    spike_loss: int = 0
    spike_grad: int = 0
    spike_any: int = 0
    data_spike: int = 0
    """Ranks whose loss or gradient norm spiked in a step whose batch spiked too (its norm
    against its own reference): the data changed, not the weights (decide/spikes.py)."""
    not_quiet: int = 0
    injected: int = 0
    quarantined: int = 0
    loss_n: int = 0
    loss_sum: float = 0.0
    loss_sq: float = 0.0
    grad_n: int = 0
    grad_sum: float = 0.0
    grad_sq: float = 0.0
    reached: int = 0
    """Ranks whose only non-finite values arrived from another rank (a pipeline boundary)."""
    dropped: int = 0
    """Ranks whose gradients were replaced by zeros before their reduction (effects/drop.py)."""
    stop_term: int = 0
    stop_int: int = 0
    """Ranks that a SIGTERM (SIGINT) reached before they packed this step's row: every rank
    reads the same sums, so every rank stops after this same step (decide/policy.py
    ``requested_stop``)."""

    @classmethod
    def from_values(cls, values: Sequence[float]) -> Totals:
        """The totals of a vector read back on the host (the whole vector, or its totals)."""
        return cls(*_decoded(cls, values[:T.size]))

    def bad(self, kind: str) -> int:
        """Ranks whose ``kind`` (batch, loss, grad) was non-finite."""
        return {"batch": self.bad_batch, "loss": self.bad_loss, "grad": self.bad_grad}[kind]

    @property
    def single_flagged(self) -> int | None:
        """The flagged rank when exactly one is (from the sum of indices), else None."""
        return round(self.flagged_rank) if self.flagged == 1 else None

    @property
    def device_skips(self) -> bool:
        """Some rank had a non-finite value or a quarantined batch (:func:`skip_count`, the
        rule the device gate's ``found_inf`` applies on the device)."""
        return skip_count([getattr(self, f.name) for f in dataclasses.fields(self)]) > 0

    def sums(self, signal: str) -> tuple[int, float, float]:
        """Ranks with a finite ``loss`` or ``grad_norm``, its sum and sum of squares."""
        if signal == "loss":
            return self.loss_n, self.loss_sum, self.loss_sq
        return self.grad_n, self.grad_sum, self.grad_sq

    def mean(self, signal: str) -> float | None:
        """The cluster mean of ``loss`` or ``grad_norm`` over the ranks with a finite one."""
        n, total, _ = self.sums(signal)
        return total / n if n else None

    def std(self, signal: str) -> float | None:
        n, total, sq = self.sums(signal)
        if not n:
            return None
        return math.sqrt(max(0.0, sq / n - (total / n) ** 2))

    def without(self, signal: str, values: list[float]) -> float | None:
        """The cluster mean of ``signal`` over the ranks other than those with ``values``."""
        n, total, _ = self.sums(signal)
        finite = [v for v in values if math.isfinite(v)]
        rest = n - len(finite)
        return (total - sum(finite)) / rest if rest > 0 else None


@dataclasses.dataclass(frozen=True, slots=True)
class GroupTotals:
    """The row torchft's replica groups sum each step (wire/group_rows.py), through
    torchft's managed all-reduce, beside the ranks' exchange: counts over the groups."""

    bad: int = 0
    """Replica groups (of this group rank) that did not apply the step."""
    batch: int = 0
    loss: int = 0
    grad: int = 0
    """Groups whose batch, loss or gradients were non-finite."""
    index: int = 0
    """Sum of the bad groups' participating ranks + 1: the bad group when ``bad == 1``."""
    dropped: int = 0
    """Bad groups whose gradients went as zeros (``policy="drop"``)."""

    @classmethod
    def from_values(cls, values: Sequence[float]) -> GroupTotals:
        """The summed row read back on the host."""
        return cls(*_decoded(cls, values[:G.size]))

    @property
    def kinds(self) -> tuple[str, ...]:
        """Which of ``batch``, ``loss``, ``grad`` were non-finite in some group."""
        return tuple(k for k, n in zip(KINDS, (self.batch, self.loss, self.grad), strict=True)
                     if n)

    @property
    def single(self) -> int:
        """With one bad group: its participating replica rank (else -1)."""
        return self.index - 1 if self.bad == 1 else -1


class Index:
    """The wire positions of a record's fields, generated from the record: ``T.bad_batch`` is
    where ``Totals.bad_batch`` lies in the vector, ``R.loss_value`` where the loss lies in a
    :class:`Row`. An unknown name is an error at once, not a silent 0."""

    __slots__ = ("_at", "names", "size", "start")

    def __init__(self, record: type, start: int = 0) -> None:
        self.names: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(record))
        self._at = {name: start + i for i, name in enumerate(self.names)}
        self.start, self.size = start, len(self.names)

    def __getattr__(self, name: str) -> int:
        try:
            return self._at[name]
        except KeyError:
            raise AttributeError(f"no field {name!r} on the wire") from None

    def __repr__(self) -> str:
        return f"Index({self.start}..{self.start + self.size})"


#: Positions in a :class:`Row`, in the totals section, and in the own section (after it).
R = Index(Row)
T = Index(Totals)
O = Index(OwnRow, start=T.size)  # noqa: E741 - the own section, beside R and T
#: Positions in torchft's replica groups' row (:class:`GroupTotals`).
G = Index(GroupTotals)
#: Floats in a rank's vector, and bytes one rank sends per step (fp32), at any world size.
SIZE = T.size + O.size
EXCHANGE_BYTES = T.size * 4


def _decoded(record: Any, values: Sequence[float]) -> list[Any]:
    """``values`` as the record's fields: counts rounded to int, flags as bool (each record's
    decoders found once: this runs on every step)."""
    decoders = _DECODERS.get(record)
    if decoders is None:
        decoders = _DECODERS[record] = tuple(_DECODE[f.type]
                                             for f in dataclasses.fields(record))
    return [decode(x) for decode, x in zip(decoders, values, strict=True)]


_DECODERS: dict[Any, tuple[Any, ...]] = {}


_DECODE: dict[Any, Any] = {"int": round, "float": float, "bool": bool}


def pack(
    row: torch.Tensor | list[float], thresholds: torch.Tensor, rank: int, *, amp: bool,
    dropped: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's exchange vector (``SIZE`` fp32 on ``row``'s device), without a host sync.

    Args:
        row: the health row (:class:`Row` layout, fp32), or its host floats on the CPU
            (``LocalHealth.host_row``).
        thresholds: ``[spike loss, spike grad, quiet loss, quiet grad, spike batch]`` of this
            rank's own rolling references (``inf`` while a series warms up; see
            decide/spikes.py).
        rank: this rank's index, summed where the rank is flagged.
        amp: under GradScaler a non-finite gradient alone is fp16 overflow, not blame.
        dropped: 0-d fp32 on the device, 1 where this rank's gradients were replaced by zeros
            before their reduction (``policy="drop"``); None: they were not.

    On the CPU the host is the device: reading the row syncs nothing, so the rule runs on
    its floats (:func:`pack_values`, one read and one tensor made, about a tenth of the
    time of three dozen small tensor operations, each a few microseconds of dispatch).
    Elsewhere :func:`pack_on_device`. The two are the same rule (tests/unit/test_exchange.py
    holds them bit for bit equal over every combination of flags and special values).
    """
    if isinstance(row, list) or row.device.type == "cpu":
        return torch.tensor(pack_values(
            row if isinstance(row, list) else row.tolist(), thresholds.tolist(), rank, amp=amp,
            dropped=dropped is not None and bool(dropped)), dtype=torch.float32)
    return pack_on_device(row, thresholds, rank, amp=amp, dropped=dropped)


def pack_values(row: Sequence[float], thresholds: Sequence[float], rank: int, *, amp: bool,
                dropped: bool = False) -> list[float]:
    """:func:`pack_on_device`'s rule on host floats (the row and thresholds as fp32 values,
    so every comparison and product rounds as on the device): flags are 0.0/1.0, "and" a
    product, "or" a max, as there."""
    values = [row[i] for i in range(_VALUES.start, _VALUES.stop)]
    bad = [0.0 if math.isfinite(v) else 1.0 for v in values]
    has = [row[i] for i in range(_HAS.start, _HAS.stop)]
    counted = [(1.0 - b) * h for b, h in zip(bad[1:], has, strict=True)]
    above = [1.0 if row[i] >= t else 0.0 for i, t in zip(_AGAINST, thresholds, strict=True)]
    spike = [a * c for a, c in zip(above[:2], counted, strict=True)]
    spike_any = max(spike)
    not_quiet = max(max(a, b) * h for a, b, h in zip(above[2:4], bad[1:], has, strict=True))
    batch_spike = above[4] * (1.0 - bad[0])
    buffers = [0.0 if math.isfinite(row[i]) else 1.0 for i in range(_BUFS.start, _BUFS.stop)]
    flags = [*bad, *(row[i] for i in range(_BOUNDARY.start, _BOUNDARY.stop)), *buffers]
    direct, downstream, guard, nonfinite = _ORIGIN_AMP if amp else _ORIGIN
    received = max(flags[i] for i in _RECEIVED)
    origin = max(max(flags[i] for i in direct),
                 max(flags[i] for i in downstream) * (1.0 - max(flags[i] for i in guard)))
    blamed = origin * (1.0 - row[_QUARANTINED])
    reached = max(flags[i] for i in nonfinite) * received * (1.0 - origin)
    flagged = max(blamed, spike_any, reached)
    kept = [(v if math.isfinite(v) else 0.0) * h
            for v, h in zip(values[1:], has, strict=True)]
    verdicts = [blamed, flagged, flagged * float(rank), spike_any, spike_any * batch_spike,
                not_quiet, reached, batch_spike, float(dropped)]
    computed = [*bad, buffers[0], *verdicts, *spike, *counted, *kept, *(k * k for k in kept),
                *row]
    return [computed[i] for i in _PLACED]


def pack_on_device(
    row: torch.Tensor, thresholds: torch.Tensor, rank: int, *, amp: bool,
    dropped: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`pack` on an accelerator: no host sync.

    Built on every step, on the device, so it is written as a few operations on short vectors
    rather than one per flag (each one is a kernel launch on a GPU and a few microseconds of
    host dispatch anywhere); every flag is fp32 0/1, so "and" is a product and "or" a max.
    No host-made tensor anywhere: a host-to-device copy would sync the stream (the index
    tensors are constants made once per device).
    """
    device = row.device
    one = constant((1.0,), device).reshape(())
    finite = torch.isfinite(row[_VALUES]).to(torch.float32)
    bad = one - finite  # batch, loss, grad
    has = row[_HAS]
    counted = finite[1:] * has  # a finite loss, a finite gradient norm
    # Each signal against its thresholds: spike loss, spike grad, quiet loss, quiet grad, and
    # the batch's own norm far above its reference (a loss or gradient spike in that step is
    # the data's, a shard preprocessed differently, not ruined weights).
    above = (row[positions(_AGAINST, device)] >= thresholds).to(torch.float32)
    spike = above[:2] * counted
    spike_any = spike.amax()
    not_quiet = (torch.maximum(above[2:4], bad[1:]) * has).amax()
    batch_spike = above[4] * finite[0]
    # Where a non-finite value began (checks/pipeline.py): a rank whose batch, forward output
    # or sent gradients went non-finite from finite inputs is an origin; a loss or gradient
    # that is non-finite after a non-finite value arrived from another stage was only reached.
    # Under GradScaler non-finite gradients alone are fp16 overflow, so only the forward counts.
    buffers = one - torch.isfinite(row[_BUFS]).to(torch.float32)  # as left, own, arrived
    flags = torch.cat([bad, row[_BOUNDARY], buffers])
    direct, downstream, guard, nonfinite = _ORIGIN_AMP if amp else _ORIGIN
    received = flags[positions(_RECEIVED, device)].amax()
    origin = torch.maximum(
        flags[positions(direct, device)].amax(),
        flags[positions(downstream, device)].amax()
        * (one - flags[positions(guard, device)].amax()))
    blamed = origin * (one - row[_QUARANTINED])
    reached = flags[positions(nonfinite, device)].amax() * received * (one - origin)
    flagged = torch.maximum(torch.maximum(blamed, spike_any), reached)
    kept = row[_SIGNALS].nan_to_num(0.0, 0.0, 0.0) * has
    left_out = (torch.zeros_like(reached) if dropped is None
                else dropped.to(device, torch.float32)).reshape(())
    verdicts = torch.stack([blamed, flagged, flagged * constant((float(rank),), device)[0],
                            spike_any, spike_any * batch_spike, not_quiet, reached,
                            batch_spike, left_out])
    # What is computed, in _COMPUTED's order; its place on the wire is the schema's.
    vector = torch.cat([bad, buffers[:1], verdicts, spike, counted, kept, kept * kept, row])
    return vector[positions(_PLACED, device)]


# The slots of a Row that pack reads.
_VALUES = slice(R.batch_norm, R.grad_norm_value + 1)
_SIGNALS = slice(R.loss_value, R.grad_norm_value + 1)
_HAS = slice(R.has_loss, R.has_grad + 1)
_BOUNDARY = slice(R.fwd_origin, R.loss_origin + 1)
_BUFS = slice(R.buffer_norm, R.buffer_arrived + 1)
_QUARANTINED = R.quarantined
#: The values each threshold is compared with (pack): loss, grad, loss, grad, batch.
_AGAINST = (R.loss_value, R.grad_norm_value, R.loss_value, R.grad_norm_value, R.batch_norm)
# The origin rule's slots in ``flags`` (pack): bad batch, loss, grad, then the row's boundary
# flags fwd_origin, bwd_origin, recv_act, recv_grad, loss_origin, then the floating buffers
# non-finite as the step left them, this rank's own before its forward, and as they arrived
# (DDP broadcasts its source rank's at the forward: a rank they reached is not an origin).
_B, _L, _G, _FWD, _BWD, _RACT, _RGRAD, _LORIG, _BUF, _OWNBUF, _ARRBUF = range(11)
_RECEIVED = (_RACT, _RGRAD, _ARRBUF)
#: (origins in their own right, values non-finite downstream of a boundary, the boundaries that
#: make them only reached, every non-finite value), without and under GradScaler.
_ORIGIN = ((_B, _FWD, _LORIG, _BWD, _OWNBUF), (_L, _G, _BUF), (_RACT, _RGRAD, _ARRBUF),
           (_B, _L, _G, _FWD, _BWD, _LORIG, _BUF, _OWNBUF))
_ORIGIN_AMP = ((_B, _FWD, _LORIG, _OWNBUF), (_L, _BUF), (_RACT, _ARRBUF),
               (_B, _L, _FWD, _LORIG, _BUF, _OWNBUF))
#: What pack computes, named in the order it is concatenated (``own.`` the own section).
_COMPUTED = (
    "bad_batch", "bad_loss", "bad_grad", "bad_buffer",
    "blamed", "flagged", "flagged_rank", "spike_any", "data_spike", "not_quiet", "reached",
    "own.spike_batch", "dropped",
    "spike_loss", "spike_grad", "loss_n", "grad_n", "loss_sum", "grad_sum", "loss_sq", "grad_sq",
    *(f"own.{n}" for n in R.names),
)
#: Wire slots that repeat a computed value under another name.
_SAME = {"injected": "own.injected", "quarantined": "own.quarantined",
         "bad_hyper": "own.hyper_bad",
         "stop_term": "own.stop_term", "stop_int": "own.stop_int",
         "own.spike_loss": "spike_loss", "own.spike_grad": "spike_grad",
         "own.not_quiet": "not_quiet", "own.flagged": "flagged", "own.reached": "reached",
         "own.dropped": "dropped"}


#: Every slot of a vector, in wire order (the own section's names prefixed ``own.``).
WIRE = (*T.names, *(f"own.{n}" for n in O.names))
#: Where each wire slot's value lies among what pack computes (one gather), checked once here:
#: a slot not computed, or a value computed but placed nowhere, fails the import, naming it.
_PLACED = placement(_COMPUTED, WIRE, _SAME)


def skip_count(totals: Any) -> Any:
    """The ranks whose step no policy could apply as it is: a non-finite batch, loss,
    gradient, floating buffer or hyperparameter, or a quarantined batch. ``totals`` in wire
    order: the summed vector on the device (the device gate's ``found_inf``, no host sync) or
    the host's values (``Totals.device_skips``): one rule for both gates."""
    return (totals[T.bad_batch] + totals[T.bad_loss] + totals[T.bad_grad]
            + totals[T.bad_buffer] + totals[T.bad_hyper] + totals[T.quarantined])

