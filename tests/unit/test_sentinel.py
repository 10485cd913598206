"""The Sentinel in one process (no process group): the same code path as N ranks."""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

import nansentinel


def make(tmp_path: Path, **kw: object) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                 nansentinel.Sentinel]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("metrics_port", 0)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path / "r"), env={}, **kw)
    return model, opt, sentinel


def one_step(model: torch.nn.Module, sentinel: nansentinel.Sentinel,
             x: torch.Tensor | None = None) -> nansentinel.StepResult:
    x = torch.randn(8, 4) if x is None else x
    batch = sentinel.check_batch({"x": x, "ids": torch.arange(8), "tag": "b"})
    loss = (model(batch["x"]) ** 2).mean()
    sentinel.check_loss(loss)
    loss.backward()
    return sentinel.step()


def test_healthy_steps_apply_and_report_local_values(tmp_path: Path) -> None:
    model, _opt, s = make(tmp_path)
    before = [p.clone() for p in model.parameters()]
    r = one_step(model, s)
    assert r.applied and r.outcome == "applied" and r.step == 0 and r.healthy
    assert r.local_loss is not None and r.local_grad_norm is not None and r.local_grad_norm > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert s.identity.world_size == 1


def test_real_nan_batch_is_skipped_and_weights_untouched(tmp_path: Path) -> None:
    model, _opt, s = make(tmp_path)
    x = torch.randn(8, 4)
    x[3, 1] = math.nan  # e.g. a zero-variance column normalised to 0/0
    before = [p.clone() for p in model.parameters()]
    r = one_step(model, s, x)
    assert not r.applied and r.outcome == "skipped" and r.bad_ranks == [0]
    assert r.kinds == ["batch", "loss", "grad"] and not r.injected
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())  # discarded
    rep = json.loads(Path(r.report_path).read_text())
    assert rep["bad_ranks"] == [0] and rep["poisoned"][0]["loss"] == "nan"
    saved = torch.load(rep["poisoned"][0]["batch_path"])
    assert math.isnan(saved["x"][3, 1]) and saved["tag"] == "b"


def test_a_bare_step_before_any_backward_is_refused(tmp_path: Path) -> None:
    _model, _opt, s = make(tmp_path)
    with pytest.raises(nansentinel.SentinelUsageError, match=r"before any loss\.backward"):
        s.step()  # nothing checked, nothing back-propagated: nothing to decide (issue 53)
    s.check_loss(torch.tensor(1.0))  # a loss-only step is the loop's choice: decided
    r = s.step()
    assert r.applied and r.local_grad_norm is None and r.local_loss == 1.0


def test_non_scalar_loss_is_checked_elementwise(tmp_path: Path) -> None:
    _model, _opt, s = make(tmp_path)
    s.check_loss(torch.tensor([1.0, 3.0]))
    assert s.step().local_loss == pytest.approx(2.0)
    s.check_loss(torch.tensor([1.0, math.inf]))
    r = s.step()
    assert r.kinds == ["loss"] and not r.applied


@pytest.mark.parametrize("bad", ["1.0", None, torch.tensor([1, 2]), torch.tensor([])])
def test_bad_loss_types_are_clear_errors(tmp_path: Path, bad: object) -> None:
    _, _, s = make(tmp_path)
    with pytest.raises(TypeError, match=r"check_loss expects .*rank 0, step 0"):
        s.check_loss(bad)  # type: ignore[arg-type]


