"""The DeepSpeed integration's pieces that need no engine: importing nansentinel never imports
DeepSpeed, and the forced skip puts back exactly what it shadowed (real engines are tested in
tests/distributed/test_deepspeed.py and tests/frameworks/test_deepspeed.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nansentinel.engines.deepspeed import is_engine
from nansentinel.engines.deepspeed_step import _release, _shadowed

ROOT = Path(__file__).resolve().parents[2]


def test_nansentinel_never_imports_deepspeed() -> None:
    """A plain model's whole step (the gradient path chosen, the step decided) leaves DeepSpeed
    unimported: only a process that built an engine has it."""
    script = (
        "import sys, torch, nansentinel\n"
        "m = torch.nn.Linear(2, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "s = nansentinel.Sentinel(m, opt, metrics_port=0, env={})\n"
        "s.check_batch(torch.ones(1, 2)); loss = m(torch.ones(1, 2)).sum(); s.check_loss(loss)\n"
        "loss.backward(); assert s.step().applied; s.close()\n"
        "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_plain_module_is_not_an_engine() -> None:
    assert not is_engine(torch.nn.Linear(2, 2))


def test_shadowed_puts_back_an_lr_schedulers_step_wrapper() -> None:
    """A torch LR scheduler wraps ``optimizer.step`` in an instance attribute: the forced skip
    shadows ``step`` for one call and must leave that wrapper, not the class's method."""
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    torch.optim.lr_scheduler.StepLR(opt, 1)
    wrapper = vars(opt)["step"]
    with _shadowed(opt, "step", lambda closure=None: None), _shadowed(opt, "overflow", True):
        assert opt.overflow is True and opt.step() is None
    assert vars(opt)["step"] is wrapper and not hasattr(opt, "overflow")
    bare = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(RuntimeError), _shadowed(bare, "step", None):
        raise RuntimeError("the engine's step failed")
    assert "step" not in vars(bare)  # the class's own step is seen again


@pytest.mark.parametrize(("version", "release"), [
    ("0.19.8", "0.19.8"), ("0.19.8+4f2a1b", "0.19.8"), ("0.19.8.dev0", "0.19.8"),
    ("0.20.0", "0.20.0"), ("weird", "weird"),
])
def test_release_reads_the_version_as_released(version: str, release: str) -> None:
    assert _release(version) == release
