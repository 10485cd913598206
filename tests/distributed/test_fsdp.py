"""FSDP2 and HSDP on 4 gloo ranks: every rank's local gradients are checked before their
reduce-scatter, the poisoned rank is named on every rank, the step is skipped everywhere, and
the sharded weights stay finite and identical — and on healthy steps bit-identical to plain
FSDP2 without the sentinel.

All scenarios run in one 4-rank process group (one spawn; see ``workers_fsdp.scenarios``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_fsdp import NO_SUCH_SETUP, one_process, scenarios

WORLD = 4
BAD = {0: [1], 2: [3], 4: [0, 2], 5: [3]}
KINDS = {0: ["grad"], 2: ["batch", "loss", "grad"], 4: ["loss", "grad"], 5: ["grad"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fsdp")
    return values(run_ranks(scenarios, WORLD, tmp, report_dir=str(tmp / "reports"),
                            timeout=240))


def _same_everywhere(outs: list[dict[str, Any]]) -> None:
    for out in outs[1:]:  # every rank holds the same view of every step
        for key in ("bad_ranks", "kinds", "outcome"):
            assert [r[key] for r in out["records"]] == [r[key] for r in outs[0]["records"]]
    weights = [out["weights"] for out in outs]
    assert all(torch.isfinite(w).all() for w in weights)
    assert all(torch.equal(w, weights[0]) for w in weights[1:]), "weights differ across ranks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
def test_fault_matrix_fsdp2(runs: list[dict[str, Any]], mesh: str) -> None:
    outs = [r[f"matrix-{mesh}"] for r in runs]
    for out in outs:
        assert out["error"] is None, out["error"]
        assert out["path"] == "FSDP2"
        assert [r["step"] for r in out["records"]] == list(range(7))
        for rec in out["records"]:
            if rec["step"] in BAD:
                assert rec["outcome"] == "skipped" and not rec["applied"], rec
                assert rec["bad_ranks"] == BAD[rec["step"]], rec
                assert rec["kinds"] == KINDS[rec["step"]], rec
            else:
                assert rec["applied"] and rec["bad_ranks"] == [], rec
    _same_everywhere(outs)
    records = outs[0]["records"]
    # The backward-only poison (forward and loss finite) is named with the parameters its
    # NaN reached before the reduce-scatter: the embedding and the position table, no other.
    assert records[0]["parameters"] == {1: ["embed.weight", "pos"]}
    # The fire drill poisoned rank 3's first local gradient buffer before its reduce-scatter.
    assert list(records[5]["parameters"]) == [3]
    report = json.loads(Path(records[0]["report_path"]).read_text())
    assert report["bad_ranks"] == [1]
    assert report["poisoned"][0]["parameters"] == ["embed.weight", "pos"]
    assert report["ranks"] and all("shards_nonfinite" not in r for r in report["ranks"].values())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
def test_healthy_steps_are_bit_identical_to_plain_fsdp2(
    runs: list[dict[str, Any]], mesh: str
) -> None:
    """The custom reduce-scatter keeps FSDP's op, divide factors and dtypes exactly."""
    for r in runs:
        plain, watched = r[f"healthy-{mesh}-plain"], r[f"healthy-{mesh}-watched"]
        assert [x["outcome"] for x in watched["records"]] == ["applied"] * 4
        assert torch.equal(plain["weights"], watched["weights"])


