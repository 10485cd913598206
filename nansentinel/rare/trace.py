"""Which rank's collective input went non-finite first: the trace of a forward collective.

A faulty device inside the forward, before a collective that carries values to other ranks
(an MoE expert's output on its way back by all-to-all, SyncBatchNorm's statistics, a
sequence-parallel all-gather), makes every rank it reaches non-finite at the same point of the
step as itself: their losses. The order of points (origins.weigh) cannot tell them apart,
and every rank is named; with every host named the cause looks global and nobody is struck,
while the faulty host poisons the job again at its next step.

So, after such a detection only (origins.needs_trace), every rank replays its own batch's
forward and loss in lockstep (replay.py: the same weights, a round before each collective, so
that collective #k is the same one on every rank and a rank whose replay fails stops every
rank at once), under ``torch.no_grad()``, with each collective's *input* flagged on the device
as it is issued (collective_inputs.py). The rank whose input to collective #k was non-finite
while every input to #1..#k-1 on every rank was finite began it: it had only finite values
from every other rank until then. One read of the flags per rank at the end; then one MIN
all-reduce of four int64 numbers tells every rank the first place, the lowest and the highest
rank there, whether every replay ran and whether every loss was finite; only when several
ranks went non-finite at that same collective does a byte per rank name them
(:meth:`Peers.flagged`). Nothing here runs on a healthy step.

What it cannot see: collectives inside a compiled graph (``torch.compile`` lowers them to
kernels that no dispatch mode intercepts) or issued from C++ (a custom extension calling NCCL
directly, Megatron's fused kernels, DeepSpeed's own communication), and a fault that does not
reproduce in the replay (a transient: the report says so and the step keeps the answer it had).
"""

from __future__ import annotations

from typing import Any

import torch

from nansentinel.decide.origins import Trace
from nansentinel.rare.replay import NO_COLLECTIVE, Mode, ReplayFn, replay
from nansentinel.wire.collectives import Peers


def locate(peers: Peers, module: torch.nn.Module, batch: Any, fn: ReplayFn
           ) -> tuple[Trace, str | None]:
    """Replay this rank's forward with its collectives' inputs watched, on every rank
    together; returns the trace (the same on every rank, its ``op`` still empty) and, on an
    origin, what its first non-finite collective was (for the report: the detection gathers
    it from the first origin). Called on every rank, on the rare path only."""
    world, rank = peers.world_size, peers.rank
    if batch is None:
        result = replay(module, None, _no_batch, Mode(localise=False, backward=False), peers)
    else:
        result = replay(module, batch, fn, Mode(localise=False, watch=True, backward=False),
                        peers)
    at = result.first_collective if result.first_collective is not None else NO_COLLECTIVE
    # place * world + rank: the place and who, exact in int64 up to 2**22 ranks.
    low, high, finite, ran = peers.min_ints([
        at * world + rank, at * world + (world - 1 - rank),
        int(result.finite), int(result.error is None),
    ])
    first = low // world
    if not ran:
        return Trace(reason=(
            "the replay that checks each collective's input did not run on every rank (an "
            "error, an out-of-memory error, or a rank without a batch: check_batch was not "
            "called with it); every rank stopped together and the origin could not be told")), None
    if first >= NO_COLLECTIVE:
        return Trace(reason=(
            "no rank's input to a collective went non-finite in the replay" + (
                ", and every rank's replayed loss was finite: the fault did not reproduce "
                "(transient), so the origin could not be told" if finite else
                ": the non-finite values began after the forward's last collective, on "
                "the ranks they were found on"))), None
    lowest, highest = low % world, world - 1 - high % world
    origins = ([lowest] if lowest == highest else
               peers.flagged(result.first_collective == first))
    mine = result.first_collective_op if rank in origins else None
    return Trace(origins=tuple(origins), index=int(first)), mine


def _no_batch(module: torch.nn.Module, batch: Any) -> torch.Tensor:
    raise ValueError("this rank has no batch to replay (check_batch was not called with it)")
