"""Issue 38's rules on a real loop in one process: a learning rate that blows up from one step
on is rolled back to the state before that step's update, and the rollback's learning-rate
factor holds though the loop sets every group's learning rate itself each iteration."""

from __future__ import annotations

from pathlib import Path

import torch

import nansentinel

BAD = range(30, 35)  # the schedule error: lr x1000 for five iterations
LR = 0.05


def lr_at(step: int) -> float:
    return LR * 1000 if step in BAD else LR


def test_recover_rolls_back_to_before_the_ruining_update_and_its_lr_factor_holds(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[0]["lr"]))
    sentinel = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={},
                                    metrics_port=0, spikes="recover", snapshot_every=1,
                                    lr_jump_ratio=0)  # the jump rule would hold it (issue 52)
    w_true = torch.randn(8, 1)
    before: dict[int, list[torch.Tensor]] = {}
    results = []
    with sentinel:
        for step in range(60):
            for g in opt.param_groups:  # the loop's own schedule, set every iteration
                g["lr"] = lr_at(step)
            x = torch.randn(32, 8)
            batch = sentinel.check_batch({"x": x, "y": x @ w_true})
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            sentinel.check_loss(loss)
            loss.backward()
            before[step] = [p.detach().clone() for p in model.parameters()]
            results.append(sentinel.step())
            opt.zero_grad(set_to_none=True)
    outcomes = [r.outcome for r in results]
    rolled = [r for r in results if r.outcome == "rolled_back"]
    assert rolled, outcomes
    first = rolled[0]
    # Step 30 was quiet (its loss came from good weights) and its own update ruined them:
    # step 31 spiked (skipped: spike_patience=2), step 32 rolled back to the state step 30
    # was computed from, not to the one after its update.
    assert first.step == 32 and first.rolled_back_to == 30, outcomes[28:40]
    assert results[31].outcome == "skipped" and results[31].spikes["loss"] == [0, -1]
    assert "1 of 2 in a row before a rollback" in results[31].reason
    restored = [p.detach() for p in model.parameters()]  # nothing applied since (skipped)
    assert all(r.outcome == "skipped" for r in results[33:43]), outcomes[33:43]
    after_rollback = used[-(60 - 43):]  # the optimizer steps from step 43 on
    # The loop set lr=0.05 each iteration; the step used 0.05 x 0.5: the factor holds.
    assert after_rollback[0] == LR * 0.5 and results[43].lr_factor == 0.5
    assert all(abs(r.local_loss or 0) < 10 for r in results[43:]), outcomes
    assert results[-1].applied and not any(r.outcome == "aborted" for r in results)
    del restored, before


def test_recover_skips_a_bad_shard_without_rolling_back(tmp_path: Path) -> None:
    """Eight batches in a row whose first column was not normalised (x1000): each spikes the
    loss, as ruined weights would, but each batch's norm is far above its own reference, so
    every one is skipped as the data's and no good step is rolled back over."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={},
                                    metrics_port=0, spikes="recover")
    w_true = torch.randn(8, 1)
    shard = range(40, 48)
    results = []
    with sentinel:
        for step in range(70):
            x = torch.randn(32, 8)
            y = x @ w_true
            if step in shard:
                x[:, 0] *= 1000.0  # the shard preprocessed without its scaler
            batch = sentinel.check_batch({"x": x, "y": y})
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            sentinel.check_loss(loss)
            loss.backward()
            results.append(sentinel.step())
            opt.zero_grad(set_to_none=True)
    outcomes = [r.outcome for r in results]
    assert [r.outcome for r in results[40:48]] == ["skipped"] * 8, outcomes[38:50]
    assert all("the data's, not the weights'" in (r.reason or "") for r in results[40:48])
    assert all(r.local_spikes[-1] == "batch" for r in results[40:48])
    assert "rolled_back" not in outcomes and "aborted" not in outcomes
    assert all(r.applied for r in results[48:]), outcomes[48:]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
