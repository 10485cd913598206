"""The detection's naming without a process group: which collectives it asks of its peers."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

from nansentinel.config import SentinelConfig
from nansentinel.rare.detection import Detector, replay_candidate
from nansentinel.rare.replay import Replayer
from nansentinel.result import RankIdentity
from nansentinel.wire.schema import OwnRow, Totals


class Peers:
    """Records what the detection asks; every other rank is silent."""

    def __init__(self, world: int, flagged: list[int]) -> None:
        self.rank, self.world_size = 0, world
        self._flagged = flagged
        self.asked: list[str] = []

    def flagged(self, flag: bool) -> list[int]:
        self.asked.append("flagged")
        return self._flagged

    def gather_from(self, speakers: list[int], payload: Any) -> dict[int, Any]:
        self.asked.append(f"gather_from {speakers}")
        return {}

    def max_floats(self, values: list[float]) -> list[float]:
        self.asked.append("max_floats")
        return values


def fake_context(peers: Any, world: int) -> Any:
    """The run as the detection reads it: its peers, identity, loss scale and deadline."""
    return SimpleNamespace(peers=peers, identity=RankIdentity(0, 0, world, "node0", "cpu"),
                           amp=False, guarded=contextlib.nullcontext, config=SentinelConfig())


def detector(peers: Peers) -> Detector:
    return Detector(fake_context(peers, peers.world_size), None,  # type: ignore[arg-type]
                    None, Replayer(None, None, peers), None)  # type: ignore[arg-type]


HEALTHY = OwnRow(1.0, 2.0, 1.0, has_loss=True, has_grad=True)


def test_one_flagged_rank_is_named_by_the_sum_of_indices_without_asking_every_rank() -> None:
    peers = Peers(1024, flagged=[])
    view = detector(peers).view(3, Totals(bad_loss=1, blamed=1, flagged=1, flagged_rank=700.0),
                                HEALTHY, {})
    assert [r.rank for r in view.flagged] == [700]
    assert peers.asked == ["gather_from [188, 700]", "max_floats"]  # the peer: 700 + 512
    assert replay_candidate([700], 1024) == 188


def test_several_flagged_ranks_and_worlds_past_fp32_indices_ask_every_rank() -> None:
    peers = Peers(8, flagged=[2, 5])
    view = detector(peers).view(3, Totals(flagged=2, flagged_rank=7.0), HEALTHY, {})
    assert [r.rank for r in view.flagged] == [2, 5] and peers.asked[0] == "flagged"
    huge = Peers(2**24 + 8, flagged=[2**24 + 3])  # 2**24 + 3 is no fp32 number
    view = detector(huge).view(3, Totals(flagged=1, flagged_rank=float(2**24 + 4)), HEALTHY, {})
    assert [r.rank for r in view.flagged] == [2**24 + 3] and huge.asked[0] == "flagged"


def test_a_named_rows_wire_is_its_row() -> None:
    import dataclasses

    from nansentinel.wire.view import RankHealth

    row = RankHealth(RankIdentity(5, 1, 8, "node2", "cuda:1", "1", "GPU-5"), ("loss", "grad"),
                     True, float("inf"), 2.0, True, {"loss": 3.5}, True, ("received gradients",),
                     ("0", "tp"), True)
    # Every field off its default, so a field the wire leaves out fails the round trip.
    for f in dataclasses.fields(RankHealth):
        default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                   else f.default)
        assert getattr(row, f.name) != default, f"{f.name} left at its default"
    assert RankHealth.from_wire(row.to_wire(), 8) == row


def test_a_detection_naming_every_rank_is_linear() -> None:
    """A global NaN at 20,000 ranks, each with a forward collective in its record: the rows
    are built and weighed in well under a second (the quadratic weighing alone took 30 s)."""
    import time  # CPU time: other processes on the machine do not count

    from nansentinel.wire.view import RankHealth

    world = 20_000
    records = {r: RankHealth(RankIdentity(r, r % 8, world, f"node{r // 8}", "cpu"), ("loss",),
                             False, float("nan"), 1.0, forward_groups=("0",)).to_wire()
               for r in range(world)}

    class Everyone(Peers):
        def gather_from(self, speakers: list[int], payload: Any) -> dict[int, Any]:
            self.asked.append(f"gather_from {len(speakers)}")
            return records

    peers = Everyone(world, flagged=list(range(world)))
    bad = OwnRow(1.0, float("nan"), 1.0, has_loss=True, has_grad=True, flagged=True)
    started = time.process_time()
    view = detector(peers).view(3, Totals(bad_loss=world, blamed=world, flagged=world), bad, {},
                                ("0",))
    assert time.process_time() - started < 1.0
    assert len(view.flagged) == world and not view.reached and view.replay_peer is None
    assert peers.asked == ["flagged", f"gather_from {world}", "max_floats"]
    assert view.named(world - 1) is view.flagged[-1] and view.named(world) is None
