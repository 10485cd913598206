"""The pre-hook path's pure parts: which send buffers count, the live trace's agreement, and
(on torch >= 2.14) a hook call checked, kept and named without a process group."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from nansentinel.common import torch_insides as insides
from nansentinel.engines import KeptNorms
from nansentinel.engines.prehook import API_NAMES, REDUCTIONS, addresses, contributed, sent
from nansentinel.rare import live_trace
from nansentinel.rare.replay import NO_COLLECTIVE


def test_only_reductions_send_gradients_and_only_floating_buffers_count() -> None:
    g, ids = torch.ones(3), torch.ones(3, dtype=torch.int64)
    assert sent("ALLREDUCE", [g, ids]) == [g]
    assert sent("REDUCE_SCATTER_BASE", [g]) == [g]
    # Values already reduced (a reduce-scatter's shards gathered back), or parameters.
    assert sent("ALLGATHER_BASE", [g]) == [] and sent("BROADCAST", [g]) == []
    assert {"ALLREDUCE", "ALLTOALL_BASE", "REDUCE"} <= REDUCTIONS


def test_a_sent_buffer_is_keyed_by_its_memory_a_sparse_one_by_its_stored_values() -> None:
    dense, sparse = torch.ones(3), torch.tensor([0.0, 2.0]).to_sparse()
    assert addresses([dense]) == [dense.data_ptr()]
    assert addresses([dense, sparse]) == [dense.data_ptr(), sparse._values().data_ptr()]


def test_a_forward_collective_counts_what_this_rank_contributes() -> None:
    t = torch.ones(2)
    assert contributed("ALLGATHER_BASE", [t], -1, 1) == [t]  # TP gathers each rank's own
    assert contributed("BROADCAST", [t], 0, 1) == []  # a buffer off the root
    assert contributed("BROADCAST", [t], 1, 1) == [t]
    assert contributed("BARRIER", [], -1, 0) == []
    assert API_NAMES["ALLTOALL_BASE"] == "all_to_all_single"  # the replay's word for it


class _Peers:
    """Three ranks' ``min_ints`` and ``flagged`` answered from every rank's inputs."""

    def __init__(self, rank: int, firsts: list[Any]) -> None:
        self.rank, self.world_size, self.firsts = rank, len(firsts), firsts

    def min_ints(self, values: list[int]) -> list[int]:
        w = self.world_size
        every = [[(f or (NO_COLLECTIVE,))[0] * w + r, (f or (NO_COLLECTIVE,))[0] * w + w - 1 - r]
                 for r, f in enumerate(self.firsts)]
        assert every[self.rank] == values
        return [min(v[i] for v in every) for i in range(2)]

    def flagged(self, flag: bool) -> list[int]:
        place = min((f[0] for f in self.firsts if f), default=None)
        return [r for r, f in enumerate(self.firsts) if f and f[0] == place]


@pytest.mark.parametrize(("firsts", "origins", "index"), [
    ([None, (2, "all_reduce on group 0"), (3, "all_reduce on group 0")], (1,), 2),
    ([(4, "a"), (4, "b"), None], (0, 1), 4),
    ([None, None, None], (), None),
])
def test_the_first_non_finite_send_on_any_rank_names_the_origins(
        firsts: list[Any], origins: tuple[int, ...], index: int | None) -> None:
    traces = [live_trace.locate(_Peers(r, firsts), firsts[r]) for r in range(3)]  # type: ignore[arg-type]
    assert all(t == traces[0][0] for t, _ in traces), "every rank must agree"
    trace = traces[0][0]
    assert trace.origins == origins and trace.index == index
    for r, (_, op) in enumerate(traces):
        assert (op is not None) == (r in origins)
    if not origins:
        assert "no rank's send buffer" in trace.reason


@pytest.mark.skipif(not insides.supported("collective_hooks"),
                    reason="collective pre-hooks need torch >= 2.14")
def test_a_hooked_reduction_is_normed_kept_and_named() -> None:
    from nansentinel.engines.prehook import PreHookPath

    norms: list[torch.Tensor] = []
    armed: list[torch.Tensor] = []
    sink = SimpleNamespace(step_index=0, world_size=2, add_grad_norm=norms.append,
                           before_reduction=lambda t: armed.append(t) and False,
                           spent=lambda s: None)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    path = PreHookPath(model, sink)  # type: ignore[arg-type]
    path.keep_norms = True
    model(torch.ones(1, 2)).sum().backward()
    model[1].weight.grad[0, 0] = math.nan
    pg = SimpleNamespace(rank=lambda: 0, group_name="0")

    def args(name: str, tensors: list[torch.Tensor]) -> Any:
        return SimpleNamespace(name=SimpleNamespace(name=name), input_tensors=tensors,
                               output_tensors=[], root=-1, op_id=0)

    grads = [p.grad for p in model.parameters()]
    path._on(pg, args("ALLREDUCE", [grads[2]]))  # per parameter: named by its gradient
    path._on(pg, args("ALLREDUCE", [torch.cat([g.reshape(-1) for g in grads])]))  # a bucket
    path._on(pg, args("ALLGATHER_BASE", [grads[0]]))  # reduced values: not checked
    assert path.checked == 2 and len(armed) == 1 and len(norms) == 2
    assert all(not torch.isfinite(n) for n in norms)
    kept = path.take_norms()
    assert isinstance(kept, KeptNorms)
    named = path.naming_detail(True, None, kept)["parameters"]
    assert named == ["1.weight", "<buffer of collective #2>"]
    path.check_now()  # the step's check closes: later collectives are left alone
    path._on(pg, args("ALLREDUCE", [grads[0]]))
    assert path.checked == 2
