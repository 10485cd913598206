"""The exchange's wire format and the cluster view: pure data, no collectives.

Every rank contributes the same fixed number of floats, whatever the world size: counts of
ranks with a non-finite batch, loss or gradient norm, of ranks blamed, spiking, quarantined or
fired on by a drill, or whose gradients were left out of the reduction (``policy="drop"``,
drop.py), the sums the cluster-mean signals need, and the sum of the flagged ranks' indices,
which names the flagged rank exactly when there is one. Summed across ranks, that
vector is the same on every rank, so every rank decides the same from it (policy.py); a
healthy step needs nothing more. Only when something is flagged does a detection
(detection.py) gather the flagged ranks' own rows and identities.

:func:`pack` builds a rank's vector on its device (no host sync): ``TOTALS`` floats that the
exchange sums, then ``OWN`` floats of this rank's own row that travel nowhere and are read
back in the same host copy as the sums. Flags are computed on the device (fp32 0/1): the
sum of a flag is a count, and NCCL reduces no bool.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any

import torch

from nansentinel.result import ACTIVATION, KINDS, RankIdentity

# This rank's health row, as the checks fill it (local.py): three values whose finiteness is
# the check, four flags the host knows, then five flags of the boundaries where values arrive
# from other ranks (pipeline.py; 0 without pipeline stages): a forward output non-finite from
# finite inputs, sent gradients non-finite from finite received ones, a non-finite received
# activation, a non-finite received gradient, a loss non-finite from finite activations and
# targets.
(
    R_BATCH, R_LOSS, R_GRAD, R_INJECTED, R_HAS_LOSS, R_HAS_GRAD, R_QUARANTINED,
    R_FWD_ORIGIN, R_BWD_ORIGIN, R_RECV_ACT, R_RECV_GRAD, R_LOSS_ORIGIN,
) = range(12)
ROW = 12

# The summed part: each rank adds its flags and values; every rank reads the totals.
(
    T_BAD_BATCH, T_BAD_LOSS, T_BAD_GRAD, T_BLAMED, T_FLAGGED, T_FLAGGED_RANK,
    T_SPIKE_LOSS, T_SPIKE_GRAD, T_SPIKE_ANY, T_NOT_QUIET, T_INJECTED, T_QUARANTINED,
    T_LOSS_N, T_LOSS_SUM, T_LOSS_SQ, T_GRAD_N, T_GRAD_SUM, T_GRAD_SQ, T_REACHED, T_DROPPED,
) = range(20)
TOTALS = 20

# The own part, after the totals: this rank's row and its device-side verdicts, and whether
# its gradients were replaced by zeros before their reduction (drop.py).
O_ROW = TOTALS
O_SPIKE_LOSS, O_SPIKE_GRAD, O_NOT_QUIET, O_FLAGGED, O_REACHED, O_DROPPED = range(
    TOTALS + ROW, TOTALS + ROW + 6)
OWN = ROW + 6
SIZE = TOTALS + OWN

#: Bytes one rank sends per step (fp32), at any world size.
EXCHANGE_BYTES = TOTALS * 4

#: The signals a spike is judged on, in the order of the thresholds.
SIGNALS = ("loss", "grad_norm")


def pack(
    row: torch.Tensor, thresholds: torch.Tensor, rank: int, *, amp: bool,
    dropped: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's exchange vector (``SIZE`` fp32 on ``row``'s device), without a host sync.

    Args:
        row: the health row (``R_*`` layout, fp32).
        thresholds: ``[spike loss, spike grad, quiet loss, quiet grad]`` of this rank's own
            rolling references (``inf`` while a series warms up; see spikes.py).
        rank: this rank's index, summed where the rank is flagged.
        amp: under GradScaler a non-finite gradient alone is fp16 overflow, not blame.
        dropped: 0-d fp32 on the device, 1 where this rank's gradients were replaced by zeros
            before their reduction (``policy="drop"``); None: they were not.
    """
    finite = torch.isfinite(row[R_BATCH:R_GRAD + 1])  # batch, loss, grad
    bad = (~finite).to(torch.float32)
    signal, has = row[R_LOSS:R_GRAD + 1], row[R_HAS_LOSS:R_HAS_GRAD + 1]
    above = signal.repeat(2) >= thresholds  # spike loss, spike grad, quiet loss, quiet grad
    spike = (above[:2] & finite[1:]) * has
    not_quiet = ((above[2:] | ~finite[1:]) * has).amax()
    # No host-made tensor anywhere: a host-to-device copy would sync the stream.
    # Where a non-finite value began (pipeline.py): a rank whose batch, forward output or sent
    # gradients went non-finite from finite inputs is an origin; a loss or gradient that is
    # non-finite after a non-finite value arrived from another stage was only reached. Under
    # GradScaler non-finite gradients alone are fp16 overflow, so only the forward counts.
    fwd = torch.maximum(row[R_FWD_ORIGIN], row[R_LOSS_ORIGIN])
    bwd = row[R_BWD_ORIGIN]
    recv_act, received = row[R_RECV_ACT], torch.maximum(row[R_RECV_ACT], row[R_RECV_GRAD])
    if amp:
        origin = torch.stack([bad[0], fwd, bad[1] * (1.0 - recv_act)]).amax()
        nonfinite = torch.maximum(bad[:2].amax(), fwd)
    else:
        origin = torch.stack([bad[0], fwd, bwd, bad[1:].amax() * (1.0 - received)]).amax()
        nonfinite = torch.stack([bad.amax(), fwd, bwd]).amax()
    blamed = origin * (1.0 - row[R_QUARANTINED])
    reached = nonfinite * received * (1.0 - origin)
    flagged = torch.stack([blamed, spike.amax(), reached]).amax()
    kept = signal.nan_to_num(0.0, 0.0, 0.0) * has  # a non-finite value is counted, not added
    sums = torch.stack([finite[1:] * has, kept, kept * kept], dim=1).reshape(-1)
    flags = torch.stack([blamed, flagged, flagged * float(rank), spike[0], spike[1],
                         spike.amax(), not_quiet, row[R_INJECTED], row[R_QUARANTINED]])
    left_out = (torch.zeros_like(reached) if dropped is None
                else dropped.to(reached.device, torch.float32)).reshape(1)
    return torch.cat([bad, flags, sums, reached.reshape(1), left_out, row, spike,
                      not_quiet.reshape(1), flagged.reshape(1), reached.reshape(1), left_out])


