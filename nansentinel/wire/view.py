"""The cluster view: what every rank knows of a step, the same on every rank. Pure data.

A healthy step's view is the summed totals alone (wire/schema.py): no row per rank. Only when
something is flagged does a detection (rare/detection.py) name the flagged ranks, whose own
:class:`RankHealth` rows and identities travel then (only they speak), so that every rank
decides the same from the same view (decide/policy.py).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from nansentinel.result import KINDS, RankIdentity
from nansentinel.wire.schema import OwnRow, Totals


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
        order, its identity's first (its world size left out: the receiver's own).
        Positional because a detection may name every rank: 131,072 records of keys would be
        three times the bytes and the parse. Generated from the fields, so a field added to
        the class travels (test_detection sets every field off its default)."""
        identity = [getattr(self.identity, name) for name in _IDENTITY]
        return identity + [_ENCODE.get(f.type, _plain)(getattr(self, f.name))
                           for f in _ROW_FIELDS]

    @classmethod
    def from_wire(cls, w: list[Any], world_size: int) -> RankHealth:
        """The row :meth:`to_wire` sent, from a rank of a group of ``world_size``."""
        n = len(_IDENTITY)
        ident = dict(zip(_IDENTITY, w[:n], strict=True))
        identity = RankIdentity(**{**ident, "rank": int(ident["rank"]),
                                   "local_rank": int(ident["local_rank"]),
                                   "world_size": world_size})
        return cls(identity, *(_DECODE.get(f.type, _plain)(x)
                               for f, x in zip(_ROW_FIELDS, w[n:], strict=True)))


def _plain(x: Any) -> Any:
    return x


def _spikes(x: Any) -> dict[str, float]:
    return {str(k): float(v) for k, v in x.items()} if x else {}


#: How a named row's fields travel (JSON) and come back, by their declared type.
_ENCODE: dict[Any, Any] = {"tuple[str, ...]": list, "dict[str, float]": dict}
_DECODE: dict[Any, Any] = {"tuple[str, ...]": lambda x: _shared(x), "bool": bool,
                           "dict[str, float]": _spikes}
#: The identity's fields a row carries (its world size is the receiver's), and the rest.
_IDENTITY = tuple(f.name for f in dataclasses.fields(RankIdentity) if f.name != "world_size")
_ROW_FIELDS = tuple(f for f in dataclasses.fields(RankHealth) if f.name != "identity")


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