@pytest.mark.timeout(300)
def test_abort_raises_on_every_rank_fsdp2(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        error = r["abort"]["error"]
        assert error and error["type"] == "NonFiniteError"
        assert error["step"] == 2 and "rank(s) 3" in error["message"]
        assert torch.isfinite(r["abort"]["weights"]).all()
    assert Path(runs[0]["abort"]["error"]["report_path"]).exists()


@pytest.mark.timeout(300)
def test_rollback_restores_the_local_shards_on_every_rank(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        out = r["rollback"]
        assert [x["outcome"] for x in out["records"]] == [
            "applied", "applied", "applied", "rolled_back"]
        assert out["records"][3]["rolled_back_to"] == 0
        assert torch.equal(out["weights"], r["no-step"]["weights"])
    _same_everywhere([r["rollback"] for r in runs])


@pytest.mark.timeout(300)
def test_gradient_accumulation_checks_the_accumulated_gradients(
    runs: list[dict[str, Any]],
) -> None:
    """A backward-only poison in a micro-batch without gradient sync is caught when the
    accumulated gradients are finally reduce-scattered."""
    outs = [r["accumulate"] for r in runs]
    for out in outs:
        assert [x["outcome"] for x in out["records"]] == ["applied", "skipped", "applied"]
        assert out["records"][1]["bad_ranks"] == [2]
        assert out["records"][1]["kinds"] == ["grad"]
    _same_everywhere(outs)


@pytest.mark.timeout(300)
def test_unsupported_fsdp_setups_are_refused_at_construction(
    runs: list[dict[str, Any]],
) -> None:
    refused = runs[0]["refused"]
    assert "replicated 4 ways" in refused["replicate-only"]
    # Sharded below the root is a normal shape; the root's own parameters, in no FSDP module,
    # are what is refused (nothing reduces their gradients).
    unsharded = refused["unsharded-root"]
    assert "belong to no fully_shard-ed module" in unsharded and "'embed.weight'" in unsharded
    if refused["placement-fn"] == NO_SUCH_SETUP:
        pytest.skip("torch before 2.13 keeps one param group per FSDP state: nothing to refuse")
    assert "2 parameter groups" in refused["placement-fn"]
    assert "'<root>'" in refused["placement-fn"]


@pytest.mark.timeout(120)
def test_world_of_one_checks_the_local_gradients_at_step(tmp_path: Path) -> None:
    out = values(run_ranks(one_process, 1, tmp_path, report_dir=str(tmp_path / "r"),
                           timeout=90))[0]
    assert out["error"] is None and out["path"] == "FSDP2"
    assert [r["outcome"] for r in out["records"]] == ["applied", "skipped", "applied"]
    assert sorted(out["records"][1]["parameters"][0]) == ["embed.weight", "pos"]
    assert torch.isfinite(out["weights"]).all()


@pytest.mark.timeout(120)
def test_the_watchdog_spares_slow_work_between_micro_batches(tmp_path: Path) -> None:
    """3 micro-batches with 3 s of the user's work after each: 9 s from the first
    reduce-scatter to the exchange, past the watchdog's 8 s (exchange_timeout 1 s + 5 s grace +
    2 s). Every reduce-scatter restarts the deadline, so nothing is killed."""
    from tests.distributed.workers_fsdp import slow_micro_batches

    outs = values(run_ranks(slow_micro_batches, 2, tmp_path, report_dir=str(tmp_path / "r"),
                            pause=3.0, exchange_timeout=1.0, timeout=100))
    assert outs == [["applied", "applied"]] * 2


@pytest.fixture(scope="module")
def precision(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.distributed.workers_fsdp import precision_and_naming

    tmp = tmp_path_factory.mktemp("fsdp-precision")
    return values(run_ranks(precision_and_naming, WORLD, tmp, report_dir=str(tmp / "reports"),
                            timeout=240))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dtype", "tolerance"), [("fp32", 1e-5), ("fp16", 2e-3),
                                                  ("bf16", 1e-2)])
@pytest.mark.parametrize("mesh", ["fsdp", "hsdp"])
def test_local_grad_norm_is_this_ranks_own_under_every_reduce_dtype(
    precision: list[dict[str, Any]], dtype: str, tolerance: float, mesh: str
) -> None:
    """FSDP2 hands an fp16 buffer over already divided by 2 on 4 ranks (2x2 HSDP too: the
    factor is the whole data-parallel size's); the norm reported is the undivided one, as a
    model without FSDP computes it on the same batch (the tolerance is the reduce dtype's
    rounding, far below the factor of 2)."""
    for rank, r in enumerate(precision):
        reported, reference = r[f"norm-{dtype}-{mesh}"]["local_grad_norm"], r["reference"]
        assert reported == pytest.approx(reference, rel=tolerance), (rank, reported, reference)


@pytest.mark.timeout(300)
def test_cpu_offload_runs_checks_and_names_the_poisoned_rank(
    precision: list[dict[str, Any]],
) -> None:
    outs = [r["offload"] for r in precision]
    for out in outs:
        assert out["error"] is None and out["path"] == "FSDP2"
        assert out["device"] == "cpu"  # a CPU mesh: the mesh's device is the shards' device
        assert [x["outcome"] for x in out["records"]] == ["applied", "skipped", "applied"]
        assert out["records"][1]["parameters"] == {1: ["embed.weight", "pos"]}
    _same_everywhere(outs)


@pytest.mark.timeout(300)
def test_two_poisoned_ranks_in_one_fsdp_group_each_name_their_own_parameters(
    precision: list[dict[str, Any]],
) -> None:
    """Rank 1 poisoned the position table's gradient only, rank 2 the embedding's only, both
    of the root group; each is named with its own parameter, not the group's union."""
    outs = [r["two-in-one-group"] for r in precision]
    for out in outs:
        assert [x["outcome"] for x in out["records"]] == ["applied", "skipped"]
        assert out["records"][1]["bad_ranks"] == [1, 2]
    assert outs[0]["records"][1]["parameters"] == {1: ["pos"], 2: ["embed.weight"]}
    report = json.loads(Path(outs[0]["records"][1]["report_path"]).read_text())
    named = {p["rank"]: p["parameters"] for p in report["poisoned"]}
    assert named == {1: ["pos"], 2: ["embed.weight"]}
