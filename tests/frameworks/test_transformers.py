"""The real Hugging Face Trainer (on Accelerate) with SentinelCallback: 2 CPU DDP ranks under
torchrun, faults made by the model (a forward log(0) on rank 0, a backward-only NaN on rank 1),
gradient accumulation; an abort under ``nansentinel run``; one process in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frameworks import runner

pytest.importorskip("transformers")

WORKER = "hf_worker.py"


@pytest.mark.timeout(300)
def test_hf_trainer_ddp_skips_model_made_faults_on_both_ranks(tmp_path: Path) -> None:
    """Then, in the same ranks, one train() each under policy='rollback' and policy='drop'
    (a dropped step's gradients are rescaled at the decision, after the Trainer's
    max_grad_norm clip: docs/frameworks.md)."""
    proc = runner.run(
        runner.torchrun(WORKER, str(tmp_path), "--steps=6", "--accumulate=2",
                        "--faults=2:0:log0,4:1:grad", "--phases=skip,rollback,drop"),
        tmp_path, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = runner.ranks(tmp_path, 2, proc)
    # Weights and AdamW state (exp_avg, exp_avg_sq, step) untouched on a skipped step.
    runner.assert_two_rank_faults_skipped(results, steps=6)
    for res in results:
        # As when Accelerate's GradScaler skips: global_step advances, the scheduler does not.
        assert res["global_step"] == 6 and res["sentinel_steps"] == 6
        assert res["scheduler_steps"] == 4
    _assert_rolled_back_and_dropped(tmp_path, drill=False)


@pytest.mark.timeout(300)
def test_hf_trainer_abort_under_nansentinel_run_exits_3_with_report(tmp_path: Path) -> None:
    proc = runner.run(
        runner.nansentinel_run(WORKER, str(tmp_path), "--steps=4", "--faults=1:0:log0"),
        tmp_path, timeout=240, env={"NANSENTINEL_POLICY": "abort"},
    )
    runner.assert_aborted_with_one_report(proc, tmp_path, 0, "loss")


@pytest.mark.timeout(240)
def test_hf_trainer_single_process_bf16_skips(tmp_path: Path) -> None:
    proc = runner.run(
        runner.python(WORKER, str(tmp_path), "--steps=4", "--accumulate=2", "--bf16",
                      "--faults=1:0:grad"),
        tmp_path, timeout=200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    (res,) = runner.ranks(tmp_path, 1, proc)
    assert res["sentinel_model"] == "Net"
    assert sorted(res["skipped"]) == ["1"] and res["skipped"]["1"]["kinds"] == ["grad"]
    assert res["unchanged"] == {str(s): s == 1 for s in range(4)}
    assert res["scheduler_steps"] == 3
    runner.assert_same_finite_weights([res])


def test_the_skip_mark_is_what_accelerate_reads() -> None:
    """Pins Accelerate's private skip flag (``_is_overflow``) behind its public read: marked by
    the callback's ``mark_skipped``, the accelerator reports the step skipped and its scheduler
    wrapper does not step. Fails naming the installed version when a release changes it."""
    import accelerate
    import torch
    from accelerate import Accelerator

    from nansentinel.transformers import mark_skipped

    where = f"accelerate {accelerate.__version__} (tested with 1.15)"
    accelerator = Accelerator(cpu=True)
    try:
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        model, opt, sched = accelerator.prepare(model, opt, sched)
        opt.step()  # no gradients: changes nothing, leaves the mark alone
        assert mark_skipped(opt, True), f"{where}: step_was_skipped ignores _is_overflow"
        assert accelerator.optimizer_step_was_skipped, f"{where}: the accelerator misses it"
        sched.step()
        assert sched.get_last_lr() == [1.0], f"{where}: the scheduler stepped on a skip"
        assert mark_skipped(opt, False) and not accelerator.optimizer_step_was_skipped, where
        sched.step()
        assert sched.get_last_lr() == [0.5], where
        assert not mark_skipped(torch.optim.SGD(model.parameters(), lr=1.0), True)
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)  # process-wide singletons


def test_several_ranks_without_a_ddp_wrapper_are_refused_at_the_first_training_forward() -> None:
    """On 2 ranks (torch's fake backend) the callback waits for the DDP wrapper's first
    forward; a training forward of the bare model (FSDP, DeepSpeed) is refused by name, an
    evaluation forward before training is not, and the global hook is gone afterwards."""
    import pytest
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nansentinel.result import SentinelUsageError
    from nansentinel.transformers import SentinelCallback

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        model = torch.nn.Linear(2, 2)
        callback = SentinelCallback()
        callback.on_train_begin(None, None, None, model=model,
                                optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        with torch.no_grad():
            model.eval()(torch.zeros(1, 2))  # evaluation: nothing is decided yet
        with pytest.raises(SentinelUsageError, match=r"2 ranks .*DistributedDataParallel.*rank 1"):
            model.train()(torch.zeros(1, 2))
        assert callback._finder is None and callback.sentinel is None
        callback.close()
    finally:
        dist.destroy_process_group()


def _assert_three_faults_skipped(results: list[dict], steps: int = 6) -> None:
    """A batch drill on rank 1 at step 1, a forward log(0) on rank 0 at step 2 and a
    backward-only NaN on rank 1 at step 4: each skipped on both ranks with its rank named, the
    weights untouched exactly on those steps, finite and identical at the end."""
    for res in results:
        assert res["world"] == 2 and res["global_step"] == steps
        assert sorted(res["skipped"]) == ["1", "2", "4"], res["skipped"]
        assert {s: r["bad_ranks"] for s, r in res["skipped"].items()} == {
            "1": [1], "2": [0], "4": [1]}
        assert all(r["outcome"] == "skipped" for r in res["skipped"].values())
        assert "batch" in res["skipped"]["1"]["kinds"] and "loss" in res["skipped"]["2"]["kinds"]
        assert res["skipped"]["4"]["kinds"] == ["grad"]
        assert res["unchanged"] == {str(s): s in (1, 2, 4) for s in range(steps)}
        # As after an overflow: global_step advances, the LR scheduler does not.
        assert res["scheduler_steps"] == steps - 3
    runner.assert_report_names(results[0]["skipped"]["1"]["report_path"], 1, "batch")
    runner.assert_report_names(results[0]["skipped"]["4"]["report_path"], 1, "grad")
    runner.assert_same_finite_weights(results)


@pytest.mark.timeout(420)
def test_hf_trainer_on_deepspeed_zero_1_2_3_skips_each_ranks_fault(tmp_path: Path) -> None:
    """The same SentinelCallback on TrainingArguments(deepspeed=...) at ZeRO-1, 2 and 3 (one
    train() each, in the same 2 gloo ranks): the engine is found at its first forward, each
    stage's gradients are checked before DeepSpeed reduces them, and a skip is DeepSpeed's own
    overflow skip, forced on both ranks: its counters advance, the scheduler stays. Rollback
    and drop are refused with what to use instead."""
    proc = runner.run(
        runner.torchrun(WORKER, str(tmp_path), "--deepspeed=1,2,3", "--steps=6",
                        "--accumulate=2", "--faults=2:0:log0,4:1:grad",
                        "--phases=skip,rollback,drop"),
        tmp_path, timeout=400, env={"DS_ACCELERATOR": "cpu",
                                    "NANSENTINEL_INJECT": "kind=batch,rank=1,step=1"},
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    for stage in (1, 2, 3):
        results = [json.loads((tmp_path / f"rank{r}-zero{stage}.json").read_text())
                   for r in range(2)]
        _assert_three_faults_skipped(results)
        for res in results:
            assert res["sentinel_model"] == "DeepSpeedEngine", res["sentinel_model"]
            assert res["replays"] is False  # a replay's backward would reduce through DeepSpeed
            assert res["ds_steps"] == [6, 3]  # DeepSpeed's global_steps, skipped_steps
    for r in range(2):
        refused = json.loads((tmp_path / f"refusals-rank{r}.json").read_text())
        assert "SentinelUsageError" in refused["rollback"] and "rollback" in refused["rollback"]
        assert "policy='skip'" in refused["rollback"]
        assert "ConfigError" in refused["drop"] and "policy='skip'" in refused["drop"]


def _assert_rolled_back_and_dropped(tmp_path: Path, *, drill: bool = True) -> None:
    """The rollback and drop phases: a fault on rank 1 at step 3 (a backward NaN to roll
    back, a forward log(0) to drop), and, with ``drill``, the batch drill on rank 1 at step 1."""
    rollback = [json.loads((tmp_path / f"rank{r}-rollback.json").read_text()) for r in range(2)]
    for res in rollback:
        assert {s: (r["outcome"], r["rolled_back_to"], r["bad_ranks"])
                for s, r in res["skipped"].items()} == {
            **({"1": ("rolled_back", 0, [1])} if drill else {}), "3": ("rolled_back", 2, [1])}
    runner.assert_same_finite_weights(rollback)
    drop = [json.loads((tmp_path / f"rank{r}-drop.json").read_text()) for r in range(2)]
    for res in drop:  # applied without rank 1's gradients
        assert res["outcomes"] == {s: {"outcome": "dropped", "bad_ranks": [1]}
                                   for s in (("1", "3") if drill else ("3",))}
        assert not any(res["unchanged"].values()) and not res["skipped"]
    runner.assert_same_finite_weights(drop)


@pytest.mark.timeout(300)
def test_hf_trainer_on_fsdp2_seam_on_cpu(tmp_path: Path) -> None:
    """The Trainer with fsdp_config version 2 on 2 gloo ranks, with Accelerate's one CPU
    refusal lifted (tests/frameworks/cpu_guards.py; the GPU script runs it without): the
    callback builds on the FSDP2 root the Trainer hands it and checks every fully_shard-ed
    module's reduce-scatter; skip, rollback and drop, one train() each."""
    proc = runner.run(
        runner.torchrun(WORKER, str(tmp_path), "--fsdp2", "--steps=6", "--accumulate=2",
                        "--faults=2:0:log0,4:1:grad", "--phases=skip,rollback,drop"),
        tmp_path, timeout=280, env={"NANSENTINEL_INJECT": "kind=batch,rank=1,step=1"},
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = runner.ranks(tmp_path, 2, proc)
    _assert_three_faults_skipped(results)
    assert all(r["gradient_path"] == "FSDP2" and r["sentinel_model"].startswith("FSDP")
               for r in results)
    _assert_rolled_back_and_dropped(tmp_path)


@pytest.mark.timeout(300)
def test_hf_trainer_on_fsdp1_seam_on_cpu(tmp_path: Path) -> None:
    """The Trainer with fsdp_config version 1 on 2 gloo ranks, Accelerate's one CPU refusal
    lifted (cpu_guards.py) and its CPU device named ``cpu`` (ACCELERATE_TORCH_DEVICE): the
    callback builds on the FSDP1 root the Trainer hands it and checks each rank's flat
    gradient in FSDP1's communication hook; skip, rollback and drop, one train() each."""
    proc = runner.run(
        runner.torchrun(WORKER, str(tmp_path), "--fsdp1", "--steps=6", "--accumulate=2",
                        "--faults=2:0:log0,4:1:grad", "--phases=skip,rollback,drop"),
        tmp_path, timeout=280, env={"NANSENTINEL_INJECT": "kind=batch,rank=1,step=1"},
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = runner.ranks(tmp_path, 2, proc)
    _assert_three_faults_skipped(results)
    assert all(r["gradient_path"] == "FSDP1" and r["sentinel_model"] ==
               "FullyShardedDataParallel" for r in results)
    _assert_rolled_back_and_dropped(tmp_path)


def test_a_trainer_that_runs_each_rank_alone_is_refused_naming_use_cpu() -> None:
    """2 ranks (torch's fake backend), but TrainingArguments says 1 (CPU ranks without
    use_cpu=True): refused at train begin, before anything is installed."""
    import types

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nansentinel.result import SentinelUsageError
    from nansentinel.transformers import SentinelCallback

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        model = torch.nn.Linear(2, 2)
        callback = SentinelCallback()
        with pytest.raises(SentinelUsageError, match=r"2 ranks.*1 of 1.*use_cpu=True"):
            callback.on_train_begin(types.SimpleNamespace(world_size=1), None, None,
                                    model=model,
                                    optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        assert callback.sentinel is None and callback._finder is None
    finally:
        dist.destroy_process_group()
