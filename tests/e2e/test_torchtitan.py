"""torchtitan 0.3.0's own trainer under the sentinel, run as a user runs it: real ``torchrun``,
``-m torchtitan.train --module REGISTRY --config FN``, llama3's debug model, on CPU ranks.

The registry (workers/torchtitan_registry.py) is the user's one function,
``with_sentinel(llama3_debugmodel())``, plus a fault the model makes itself: the first block's
output turns NaN on one rank at torchtitan's step 2. The launcher (workers/torchtitan_train.py)
applies the CPU patches (torchtitan_cpu.py) before torchtitan is imported. Asserted: the fault
is named (rank and host, in the log and the incident report), the step is skipped, and
training runs to the last step with exit code 0. Under pipeline parallelism (2 stages) the
stage where the NaN began is named alone, and the stage it reached is ``reached``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.torchtitan_cpu import write_assets
from tests.frameworks import runner

pytestmark = pytest.mark.e2e
pytest.importorskip("torchtitan")

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
STEPS = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_assets(tmp_path_factory.mktemp("torchtitan-assets"))


def _env(tmp: Path) -> dict[str, str]:
    """This checkout and the workers first on the path (the registry is imported by name), no
    network, Hugging Face caches in the test's directory."""
    return {
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), str(WORKERS), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
    }


