"""A plain Accelerate loop (docs/frameworks.md's recipe) with ``AcceleratedSentinel`` on 2 gloo
CPU ranks under torchrun: on DDP (bf16 autocast, ``accelerator.accumulate``,
``clip_grad_norm_``, an LR scheduler), on DeepSpeed ZeRO-2 (as Accelerate allows it on CPU: the
process state first, as the HF Trainer does) and on FSDP2 (Accelerate's CPU refusal lifted:
cpu_guards.py). Each run goes through its phases in the same processes (accelerate_worker.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.frameworks import runner, test_gpu_script

pytest.importorskip("accelerate")

WORKER = "accelerate_worker.py"
STEPS = 6


def _run(tmp_path: Path, engine: str, timeout: float = 240) -> list[dict[str, Any]]:
    env = {"DS_ACCELERATOR": "cpu"} if engine.startswith("deepspeed") else {}
    proc = runner.run(runner.torchrun(WORKER, str(tmp_path), f"--engine={engine}",
                                      f"--steps={STEPS}"), tmp_path, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _assert_skips(phases: list[dict[str, Any]], model: str) -> None:
    """The batch drill (rank 1, step 1), the forward log(0) (rank 0, step 2) and the
    backward-only NaN (rank 1, step 4): skipped on both ranks, that rank named, the weights
    untouched on exactly those steps, and the scheduler not advanced on them."""
    for res in phases:
        assert res["num_processes"] == 2 and res["sentinel_model"] == model
        skipped = {s: r for s, r in res["results"].items() if not r["applied"]}
        assert {s: r["bad_ranks"] for s, r in skipped.items()} == {"1": [1], "2": [0], "4": [1]}
        assert all(r["outcome"] == "skipped" for r in skipped.values())
        assert "batch" in skipped["1"]["kinds"] and "loss" in skipped["2"]["kinds"]
        assert skipped["4"]["kinds"] == ["grad"]
        assert res["unchanged"] == {str(s): s in (1, 2, 4) for s in range(STEPS)}
        # Accelerate steps a prepared scheduler once per process per optimizer step, and not at
        # all where optimizer.step_was_skipped: 2 processes x 3 applied steps.
        assert res["scheduler_steps"] == 2 * (STEPS - 3)
    runner.assert_report_names(phases[0]["results"]["1"]["report_path"], 1, "batch")
    runner.assert_report_names(phases[0]["results"]["4"]["report_path"], 1, "grad")
    runner.assert_same_finite_weights(phases)


def _assert_rollback_and_drop(results: list[dict[str, Any]]) -> None:
    for res in results:
        rolled = res["rollback"]["results"]["3"]
        assert rolled["outcome"] == "rolled_back" and rolled["rolled_back_to"] == 2
        assert rolled["bad_ranks"] == [1]
        dropped = res["drop"]["results"]["3"]
        assert dropped["outcome"] == "dropped" and dropped["applied"]
        assert dropped["bad_ranks"] == [1]
        assert res["drop"]["unchanged"]["3"] is False  # applied without rank 1's gradients
    runner.assert_same_finite_weights([r["rollback"] for r in results])
    runner.assert_same_finite_weights([r["drop"] for r in results])


@pytest.mark.timeout(300)
def test_accelerate_loop_on_ddp_skips_rolls_back_drops_and_names_cpu_true(tmp_path: Path) -> None:
    results = _run(tmp_path, "ddp")
    for res in results:
        # Accelerator() without cpu=True on torchrun's CPU ranks: each would train alone.
        alone = res["alone"]
        assert alone and "process group of 2 ranks" in alone and "cpu=True" in alone, alone
    _assert_skips([r["skip"] for r in results], "DistributedDataParallel")
    _assert_rollback_and_drop(results)
    # The GPU script's checks of this cell pass on what this run wrote (its faults are these).
    gpu = test_gpu_script.load()
    assert gpu.check(gpu.cells(2)["accelerate-ddp"], tmp_path, 2) == []


@pytest.mark.timeout(300)
def test_accelerate_loop_on_deepspeed_zero2_skips_and_refuses_rollback_and_drop(
    tmp_path: Path,
) -> None:
    """accelerator.backward calls engine.step() at the boundary: that call is the sentinel's,
    which forces DeepSpeed's own overflow skip, and Accelerate's scheduler reads it."""
    pytest.importorskip("deepspeed")
    results = _run(tmp_path, "deepspeed_2")
    _assert_skips([r["skip"] for r in results], "DeepSpeedEngine")
    for res in results:
        assert res["skip"]["ds_steps"] == [STEPS, 3]  # DeepSpeed's global_steps, skipped_steps
        assert "rollbacks are not supported" in res["rollback"]["refused"]
        assert "policy='skip'" in res["drop"]["refused"]


@pytest.mark.timeout(300)
def test_accelerate_loop_on_fsdp2_seam_on_cpu(tmp_path: Path) -> None:
    results = _run(tmp_path, "fsdp2")
    _assert_skips([r["skip"] for r in results], "FSDPNet")
    _assert_rollback_and_drop(results)


@pytest.mark.timeout(300)
def test_accelerate_loop_on_fsdp1_default_plugin_seam_on_cpu(tmp_path: Path) -> None:
    """Accelerate's default FSDP plugin (FSDP1, ``use_orig_params=True``, the blocks wrapped
    by class): each rank's flat gradient checked in FSDP1's communication hook; Accelerate's
    ``clip_grad_norm_`` (FSDP1's own) and ``no_sync`` accumulation unchanged. On CPU past
    Accelerate's refusal (cpu_guards.py) with ``ACCELERATE_TORCH_DEVICE=cpu``."""
    results = _run(tmp_path, "fsdp1")
    _assert_skips([r["skip"] for r in results], "FullyShardedDataParallel")
    _assert_rollback_and_drop(results)
