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
    for res in results:
        assert res["world"] == 2
        assert res["sentinel_model"] == "DistributedDataParallel"  # its comm hook, not local
        assert sorted(res["skipped"]) == ["2", "4"], res["skipped"]
        assert res["skipped"]["2"]["bad_ranks"] == [0]
        assert "loss" in res["skipped"]["2"]["kinds"]
        assert res["skipped"]["4"]["bad_ranks"] == [1]
        assert res["skipped"]["4"]["kinds"] == ["grad"]
        # Replayed through the framework's own step: the fault follows the rank, not the data.
        assert res["skipped"]["2"]["verdict"] == res["skipped"]["4"]["verdict"] == "host"
        # Skipped steps leave weights and momentum exactly as they were; others change them.
        assert res["unchanged"] == {str(s): s in (2, 4) for s in range(6)}
        # As when Lightning's own GradScaler skips: global_step and the step-interval
        # scheduler advance on a skipped step too.
        assert res["global_step"] == 6 and res["sentinel_steps"] == 6
        assert res["scheduler_steps"] == 6
    runner.assert_report_names(results[0]["skipped"]["2"]["report_path"], 0, "loss")
    runner.assert_report_names(results[0]["skipped"]["4"]["report_path"], 1, "grad")
    runner.assert_same_finite_weights(results)


@pytest.mark.timeout(300)
def test_lightning_abort_under_nansentinel_run_exits_3_with_report(tmp_path: Path) -> None:
    proc = runner.run(
        runner.nansentinel_run(WORKER, str(tmp_path), "--devices=2", "--steps=4",
                               "--faults=1:1:grad"),
        tmp_path, timeout=240, env={"NANSENTINEL_POLICY": "abort"},
    )
    assert proc.returncode == 3, proc.stdout[-6000:]
    assert "NonFiniteError" in proc.stdout or "aborted" in proc.stdout
    assert not list(tmp_path.glob("rank*.json")), "fit went on past the abort"
    reports = sorted((tmp_path / "reports").glob("incident-*step00000001.json"))
    assert len(reports) == 1, list((tmp_path / "reports").iterdir())
    report = runner.assert_report_names(str(reports[0]), 1, "grad")
    assert report["outcome"] == "aborted"


@pytest.mark.timeout(240)
def test_lightning_single_device_bf16_skips(tmp_path: Path) -> None:
    proc = runner.run(
        runner.python(WORKER, str(tmp_path), "--devices=1", "--strategy=auto", "--steps=4",
                      "--accumulate=2", "--precision=bf16-mixed", "--faults=1:0:grad"),
        tmp_path, timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    (res,) = runner.ranks(tmp_path, 1, proc)
    assert res["sentinel_model"] == "Net"
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