def test_env_drill_and_precedence(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    env = {"NANSENTINEL_INJECT": "kind=grad,step=1,value=-inf", "NANSENTINEL_POLICY": "abort",
           "NANSENTINEL_METRICS_PORT": "0"}
    s = nansentinel.Sentinel(model, opt, env=env, policy="skip", report_dir=str(tmp_path))
    assert s.config.policy == "skip"
    results = [one_step(model, s, torch.randn(8, 4)) for _ in range(3)]
    assert [r.applied for r in results] == [True, False, True]
    assert results[1].injected and results[1].parameters == {0: ["weight"]}


def test_abort_raises_with_step_rank_host_kind(tmp_path: Path) -> None:
    model, _opt, s = make(tmp_path, policy="abort", hostname="node-a", inject="kind=loss,step=0")
    with pytest.raises(nansentinel.NonFiniteError) as info:
        one_step(model, s)
    msg = str(info.value)
    for word in ("step 0", "rank(s) 0", "node-a", "loss", "policy is abort"):
        assert word in msg
    assert Path(info.value.result.report_path).exists()


def test_amp_overflow_is_counted_not_blamed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # scaled grads overflow fp32
    s = nansentinel.Sentinel(model, opt, scaler=scaler, metrics_port=0,
                             report_dir=str(tmp_path), env={})
    before = model.weight.clone()
    loss = (model(torch.randn(8, 4)) * 1e3).pow(2).mean()
    s.check_loss(loss)
    scaler.scale(loss).backward()
    r = s.step()
    assert r.outcome == "overflow" and r.overflow and r.bad_ranks == [] and r.applied
    assert torch.equal(model.weight, before)  # GradScaler skipped the update itself
    assert scaler.get_scale() < 2.0**127  # and lowered its scale
    s.check_loss(torch.tensor(math.nan))  # a NaN loss is still blamed under AMP
    assert s.step().bad_ranks == [0]


def test_state_dict_roundtrip(tmp_path: Path) -> None:
    model, _opt, s = make(tmp_path, inject="kind=grad,step=0")
    one_step(model, s)
    state = s.state_dict()
    _, _, s2 = make(tmp_path)
    s2.load_state_dict(state)
    assert s2.step_index == 1 and s2.history.consecutive_skips == 1


def test_metrics_exported_on_the_rank_port(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    registry = CollectorRegistry()
    port = free_port()
    model, _opt, s = make(tmp_path, metrics_port=port, metrics_addr="127.0.0.1",
                         registry=registry, inject="kind=batch,step=1", hostname="node-m")
    try:
        for _ in range(3):
            one_step(model, s)
        get = registry.get_sample_value
        assert get("nansentinel_steps_total", {"outcome": "applied"}) == 2
        assert get("nansentinel_steps_total", {"outcome": "skipped"}) == 1
        assert get("nansentinel_nonfinite_total", {"kind": "batch"}) == 1
        assert get("nansentinel_step") == 2 and get("nansentinel_rank_healthy") == 1
        assert get("nansentinel_check_seconds_count") == 3
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b'hostname="node-m"' in body and b"nansentinel_grad_norm" in body
    finally:
        s.close()


def test_busy_metrics_port_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match=str(port)):
            make(tmp_path, metrics_port=port, metrics_addr="127.0.0.1")


def test_a_tensor_lr_on_the_accelerator_skips_its_step_read_on_the_device_and_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 68: a tensor lr that the host does not read (on the GPU a read would sync every
    step) still skips the step it went NaN at, through the row's device flag, and the
    reason names it (read once, on the rare path); the next step with a finite rate
    applies. The CPU stands in for the GPU: the lr tensor is hidden from the host's read
    and handed to the device's, as a CUDA tensor is."""
    import nansentinel.checks.state as state
    import nansentinel.step.current as current

    def as_on_the_gpu(opt: torch.optim.Optimizer) -> tuple[bool, list[torch.Tensor]]:
        lrs = [g["lr"] for g in opt.param_groups if isinstance(g["lr"], torch.Tensor)]
        return True, lrs  # the host reads none of them (the rest of SGD's entries: finite)

    monkeypatch.setattr(current, "read_hyperparameters", as_on_the_gpu)
    model, opt, s = make(tmp_path)
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    assert one_step(model, s).applied
    opt.param_groups[0]["lr"].fill_(math.nan)
    assert not state.read_hyperparameters(opt)[0]  # as the CPU's host read would see it
    before = [p.detach().clone() for p in model.parameters()]
    skipped = one_step(model, s)
    assert not skipped.applied and "param group 0's lr is nan" in skipped.reason, skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    opt.zero_grad(set_to_none=True)
    opt.param_groups[0]["lr"].fill_(0.1)
    assert one_step(model, s).applied
    s.close()
