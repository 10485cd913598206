"""Issue 52: no update at a learning rate that was never known to work.

The rules alone (decide/lr_guard.py, pure), then on a real loop in one process: a jump held
on the host gate and on the device gate, a cause that outlasts the discard window capped at
the known-good rate after the rollback and the backoff ended by a quiet window, the reference
kept in the checkpoint and reset, and optimizers whose lr is not a step size left alone."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import nansentinel
from nansentinel.config import ConfigError, SentinelConfig
from nansentinel.decide.lr_guard import LrGuard, LrRules
from nansentinel.effects.learning_rate import left_alone
from nansentinel.reading import incidents

ALL = LrRules(cap=True, jump_ratio=4.0, quiet_steps=3, clean_snapshots=True)


def step(guard: LrGuard, asked: list[float | None], factor: float = 1.0, *,
         quiet: bool = True, grad_ratio: float = 1.0) -> tuple[float | None, ...]:
    plan = guard.plan(asked, factor)
    guard.applied(plan, quiet=quiet, update_ratio=guard.update_ratio(plan.lrs, grad_ratio))
    return plan.lrs


def test_a_jump_is_held_at_the_last_applied_rate_and_a_ramp_is_not() -> None:
    guard = LrGuard(ALL)
    for lr in (0.0, 0.1, 0.2, 0.3, 0.4):  # a linear warm-up from 0: never a jump
        assert step(guard, [lr]) == (lr,)
    plan = guard.plan([4.0], 1.0)  # 10x the highest applied
    assert plan.held == (0,) and plan.lrs == (0.4,) and not plan.under
    guard.applied(plan, quiet=True, update_ratio=1.0)
    assert guard.highest == [0.4] and guard.last == [0.4]  # a held rate moves nothing
    assert step(guard, [1.5]) == (1.5,)  # under 4x 0.4: taken, and the new reference
    assert guard.highest == [1.5]
    assert step(guard, [None, 0.1]) == (None, 0.1)  # a group left alone; a new group
    guard.reset()
    assert step(guard, [100.0]) == (100.0,)  # a deliberate change, once reset


def test_after_a_rollback_the_known_good_rate_caps_the_schedule_until_a_quiet_window() -> None:
    guard = LrGuard(ALL)
    for _ in range(3):
        step(guard, [0.1, 0.01])
    guard.snapshot_taken()  # the state made at 0.1 / 0.01
    step(guard, [0.35, 0.035])  # a climb under the jump ratio: applied, then a rollback
    guard.rolled_back()
    assert guard.known_good == [0.1, 0.01] and guard.highest == [0.1, 0.01]
    plan = guard.plan([3.0, 0.005], 0.5)  # the schedule still blown up for group 0
    assert plan.held == (0,)  # 30x the snapshot's reference: held at its last rate
    plan = guard.plan([0.3, 0.005], 0.5)  # 3x: capped at the known-good rate x the factor
    assert plan.lrs == (0.05, 0.0025) and plan.capped == (0,) and plan.above
    assert not plan.applied_above
    guard.applied(plan, quiet=True, update_ratio=1.0)
    # Made at a known-good rate: a state worth keeping, but the schedule is not back yet.
    assert guard.clean_run == 1 and guard.quiet_run == 0 and guard.may_snapshot(None)
    step(guard, [0.09, 0.009], 0.5, quiet=False)  # a loss half-way to a spike: not clean
    assert guard.clean_run == 0 and not guard.may_snapshot(None)
    for _ in range(2):
        step(guard, [0.09, 0.009], 0.5)
    assert guard.quiet_run == 2 and not guard.quiet_enough()
    step(guard, [0.09, 0.009], 0.5, grad_ratio=5.0)  # a large update breaks the window
    assert guard.clean_run == guard.quiet_run == 0
    for _ in range(3):
        step(guard, [0.09, 0.009], 0.5, quiet=True)
    assert guard.quiet_enough()
    nocap = LrGuard(LrRules(quiet_steps=3, clean_snapshots=True))  # the cap off
    step(nocap, [0.1])
    nocap.snapshot_taken()
    nocap.rolled_back()
    plan = nocap.plan([1.0], 0.5)  # 0.5 applied over a known-good 0.1: a damaging rate
    assert plan.lrs == (0.5,) and plan.applied_above and not nocap.may_snapshot(plan)


def test_a_rate_that_rose_into_the_spike_sets_the_margin_from_the_rate_that_failed() -> None:
    """slow_climb: the snapshot's rate sits just under the one that spiked, so the cap at half
    of it kept the run at the edge; the known-good rate is at most the factor x the highest
    rate applied since the snapshot. A jump (x100) and a data spike (no rise) keep the
    snapshot's rate."""
    guard = LrGuard(ALL)
    for lr in (0.10, 0.11, 0.12):
        step(guard, [lr, 0.01, 0.5])
    guard.snapshot_taken()  # the state made at 0.12 / 0.01 / 0.5
    step(guard, [0.13, 0.01, 0.4])  # group 0 climbs on, 1 stays, 2 decays
    step(guard, [0.14, 1.0, 0.4])  # group 1 jumps x100 (the jump rule holds it at 0.01)
    guard.rolled_back(0.5)
    assert guard.known_good == [0.07, 0.01, 0.5]  # 0.5 x 0.14, under the snapshot's 0.12
    assert guard.plan([0.2, 0.01, 0.5], 0.5).lrs == (0.035, 0.005, 0.25)
    step(guard, [0.2, 0.01, 0.5], 0.5)
    guard.rolled_back(0.5)  # nothing applied since the snapshot rose above it: as it was
    assert guard.known_good == [0.12, 0.01, 0.5]
    resumed = LrGuard(ALL)
    guard.end_backoff()
    step(guard, [0.15, 0.01, 0.5])
    resumed.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    resumed.rolled_back(0.5)  # the rates since the snapshot are kept in the checkpoint
    assert resumed.known_good == [0.075, 0.01, 0.5]
    older = {k: v for k, v in guard.state_dict().items() if k != "since"}  # before the rule
    resumed.load_state_dict(older)
    resumed.rolled_back(0.5)  # no record of a rise: the snapshot's rates, as before
    assert resumed.known_good == [0.12, 0.01, 0.5]


