"""Choosing the gradient path: what is refused at construction, and how names are resolved."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nansentinel.gradpaths import fsdp
from nansentinel.gradpaths.local_grads import naming_detail, scan_parameters
from nansentinel.result import SentinelUsageError


def test_fsdp1_is_refused_by_name() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    legacy = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # needs no GPU
    nn.Module.__init__(legacy)
    with pytest.raises(SentinelUsageError, match=r"FSDP1 .*fully_shard"):
        fsdp.is_fsdp(legacy)
    outer = nn.Sequential(legacy)
    with pytest.raises(SentinelUsageError, match="FSDP1"):
        fsdp.is_fsdp(outer)


def test_plain_modules_are_not_fsdp() -> None:
    assert not fsdp.is_fsdp(nn.Linear(2, 2))


def test_an_old_torch_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    class OldFSDPModule:  # FSDP2 before torch 2.9: no set_custom_reduce_scatter
        pass

    monkeypatch.setattr(fsdp, "FSDPModule", OldFSDPModule)
    version = torch.__version__.replace("+", r"\+")
    with pytest.raises(SentinelUsageError, match=rf"torch >= 2\.9 .* this is torch {version}"):
        fsdp.FSDPPath(nn.Linear(2, 2), sink=None)  # type: ignore[arg-type]


class _OtherShards:
    """The other ranks' part of the max-reduce: their per-parameter non-finite flags."""

    def __init__(self, *others: list[float]) -> None:
        self.others = others
        self.calls = 0

    def max_floats(self, values: list[float]) -> list[float]:
        self.calls += 1
        return [max(column) for column in zip(values, *self.others, strict=True)]


def _sharded(norms: list[float], nonfinite: set[str]) -> fsdp.FSDPPath:
    """An FSDP path over groups a (a.weight, a.bias) and b (b.weight) whose reduce-scatter
    inputs had ``norms``, and whose reduced local shards are non-finite in ``nonfinite``."""
    model = nn.Module()
    model.a, model.b = nn.Linear(1, 1), nn.Linear(1, 1, bias=False)
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, float("nan") if name in nonfinite else 0.0)
    path = fsdp.FSDPPath.__new__(fsdp.FSDPPath)
    path.model = model
    path.groups = [("a", ["a.weight", "a.bias"]), ("b", ["b.weight"])]
    path.norms = [(i, torch.tensor(v)) for i, v in enumerate(norms)]
    return path


def test_fsdp_names_each_poisoned_rank_from_every_ranks_share() -> None:
    # Rank 1's group a was non-finite before the reduce-scatter; its a.weight NaN landed in
    # rank 0's shard, and rank 1's own shard holds the b.weight NaN of rank 2's group b.
    rank1 = _sharded([float("nan"), 1.0], {"b.weight"})
    peers = _OtherShards([1.0, 0.0, 0.0], [0.0, 0.0, 0.0])  # ranks 0 and 2's shards
    assert rank1.naming_detail(True, peers) == {"parameters": ["a.weight"]}
    rank2 = _sharded([1.0, float("nan")], set())
    assert rank2.naming_detail(True, _OtherShards([1.0, 0.0, 0.0], [0.0, 0.0, 1.0])) == {
        "parameters": ["b.weight"]}
    # A healthy rank takes part in the reduce (every rank issues it) and names nothing.
    healthy = _OtherShards([0.0, 0.0, 1.0])
    assert _sharded([1.0, 1.0], {"a.weight"}).naming_detail(False, healthy) == {}
    assert healthy.calls == 1
    # Nothing reduced (a world of one): the local scan is exact.
    alone = _sharded([], {"a.bias"})
    alone.norms = []
    assert alone.naming_detail(True, _OtherShards()) == {"parameters": ["a.bias"]}


def test_local_scan_names_nonfinite_gradients_and_strips_the_prefix() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[1].bias.grad[0] = float("inf")
    named = [(f"module.{n}", p) for n, p in model.named_parameters()]
    assert scan_parameters(named, prefix="module.") == ["1.bias"]
    assert naming_detail(model.named_parameters(), poisoned=False) == {}
    assert naming_detail(model.named_parameters(), poisoned=True) == {"parameters": ["1.bias"]}


def test_ddp_averages_as_ddp_does_but_sums_a_world_of_one() -> None:
    from nansentinel.gradpaths.ddp import AVG, SCALE_THEN_SUM, SUM, averaging

    assert averaging("nccl", "cuda", 8) == AVG
    assert averaging("gloo", "cpu", 8) == averaging("nccl", "cpu", 2) == SCALE_THEN_SUM
    # NCCL's one-rank AVG dropped trailing elements (NVIDIA/nccl#1950): a sum is the identity.
    assert averaging("nccl", "cuda", 1) == averaging("gloo", "cpu", 1) == SUM
