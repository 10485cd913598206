"""Issue 60 on a real loop in one process: a collapse is reported and keeps snapshots off, a
rollback re-anchors the spike references to the snapshot's, a rollback that does not bring the
loss back goes on to the older snapshot, and when none helps the recovery ends (or aborts) and
says so, with the steps it left unapplied in the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import nansentinel

LR = 0.02


def _train(tmp_path: Path, level: dict[int, float], steps: int, **kwargs: Any
           ) -> tuple[list[Any], dict[int, Any]]:
    """A linear regression whose loss the loop scales by ``level[step]`` (1 if absent): 0.01
    is a collapse (degenerate data), 6 a spike. Returns the results and, per step, the spike
    references after it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sentinel = nansentinel.Sentinel(
        model, opt, report_dir=str(tmp_path), env={}, metrics_port=0, spikes="recover",
        spike_window=40, spike_warmup=10, snapshot_every=2, lr_jump_ratio=0, **kwargs)
    judge = sentinel._parts.judge
    w_true = torch.randn(8, 1)
    with torch.no_grad():  # at its noise floor from the start: a level the window knows
        model.weight.copy_(w_true.T)
        model.bias.zero_()
    results, refs = [], {}
    with sentinel:
        for step in range(steps):
            x = torch.randn(64, 8)
            batch = sentinel.check_batch({"x": x, "y": x @ w_true + 0.3 * torch.randn(64, 1)})
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            loss = loss * level.get(step, 1.0)
            sentinel.check_loss(loss)
            loss.backward()
            try:
                results.append(sentinel.step())
            except nansentinel.NonFiniteError as exc:
                results.append(exc.result)
                break
            refs[step] = judge.spikes.state_dict()
            opt.zero_grad(set_to_none=True)
    return results, refs


def test_a_collapse_is_reported_keeps_snapshots_off_and_a_rollback_re_anchors(
        tmp_path: Path) -> None:
    collapse = range(40, 46)
    level = {s: 0.01 for s in collapse} | {46: 6.0, 47: 6.0}
    results, refs = _train(tmp_path, level, 60)
    by = {r.step: r for r in results}
    # Reported like a rise: the kind named in the result, the step applied (warn).
    for s in collapse:
        assert by[s].collapsed.get("loss", 1.0) < 0.1, by[s]
        assert by[s].applied and by[s].outcome == "applied"
    assert not any(by[s].collapsed for s in range(12, 40)), "a false alarm"
    # No snapshot while it lasted: the rollback restores one from before it.
    rolled = [r for r in results if r.outcome == "rolled_back"]
    assert [r.step for r in rolled] == [47], [(r.step, r.outcome, r.reason) for r in results]
    assert rolled[0].rolled_back_to is not None and rolled[0].rolled_back_to < collapse[0]
    assert "restoring step" in rolled[0].reason
    # Re-anchored: right after the rollback the references are the snapshot's.
    anchor = refs[rolled[0].rolled_back_to]
    assert refs[47]["cluster"] == anchor["cluster"]
    assert refs[47]["own"] == anchor["own"]
    # The recovery's account: the steps undone, the one skipped, and the rollback itself.
    assert rolled[0].recovery["lost_steps"] == 47 - rolled[0].rolled_back_to + 1
    assert rolled[0].recovery["max_lost_steps"] == 60
    reports = sorted(tmp_path.glob("*.json"))
    contents = [json.loads(p.read_text()) for p in reports]
    collapse_reports = [c for c in contents if "collapse" in c.get("spikes", {})]
    assert collapse_reports, [c.get("message") for c in contents]
    assert "loss collapse on cluster mean" in collapse_reports[0]["message"]
    back = [c for c in contents if c["outcome"] == "rolled_back"]
    assert back and back[0]["recovery"]["lost_steps"] == rolled[0].recovery["lost_steps"]
    assert "the newest snapshot kept" in back[0]["reason"]


def test_a_rollback_that_does_not_help_goes_older_then_the_recovery_ends(
        tmp_path: Path) -> None:
    # From step 40 on every step spikes: no snapshot brings the loss back.
    level = {s: 6.0 for s in range(40, 120)}
    results, _ = _train(tmp_path, level, 120)
    rolled = [r for r in results if r.outcome == "rolled_back"]
    assert len(rolled) == 2, [(r.step, r.outcome, r.reason) for r in results[38:]]
    first, second = rolled
    assert second.rolled_back_to is not None and first.rolled_back_to is not None
    assert second.rolled_back_to < first.rolled_back_to  # the older snapshot, not the same
    assert f"rollback to step {first.rolled_back_to} did not bring the loss back" in (
        second.reason)
    assert first.rolled_back_to in second.recovery["failed_snapshots"]
    over = [r for r in results if "the recovery ends" in r.reason]
    assert over, [(r.step, r.outcome, r.reason) for r in results[38:]]
    end = over[0]
    assert end.applied and end.recovery["lost_steps"] == 0
    # Nothing skips forever: the steps after the end apply (the references restart).
    unapplied = [r.step for r in results if not r.applied]
    assert unapplied and max(unapplied) <= end.step
    assert all(r.applied for r in results if r.step > end.step)
    # Every step left unapplied is within the bound, and accounted for.
    assert len(unapplied) <= 60


def test_under_policy_abort_a_recovery_that_does_not_help_aborts(tmp_path: Path) -> None:
    level = {s: 6.0 for s in range(40, 120)}
    results, _ = _train(tmp_path, level, 120, policy="abort")
    last = results[-1]
    assert last.outcome == "aborted", [(r.step, r.outcome, r.reason) for r in results[38:]]
    assert "aborting (policy is abort)" in last.reason


@pytest.mark.parametrize("bound", [12])
def test_max_lost_steps_ends_a_recovery_at_its_bound(tmp_path: Path, bound: int) -> None:
    level = {s: 6.0 for s in range(40, 120)}
    results, _ = _train(tmp_path, level, 120, max_lost_steps=bound)
    unapplied = [r.step for r in results if not r.applied]
    assert 0 < len(unapplied) <= bound, unapplied
    over = [r for r in results if "max_lost_steps=" in r.reason]
    assert over and over[0].applied


def test_skip_spike_action_stops_skipping_after_max_consecutive_skips(tmp_path: Path) -> None:
    """A ``skip`` spike action against a level the run has left (every step spiking) skips
    ``max_consecutive_skips`` steps, then the next applies, says why and restarts the
    references: it does not skip to the end of the run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    results = []
    with nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, metrics_port=0,
                              loss_spike_action="skip", spike_warmup=5, spike_window=20,
                              max_consecutive_skips=4) as sentinel:
        for step in range(60):
            x = torch.randn(64, 8)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss = loss * (30.0 if step >= 30 else 1.0)
            sentinel.check_loss(loss)
            loss.backward()
            results.append(sentinel.step())
            opt.zero_grad(set_to_none=True)
    skipped = [r.step for r in results if not r.applied]
    assert skipped == [30, 31, 32, 33], skipped
    assert "max_consecutive_skips=4" in results[34].reason and results[34].applied
