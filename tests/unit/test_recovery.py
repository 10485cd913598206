"""Snapshots restore exactly; the LR cooldown composes with a scheduler."""

from __future__ import annotations

import torch

from nansentinel.recovery import Cooldown, MemorySnapshots, UserSnapshots


def test_memory_snapshot_restores_model_and_optimizer() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    snaps = MemorySnapshots(model, opt)
    assert snaps.step is None
    snaps.save(7)
    saved_w = model.weight.detach().clone()
    saved_m = opt.state[model.weight]["exp_avg"].clone()
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    assert not torch.equal(model.weight, saved_w)
    assert snaps.load() == 7 and snaps.step == 7
    assert torch.equal(model.weight, saved_w)
    assert torch.equal(opt.state[model.weight]["exp_avg"], saved_m)
    opt.step()  # still a working optimizer
    assert snaps.load() == 7 and torch.equal(model.weight, saved_w)  # the snapshot is intact


def test_user_snapshots_call_the_pair() -> None:
    calls: list[object] = []
    snaps = UserSnapshots(lambda step: calls.append(("save", step)), lambda: 40)
    snaps.save(40)
    assert snaps.step == 40 and snaps.load() == 40 and calls == [("save", 40)]


def test_cooldown_scales_around_the_step_and_composes_with_a_scheduler() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    cool = Cooldown()
    cool.start(0.5, steps=2)
    seen = []
    for _ in range(3):
        saved = cool.apply(opt)
        seen.append(opt.param_groups[0]["lr"])
        cool.undo(opt, saved)
        sched.step()
    assert seen == [0.5, 0.25, 1.0 / 3]  # halved twice, then the schedule alone
    cool.start(0.5, steps=5)
    cool.start(0.5, steps=5)  # a second rollback during the cooldown compounds
    assert cool.factor == 0.25


def test_cooldown_saves_its_own_state_and_loads_older_pairs() -> None:
    c = Cooldown()
    c.start(0.5, 3)
    restored = Cooldown()
    restored.load_state_dict(c.state_dict())
    assert (restored.factor, restored.steps_left, restored.lr_factor) == (0.5, 3, 0.5)
    older = Cooldown()
    older.load_state_dict([0.25, 7])  # what checkpoints before 0.2 hold
    assert (older.factor, older.steps_left) == (0.25, 7)
    assert Cooldown().lr_factor == 1.0
