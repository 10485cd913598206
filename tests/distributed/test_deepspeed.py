"""DeepSpeed engines (ZeRO 0, 1, 2, 3; DeepSpeed 0.19.8 on CPU gloo ranks) under the sentinel.

The 4-rank test is one spawn of real ranks that runs an engine per stage in turn (``run_cases``:
one import of DeepSpeed for all); the 2-rank tests share one such spawn (``two_ranks``). Every
stage is covered on 2 and on 4 ranks: the poisoned rank and its host named on every rank,
the step skipped as DeepSpeed skips an overflow (its counters, LR schedule and loss scale as
after its own skip, weights and optimizer state untouched), every healthy step applied,
training to the end, the same finite weights on every rank.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_deepspeed import run_cases

if importlib.util.find_spec("deepspeed") is None:  # tests/constraints.txt pins it; not imported
    pytest.skip("deepspeed is not installed (pip install -c tests/constraints.txt "
                "-r tests/requirements-main.txt)", allow_module_level=True)

ENV = {"DS_ACCELERATOR": "cpu"}
STAGES = (0, 1, 2, 3)
#: The 4-rank matrix: (step, rank) -> fault, on two hosts (ranks 0-1: node0, 2-3: node1).
#: ``grad`` is the NANSENTINEL_INJECT drill, written into the first local gradient DeepSpeed
#: is about to reduce (its IPG bucket from ZeRO-2 on).
FOUR = {(1, 1): "batch", (3, 2): "loss", (5, 3): "backward", (6, 0): "grad", (7, 0): "aux"}
KIND = {"batch": "batch", "loss": "loss", "backward": "grad", "grad": "grad", "aux": "batch"}
#: What each stage's gradient path is, and where its optimizer decides on overflow.
SEAMS = {0: ("allreduce", "AdamW"), 1: ("allreduce", "DeepSpeedZeroOptimizer"),
         2: ("bucket", "DeepSpeedZeroOptimizer"), 3: ("partition", "DeepSpeedZeroOptimizer_Stage3")}


def _run(world: int, tmp: Path, cases: list[dict[str, Any]], timeout: float) -> list[Any]:
    outs = values(run_ranks(run_cases, world, tmp, cases=cases, report_dir=str(tmp / "r"),
                            env=ENV, timeout=timeout))
    return [[out[i] for out in outs] for i in range(len(cases))]  # per case, per rank


def _same_finite_weights(ranks: list[dict[str, Any]], what: str) -> None:
    first = ranks[0]["weights"]
    assert torch.isfinite(first).all(), f"{what}: non-finite weights"
    for r, out in enumerate(ranks):
        assert torch.equal(out["weights"], first), f"{what}: rank {r}'s weights differ"


def _skipped_exactly(ranks: list[dict[str, Any]], faults: dict[tuple[int, int], str],
                     steps: int, what: str) -> None:
    """Every rank: each fault's step skipped with its rank and host named and its kind, the
    weights and optimizer state unchanged there and moved on every other step, DeepSpeed's
    counters and LR as after its own skips."""
    bad = {step: (rank, kind) for (step, rank), kind in faults.items()}
    hosts = {r: ranks[r]["hostname"] for r in range(len(ranks))}
    for r, out in enumerate(ranks):
        assert out["error"] is None, f"{what}, rank {r}: {out['error']}"
        recs = out["records"]
        assert [rec["step"] for rec in recs] == list(range(steps)), f"{what}: not to the end"
        for rec in recs:
            where = f"{what}, rank {r}, step {rec['step']}"
            if rec["step"] in bad:
                rank, kind = bad[rec["step"]]
                assert rec["outcome"] == "skipped" and not rec["applied"], (where, rec)
                assert rec["bad_ranks"] == [rank] and rec["bad_hosts"] == [hosts[rank]], where
                assert KIND[kind] in rec["kinds"], (where, rec["kinds"])
                assert rec["unchanged"] and not rec["ds_applied"], where
            else:
                assert rec["outcome"] == "applied" and rec["bad_ranks"] == [], (where, rec)
                assert not rec["unchanged"] and rec["ds_applied"], where
        # DeepSpeed's own bookkeeping of a skip: every step counted, the skips as skipped,
        # the LR schedule held on each skipped step.
        assert recs[-1]["global_steps"] == steps and recs[-1]["skipped_steps"] == len(bad)
        lrs = [rec["lr"] for rec in recs]
        for step in bad:
            assert lrs[step] == lrs[step - 1], f"{what}: the LR scheduler stepped at {step}"
    _same_finite_weights(ranks, what)


@pytest.mark.timeout(240)
def test_every_stage_on_four_ranks_of_two_hosts(tmp_path: Path) -> None:
    """ZeRO 0-3 on 4 ranks, 2 hosts: a batch, a loss, a backward-made NaN, a gradient drill and
    a non-finite batch tensor the model never reads (finite gradients: DeepSpeed alone would
    apply it), each on its own rank and step; host strikes raised so no host is excluded."""
    steps = 9
    faults = {k: v for k, v in FOUR.items() if v != "grad"}
    cases = [dict(stage=s, steps=steps, hosts=2, host_strikes=10, faults=faults,
                  inject="kind=grad,rank=0,step=6,value=nan") for s in STAGES]
    for stage, ranks in zip(STAGES, _run(4, tmp_path, cases, timeout=200), strict=True):
        what = f"ZeRO-{stage}, 4 ranks"
        assert (ranks[0]["path"], ranks[0]["optimizer"]) == SEAMS[stage], what
        assert [o["hostname"] for o in ranks] == ["node0", "node0", "node1", "node1"]
        _skipped_exactly(ranks, FOUR, steps, what)
        poisoned = ranks[0]["records"][5]
        # Only the backward-made NaN's parameters, named by the rank that made it.
        assert poisoned["parameters"] == {3: ["pos", "embed.weight"]}, (what, poisoned)
        assert ranks[0]["records"][6]["injected"], what
        # close() gave the engine back: its own all-reduce in backward, no wrapped method.
        assert all(o["released"] == (True, []) for o in ranks), what


#: The 2-rank cases, all run in one spawn (the ``two_ranks`` fixture) and read by three tests.
BF16_STEPS, FP16_STEPS = 6, 5
BF16_FAULTS = {(1, 1): "batch", (3, 0): "backward", (4, 1): "aux"}
OWN_SKIPS = {(step, -1): "all" for step, _ in BF16_FAULTS}


def _two_rank_cases() -> list[dict[str, Any]]:
    cases = []
    for s in STAGES:  # ZeRO-1 with overlap_comm: its IPG bucket seam
        common = dict(stage=s, steps=BF16_STEPS, dtype="bf16", accumulate=2,
                      zero={"overlap_comm": True} if s == 1 else None)
        cases += [dict(common, faults=BF16_FAULTS),
                  dict(common, faults=OWN_SKIPS, sentinel=False)]
    return [
        *cases,
        dict(stage=2, steps=FP16_STEPS, dtype="fp16", faults={(2, 1): "batch"}),
        dict(stage=2, steps=FP16_STEPS, dtype="fp16", faults={(2, -1): "all"}, sentinel=False),
        dict(stage=0, steps=3, faults={(1, 1): "batch"}, sentinel=False),
        dict(run="refusals"),
    ]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    """One spawn of 2 ranks for every 2-rank case (one import of DeepSpeed, ~15 s less than a
    spawn per test): per case, per rank, what it returned."""
    return _run(2, tmp_path_factory.mktemp("deepspeed2"), _two_rank_cases(), timeout=300)


@pytest.mark.timeout(360)  # the fixture's spawn runs in the first test that asks for it
def test_every_stage_on_two_ranks_skips_as_deepspeed_skips_an_overflow(
    two_ranks: list[Any],
) -> None:
    """ZeRO 0-3 on 2 ranks in bf16 with 2 micro-batches per step, faults in the first
    micro-batch (checked there, decided at the boundary); ZeRO-1 with overlap_comm (its IPG
    bucket seam). Each is compared with DeepSpeed alone where every rank overflows at the same
    steps (DeepSpeed's own skip): the same weights bit for bit, the same counters and LRs."""
    results = two_ranks[:2 * len(STAGES)]
    for stage, ranks, alone in zip(STAGES, results[::2], results[1::2], strict=True):
        what = f"ZeRO-{stage}, 2 ranks, bf16, 2 micro-batches"
        assert ranks[0]["path"] == ("bucket" if stage == 1 else SEAMS[stage][0]), what
        _skipped_exactly(ranks, BF16_FAULTS, BF16_STEPS, what)
        for r in range(2):
            mine, theirs = ranks[r]["records"], alone[r]["records"]
            for key in ("global_steps", "skipped_steps", "lr", "unchanged", "ds_applied"):
                assert [x[key] for x in mine] == [x[key] for x in theirs], (what, key)
            assert torch.equal(ranks[r]["weights"], alone[r]["weights"]), what


@pytest.mark.timeout(360)
def test_fp16_overflow_is_counted_not_blamed_and_deepspeed_alone_applies_nan_at_zero_0(
    two_ranks: list[Any],
) -> None:
    """fp16 with DeepSpeed's dynamic loss scale (ZeRO-2, 2 ranks, an initial scale so high that
    the first steps overflow): those steps are ``overflow``, nobody blamed, DeepSpeed skips
    them and halves its scale; a NaN batch on rank 1 is still blamed, and its skip lowers the
    scale as DeepSpeed's own overflow does (compared with DeepSpeed alone, every rank
    overflowing there). Then DeepSpeed alone at ZeRO-0 fp32: the NaN batch is applied and every
    rank's weights are NaN: what the sentinel prevents."""
    watched, alone, zero0 = two_ranks[2 * len(STAGES):2 * len(STAGES) + 3]
    for r in range(2):
        recs = watched[r]["records"]
        assert recs[2]["outcome"] == "skipped" and recs[2]["bad_ranks"] == [1]
        assert "batch" in recs[2]["kinds"]
        overflowed = [rec["step"] for rec in recs if rec["outcome"] == "overflow"]
        assert overflowed and 2 not in overflowed, [rec["outcome"] for rec in recs]
        for rec in recs:
            if rec["step"] in overflowed:
                assert rec["bad_ranks"] == [] and rec["overflow"] and not rec["ds_applied"]
        theirs = alone[r]["records"]
        for key in ("scale", "skipped_steps", "global_steps", "lr", "ds_applied"):
            assert [x[key] for x in recs] == [x[key] for x in theirs], key
        assert recs[-1]["scale"] < recs[0]["scale"]
        assert any(rec["ds_applied"] for rec in recs), "no fp16 step applied at all"
        assert torch.equal(watched[r]["weights"], alone[r]["weights"])
    _same_finite_weights(watched, "fp16 ZeRO-2")
    for out in zero0:
        assert out["records"][1]["ds_applied"] and out["records"][-1]["skipped_steps"] == 0
        assert torch.isnan(out["weights"]).all()


@pytest.mark.timeout(360)
def test_unsupported_setups_are_refused_by_name(two_ranks: list[Any]) -> None:
    """Real engines that the sentinel cannot watch, refused at construction with what, where
    and what to do; an accepted engine refuses ``step(optimizer_step=False)``, a second
    Sentinel on it, and takes one again after close()."""
    said = two_ranks[-1]
    expected = {
        "rollback": "rollbacks are not supported", "optimizer": "optimizer given beside",
        "replay": "replay= is not supported", "device gate": "gate='device'",
        "version": "DeepSpeed 0.20.0 is untested", "offload": "ZeRO-Offload (offload_optimizer",
        "BF16_Optimizer": "BF16_Optimizer", "optimizer_step=False": "optimizer_step=False",
        "second sentinel": "one Sentinel per engine",
    }
    for rank, messages in enumerate(said):
        assert messages["accepted"] == ""
        assert messages["after close"] == "accepted"  # close() gave the engine back
        for case, words in expected.items():
            message = messages[case]
            assert words in message and f"rank {rank}" in message, (case, message)
            assert "host" in message, (case, message)
        assert "step 0" in messages["optimizer_step=False"]
