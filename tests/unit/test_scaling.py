"""record_skip: the caller's GradScaler sees a skipped step as an overflow."""

from __future__ import annotations

import torch

from nansentinel.effects.scaling import record_skip


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=8.0)


def test_a_skip_is_recorded_as_an_overflow_and_the_grads_stay_none() -> None:
    model, opt, scaler = _setup()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    opt.zero_grad(set_to_none=True)  # what a skip does
    before = [p.detach().clone() for p in model.parameters()]
    assert record_skip(scaler, opt)
    assert all(p.grad is None for p in model.parameters())  # the probe's grad is taken back
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert not opt.state  # the optimizer never stepped


def test_an_unscaled_or_disabled_scaler_is_left_as_it_found() -> None:
    model, opt, scaler = _setup()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.unscale_(opt)  # what Lightning does before its callbacks: found_inf is recorded
    opt.zero_grad(set_to_none=True)
    assert not record_skip(scaler, opt)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 8.0  # the reduced gradients were finite: no back-off
    assert not record_skip(torch.amp.GradScaler("cpu", enabled=False), opt)
