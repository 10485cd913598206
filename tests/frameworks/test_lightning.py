"""The real PyTorch Lightning Trainer with SentinelCallback: 2 CPU DDP ranks (gloo) launched
by Lightning itself, faults made by the model (a forward log(0) on rank 0, a backward-only
NaN on rank 1), gradient accumulation; an abort under ``nansentinel run``; one device in bf16.
"""

from __future__ import annotations

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
