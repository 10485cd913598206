"""FSDP1 (``FullyShardedDataParallel``) on 4 gloo ranks, every sharding strategy: each rank's
flat local gradient is checked in FSDP1's communication hook before its reduction, the
poisoned rank and its parameters are named on every rank, skip / abort / drop / rollback act
as on FSDP2, FSDP1's own ``clip_grad_norm_`` keeps working, and healthy steps are
bit-identical to plain FSDP1 (the hook reduces exactly as FSDP1's default does).

All scenarios run in one 4-rank process group (one spawn; see ``workers_fsdp1.scenarios``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_fsdp1 import DTYPES, MATRIX_STEPS, SETUPS, scenarios

WORLD = 4
BAD = {0: [1], 2: [3], 4: [0, 2], 5: [3]}
KINDS = {0: ["grad"], 2: ["batch", "loss", "grad"], 4: ["loss", "grad"], 5: ["grad"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fsdp1")
    return values(run_ranks(scenarios, WORLD, tmp, report_dir=str(tmp / "reports"),
                            timeout=280))


def _same_everywhere(outs: list[dict[str, Any]]) -> None:
    for out in outs[1:]:
        for key in ("bad_ranks", "kinds", "outcome"):
            assert [r[key] for r in out["records"]] == [r[key] for r in outs[0]["records"]]
    weights = [out["weights"] for out in outs]
    assert all(torch.isfinite(w).all() for w in weights)
    assert all(torch.equal(w, weights[0]) for w in weights[1:]), "weights differ across ranks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_fault_matrix_fsdp1(runs: list[dict[str, Any]], setup: str) -> None:
    outs = [r[f"matrix-{setup}"] for r in runs]
    for out in outs:
        assert out["error"] is None, out["error"]
        assert out["path"] == "FSDP1"
        assert [r["step"] for r in out["records"]] == list(range(MATRIX_STEPS))
        for rec in out["records"]:
            if rec["step"] in BAD:
                assert rec["outcome"] == "skipped" and not rec["applied"], rec
                assert rec["bad_ranks"] == BAD[rec["step"]], rec
                assert rec["kinds"] == KINDS[rec["step"]], rec
            else:
                assert rec["applied"] and rec["bad_ranks"] == [], rec
    _same_everywhere(outs)
    records = outs[0]["records"]
    # A backward-only poison (forward and loss finite) names exactly the parameters its NaN
    # reached before the reduction, by their names in the user's module (the root unit's
    # flat parameter holds them).
    assert records[0]["parameters"] == {1: ["pos", "embed.weight"]}
    assert records[4]["parameters"][2] == ["pos", "embed.weight"]
    # The fire drill wrote into the first flat gradient reduced at step 5: the last layer's
    # unit, whose first segment is its attention's input projection.
    assert records[5]["parameters"] == {3: ["encoder.layers.1.self_attn.in_proj_weight"]}
    report = json.loads(Path(records[0]["report_path"]).read_text())
    assert report["bad_ranks"] == [1]
    assert report["poisoned"][0]["parameters"] == ["pos", "embed.weight"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_healthy_steps_are_bit_identical_to_plain_fsdp1(
    runs: list[dict[str, Any]], setup: str
) -> None:
    """The hook divides, reduces (and, hybrid, all-reduces over the replicas) as FSDP1's
    default does; the norm it reports is this rank's own local gradient's, before any
    divide, as the same model without FSDP computes it."""
    for r in runs:
        plain, watched = r[f"healthy-{setup}-False"], r[f"healthy-{setup}-True"]
        assert [x["outcome"] for x in watched["records"]] == ["applied"] * 3
        assert torch.equal(plain["weights"], watched["weights"])
        norm = watched["records"][0]["local_grad_norm"]
        assert norm == pytest.approx(r["reference"], rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_mixed_precision_is_bit_identical_and_names_the_rank(
    runs: list[dict[str, Any]], dtype: str
) -> None:
    """Parameters and reduction in fp16 / bf16 (HYBRID_SHARD): the same weights as plain
    FSDP1; a NaN in one parameter's gradient names that parameter only."""
    for r in runs:
        assert torch.equal(r[f"mixed-{dtype}-False"]["weights"],
                           r[f"mixed-{dtype}-True"]["weights"])
    outs = [r[f"mixed-{dtype}-fault"] for r in runs]
    for out in outs:
        assert [x["outcome"] for x in out["records"]] == ["applied", "skipped"]
    assert outs[0]["records"][1]["parameters"] == {2: ["pos"]}
    _same_everywhere(outs)


