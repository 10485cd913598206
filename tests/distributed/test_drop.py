"""``policy="drop"`` on 4 gloo ranks, under DDP (with ``no_sync`` accumulation and several
buckets), FSDP2 and HSDP: a batch or loss fault on one rank or two is ``dropped`` on every
rank, and the gradient the optimizer gets and the weights after it equal (to rounding) a hand
all-reduce of the other ranks' gradients divided by their number; a fault on more than
``max_dropped`` ranks, on every rank, or made inside the backward is skipped; healthy steps are
bit-identical to ``policy="skip"``; what drop cannot leave out is refused at construction.

Every scenario runs in one 4-rank process group (one spawn; see ``workers_drop.scenarios``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_drop import (
    DDP_PLAN,
    DDP_STEPS,
    FSDP_PLAN,
    FSDP_STEPS,
    HSDP_STEPS,
    ROWS,
    expected,
    sample_id,
    scenarios,
)

WORLD = 4
#: Rounding between DDP's or FSDP2's averaging and the hand reference (fp32, values ~1e-1).
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("drop")
    return values(run_ranks(scenarios, WORLD, tmp, report_dir=str(tmp / "reports"),
                            timeout=280))


def _check(outs: list[dict[str, Any]], plan: dict[int, Any], steps: int) -> None:
    for out in outs:
        assert out["gate"] == "host"
        assert [r["step"] for r in out["records"]] == list(range(steps))
        for rec in out["records"]:
            outcome, ranks = expected(plan, rec["step"], WORLD)
            assert (rec["outcome"], rec["bad_ranks"]) == (outcome, ranks), rec
            assert rec["applied"] == (outcome != "skipped"), rec
            # The gradient the optimizer stepped with, and the weights after it.
            assert rec["grad_diff"] is None or rec["grad_diff"] <= TOLERANCE, rec
            assert rec["weight_diff"] <= TOLERANCE, rec
    weights = [out["weights"] for out in outs]
    assert all(torch.isfinite(w).all() for w in weights)
    assert all(torch.equal(w, weights[0]) for w in weights[1:]), "weights differ across ranks"


@pytest.mark.timeout(300)
def test_ddp_drops_one_or_two_ranks_and_matches_the_hand_reduction(
    runs: list[dict[str, Any]],
) -> None:
    outs = [r["ddp"] for r in runs]
    assert outs[0]["path"] == "DDP"
    _check(outs, DDP_PLAN, DDP_STEPS)
    records = outs[0]["records"]
    assert records[1]["kinds"] == ["batch", "loss", "grad"]  # named as under skip
    # Its gradients were zeros in the reduction: the scan after it finds no parameter.
    assert records[1]["parameters"] == {}
    assert "other 3 ranks' gradients" in records[1]["reason"]
    assert "other 2 ranks' gradients" in records[3]["reason"]
    # A dropped step is applied: the skips before step 6 are counted from the first skip.
    assert [r["consecutive_skips"] for r in records] == [0, 0, 0, 0, 1, 2, 3, 0]
    # Strikes as for a blamed rank (none while every host had a bad rank: steps 3 to 5).
    assert outs[0]["strikes"] == {"host0": [1, 6], "host1": [2]}
    assert outs[0]["reports"] == ["dropped"] * 3 + ["skipped"] * 3
    # A dropped batch goes to the skip list: the NaN row of each poisoned micro-batch.
    listed = sorted(i for line in outs[0]["skip_list"] for i in line["ids"])
    want = sorted(sample_id(r, s, micro, 0) for s, faults in DDP_PLAN.items()
                  for r, (kind, micro) in faults.items() if kind == "batch")
    assert listed == want and ROWS > 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mesh", "steps"), [("fsdp", FSDP_STEPS), ("hsdp", HSDP_STEPS)])
def test_fsdp2_and_hsdp_drop_and_match_the_hand_reduction(
    runs: list[dict[str, Any]], mesh: str, steps: int,
) -> None:
    outs = [r[mesh] for r in runs]
    assert outs[0]["path"] == "FSDP2"
    _check(outs, FSDP_PLAN, steps)
    # The norms taken before the withhold still name the dropped rank's parameters.
    assert list(outs[0]["records"][1]["parameters"]) == [1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["ddp", "fsdp"])
def test_healthy_steps_are_bit_identical_to_policy_skip(
    runs: list[dict[str, Any]], path: str,
) -> None:
    for r in runs:
        skip, drop = r[f"healthy-{path}-skip"], r[f"healthy-{path}-drop"]
        assert [x["outcome"] for x in drop["records"]] == ["applied"] * 2
        assert torch.equal(skip["weights"], drop["weights"])


@pytest.mark.timeout(300)
def test_what_drop_cannot_leave_out_is_refused_at_construction(
    runs: list[dict[str, Any]],
) -> None:
    refused = runs[0]["refused"]
    assert "policy='drop' is refused on rank 0" in refused["local"]
    assert "reduced by hand" in refused["local"] and "NANSENTINEL_POLICY" in refused["local"]
    assert "mesh does not span the job" in refused["fsdp-sub-mesh"]


def test_the_plan_is_what_the_docstring_says() -> None:
    """The expectations are the test's own, not read back from the sentinel."""
    assert [expected(DDP_PLAN, s, WORLD)[0] for s in range(DDP_STEPS)] == [
        "applied", "dropped", "dropped", "dropped", "skipped", "skipped", "skipped", "applied"]
    assert [expected(FSDP_PLAN, s, WORLD)[0] for s in range(FSDP_STEPS)] == [
        "applied", "dropped", "dropped", "skipped", "skipped", "applied"]