@dataclasses.dataclass(frozen=True, slots=True)
class Totals:
    """The summed part of the exchange: counts and sums over every rank, the same on all."""

    bad_batch: int = 0
    bad_loss: int = 0
    bad_grad: int = 0
    blamed: int = 0
    flagged: int = 0
    flagged_rank: float = 0.0
    """Sum of the flagged ranks' indices: the flagged rank itself when ``flagged == 1``."""
    spike_loss: int = 0
    spike_grad: int = 0
    spike_any: int = 0
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
    """Ranks whose gradients were replaced by zeros before their reduction (drop.py)."""

    @classmethod
    def from_values(cls, values: list[float]) -> Totals:
        v = values[:TOTALS]
        return cls(*(round(x) if f.name in _INT_FIELDS else x
                     for f, x in zip(_TOTAL_FIELDS, v, strict=True)))

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
        return skip_count([getattr(self, f.name) for f in _TOTAL_FIELDS]) > 0

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


def skip_count(totals: Any) -> Any:
    """The ranks whose step no policy could apply as it is: a non-finite batch, loss or
    gradient, or a quarantined batch. ``totals`` in wire order (``T_*``): the summed vector on
    the device (the device gate's ``found_inf``, no host sync) or the host's values
    (``Totals.device_skips``): one rule for both gates."""
    return totals[T_BAD_BATCH] + totals[T_BAD_LOSS] + totals[T_BAD_GRAD] + totals[T_QUARANTINED]


