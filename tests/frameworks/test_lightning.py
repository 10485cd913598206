"""The real PyTorch Lightning Trainer with SentinelCallback: 2 CPU DDP ranks (gloo) launched
by Lightning itself, faults made by the model (a forward log(0) on rank 0, a backward-only
NaN on rank 1), gradient accumulation; an abort under ``nansentinel run``; one device in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frameworks import runner

pytest.importorskip("lightning")

WORKER = "lightning_worker.py"


@pytest.mark.timeout(300)
def test_lightning_ddp_skips_model_made_faults_on_both_ranks(tmp_path: Path) -> None:
    proc = runner.run(
        runner.python(WORKER, str(tmp_path), "--devices=2", "--steps=6", "--accumulate=2",
                      "--faults=2:0:log0,4:1:grad"),
        tmp_path, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = runner.ranks(tmp_path, 2, proc)
    runner.assert_two_rank_faults_skipped(results, steps=6)
    for res in results:
        # As when Lightning's own GradScaler skips: global_step and the step-interval
        # scheduler advance on a skipped step too.
        assert res["global_step"] == 6 and res["sentinel_steps"] == 6
        assert res["scheduler_steps"] == 6


@pytest.mark.timeout(300)
def test_lightning_abort_under_nansentinel_run_exits_3_with_report(tmp_path: Path) -> None:
    proc = runner.run(
        runner.nansentinel_run(WORKER, str(tmp_path), "--devices=2", "--steps=4",
                               "--faults=1:1:grad"),
        tmp_path, timeout=240, env={"NANSENTINEL_POLICY": "abort"},
    )
    runner.assert_aborted_with_one_report(proc, tmp_path, 1, "grad")
    assert "NonFiniteError" in proc.stdout or "aborted" in proc.stdout


@pytest.mark.timeout(240)
def test_lightning_single_device_bf16_skips(tmp_path: Path) -> None:
    proc = runner.run(
        runner.python(WORKER, str(tmp_path), "--devices=1", "--strategy=auto", "--steps=4",
                      "--accumulate=2", "--precision=bf16-mixed", "--faults=1:0:grad",
                      "--no-replay"),
        tmp_path, timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    (res,) = runner.ranks(tmp_path, 1, proc)
    # SentinelCallback(replay=False) turns the replay off (it was a TypeError at fit start).
    assert res["sentinel_model"] == "Net" and res["replays"] is False
    assert sorted(res["skipped"]) == ["1"] and res["skipped"]["1"]["kinds"] == ["grad"]
    assert res["unchanged"] == {str(s): s == 1 for s in range(4)}
    runner.assert_same_finite_weights([res])


@pytest.mark.timeout(300)
def test_lightning_ddp_rolls_back_every_rank_to_the_last_good_step(tmp_path: Path) -> None:
    proc = runner.run(
        runner.python(WORKER, str(tmp_path), "--devices=2", "--steps=5", "--accumulate=1",
                      "--faults=3:1:grad"),
        tmp_path, timeout=240,
        env={"NANSENTINEL_POLICY": "rollback", "NANSENTINEL_SNAPSHOT_EVERY": "1",
             "NANSENTINEL_ROLLBACK_SKIP_BATCHES": "0"},
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = runner.ranks(tmp_path, 2, proc)
    for res in results:
        assert sorted(res["skipped"]) == ["3"], res["skipped"]
        step3 = res["skipped"]["3"]
        assert step3["outcome"] == "rolled_back" and step3["rolled_back_to"] == 2
        assert step3["bad_ranks"] == [1]
        assert res["global_step"] == 5
    runner.assert_same_finite_weights(results)


def _phase(tmp_path: Path, phase: str) -> list[dict]:
    return [json.loads((tmp_path / f"rank{r}-{phase}.json").read_text()) for r in range(2)]


def _assert_three_faults_skipped(results: list[dict]) -> None:
    """A batch drill on rank 1 at step 1, a forward log(0) on rank 0 at step 2, a backward-only
    NaN on rank 1 at step 4: skipped on both ranks, that rank named, weights (and SGD's
    momentum) untouched on exactly those steps, finite and identical at the end."""
    for res in results:
        assert res["world"] == 2 and res["global_step"] == 6
        assert {s: r["bad_ranks"] for s, r in res["skipped"].items()} == {
            "1": [1], "2": [0], "4": [1]}
        assert all(r["outcome"] == "skipped" for r in res["skipped"].values())
        assert "batch" in res["skipped"]["1"]["kinds"] and "loss" in res["skipped"]["2"]["kinds"]
        assert res["skipped"]["4"]["kinds"] == ["grad"]
        assert res["unchanged"] == {str(s): s in (1, 2, 4) for s in range(6)}
        assert res["scheduler_steps"] == 6  # Lightning steps it after a skip too
    runner.assert_report_names(results[0]["skipped"]["1"]["report_path"], 1, "batch")
    runner.assert_report_names(results[0]["skipped"]["4"]["report_path"], 1, "grad")
    runner.assert_same_finite_weights(results)


@pytest.mark.timeout(300)
def test_lightning_fsdp2_sharded_below_the_root_skips_rolls_back_and_drops(
    tmp_path: Path,
) -> None:
    """ModelParallelStrategy with fully_shard in configure_model (Lightning's recipe: the
    LightningModule is never the FSDP2 root) on 2 CPU devices: three fits in the same ranks,
    skip, rollback and drop, each with a batch drill on rank 1 at step 1 beside the model's
    own faults."""
    proc = runner.run(
        runner.python(WORKER, str(tmp_path), "--strategy=fsdp2", "--devices=2", "--steps=6",
                      "--accumulate=2", "--faults=2:0:log0,4:1:grad",
                      "--phases=skip,rollback,drop"),
        tmp_path, timeout=280, env={"NANSENTINEL_INJECT": "kind=batch,rank=1,step=1"},
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    skip = _phase(tmp_path, "skip")
    _assert_three_faults_skipped(skip)
    assert all(r["gradient_path"] == "FSDP2" and r["sentinel_model"] == "Net" for r in skip)
    rollback = _phase(tmp_path, "rollback")
    for res in rollback:  # the drill at 1 (to the snapshot after step 0), the grad NaN at 3
        assert {s: (r["outcome"], r["rolled_back_to"], r["bad_ranks"])
                for s, r in res["skipped"].items()} == {
            "1": ("rolled_back", 0, [1]), "3": ("rolled_back", 2, [1])}
    runner.assert_same_finite_weights(rollback)
    drop = _phase(tmp_path, "drop")
    for res in drop:  # a non-finite batch or loss on rank 1: applied without its gradients
        assert res["outcomes"] == {s: {"outcome": "dropped", "bad_ranks": [1]}
                                   for s in ("1", "3")}
        assert not any(res["unchanged"].values())
    runner.assert_same_finite_weights(drop)


@pytest.mark.timeout(300)
def test_lightning_fsdp1_strategy_skips_rolls_back_and_drops(tmp_path: Path) -> None:
    """``strategy="fsdp"`` (Lightning's FSDPStrategy: FSDP1, the LightningModule one unit,
    ``use_orig_params=True``) on 2 CPU devices, past Lightning's CUDA-only check
    (cpu_guards.py; the GPU script runs it without): the Sentinel is built on the FSDP1 root
    and checks each rank's flat gradient in FSDP1's communication hook; skip, rollback and
    drop as on FSDP2, the parameters named as the LightningModule names them."""
    proc = runner.run(
        runner.python(WORKER, str(tmp_path), "--strategy=fsdp", "--devices=2", "--steps=6",
                      "--accumulate=2", "--faults=2:0:log0,4:1:grad",
                      "--phases=skip,rollback,drop"),
        tmp_path, timeout=280, env={"NANSENTINEL_INJECT": "kind=batch,rank=1,step=1"},
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    skip = _phase(tmp_path, "skip")
    _assert_three_faults_skipped(skip)
    assert all(r["gradient_path"] == "FSDP1" and
               r["sentinel_model"] == "FullyShardedDataParallel" for r in skip)
    report = json.loads(Path(skip[0]["skipped"]["4"]["report_path"]).read_text())
    assert report["poisoned"][0]["parameters"] == ["body.inp.weight", "body.inp.bias"]
    rollback = _phase(tmp_path, "rollback")
    for res in rollback:
        assert {s: (r["outcome"], r["rolled_back_to"], r["bad_ranks"])
                for s, r in res["skipped"].items()} == {
            "1": ("rolled_back", 0, [1]), "3": ("rolled_back", 2, [1])}
    runner.assert_same_finite_weights(rollback)
    drop = _phase(tmp_path, "drop")
    for res in drop:
        assert res["outcomes"] == {s: {"outcome": "dropped", "bad_ranks": [1]}
                                   for s in ("1", "3")}
        assert not any(res["unchanged"].values())
    runner.assert_same_finite_weights(drop)


@pytest.mark.timeout(300)
def test_lightning_deepspeed_zero3_seam_on_cpu(tmp_path: Path) -> None:
    """DeepSpeedStrategy(stage=3) on 2 CPU devices, Lightning's CUDA-only check lifted
    (cpu_guards.py; the GPU script runs it without): Lightning's engine.step() after
    on_before_optimizer_step is the sentinel's, and a skip is DeepSpeed's own overflow skip."""
    pytest.importorskip("deepspeed")
    proc = runner.run(
        runner.python(WORKER, str(tmp_path), "--strategy=deepspeed_3", "--devices=2",
                      "--steps=6", "--accumulate=2", "--faults=2:0:log0,4:1:grad",
                      "--phases=skip"),
        tmp_path, timeout=280,
        env={"NANSENTINEL_INJECT": "kind=batch,rank=1,step=1", "DS_ACCELERATOR": "cpu"},
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = _phase(tmp_path, "skip")
    _assert_three_faults_skipped(results)
    for res in results:
        assert res["sentinel_model"] == "DeepSpeedEngine" and res["replays"] is False
        assert res["ds_steps"] == [6, 3]  # DeepSpeed's global_steps, skipped_steps
