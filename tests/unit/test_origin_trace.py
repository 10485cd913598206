"""The trace of a forward collective, in one process (issue 31): which arguments of each
collective are this rank's inputs, the replay's watch of them on torch's fake backend, and the
pure rules that read what the trace found (origins.needs_trace, origins.retrace,
replay.judged)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.utils._python_dispatch import TorchDispatchMode

from nansentinel.decide import origins
from nansentinel.rare.replay import NO_COLLECTIVE, Mode, judged, replay
from nansentinel.result import RankIdentity
from nansentinel.wire import collective_inputs
from nansentinel.wire.view import RankHealth

NAN = float("nan")


@pytest.fixture
def fake() -> Iterator[None]:
    """Rank 0 of 2 on torch's fake backend: collectives are no-ops, dispatched as on gloo."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class Seen(TorchDispatchMode):
    """Records each collective's op and the shapes of what it reads as this rank's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if collective_inputs.is_collective(func):
            given = collective_inputs.inputs(func, args, kwargs or {})
            self.seen.append((func._opname, [tuple(t.shape) for t in given]))
        return func(*args, **(kwargs or {}))


def test_the_inputs_are_what_this_rank_gives_never_a_buffer_it_fills(fake: None) -> None:
    a, b = torch.ones(4), torch.ones(6)
    sub = dist.new_group([0, 1])
    with Seen() as mode:
        dist.all_reduce(a)
        dist.all_gather([torch.empty(4), torch.empty(4)], a)
        dist.all_to_all_single(torch.empty(6), b)
        dist.reduce_scatter_tensor(torch.empty(3), b)
        dist.broadcast(a, src=0)               # the root's tensor is its input
        dist.broadcast(a, src=1)               # elsewhere a buffer (maybe uninitialised)
        dist.broadcast(a, src=1, group=sub)    # the root by its rank in the group
        dist.barrier()
        dist.all_reduce(torch.ones(3, dtype=torch.int64))  # a count cannot be NaN
        funcol.wait_tensor(funcol.all_reduce(a, "sum", dist.group.WORLD))
        for t in (funcol.all_gather_tensor(a, 0, dist.group.WORLD),
                  funcol.all_to_all_single_autograd(b, None, None, sub),
                  funcol.broadcast(a, 1, sub)):
            funcol.wait_tensor(t)
    assert mode.seen == [
        ("allreduce_", [(4,)]), ("allgather_", [(4,)]), ("alltoall_base_", [(6,)]),
        ("_reduce_scatter_base_", [(6,)]), ("broadcast_", [(4,)]), ("broadcast_", []),
        ("broadcast_", []), ("barrier", []), ("allreduce_", []), ("all_reduce", [(4,)]),
        ("all_gather_into_tensor", [(4,)]), ("all_to_all_single", [(6,)]), ("broadcast", []),
    ]  # no wait_tensor, no _wrap_tensor_autograd: they are no collectives


def test_the_replay_names_its_first_non_finite_collective_input_with_one_read(
    fake: None,
) -> None:
    def fn(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        h = module(batch)
        stats = h.detach().mean(0)
        dist.all_reduce(stats)                # finite
        poisoned = h * torch.tensor([NAN, 1.0])
        out = funcol.all_to_all_single(poisoned.detach(), None, None, dist.group.WORLD)
        # the fake backend's all_to_all leaves its output unwritten on some releases (2.11):
        # the loss is non-finite through the poisoned tensor itself, whatever it returns
        return (h - stats).pow(2).mean() + out.wait().sum() + poisoned.sum()

    net = torch.nn.Linear(3, 2)
    syncs = []
    real = torch.Tensor.tolist
    torch.Tensor.tolist = lambda t: syncs.append(1) or real(t)  # type: ignore[assignment]
    try:
        result = replay(net, torch.ones(4, 3), fn, Mode(localise=False, watch=True, backward=False))
    finally:
        torch.Tensor.tolist = real  # type: ignore[method-assign]
    assert (result.first_collective, result.first_collective_op) == (
        2, "all_to_all_single on group 0")
    assert result.collectives == 2 and not result.finite and len(syncs) == 1
    assert all(p.grad is None for p in net.parameters())


def _rank(r: int, kinds: tuple[str, ...], groups: tuple[str, ...], *,
          reached: bool = False) -> RankHealth:
    return RankHealth(RankIdentity(r, r, 6, f"node{r}", "cpu"), kinds, False, None, None,
                      reached=reached, forward_groups=groups)


def test_a_tie_in_the_forward_behind_a_collective_needs_a_trace_and_nothing_else_does() -> None:
    tie = [_rank(0, ("loss", "grad"), ("ep",)), _rank(1, ("loss", "grad"), ("ep",))]
    assert origins.needs_trace(origins.weigh(tie))
    batch = [_rank(0, ("loss", "grad"), ("ep",)), _rank(1, ("batch", "loss"), ("ep",))]
    assert not origins.needs_trace(origins.weigh(batch))  # the batch explains it
    assert not origins.needs_trace([_rank(0, ("loss",), ())])  # no forward collective
    assert not origins.needs_trace([_rank(0, ("grad",), ("tp",))])  # after the forward


def test_retrace_blames_the_origin_and_marks_whom_it_reached_through_shared_groups() -> None:
    named = [
        _rank(0, ("loss", "grad"), ("g1",)),
        _rank(2, ("loss", "grad"), ("g2",)),   # reached through rank 3, which rank 1 reached
        _rank(3, ("grad",), ("g1", "g2"), reached=True),  # what weigh said: overruled below
        _rank(4, ("loss",), ("g9",)),          # shares nothing: an independent fault, blamed
        _rank(5, ("batch", "loss"), ("g1",)),  # its own NaN batch keeps its blame
    ]
    rows = {1: _rank(1, ("grad",), ("g1",))}  # the origin, which the detection had not named
    trace = origins.Trace(origins=(1,), index=3, op="all_to_all_single on group g1")
    out = {r.rank: r for r in origins.retrace(named, trace, rows)}
    assert sorted(out) == [0, 1, 2, 3, 4, 5]
    assert [r for r, h in out.items() if h.reached] == [0, 2, 3]
    assert out[1].kinds == ("grad", "activation") and not out[1].reached
    assert "collective #3 (all_to_all_single on group g1)" in out[1].boundary[-1]
    assert out[0].boundary[-1].endswith("after rank 1's forward")
    assert not out[4].reached and not out[5].reached
    assert origins.retrace(named, origins.Trace(reason="transient")) == tuple(named)


@pytest.mark.parametrize(
    ("firsts", "own_finite", "peer_finite", "verdict"),
    [
        ((NO_COLLECTIVE,) * 3, False, True, (False, True)),    # no collective input bad
        ((3, 3, NO_COLLECTIVE), False, False, (False, True)),  # the peer was only reached
        ((3, 3, 3), False, False, (False, False)),             # both first: the batch
        ((3, 3, NO_COLLECTIVE), False, None, (False, None)),   # no peer
        ((3, NO_COLLECTIVE, NO_COLLECTIVE), True, True, (True, True)),  # transient
        ((3, NO_COLLECTIVE, 3), False, False, (None, None)),   # reached by another: undecided
    ],
)
def test_the_two_replays_are_judged_at_the_first_non_finite_collective_input(
    firsts: tuple[int, int, int], own_finite: bool, peer_finite: bool | None,
    verdict: tuple[bool | None, bool | None],
) -> None:
    assert judged(list(firsts), own_finite, peer_finite) == verdict


def test_without_a_replay_function_the_report_says_why_no_trace_ran() -> None:
    """Every rank's loss non-finite behind a forward collective, no replay= given: nothing
    runs, and the view's origin_trace (the report's) says why the origin was not told."""
    from nansentinel.rare.detection import Detector
    from nansentinel.rare.replay import Replayer
    from nansentinel.wire.schema import OwnRow, Totals
    from tests.unit.test_detection import fake_context

    class Peers:
        rank, world_size = 0, 2

        def flagged(self, flag: bool) -> list[int]:
            return [0, 1]

        def gather_from(self, speakers: list[int], payload: Any) -> dict[int, Any]:
            return {r: _rank(r, ("loss", "grad"), ("0",)).to_wire() for r in speakers}

        def max_floats(self, values: list[float]) -> list[float]:
            return values

    own = OwnRow(1.0, NAN, NAN, has_loss=True, has_grad=True, flagged=True)
    peers = Peers()
    detector = Detector(fake_context(peers, 2), None, None,  # type: ignore[arg-type]
                        Replayer(None, None, peers), None)  # type: ignore[arg-type]
    view = detector.view(3, Totals(bad_loss=2, blamed=2, flagged=2, flagged_rank=1.0), own, {},
                         ("0",))
    assert [r.rank for r in view.flagged] == [0, 1] and view.reached == []
    assert view.origin_trace is not None and "no replay function" in view.origin_trace["reason"]
