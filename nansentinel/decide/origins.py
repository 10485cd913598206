"""Where a non-finite value began, when a collective in the forward spread it: pure.

Every collective in the forward carries a NaN from the rank where it began to every rank of its
group: tensor parallelism's all-reduces, SyncBatchNorm's statistics, a model that subtracts a
mean over all ranks' batches. Each rank's checks then see a finite batch and a non-finite loss,
exactly like a rank whose own forward went wrong. The pipeline's boundaries are checked where
the values arrive (pipeline.py, on the device); a collective inside the user's forward cannot
be, on the healthy step, without wrapping every collective.

So each rank counts, per process group, the collectives issued between the start of its
forward and its first loss (:class:`nansentinel.wire.collectives.ForwardCollectives`: two reads of
a sequence number per group, nothing per rank), and a named rank sends the groups that ran
one. After a detection this module weighs the named ranks: a rank whose first non-finite value
came *later* in the step (loss or forward output after a batch; gradients after either) than
another named rank's, and that shares a forward collective with it, was reached through that
collective, not poisoned itself. It is named in ``reached``, never blamed or struck.

The order of a step's checks is its causality: batch, then forward (loss, a stage's output),
then backward (gradients). Two independent faults at different points of one step, on ranks
that share a forward collective, are named once, by the earlier; the later one is named on
its own the next time it happens. That errs towards sparing a healthy host, which is the
point: a reached rank's host is never struck.

The order of points cannot tell a faulty device inside the forward from the ranks its output
reached: a layer that writes NaN before an all-reduce of values (SyncBatchNorm's statistics)
or an all-to-all (an MoE expert's output) makes every rank's first non-finite value its loss,
the same point everywhere. When a named rank's first non-finite value is its forward and its
forward ran a collective (:func:`needs_trace`), the rare path replays the forward on every
rank with each collective's input checked (trace.py): the rank whose input to collective #k
went non-finite while every input before it, on every rank, was finite began it.
:func:`retrace` applies that :class:`Trace` to the named ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from nansentinel.result import ACTIVATION
from nansentinel.wire.view import RankHealth

#: The forward's point: where a tie between ranks sharing a forward collective needs a trace.
FORWARD = 1

#: The point of a step where each kind of value is checked, in causal order.
_POINT = {"batch": 0, "loss": 1, ACTIVATION: 1, "grad": 2}


def first_point(rank: RankHealth) -> int | None:
    """The earliest point of the step (0 batch, 1 forward, 2 backward) where ``rank`` held a
    non-finite value; None when it held none."""
    points = [_POINT[k] for k in rank.kinds if k in _POINT]
    return min(points) if points else None


def weigh(named: Sequence[RankHealth]) -> tuple[RankHealth, ...]:
    """``named`` with the ranks reached through a forward collective marked ``reached``.

    A rank not yet reached is reached when another named rank, not reached itself, held a
    non-finite value at an earlier point of the step and ran a collective of the same process
    group in its forward; the cause named is the first such rank in ``named``. The comparison
    is against the ranks as they came in, so the answer does not depend on their order.

    Linear in the named ranks (times their groups): the sources are indexed once, per group
    and point, by the first of them, and each rank asks only its own groups at the points
    before its own. A detection where every rank is named (a global NaN at 131,072 ranks, each
    with a forward collective) stays within a watchdog's patience; nothing runs on a healthy
    step.
    """
    # group -> point -> (position in named, the first source there)
    first: dict[str, dict[int, tuple[int, RankHealth]]] = {}
    points = [first_point(r) for r in named]
    for i, (src, point) in enumerate(zip(named, points, strict=True)):
        if src.reached or point is None:
            continue
        for group in src.forward_groups:
            first.setdefault(group, {}).setdefault(point, (i, src))
    out = []
    for rank, mine in zip(named, points, strict=True):
        if rank.reached or mine is None or not rank.forward_groups:
            out.append(rank)
            continue
        found = [first[g][p] for g in rank.forward_groups if g in first
                 for p in range(mine) if p in first[g]]
        if not found:
            out.append(rank)
            continue
        i, cause = min(found, key=lambda f: f[0])  # an earlier point: never the rank itself
        shared = sorted(set(rank.forward_groups) & set(cause.forward_groups))
        word = f"a forward collective (group {shared[0]}) after rank {cause.rank}'s " + (
            "batch" if points[i] == 0 else "forward")
        out.append(dataclasses.replace(rank, reached=True, boundary=(*rank.boundary, word)))
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class Trace:
    """What the replay that checks each collective's input found (trace.py), the same on
    every rank, since every rank computed it from the same reduced numbers."""

    origins: tuple[int, ...] = ()
    """Ranks whose input to collective ``index`` was non-finite while every input to the
    collectives before it, on every rank, was finite. Empty: the origin could not be told."""
    index: int | None = None
    """That collective's place in the replay's issue order (1-based; the replay's lockstep
    keeps the count in step on every rank, across process groups)."""
    op: str = ""
    """What it was, as the first origin issued it (``allreduce on group 0``)."""
    reason: str = ""
    """Why the origin could not be told (empty when it was)."""

    def to_json(self) -> dict[str, object]:
        return {"origins": list(self.origins), "collective": self.index, "op": self.op,
                "reason": self.reason}


def needs_trace(named: Sequence[RankHealth]) -> bool:
    """Some named rank, not reached, first went non-finite in its forward and ran a collective
    there: another rank's fault could have reached it through that collective, and the order
    of points (:func:`weigh`) could not say. One such rank is enough: the rank where it began
    may not be named at all (an MoE expert whose own rank routed it no token).

    A non-finite batch is checked where it enters, and a gradient after the forward: neither
    needs a trace. Pure, the same on every rank."""
    return any(not r.reached and r.forward_groups and first_point(r) == FORWARD
               for r in named)


def retrace(named: Sequence[RankHealth], trace: Trace,
            rows: dict[int, RankHealth] | None = None) -> tuple[RankHealth, ...]:
    """``named`` (by rank) with a trace's origins blamed and the ranks they reached marked.

    An origin is not reached (whatever :func:`weigh` said: an expert's rank whose own tokens
    all went elsewhere is non-finite only in its gradients, *after* the others' losses) and
    gets the kind ``activation`` (a forward value went non-finite from finite inputs, as at a
    pipeline stage); an origin not named before comes from ``rows``. Every named rank whose
    first non-finite value came in the forward or later and that shares a forward group with
    an origin, or with a rank so reached (the closure: a NaN travels on), is reached. A rank
    whose batch was non-finite keeps its blame: its batch is checked where it enters. Linear
    in the named ranks and their groups. Without origins, ``named`` as it was.
    """
    if not trace.origins:
        return tuple(named)
    rows = rows or {}
    by_rank = {r.rank: r for r in named}
    for rank in trace.origins:
        if rank not in by_rank and rank in rows:
            by_rank[rank] = rows[rank]
    origins = [by_rank[o] for o in trace.origins if o in by_rank]
    where = f"collective #{trace.index}" + (f" ({trace.op})" if trace.op else "")
    out: dict[int, RankHealth] = {}
    for o in origins:
        kinds = o.kinds if ACTIVATION in o.kinds else (*o.kinds, ACTIVATION)
        out[o.rank] = dataclasses.replace(o, kinds=kinds, reached=False, boundary=(
            *o.boundary, f"its input to {where} went non-finite, every earlier input finite"))
    # group -> the named ranks that could have been reached through it
    members: dict[str, list[RankHealth]] = {}
    for r in by_rank.values():
        point = first_point(r)
        if r.rank in out or point is None or point < FORWARD:
            continue
        for g in r.forward_groups:
            members.setdefault(g, []).append(r)
    cause = origins[0].rank if origins else trace.origins[0]
    todo = [g for o in origins for g in o.forward_groups]
    done: set[str] = set()
    while todo:
        group = todo.pop()
        if group in done:
            continue
        done.add(group)
        for r in members.get(group, ()):
            if r.rank in out:
                continue
            out[r.rank] = dataclasses.replace(r, reached=True, boundary=(
                *r.boundary, f"{where} after rank {cause}'s forward"))
            todo.extend(r.forward_groups)
    return tuple(out.get(rank, r) for rank, r in sorted(by_rank.items()))


#: The backward's point: gradients, checked as each collective's send buffers leave.
BACKWARD = 2


def needs_gradient_trace(named: Sequence[RankHealth]) -> bool:
    """Several named ranks, none reached, first went non-finite in their gradients: one rank's
    NaN may have reached the others through a gradient collective of the step (a
    reduce-scatter puts it in a peer's shard; that shard's norm all-reduce then leaves the
    peer non-finite too), and the pre-hook path's order of gradient collectives can tell
    (:func:`regrade`). Pure, the same on every rank."""
    return sum(not r.reached and first_point(r) == BACKWARD for r in named) > 1


def regrade(named: Sequence[RankHealth], trace: Trace) -> tuple[RankHealth, ...]:
    """``named`` with the ranks a gradient collective's trace shows were reached marked so.

    ``trace`` names the ranks whose send buffer at gradient collective #k was non-finite while
    every gradient collective before it, on every rank, was finite: they began it. Every other
    named rank whose first non-finite value was its gradients (not its batch or its loss) is
    then reached, named but not blamed nor struck. Without origins, ``named`` as it was.

    What stays ambiguous (docs/parallelism.md, "Two-level reductions"): a second, independent
    fault on another rank at a later collective of the same step is spared as reached (named
    the next time it happens), and ranks that issue different gradient collectives, or in a
    different order, do not line up by place.
    """
    if not trace.origins:
        return tuple(named)
    origins = set(trace.origins)
    where = f"gradient collective #{trace.index}" + (f" ({trace.op})" if trace.op else "")
    first = min(trace.origins)
    out = []
    for r in named:
        if r.rank in origins or r.reached or first_point(r) != BACKWARD:
            out.append(r)
        else:
            out.append(dataclasses.replace(r, reached=True, boundary=(
                *r.boundary, f"its gradients went non-finite after rank {first}'s send to "
                f"{where}, every earlier send finite")))
    return tuple(out)
