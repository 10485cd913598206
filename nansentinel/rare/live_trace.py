"""Where a NaN began, from the step itself: the forward collectives' send buffers as they left.

trace.py replays a flagged step's forward to find the first collective whose input went
non-finite. On torch >= 2.14, where the pre-hook path (engines/prehook.py) sees every
collective before it is issued, the live step already answers: each forward collective's send
buffers were normed on the device as they left (one norm per collective, no host sync), and
after a detection only (origins.needs_trace) each rank reads its own norms once and names the
first non-finite one by its place in this rank's forward. Then the same agreement as the
replay's: one MIN all-reduce of two int64 numbers (the place times the world plus the rank,
both ways round) tells every rank the first place and the lowest and highest rank there;
only when several ranks went non-finite at that same collective does a byte per rank name
them. The rank whose send buffer at collective #k was non-finite while every send buffer
before it, on every rank, was finite began it.

What the live step tells that a replay cannot: a fault that does not reproduce (a transient
device fault), and a run without a replay function. What it shares with the replay: the
places line up across ranks when every rank issues the same forward collectives in the same
order (tensor parallelism, an MoE's all-to-all, SyncBatchNorm), which is what the trace
assumes there too.
"""

from __future__ import annotations

from nansentinel.decide.origins import Trace
from nansentinel.rare.replay import NO_COLLECTIVE
from nansentinel.wire.collectives import Peers


def locate(peers: Peers, first: tuple[int, str] | None) -> tuple[Trace, str | None]:
    """The trace of this step's forward collectives from each rank's ``first`` non-finite
    send (place, what it was; None: none), the same on every rank; and, on an origin, what
    its first non-finite collective was. Called on every rank, on the rare path only."""
    world, rank = peers.world_size, peers.rank
    at = first[0] if first is not None else NO_COLLECTIVE
    low, high = peers.min_ints([at * world + rank, at * world + (world - 1 - rank)])
    place = low // world
    if place >= NO_COLLECTIVE:
        return Trace(reason=(
            "no rank's send buffer in a forward collective of this step was non-finite: the "
            "non-finite values began after the forward's last collective, on the ranks they "
            "were found on")), None
    lowest, highest = low % world, world - 1 - high % world
    origins = [lowest] if lowest == highest else peers.flagged(at == place)
    mine = first[1] if first is not None and rank in origins else None
    return Trace(origins=tuple(origins), index=int(place)), mine
