"""The real Hugging Face Trainer (on Accelerate) with SentinelCallback: 2 CPU DDP ranks under
torchrun, faults made by the model (a forward log(0) on rank 0, a backward-only NaN on rank 1),
gradient accumulation; an abort under ``nansentinel run``; one process in bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.frameworks import runner

pytest.importorskip("transformers")

WORKER = "hf_worker.py"


@pytest.mark.timeout(300)
def test_hf_trainer_ddp_skips_model_made_faults_on_both_ranks(tmp_path: Path) -> None:
    proc = runner.run(
        runner.torchrun(WORKER, str(tmp_path), "--steps=6", "--accumulate=2",
                        "--faults=2:0:log0,4:1:grad"),
        tmp_path, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = runner.ranks(tmp_path, 2, proc)
    # Weights and AdamW state (exp_avg, exp_avg_sq, step) untouched on a skipped step.
    runner.assert_two_rank_faults_skipped(results, steps=6)
    for res in results:
        # As when Accelerate's GradScaler skips: global_step advances, the scheduler does not.
        assert res["global_step"] == 6 and res["sentinel_steps"] == 6
        assert res["scheduler_steps"] == 4


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