def test_rules_off_change_nothing_and_the_state_round_trips() -> None:
    off = LrGuard(LrRules())
    assert not LrRules().any
    step(off, [0.1])
    assert step(off, [100.0], 0.5) == (50.0,)  # today's backoff: the factor alone
    guard = LrGuard(ALL)
    step(guard, [0.1])
    guard.snapshot_taken()
    guard.rolled_back()
    again = LrGuard(ALL)
    again.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert again.state_dict() == guard.state_dict()
    again.load_state_dict(guard.state_dict(), reference=False)  # lr_jump_reset
    assert again.highest == [None] and again.known_good == [0.1]


def test_config_fields_are_validated_and_set_by_recover() -> None:
    cfg = SentinelConfig.from_env({}, spikes="recover")
    assert (cfg.rollback_lr_cap, cfg.lr_jump_ratio, cfg.rollback_lr_quiet_steps,
            cfg.rollback_clean_snapshots) == (True, 4.0, 20, True)
    off = SentinelConfig.from_env({"NANSENTINEL_LR_JUMP_RATIO": "0"}, spikes="recover")
    assert off.lr_jump_ratio == 0
    assert SentinelConfig().lr_jump_ratio == 0 and not SentinelConfig().rollback_lr_cap
    with pytest.raises(ConfigError, match=r"lr_jump_ratio=0\.5"):
        SentinelConfig(lr_jump_ratio=0.5)
    with pytest.raises(ConfigError, match="NANSENTINEL_ROLLBACK_LR_QUIET_STEPS"):
        SentinelConfig.from_env({"NANSENTINEL_ROLLBACK_LR_QUIET_STEPS": "-1"})


