"""Where a non-finite value began, when a collective in the forward spread it: pure.

Every collective in the forward carries a NaN from the rank where it began to every rank of its
group: tensor parallelism's all-reduces, SyncBatchNorm's statistics, a model that subtracts a
mean over all ranks' batches. Each rank's checks then see a finite batch and a non-finite loss,
exactly like a rank whose own forward went wrong. The pipeline's boundaries are checked where
the values arrive (pipeline.py, on the device); a collective inside the user's forward cannot
be, on the healthy step, without wrapping every collective.

So each rank counts, per process group, the collectives issued between the start of its
forward and its first loss (:class:`nansentinel.collectives.ForwardCollectives`: two reads of
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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from nansentinel.result import ACTIVATION
from nansentinel.view import RankHealth

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
