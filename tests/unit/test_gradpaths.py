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


def test_fsdp_names_each_poisoned_rank_from_every_ranks_share() -> None:
    path = fsdp.FSDPPath.__new__(fsdp.FSDPPath)
    details = [
        {"shards_nonfinite": ["a.w"]},  # rank 0 holds the shard where rank 1's NaN landed
        {"shards_nonfinite": ["b.w"], "groups_nonfinite": ["a.w", "a.b"]},
        {"shards_nonfinite": [], "groups_nonfinite": ["b.w"], "batch_path": "x"},
    ]
    assert path.parameters(details) == {1: ["a.w"], 2: ["b.w"]}
    assert details[2] == {"parameters": ["b.w"], "batch_path": "x"}


def test_local_scan_names_nonfinite_gradients_and_strips_the_prefix() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[1].bias.grad[0] = float("inf")
    named = [(f"module.{n}", p) for n, p in model.named_parameters()]
    assert scan_parameters(named, prefix="module.") == ["1.bias"]
    assert naming_detail(model.named_parameters(), poisoned=False) == {}
    assert naming_detail(model.named_parameters(), poisoned=True) == {"parameters": ["1.bias"]}