def train(tmp: Path, assets: tuple[Path, Path], ranks: int, config: str, *args: str,
          timeout: float = 150, env: dict[str, str] | None = None,
          steps: int = STEPS) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``torchrun --standalone -m torchtitan.train`` (through the CPU launcher); returns the
    finished process (stdout and stderr together) and the report directory. ``env``: more
    environment for the ranks."""
    tokenizer, data = assets
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", str(WORKERS / "torchtitan_train.py"),
        "--module", "torchtitan_registry", "--config", config,
        "--parallelism.spmd-backend", "partial_dtensor",
        "--hf-assets-path", str(tokenizer), "--dataloader.dataset-path", str(data),
        "--training.steps", str(steps), "--training.seq-len", "32",
        "--training.local-batch-size", "1", "--dump-folder", str(tmp / "out"), *args,
    ]
    return (runner.run(cmd, tmp, timeout=timeout, env={**_env(tmp), **(env or {})}),
            tmp / "reports")


def _check_run(proc: subprocess.CompletedProcess[str], reports: Path, *, ranks: int,
               origin: int, reached: set[int], bad_host: str, clean_host: str) -> None:
    """``origin``: the rank whose block turned NaN; ``reached``: ranks the NaN may reach in
    the same step (TP peers on its host), which may be named too, or not."""
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    # Named, on every rank's view, in the log and in rank 0's report.
    assert f"rank {origin} on host {bad_host}" in out, out[-6000:]
    assert f"host {clean_host}" not in out
    report = json.loads(next(reports.glob("incident-*.json")).read_text())
    assert origin in report["bad_ranks"], report
    assert set(report["bad_ranks"]) <= {origin, *reached}, report
    assert report["bad_hosts"] == [bad_host], report
    assert report["outcome"] == "skipped" and report["step"] == 1  # torchtitan's step 2
    assert "torchtitan step 2 (sentinel step 1) skipped, not applied" in out
    assert "stop on its non-finite loss was passed over" in out
    # torchtitan logged every step but the skipped one on every rank, and finished.
    logged = [line for line in out.splitlines() if "step:" in line and "loss:" in line]
    for step in (1, 3):
        assert sum(f"step: {step:2d} " in line for line in logged) == ranks, logged
    assert not any("step:  2 " in line for line in logged)
    assert "Loss is not finite" not in out
    assert out.count("Training completed") == ranks


@pytest.mark.timeout(200)
def test_fsdp_x_tp_on_four_ranks_names_the_tp_groups_host(
    tmp_path: Path, assets: tuple[Path, Path]
) -> None:
    """Rank 0's block turns NaN; TP's collectives reach rank 1, its TP peer on node0 (named
    today too: both local losses and gradients are non-finite). node0 is named; node1's ranks
    stay clean. (FSDP alone, one rank named exactly, is test_torchtitan_ft.py's run: FSDP2
    shard degree 2 inside each replica group.)"""
    proc, reports = train(tmp_path, assets, 4, "tp_fault",
                          "--parallelism.tensor-parallel-degree", "2")
    _check_run(proc, reports, ranks=4, origin=0, reached={1}, bad_host="node0",
               clean_host="node1")


@pytest.mark.timeout(200)
def test_pipeline_on_two_ranks_names_the_origin_stage_alone(
    tmp_path: Path, assets: tuple[Path, Path]
) -> None:
    """Two pipeline stages (GPipe, 2 micro-batches), one rank and host each: stage 0's first
    block turns NaN on rank 0 at step 2. The NaN reaches stage 1 (its activations, its loss)
    and comes back in the gradients; rank 0 alone is named, rank 1 is ``reached``. Only the
    last stage has a loss: torchtitan logs -1 for it on stage 0, and stops on the last
    stage's NaN loss, which is passed over there."""
    proc, reports = train(
        tmp_path, assets, 2, "pp_fault", "--parallelism.pipeline-parallel-degree", "2",
        "--parallelism.pipeline-parallel-schedule", "GPipe",
        "--training.local-batch-size", "2", "--parallelism.pipeline-parallel-microbatch-size",
        "1",
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    assert "rank 0 on host node0" in out, out[-6000:]
    assert "reached from there (not blamed): rank(s) 1" in out
    assert "host node1" not in out
    report = json.loads(next(reports.glob("incident-*.json")).read_text())
    assert report["bad_ranks"] == [0] and report["bad_hosts"] == ["node0"], report
    assert report["reached"] == [1], report
    assert report["outcome"] == "skipped" and report["step"] == 1  # torchtitan's step 2
    assert "torchtitan step 2 (sentinel step 1) skipped, not applied" in out
    logged = [line for line in out.splitlines() if "step:" in line and "loss:" in line]
    for step in (1, 3):
        assert sum(f"step: {step:2d} " in line for line in logged) == 2, logged
    # Step 2 is logged by stage 0 alone, with no loss of its own (-1).
    second = [line for line in logged if "step:  2 " in line]
    assert len(second) == 1 and "loss: -1.00000" in second[0], second
    assert "Loss is not finite" not in out
    assert out.count("Training completed") == 2


@pytest.mark.timeout(120)
def test_with_sentinel_through_torchtitans_config_manager(tmp_path: Path) -> None:
    """``--module torchtitan_registry --config sentinel_debugmodel`` is found by torchtitan's
    own ConfigManager and builds SentinelTrainer; CLI overrides apply on top; every setup the
    sentinel cannot watch is refused, naming its field and what to use instead."""
    proc = runner.run([sys.executable, str(WORKERS / "torchtitan_config_check.py")], tmp_path,
                      timeout=100, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stdout[-6000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    assert got["type"] == "SentinelTrainer.Config" and got["owner"] == "SentinelTrainer"
    assert got["steps"] == 7 and got["cuda_graphs_off"] and got["sentinel"] == {}
    assert got["input_untouched"]
    assert got["merged"] == {"policy": "abort", "max_consecutive_skips": 2}
    for key, field in (("rollback", "policy"), ("grad_spike", "grad_spike_action"),
                       ("env_rollback", "loss_spike_action")):
        assert f"{field}='rollback' is not supported" in got[key], got[key]
        assert "policy='skip' or 'abort'" in got[key]
    for key in ("lr_jump", "env_lr_jump"):  # issue 52's jump rule writes param_groups too
        assert "lr_jump_ratio=4 is not supported" in got[key], got[key]
        assert "NANSENTINEL_LR_JUMP_RATIO=0" in got[key]
    assert got["lr_jump_off"] == "no error"
    assert got["pipeline"] == "no error"  # torchtitan's default schedule, 1F1B
    for key, schedule in (("pipeline_schedule", "ZBVZeroBubble"), ("pipeline_cli", "DualPipeV")):
        assert f"parallelism.pipeline_parallel_schedule='{schedule}'" in got[key], got[key]
        assert "GPipe, 1F1B, Interleaved1F1B" in got[key]
    assert "validator.enable=True with parallelism.pipeline_parallel_degree=2" in \
        got["pipeline_validator"], got["pipeline_validator"]
    assert got["typo"].startswith("ConfigError") and "did you mean policy" in got["typo"]
    assert "OtherTrainer.Config" in got["other_trainer"]
    assert "training.disable_cuda_graphs=False" in got["cuda_graphs"]
    # torchtitan's fault-tolerant trainer: its own config class, torchft's optimizers
    # container made the sentinel's (the same param groups), CLI overrides on top.
    assert got["ft_type"] == "SentinelFTTrainer.Config" and got["ft_owner"] == "SentinelFTTrainer"
    assert got["ft_optimizer"] == "SentinelFTOptimizers.Config"
    assert got["ft_optimizer_owner"] == "SentinelFTOptimizers" and got["ft_param_groups"]
    assert got["ft_replica"] == [1, 2] and got["ft_off"] == "no error"
    assert got["ft_init_sync"] is True and got["ft_no_init_sync"] is False
    assert got["ft_manager_owner"] == "SentinelFTManager"
    for key, method in (("ft_diloco", "diloco"), ("ft_cli_local_sgd", "local_sgd")):
        assert f"fault_tolerance.semi_sync_method='{method}'" in got[key], got[key]
        assert "semi_sync_method=None" in got[key]
    assert "fault_tolerance.enable with optimizer OptimizersContainer.Config" in \
        got["ft_plain_optimizer"], got["ft_plain_optimizer"]
    assert "pipeline_parallel_degree=2" in got["ft_pipeline"], got["ft_pipeline"]
    for key in ("ft_unsharded", "ft_one_rank_group"):
        assert "shard degree of 1 inside the replica group" in got[key], got[key]