def test_optimizers_whose_lr_is_not_a_step_size_are_left_alone() -> None:
    p = [torch.nn.Parameter(torch.zeros(2))]

    class ProdigyLike(torch.optim.SGD):
        pass

    assert "Prodigy" in (left_alone(ProdigyLike(p, lr=1.0), {"lr": 1.0}) or "")
    assert "relative_step" in (left_alone(object(), {"lr": None, "relative_step": True}) or "")
    assert left_alone(torch.optim.SGD(p, lr=0.1), {"lr": 0.1}) is None
    assert left_alone(object(), {"lr": torch.tensor(0.1)}) is None  # a CPU tensor: free to read


# --- on a real loop ----------------------------------------------------------------------------

LR = 0.05


def run(tmp_path: Path, lr_at, steps: int, *, opt_kind: str = "sgd",  # type: ignore[no-untyped-def]
        state: dict | None = None, **kw: object):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    if opt_kind == "fused":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, *_: used.append(float(o.param_groups[0]["lr"])))
    kw.setdefault("spikes", "recover")
    sentinel = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={},
                                    metrics_port=0, **kw)
    if state is not None:
        sentinel.load_state_dict(state)
    w_true = torch.randn(8, 1)
    results, asked = [], []
    with sentinel:
        for i in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(i)
            x = torch.randn(32, 8)
            batch = sentinel.check_batch({"x": x, "y": x @ w_true})
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            sentinel.check_loss(loss)
            loss.backward()
            results.append(sentinel.step())
            asked.append(opt.param_groups[0]["lr"])  # the user's value, put back
            opt.zero_grad(set_to_none=True)
        results = [r.resolve() if hasattr(r, "resolve") else r for r in results]
    return sentinel, results, used, asked