@pytest.mark.timeout(300)
def test_fsdp1_clip_grad_norm_keeps_working(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        plain, watched = r["clip-False"], r["clip-True"]
        assert plain["clipped"] == watched["clipped"] and len(plain["clipped"]) == 3
        assert torch.equal(plain["weights"], watched["weights"])


@pytest.mark.timeout(300)
def test_abort_raises_on_every_rank_fsdp1(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        error = r["abort"]["error"]
        assert error and error["type"] == "NonFiniteError"
        assert error["step"] == 1 and "rank(s) 3" in error["message"]
        assert torch.isfinite(r["abort"]["weights"]).all()
    assert Path(runs[0]["abort"]["error"]["report_path"]).exists()


@pytest.mark.timeout(300)
def test_drop_leaves_the_rank_out_and_matches_the_hand_reduction(
    runs: list[dict[str, Any]],
) -> None:
    """The poisoned rank reduced zeros; the step applied the other 3 ranks' mean: the same
    weights (to rounding) as plain FSDP1 with that rank's loss times 0 and the gradients
    times 4/3."""
    outs = [r["drop"] for r in runs]
    for r, out in zip(runs, outs, strict=True):
        assert [x["outcome"] for x in out["records"]] == ["applied", "dropped", "applied"]
        assert out["records"][1]["bad_ranks"] == [2]
        diff = (out["weights"] - r["drop-reference"]["weights"]).abs().max().item()
        assert diff <= 1e-5, diff
    _same_everywhere(outs)


@pytest.mark.timeout(300)
def test_no_sync_accumulation_checks_the_accumulated_gradients(
    runs: list[dict[str, Any]],
) -> None:
    """A backward-only poison in a micro-batch under ``no_sync`` (HYBRID_SHARD) is caught
    when the accumulated gradients are finally reduced."""
    outs = [r["accumulate"] for r in runs]
    for out in outs:
        assert [x["outcome"] for x in out["records"]] == ["applied", "skipped", "applied"]
        assert out["records"][1]["bad_ranks"] == [2]
        assert out["records"][1]["kinds"] == ["grad"]
    _same_everywhere(outs)


@pytest.mark.timeout(300)
def test_rollback_restores_the_weights_on_every_rank(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        out = r["rollback"]
        assert [x["outcome"] for x in out["records"]] == ["applied", "applied", "rolled_back"]
        assert out["records"][2]["rolled_back_to"] == 0
        assert torch.equal(out["weights"], r["no-step"]["weights"])
    _same_everywhere([r["rollback"] for r in runs])


@pytest.mark.timeout(300)
def test_replica_fingerprints_on_no_shard_and_hybrid(runs: list[dict[str, Any]]) -> None:
    """A flipped bit on rank 1 at step 1: NO_SHARD's 4 replicas repair it from the majority;
    HYBRID_SHARD's replicate group holds 2, where no majority exists: an abort."""
    for r in runs:
        records = r["fingerprint-no-shard"]["records"]
        assert [x["outcome"] for x in records] == ["applied"] * 3
        assert records[1]["bad_ranks"] == [1] and records[1]["kinds"] == ["replica"]
        error = r["fingerprint-hybrid"]["error"]
        assert error and error["type"] == "NonFiniteError" and error["step"] == 1, error
    _same_everywhere([r["fingerprint-no-shard"] for r in runs])


@pytest.mark.timeout(300)
def test_unsupported_fsdp1_setups_are_refused_at_construction(
    runs: list[dict[str, Any]],
) -> None:
    refused = runs[0]["refused"]
    assert "'<root>' already has a communication hook (reduce_scatter_hook)" in refused[
        "own-hook"]
    assert "MixedPrecision(reduce_dtype=...)" in refused["own-hook"]
    assert "4 trainable parameter(s) belong to none" in refused["outside"]
    assert "'pos'" in refused["outside"]
    assert "already watched by another Sentinel" in refused["twice"]
