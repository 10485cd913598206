"""Every gradient layout a model can hold, on DDP over 3 gloo ranks (issue 68): dense
contiguous, channels_last (non-contiguous strides), ``gradient_as_bucket_view=True``, sparse
COO from ``nn.Embedding(sparse=True)`` and ``nn.EmbeddingBag(sparse=True)`` (uncoalesced,
each DDP's bucket of its own; beside dense bucket views; alone, the drill's first bucket is
one), complex parameters, and
sparse gradients under ``policy="drop"``. In each, the healthy steps are applied with a finite
gradient norm and weights bit-identical to plain DDP's; a grad drill on rank 1 and a NaN the
test writes into one local gradient on rank 2 (a sparse one's stored values) are each blamed
on their rank alone, the parameter named, and the step skipped on every rank. Before, the
sparse ones crashed every rank at the first step (``torch._foreach_norm`` has no sparse
kernel). About 15 s on 2 cores: one process group for all scenarios."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_layouts import (
    DRILL_RANK,
    DRILL_STEP,
    HOOK_RANK,
    HOOK_STEP,
    SCENARIOS,
    build,
    every_layout,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("layouts")
    return values(run_ranks(every_layout, 3, tmp, report_dir=str(tmp / "r"), timeout=150))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", [n for n in SCENARIOS
                                  if n not in ("sparse_drop", "sparse_rollback")])
def test_each_layout_is_checked_blamed_and_named(runs: list[dict], name: str) -> None:
    poisoned = build(name)[2]
    for rank, out in enumerate(r[name] for r in runs):
        records = out["records"]
        assert [r["applied"] for r in records] == [True, False, False, True], (rank, records)
        for healthy in (records[0], records[-1]):
            assert healthy["bad_ranks"] == [] and math.isfinite(healthy["grad_norm"])
            assert healthy["grad_norm"] > 0
        drill, hooked = records[DRILL_STEP], records[HOOK_STEP]
        assert drill["bad_ranks"] == [DRILL_RANK] and drill["kinds"] == ["grad"]
        assert drill["injected"]  # said on every rank
        assert hooked["bad_ranks"] == [HOOK_RANK] and hooked["kinds"] == ["grad"]
        assert hooked["parameters"] == {HOOK_RANK: [poisoned]}, (rank, hooked)
        assert torch.isfinite(out["weights"]).all()
        assert torch.equal(out["weights"], runs[0][name]["weights"])  # identical replicas
        assert torch.equal(out["weights"], out["plain"]), name  # plain DDP's, bit for bit
    # The layouts were the ones named: sparse and uncoalesced before the reduction (and
    # sparse after it), channels_last strides, DDP's bucket views.
    first = runs[0][name]
    layouts = first["records"][0]["layouts"]
    if name.startswith("sparse"):
        assert ("torch.sparse_coo", False) in first["seen"]
        assert layouts[poisoned][0] == "torch.sparse_coo"
    if name == "channels_last":
        assert layouts["0.weight"] == ("torch.strided", False)  # not contiguous
    if name == "bucket_view":
        assert all(r["bucket_views"] for r in first["records"])


@pytest.mark.timeout(180)
def test_a_rollback_restores_a_snapshot_holding_sparse_optimizer_state(runs: list[dict]) -> None:
    """SGD's momentum of a sparse embedding is sparse: the snapshot copies it whole (no fixed
    buffer fits it) and the rollback hands it back; it used to raise "copy_() between dense
    and sparse Tensors" at the first save."""
    for out in (r["sparse_rollback"] for r in runs):
        records = out["records"]
        assert [r["outcome"] for r in records] == ["applied", "applied", "rolled_back",
                                                   "applied"], records
        assert records[HOOK_STEP]["bad_ranks"] == [HOOK_RANK]
        assert torch.isfinite(out["weights"]).all()
        assert torch.equal(out["weights"], runs[0]["sparse_rollback"]["weights"])


@pytest.mark.timeout(180)
def test_a_sparse_model_under_drop_leaves_the_poisoned_rank_out(runs: list[dict]) -> None:
    for out in (r["sparse_drop"] for r in runs):
        records = out["records"]
        assert [r["outcome"] for r in records] == ["applied", "dropped", "applied", "applied"]
        assert records[DRILL_STEP]["bad_ranks"] == [DRILL_RANK], records
        assert torch.isfinite(out["weights"]).all()
        assert torch.equal(out["weights"], runs[0]["sparse_drop"]["weights"])
        torch.testing.assert_close(out["weights"], out["plain"], rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(180)
def test_sparse_gradients_reduced_by_hand_are_checked_before_the_reduction(
        runs: list[dict]) -> None:
    """The local path (no DDP, ``check_grads()`` before the loop's own all-reduce): the drill
    goes into the first local gradient, the embedding's sparse one, and both faults are
    blamed on their rank alone with the embedding named."""
    for out in (r["by_hand"] for r in runs):
        records = out["records"]
        assert [r["applied"] for r in records] == [True, False, False, True], records
        assert all(math.isfinite(r["grad_norm"]) for r in (records[0], records[-1]))
        assert records[DRILL_STEP]["parameters"] == {DRILL_RANK: ["emb.weight"]}
        assert records[HOOK_STEP]["parameters"] == {HOOK_RANK: ["emb.weight"]}
        assert torch.isfinite(out["weights"]).all()
        assert torch.equal(out["weights"], runs[0]["by_hand"]["weights"])