@pytest.mark.parametrize("gate", ["host", "device"])
def test_a_jump_never_reaches_the_weights_on_either_gate(tmp_path: Path, gate: str,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    def lr_at(i: int) -> float:
        return LR * 1000 if 30 <= i < 35 else LR

    caplog.set_level(logging.WARNING, "nansentinel")
    sentinel, results, used, asked = run(
        tmp_path, lr_at, 40, gate=gate, opt_kind="fused" if gate == "device" else "sgd")
    assert [r.outcome for r in results] == ["applied"] * 40  # no spike, no rollback
    assert [r.step for r in results if r.lr_held] == list(range(30, 35))
    assert set(used) == {LR} and asked == [lr_at(i) for i in range(40)]
    jumps = [r.message for r in caplog.records if "learning-rate jump" in r.message]
    assert len(jumps) == 1 and "step 30" in jumps[0] and "lr_guard.reset()" in jumps[0]
    path = next(tmp_path.glob("*-lr.json"))
    report = json.loads(path.read_text())
    assert report["outcome"] == "lr_held" and report["groups"][0]["held_at"] == LR
    assert incidents.load(path).outcome == "lr_held"  # `nansentinel incidents` lists it
    assert sentinel.state_dict()["lr_guard"]["highest"] == [LR]


def test_a_cause_outlasting_the_discard_window_is_capped_and_the_backoff_ends(
        tmp_path: Path) -> None:
    """The schedule x1000 for 40 steps, the jump rule off: the blown-up update applies, the
    spike rolls back, and every step after the discard window runs at most at the snapshot's
    rate x0.5 while the schedule still asks 1000x; once it is back, 20 clean steps end the
    backoff (not 500)."""
    def lr_at(i: int) -> float:
        return LR * 1000 if 30 <= i < 70 else LR

    _, results, used, _ = run(tmp_path, lr_at, 110, lr_jump_ratio=0, snapshot_every=1)
    rolled = [r for r in results if r.outcome == "rolled_back"]
    assert rolled and rolled[0].rolled_back_to == 30
    applied = [r.step for r in results if r.applied]
    after = [s for s in applied if s > rolled[-1].step]
    by_step = dict(zip(applied, used, strict=True))
    assert all(by_step[s] <= LR * 0.5 for s in after if s < 70), by_step
    assert max(by_step[s] for s in after if s < 70) == LR * 0.5  # capped, not 1000x0.5
    assert results[-1].lr_factor == 1.0 and by_step[109] == LR  # the backoff is over
    assert all(abs(r.local_loss or 0) < 10 for r in results[after[0]:])


def test_the_reference_is_saved_and_a_resume_may_drop_it(tmp_path: Path) -> None:
    sentinel, _, _, _ = run(tmp_path, lambda i: LR, 5)
    state = sentinel.state_dict()
    for reset, held in ((False, True), (True, False)):
        _, results, _, _ = run(tmp_path / str(reset), lambda i: LR * 10, 1,
                                   lr_jump_reset=reset, state=state)
        assert results[0].lr_held is held


def test_the_users_rates_come_back_unless_the_step_wrote_its_own(tmp_path: Path) -> None:
    """The rates written around the step go back to the user's values; a scheduler that the
    step runs itself (a DeepSpeed engine's) keeps the value it wrote; a CPU tensor lr is
    replaced by a fresh tensor, never written in place."""
    from nansentinel.decide.spikes import SpikeDetector
    from nansentinel.effects.learning_rate import LearningRates

    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.SGD([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1)
    spikes = SpikeDetector(window=10, warmup=5, ratio=10.0, zscore=6.0)
    lrs = LearningRates(opt, SentinelConfig.from_env({}, spikes="recover"), spikes)
    user = torch.tensor(0.1)
    opt.param_groups[1]["lr"] = user
    lrs.restore(lrs.apply(0))  # step 0 applied at 0.1 in both groups: the reference
    lrs.count(None)
    opt.param_groups[0]["lr"], opt.param_groups[1]["lr"] = 10.0, torch.tensor(10.0)
    user = opt.param_groups[1]["lr"]
    saved = lrs.apply(1)  # both jumped 100x: held
    assert opt.param_groups[0]["lr"] == 0.1
    assert float(opt.param_groups[1]["lr"]) == pytest.approx(0.1)
    assert float(user) == 10.0  # the user's tensor untouched
    opt.param_groups[0]["lr"] = 0.05  # the step's own scheduler writes the next rate
    lrs.restore(saved)
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[1]["lr"] is user


def test_a_jump_is_held_around_the_callers_own_optimizer_step(tmp_path: Path) -> None:
    """``step(optimizer_step=False)``: the rates are written at the decision, the caller's
    ``optimizer.step()`` runs at them, and its post-hook puts the user's back."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, *_: used.append(o.param_groups[0]["lr"]))
    with nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, metrics_port=0,
                              lr_jump_ratio=4.0) as sentinel:
        held = []
        for i in range(4):
            opt.param_groups[0]["lr"] = LR * 50 if i == 2 else LR
            x = torch.randn(8, 4)
            loss = (model(sentinel.check_batch({"x": x})["x"]) ** 2).mean()
            sentinel.check_loss(loss)
            loss.backward()
            held.append(sentinel.step(optimizer_step=False).lr_held)
            opt.step()
            assert opt.param_groups[0]["lr"] == (LR * 50 if i == 2 else LR)
            opt.zero_grad(set_to_none=True)
    assert used == [LR] * 4 and held == [False, False, True, False]


@pytest.mark.parametrize("spikes", ["warn", "recover"])
@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_a_group_without_a_rate_of_its_own_is_left_alone(spikes: str, factor: float) -> None:
    """An optimizer container's ``param_groups`` (torchtitan's OptimizersContainer) may hold
    groups with no ``lr``: the rules and the backoff leave them as they are, never a
    ``KeyError`` from inside the step."""
    from nansentinel.decide.spikes import SpikeDetector
    from nansentinel.effects.learning_rate import LearningRates

    class Container:
        def __init__(self) -> None:
            self.param_groups = [{"params": []}, {"params": [], "lr": 0.1}]

    opt = Container()
    detector = SpikeDetector(window=10, warmup=5, ratio=10.0, zscore=6.0)
    lrs = LearningRates(opt, SentinelConfig.from_env({}, spikes=spikes), detector)
    lrs.cooldown.start(factor, steps=5)
    saved = lrs.apply(0)
    assert "lr" not in opt.param_groups[0]
    assert opt.param_groups[1]["lr"] == pytest.approx(0.1 * factor)
    lrs.restore(saved)
    assert opt.param_groups == [{"params": []}, {"params": [], "lr": 0.1}]
