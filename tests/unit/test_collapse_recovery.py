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
from nansentinel import skip_list

LR = 0.02


def _train(tmp_path: Path, level: dict[int, float], steps: int, rows: int = 64,
           ids: bool = False, **kwargs: Any) -> tuple[list[Any], dict[int, Any]]:
    """A linear regression whose loss the loop scales by ``level[step]`` (1 if absent): 0.01
    is a collapse (degenerate data), 6 a spike. ``rows`` per batch (the loss's noise: 18% at
    64, 2% at 4096); ``ids``: each row's sample id (step * rows + row) goes to check_batch.
    Returns the results and, per step, the spike references after it."""
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
            x = torch.randn(rows, 8)
            batch = sentinel.check_batch(
                {"x": x, "y": x @ w_true + 0.3 * torch.randn(rows, 1)},
                ids=list(range(step * rows, (step + 1) * rows)) if ids else None)
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
    """Issue 60 under ``collapse_action="warn"``: the collapse only marks; the spike rule
    rolls back when real data returns (issue 70's stretch rule would act a step earlier)."""
    collapse = range(40, 46)
    level = {s: 0.01 for s in collapse} | {46: 6.0, 47: 6.0}
    results, refs = _train(tmp_path, level, 60, collapse_action="warn")
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
    # A spike at 40-41, then the loss stays out of its band without spiking (1.3x): no
    # snapshot brings it back. From 60 on it spikes again, with no snapshot left to try.
    level = {40: 6.0, 41: 6.0} | dict.fromkeys(range(42, 60), 1.35) | dict.fromkeys(
        range(60, 120), 6.0)
    results, _ = _train(tmp_path, level, 120, rows=4096)
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


# --- issue 70: a stretch judged at its end against its start -------------------------------


def test_a_slow_collapse_is_dated_from_its_band_and_its_return_rolled_back_over(
        tmp_path: Path) -> None:
    """The loss sinks (a loader serving one batch again), leaves its band at step 41 and
    collapses at 43; real data comes back at 47, twice the level before the stretch. The
    stretch is dated from 41: the rollback restores a snapshot from before it, at once (not
    after a spike's patience), discards nothing after it, and lists the ids of the batches of
    steps 41-46 in the skip list."""
    level = {40: 0.9, 41: 0.75, 42: 0.72, 43: 0.6, 44: 0.3, 45: 0.1, 46: 0.1, 47: 2.0}
    results, refs = _train(tmp_path, level, 60, rows=4096, ids=True)
    by = {r.step: r for r in results}
    assert not by[41].collapsed and by[43].collapsed, "collapsed at 43, not before"
    rolled = [r for r in results if r.outcome == "rolled_back"]
    assert [r.step for r in rolled] == [47], [(r.step, r.outcome, r.reason) for r in results]
    (back,) = rolled
    assert back.rolled_back_to is not None and back.rolled_back_to < 41
    assert "degenerate stretch of steps 41-46" in back.reason, back.reason
    assert refs[47]["cluster"] == refs[back.rolled_back_to]["cluster"]  # re-anchored
    assert back.recovery["lost_steps"] == 47 - back.rolled_back_to + 1
    assert back.lr_factor == 1.0  # the data's doing, not the rate's: no backoff
    assert all(by[s].applied for s in range(48, 60)), "nothing discarded after it"
    listed = skip_list.load(tmp_path / "skip-list-local.jsonl")
    assert listed == set(range(41 * 4096, 47 * 4096))
    report = next(json.loads(p.read_text()) for p in tmp_path.glob("*0047.json"))
    assert report["outcome"] == "rolled_back" and report["skip_list"].endswith(".jsonl")


def test_a_stretch_longer_than_max_lost_steps_ends_the_recovery_and_is_not_undone(
        tmp_path: Path) -> None:
    """A collapse that lasts past what a rollback may undo (max_lost_steps=8) is the run's new
    level: the recovery ends there, said in the result, and its return is not rolled back
    over to before it (the references restart from there: the return is a spike against
    them, rolled back to a snapshot after the end)."""
    level = dict.fromkeys(range(40, 56), 0.05) | {56: 2.0, 57: 2.0}
    results, _ = _train(tmp_path, level, 60, rows=4096, max_lost_steps=8)
    over = [r for r in results if "has lasted longer than a rollback" in r.reason]
    # The bound counts from the oldest snapshot before the stretch (38 or 39): past it by 49.
    assert over and over[0].applied and 42 <= over[0].step <= 49, [
        (r.step, r.outcome, r.reason) for r in results[38:]]
    assert "max_lost_steps=8" in over[0].reason and over[0].recovery["lost_steps"] == 0
    assert all(r.applied for r in results if r.step < 56), "nothing undone before the return"
    assert not any("degenerate stretch of steps" in r.reason for r in results)
    assert all(r.rolled_back_to > over[0].step for r in results if r.rolled_back_to is not None)
