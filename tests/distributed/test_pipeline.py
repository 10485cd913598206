"""Pipeline parallel on gloo ranks: the rank where a NaN began is named alone, the ranks it
reached are listed apart, and every rank of every stage takes the same decision.

Layout of the 4-rank runs: rank = 2 * stage + replica, two stages on two hosts
(``stage0-host`` holds ranks 0 and 1, ``stage1-host`` ranks 2 and 3), FSDP2 over each stage's
two replicas; one pipeline per replica (ranks 0 -> 2 and 1 -> 3).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nansentinel.common import torch_insides as insides
from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_pipeline import (
    ddp_buffers,
    forward_collective,
    interleaved,
    pipelined,
)

# (step, rank) -> fault, and what every rank must read at that step: (bad ranks, reached).
FAULTS = {
    (0, 2): "forward",   # step 0, where the schedule also runs its shape inference
    (2, 0): "forward",
    (4, 2): "backward",  # stage 1's sent gradients: stage 0 only receives them
    (6, 1): "batch",
    (8, 3): "target",
    (10, 0): "backward",  # the first stage: its parameter gradients alone
    (12, 0): "forward", (12, 3): "backward",  # two at once, on the two pipelines
}
EXPECTED = {
    0: ([2], [0]), 2: ([0], [2]), 4: ([2], [0]), 6: ([1], [3]), 8: ([3], [1]),
    10: ([0], []), 12: ([0, 3], [1, 2]),
}
HOST = {0: "stage0-host", 1: "stage0-host", 2: "stage1-host", 3: "stage1-host"}
STEPS = 14

# Without the seam the feature is refused at construction (tests/unit/test_torch_insides.py).
# torch 2.9's own GPipe and 1F1B schedules over gloo abort in a send/recv size check with no
# sentinel at all: not the sentinel's to refuse, but nothing these tests can run there.
pytestmark = pytest.mark.skipif(
    not insides.supported("pipelining") or not insides._at_least("2.10"),
    reason="pipeline stage checks need the shape-inference seam, and CPU runs of torch's own "
    "schedules need torch >= 2.10 (2.9's abort over gloo without the sentinel)")


def _check(outs: list[dict], expected: dict[int, tuple[list[int], list[int]]],
           steps: int) -> None:
    for out in outs:
        assert len(out["records"]) == steps
        for rec in out["records"]:
            step = rec["step"]
            if step not in expected:
                assert rec["applied"] and rec["bad_ranks"] == [] and rec["reached"] == [], rec
                continue
            bad, reached = expected[step]
            assert not rec["applied"] and rec["outcome"] == "skipped", rec
            assert (rec["bad_ranks"], rec["reached"]) == (bad, reached), rec
            assert rec["bad_hosts"] == sorted({HOST[r] for r in bad}), rec
        assert out["finite"]
    for a, b in ((0, 1), (2, 3)):  # the data-parallel replicas of each stage
        for wa, wb in zip(outs[a]["weights"], outs[b]["weights"], strict=True):
            assert torch.equal(wa, wb), f"replicas {a} and {b} differ"


@pytest.mark.timeout(240)
def test_gpipe_names_the_origin_alone_then_50_healthy_steps_raise_nothing(
    tmp_path: Path,
) -> None:
    """The fault matrix on GPipe x FSDP2, then 50 healthy steps: every one applied, nothing
    named, no report."""
    steps = STEPS + 50
    outs = values(run_ranks(pipelined, 4, tmp_path, schedule="gpipe", steps=steps,
                            faults=FAULTS, report_dir=str(tmp_path / "r"), timeout=220))
    assert all(out["error"] is None for out in outs), [o["error"] for o in outs]
    assert all(out["quiet"] for out in outs)
    _check(outs, EXPECTED, steps)
    kinds = {r["step"]: r["kinds"] for r in outs[0]["records"]}
    assert "activation" in kinds[2] and "activation" not in kinds[4]
    assert "batch" in kinds[8] and "activation" not in kinds[8]  # a target, not the model
    report = json.loads(Path(outs[0]["records"][12]["report"]).read_text())
    assert report["bad_ranks"] == [0, 3] and report["reached"] == [1, 2]
    assert report["ranks"]["2"]["reached"] is True
    assert "received activations" in report["ranks"]["2"]["boundary"]
    reports = {p.name for p in (tmp_path / "r").rglob("incident-*.json") if "-rank" not in p.name}
    assert reports == {f"incident-local-step{s:08d}.json" for s in EXPECTED}


@pytest.mark.timeout(240)
def test_1f1b_names_the_origin_alone_and_strikes_only_its_host(tmp_path: Path) -> None:
    """1F1B x FSDP2 with host_strikes=3, from a healthy step 0 (the schedule's shape inference
    runs on uninitialised values: not judged). stage0-host is reached at steps 1 and 3 and is
    the origin at 5: one strike. stage1-host is the origin at 1, 3 and 7: its third strike
    excludes it at step 7, on every rank. Were a reached host struck, stage0-host would be
    excluded at step 5. (Two origins on the two hosts at once would strike neither: every host
    bad is a global cause.)"""
    faults = {(1, 2): "forward", (3, 2): "backward", (5, 1): "batch", (7, 3): "target"}
    expected = {1: ([2], [0]), 3: ([2], [0]), 5: ([1], [3])}
    outs = values(run_ranks(pipelined, 4, tmp_path, schedule="1f1b", steps=9, faults=faults,
                            host_strikes=3, report_dir=str(tmp_path / "r"), timeout=220))
    _check(outs, expected, 7)  # steps 0-6; step 7 raises
    for out in outs:
        err = out["error"]
        assert err and err["type"] == "HostExcludedError", out
        assert "excluding host stage1-host at step 7" in err["message"], err
        assert "host stage1-host blamed 3 times" in err["message"], err


@pytest.mark.timeout(180)
def test_an_interleaved_schedule_names_the_stage_where_it_began(tmp_path: Path) -> None:
    """Interleaved1F1B, 4 stages on 2 ranks (rank 0: stages 0 and 2; rank 1: 1 and 3): a NaN
    that began on stage 1 passes through rank 0's stage 2 before it comes back. Asked for the
    device gate with a fused optimizer, the pipeline keeps the host gate (issue 27 item 2: the
    stages make their next sentinel call at different points, where a detection deadlocked)."""
    faults = {(1, 1): "forward", (3, 2): "backward", (5, 3): "forward"}
    outs = values(run_ranks(interleaved, 2, tmp_path, steps=7, faults=faults,
                            report_dir=str(tmp_path / "r"), timeout=160))
    expected = {1: ([1], [0]), 3: ([0], [1]), 5: ([1], [0])}
    for out in outs:
        for rec in out["records"]:
            if rec["step"] in expected:
                assert not rec["applied"], rec
                assert (rec["bad_ranks"], rec["reached"]) == expected[rec["step"]], rec
            else:
                assert rec["applied"] and not rec["bad_ranks"] and not rec["reached"], rec
        assert out["finite"] and not out["replica_check"] and out["gate"] == "host"


@pytest.mark.timeout(150)
def test_a_collective_in_the_forward_names_the_rank_whose_batch_began_it(
    tmp_path: Path,
) -> None:
    """The forward subtracts the mean over every rank's batch (as SyncBatchNorm's statistics
    do): rank 1's NaN batch makes every rank's loss and gradients non-finite. Rank 1 alone is
    blamed (kind batch), the others are reached, and the verdict is not a global divergence."""
    outs = values(run_ranks(forward_collective, 4, tmp_path, steps=4, poisoned=(2, 1),
                            report_dir=str(tmp_path / "r"), timeout=130))
    for out in outs:
        rec = out["records"][2]
        assert not rec["applied"] and rec["bad_ranks"] == [1] and rec["bad_hosts"] == ["node1"]
        assert rec["reached"] == [0, 2, 3] and "batch" in rec["kinds"], rec
        assert rec["verdict"] != "divergence", rec
        assert all(r["applied"] for i, r in enumerate(out["records"]) if i != 2)
        assert all(torch.isfinite(w).all() for w in out["weights"])
    report = Path(outs[0]["records"][2]["report"]).read_text()
    assert '"reached": [\n    0,\n    2,\n    3\n  ]' in report or '"reached": [0, 2, 3]' in report


@pytest.mark.timeout(150)
def test_ddps_buffer_broadcast_is_not_a_forward_collective(tmp_path: Path) -> None:
    """DDP broadcasts a BatchNorm's buffers at the start of every forward (and rebuilds its
    buckets with a broadcast at step 1): its own collectives carry no NaN from one rank's
    batch to another's loss. Rank 0's batch and rank 1's loss go NaN in the same step: both
    are blamed, neither is reached. A collective of the user's on DDP's group, beside the
    broadcast, still makes the other rank reached."""
    outs = values(run_ranks(ddp_buffers, 2, tmp_path, report_dir=str(tmp_path / "r"),
                            timeout=130))
    for out in outs:
        rec = out["independent"]["records"][1]
        assert not rec["applied"] and rec["bad_ranks"] == [0, 1] and rec["reached"] == [], rec
        assert rec["bad_hosts"] == ["node0", "node1"], rec
        rec = out["centred"]["records"][1]
        assert not rec["applied"] and rec["bad_ranks"] == [0] and rec["reached"] == [1], rec
        for run in out.values():
            assert [r["applied"] for r in run["records"]] == [True, False, True]