#: The totals' fields in wire order (``T_*``), and those that are counts.
_TOTAL_FIELDS = dataclasses.fields(Totals)
_INT_FIELDS = frozenset(f.name for f in _TOTAL_FIELDS if f.type == "int")


@dataclasses.dataclass(frozen=True, slots=True)
class OwnRow:
    """This rank's own part of its vector, read back with the totals."""

    batch_norm: float
    loss_value: float
    grad_norm_value: float
    injected: bool
    has_loss: bool
    has_grad: bool
    quarantined: bool
    spike_loss: bool
    spike_grad: bool
    not_quiet: bool
    flagged: bool
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
    reached: bool = False
    """Non-finite only downstream of what arrived from another rank (judged on the device)."""
    dropped: bool = False
    """This rank's gradients were replaced by zeros before their reduction (drop.py)."""

    @classmethod
    def from_values(cls, values: list[float]) -> OwnRow:
        v = values[O_ROW:O_ROW + OWN]
        flags = [bool(x) for x in v]
        return cls(v[R_BATCH], v[R_LOSS], v[R_GRAD], *flags[R_INJECTED:R_QUARANTINED + 1],
                   *flags[ROW:ROW + 4], *flags[R_FWD_ORIGIN:R_LOSS_ORIGIN + 1], flags[ROW + 4],
                   flags[ROW + 5])

    @property
    def kinds(self) -> tuple[str, ...]:
        checked = (self.batch_norm, self.loss_value, self.grad_norm_value)
        kinds = [k for k, x in zip(KINDS, checked, strict=True) if not math.isfinite(x)]
        if self.fwd_origin:
            kinds.append(ACTIVATION)
        if self.bwd_origin and "grad" not in kinds:
            kinds.append("grad")  # the gradients it sent back are gradients too
        return tuple(kinds)

    @property
    def boundary(self) -> tuple[str, ...]:
        """Where a pipeline boundary saw a non-finite value on this rank, in words."""
        words = ("forward output from finite inputs", "sent gradients from finite received ones",
                 "received activations", "received gradients",
                 "loss from finite activations and targets")
        on = (self.fwd_origin, self.bwd_origin, self.recv_act, self.recv_grad, self.loss_origin)
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
class RankHealth:
    """One named rank's part of the cluster view (a flagged rank, or the replay's peer)."""

    identity: RankIdentity
    kinds: tuple[str, ...]
    injected: bool
    loss: float | None
    grad_norm: float | None
    quarantined: bool = False
    spikes: dict[str, float] = dataclasses.field(default_factory=dict)
    """Signal -> value / its running median, for the signals this rank spiked on."""
    reached: bool = False
    """Its non-finite values came from another rank within the step: named, not blamed."""
    boundary: tuple[str, ...] = ()
    """Where a pipeline boundary saw a non-finite value (``OwnRow.boundary``)."""
    forward_groups: tuple[str, ...] = ()
    """Process groups that ran a collective in this rank's forward (origins.py)."""
    dropped: bool = False
    """Its gradients were replaced by zeros before their reduction (``OwnRow.dropped``)."""

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def healthy(self) -> bool:
        return not self.kinds

    def value(self, signal: str) -> float | None:
        return self.loss if signal == "loss" else self.grad_norm

    @classmethod
    def of(
        cls, identity: RankIdentity, own: OwnRow, ratios: dict[str, float],
        forward_groups: tuple[str, ...] = (),
    ) -> RankHealth:
        return cls(identity, own.kinds, own.injected, own.loss, own.grad_norm,
                   own.quarantined, ratios, own.reached, own.boundary, forward_groups,
                   own.dropped)

    def to_wire(self) -> list[object]:
        """What a named rank sends in a detection: its fields by position, in the dataclass's
        order (its identity's first, its world size left out: the receiver's own). Positional
        because a detection may name every rank: 131,072 records of keys would be three times
        the bytes and the parse. The one list of the fields to keep in step with the class
        (test_detection sets every field off its default and round-trips it)."""
        i = self.identity
        return [i.rank, i.local_rank, i.hostname, i.device, i.gpu, i.gpu_uuid, list(self.kinds),
                self.injected, self.loss, self.grad_norm, self.quarantined, dict(self.spikes),
                self.reached, list(self.boundary), list(self.forward_groups), self.dropped]

    @classmethod
    def from_wire(cls, w: list[Any], world_size: int) -> RankHealth:
        """The row :meth:`to_wire` sent, from a rank of a group of ``world_size``."""
        (rank, local_rank, host, device, gpu, uuid, kinds, injected, loss, grad_norm,
         quarantined, spikes, reached, boundary, groups, dropped) = w
        return cls(
            RankIdentity(int(rank), int(local_rank), world_size, host, device, gpu, uuid),
            _shared(kinds), bool(injected), loss, grad_norm, bool(quarantined),
            {str(k): float(v) for k, v in spikes.items()} if spikes else {}, bool(reached),
            _shared(boundary), _shared(groups), bool(dropped),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterView:
    """The cluster at one step, the same on every rank: the totals, and after a detection the
    flagged ranks by name. A healthy step's view is the totals alone (no row per rank)."""

    step: int
    world_size: int
    totals: Totals = dataclasses.field(default_factory=Totals)
    flagged: tuple[RankHealth, ...] = ()
    """Ranks that were blamed, reached or spiked, by rank (gathered only after a detection)."""
    listed: tuple[RankHealth, ...] = ()
    """Every named rank: ``flagged`` and the replay's peer, by rank."""
    every_host_bad: bool = False
    """Every host had a blamed rank (a global cause: no host is struck)."""
    extremes: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """Signal -> (min, max) over the ranks with a finite value (after a detection)."""
    replay_peer: int | None = None
    """A healthy rank, preferably on another host, to replay a blamed rank's batch."""
    origin_trace: dict[str, Any] | None = None
    """What the trace of a forward collective found (origins.Trace, as JSON), when one ran."""

    def bad(self, kinds: tuple[str, ...] = KINDS) -> list[RankHealth]:
        """Named ranks with a non-finite value of one of ``kinds``."""
        return [r for r in self.flagged if set(r.kinds) & set(kinds)]

    @property
    def reached(self) -> list[int]:
        """Flagged ranks whose non-finite values only came from another rank, by rank."""
        return [r.rank for r in self.flagged if r.reached]

    def named(self, rank: int) -> RankHealth | None:
        """The named rank ``rank`` (flagged or the replay peer), if it is named: a binary
        search (``listed`` is by rank), so a report's few look-ups cost nothing at 131,072."""
        i = bisect.bisect_left(self.listed, rank, key=_rank_of)
        return self.listed[i] if i < len(self.listed) and self.listed[i].rank == rank else None

    @property
    def injected(self) -> bool:
        return self.totals.injected > 0

    @property
    def quarantined(self) -> bool:
        return self.totals.quarantined > 0

    @property
    def needs_detection(self) -> bool:
        """Some rank was blamed or spiked: its name must be gathered."""
        return self.totals.flagged > 0


def _rank_of(r: RankHealth) -> int:
    return r.rank


#: The few distinct kinds, boundaries and group lists of named rows, each held once.
_SHARED: dict[tuple[str, ...], tuple[str, ...]] = {}


def _shared(items: list[str]) -> tuple[str, ...]:
    """``tuple(items)``, one object for equal tuples: 131,072 rows naming the same kinds and
    groups hold two tuples, not 262,144, which the garbage collector would walk once more
    after the detection."""
    t = tuple(items)
    if len(_SHARED) > 4096:  # bounded: a stray variety cannot grow it
        _SHARED.clear()
    return _SHARED.setdefault(t, t)
