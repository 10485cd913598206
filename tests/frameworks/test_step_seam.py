"""``Sentinel.step(optimizer_step=False)``, the seam the framework callbacks use, on one
process without any framework: the caller's own ``optimizer.step()`` applies on a healthy
step, changes nothing on a skipped one, and runs under the rollback LR cooldown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from nansentinel import Sentinel


def _setup(tmp: Path, **overrides):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sentinel = Sentinel(model, opt, env={}, metrics_port=0, report_dir=str(tmp), **overrides)
    return model, opt, sentinel


def _backward(model: torch.nn.Module, sentinel: Sentinel, poison: bool = False) -> None:
    loss = model(torch.ones(3, 4)).pow(2).mean()
    if poison:
        loss = loss * float("nan")
    sentinel.check_loss(loss)
    loss.backward()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    return out + [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]


def test_the_callers_step_applies_a_healthy_step_and_is_a_no_op_after_a_skip(
    tmp_path: Path,
) -> None:
    model, opt, sentinel = _setup(tmp_path)
    _backward(model, sentinel)
    before = [p.detach().clone() for p in model.parameters()]
    result = sentinel.step(optimizer_step=False)
    assert result.applied
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    opt.step()  # the framework's own step
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    opt.zero_grad()

    _backward(model, sentinel, poison=True)
    saved = _state(model, opt)
    result = sentinel.step(optimizer_step=False)
    assert not result.applied and result.outcome == "skipped"
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(saved, _state(model, opt), strict=True))


def test_the_callers_step_runs_under_the_rollback_cooldown_then_the_lr_is_restored(
    tmp_path: Path,
) -> None:
    model, opt, sentinel = _setup(tmp_path, policy="rollback", snapshot_every=1,
                                  rollback_lr_factor=0.5, rollback_lr_steps=2,
                                  rollback_skip_batches=0)
    seen: list[float] = []
    opt.register_step_pre_hook(lambda o, *_: seen.append(o.param_groups[0]["lr"]))
    before_step0: list[torch.Tensor] = []
    for step, poison in enumerate((False, True, False, False, False)):
        opt.zero_grad()
        _backward(model, sentinel, poison=poison)
        result = sentinel.step(optimizer_step=False)
        assert result.applied is not poison
        if poison:
            assert result.outcome == "rolled_back" and result.rolled_back_to == 0
            # The snapshot was taken before the caller's step 0: the weights its loss came
            # from, and no momentum yet.
            assert all(torch.equal(a, b) for a, b in zip(
                before_step0, model.parameters(), strict=True))
            assert not any(opt.state.get(p) for p in model.parameters())
        if step == 0:
            before_step0 = [p.detach().clone() for p in model.parameters()]
        opt.step()
        assert opt.param_groups[0]["lr"] == 0.1  # as the user set it, between steps
    # Step 1 rolled back (the caller's step saw no gradients); 2 and 3 at half the LR.
    assert seen == [0.1, 0.1, 0.05, 0.05, 0.1]


def test_importing_nansentinel_imports_no_framework() -> None:
    code = (
        "import sys, nansentinel, nansentinel.step.sentinel, nansentinel.cli\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'transformers', 'accelerate')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
