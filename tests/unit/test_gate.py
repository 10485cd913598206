"""The device gate in one process: which runs it takes, its found_inf, the deferred result."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import nansentinel
from nansentinel.config import ConfigError, SentinelConfig
from nansentinel.engines.ddp import DDPPath
from nansentinel.engines.deepspeed import DeepSpeedPath
from nansentinel.engines.fsdp import FSDPPath
from nansentinel.result import ResultPending
from nansentinel.step.gate import GatedOptimizer, device_gate_refusal
from nansentinel.step.record import PendingResult
from nansentinel.wire.schema import SIZE, T


def make(tmp_path: Path, *, fused: bool = True, **kw: object):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused or None)
    kw.setdefault("metrics_port", 0)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path / "r"), env={}, **kw)
    return model, opt, sentinel


def one_step(model, sentinel, x=None):  # type: ignore[no-untyped-def]
    x = torch.randn(8, 4) if x is None else x
    batch = sentinel.check_batch({"x": x})
    loss = (model(batch["x"]) ** 2).mean()
    sentinel.check_loss(loss)
    loss.backward()
    return sentinel.step()


def test_gate_config_is_validated_and_read_from_env() -> None:
    assert SentinelConfig.from_env({}).gate == "auto"  # the device gate where it can be
    assert SentinelConfig.from_env({"NANSENTINEL_GATE": "auto"}).gate == "auto"
    with pytest.raises(ConfigError, match="NANSENTINEL_GATE"):
        SentinelConfig.from_env({"NANSENTINEL_GATE": "gpu"})
    with pytest.raises(ConfigError, match=r"gate=.gpu.*auto, device, host"):
        SentinelConfig(gate="gpu")


def test_auto_keeps_the_host_gate_on_cpu_and_device_takes_a_fused_optimizer(
    tmp_path: Path,
) -> None:
    assert make(tmp_path)[2].device_gate is None  # auto on CPU: nothing to overlap with
    assert make(tmp_path, gate="device")[2].device_gate is not None
    assert make(tmp_path, gate="host")[2].device_gate is None


def test_refusals_say_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="nansentinel"):
        _, _opt, s = make(tmp_path, fused=False, gate="device")
    assert s.device_gate is None and "use fused=True" in caplog.text
    cfg = SentinelConfig(gate="device")
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], fused=True)
    ddp = DDPPath.CAPS
    assert device_gate_refusal(fused, scaler=None, config=cfg, caps=ddp) is None
    assert "GradScaler" in str(device_gate_refusal(fused, scaler=object(), config=cfg, caps=ddp))
    spiky = SentinelConfig(gate="device", loss_spike_action="skip")
    assert "spike" in str(device_gate_refusal(fused, scaler=None, config=spiky, caps=ddp))
    assert device_gate_refusal(fused, scaler=None, config=cfg, caps=FSDPPath.CAPS) is None
    assert "DeepSpeed" in str(device_gate_refusal(fused, scaler=None, config=cfg,
                                                  caps=DeepSpeedPath.CAPS))
    assert "pipeline stages" in str(device_gate_refusal(fused, scaler=None, config=cfg,
                                                        caps=FSDPPath.CAPS.staged()))


def test_found_inf_follows_the_view() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    gate = GatedOptimizer(torch.optim.Adam([p], fused=True), torch.device("cpu"))
    vector = torch.zeros(SIZE)
    assert gate.found_inf(vector, skip=False).item() == 0.0
    assert gate.found_inf(vector, skip=True).item() == 1.0
    for field in (T.bad_loss, T.bad_grad, T.quarantined):  # the totals count ranks
        v = vector.clone()
        v[field] = 1.0
        found = gate.found_inf(v, skip=False)
        assert found.dtype == torch.float32 and found.shape == () and found.item() == 1.0


def test_fused_sgd_with_momentum_joins_once_its_buffers_exist() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
    gate = GatedOptimizer(opt, torch.device("cpu"))
    p.grad = torch.ones(3)
    assert not gate.ready()  # a skipped first step would leave empty_like buffers
    opt.step()
    assert gate.ready()
    assert GatedOptimizer(torch.optim.SGD([p], lr=0.1, fused=True), torch.device("cpu")).ready()


def test_result_is_decided_on_first_read_or_at_the_next_call(tmp_path: Path) -> None:
    model, opt, s = make(tmp_path, gate="device")
    r0 = one_step(model, s)
    assert isinstance(r0, PendingResult) and not r0.resolved
    assert r0.applied and r0.outcome == "applied" and r0.resolved  # the read decided it
    r1 = one_step(model, s)
    opt.zero_grad(set_to_none=True)
    assert not r1.resolved
    s.check_batch({"x": torch.ones(2)})  # the next sentinel call decides it
    assert r1.resolved and r1.step == 1 and r1.resolve() == r1
    assert "applied" in repr(r1)


def test_poisoned_step_is_skipped_on_the_device_and_named_at_resolution(
    tmp_path: Path,
) -> None:
    model, opt, s = make(tmp_path, gate="device")
    one_step(model, s).resolve()
    opt.zero_grad(set_to_none=True)
    weights = [p.detach().clone() for p in model.parameters()]
    moments = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")
    r = one_step(model, s, x)
    opt.zero_grad(set_to_none=True)  # the user drops the grads before the result is read
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    state = opt.state[next(iter(model.parameters()))]
    assert all(torch.equal(v, state[k]) for k, v in moments.items())
    # Read early: what the device did is known; the naming waits for the next sentinel call,
    # which every rank makes at the same point (a read never starts a collective).
    assert not r.applied and r.step == 1 and r.local_kinds == ["batch", "loss", "grad"]
    with pytest.raises(ResultPending, match=r"step 1 .* next sentinel call"):
        _ = r.outcome
    assert not r.resolved
    s.check_batch({"x": torch.ones(2)})
    assert not r.applied and r.outcome == "skipped" and r.kinds == ["batch", "loss", "grad"]
    # The parameter naming read the gradients as they were at step(), though zeroed since.
    assert r.parameters == {0: ["0.weight", "0.bias", "2.weight", "2.bias"]}
    assert r.report_path and Path(r.report_path).exists()
    assert all(p.grad is None for p in model.parameters())


def test_abort_is_raised_at_the_next_call_and_by_every_later_read(tmp_path: Path) -> None:
    model, _opt, s = make(tmp_path, gate="device", policy="abort")
    r = one_step(model, s, torch.full((8, 4), float("inf")))
    with pytest.raises(nansentinel.NonFiniteError, match="step 0") as caught:
        s.check_batch({"x": torch.ones(2)})
    assert caught.value.result.step == 0
    with pytest.raises(nansentinel.NonFiniteError):
        _ = r.applied


def test_state_dict_and_close_decide_a_pending_step(tmp_path: Path) -> None:
    model, _opt, s = make(tmp_path, gate="device")
    r = one_step(model, s)
    assert s.state_dict()["step"] == 1 and r.resolved
    r2 = one_step(model, s)
    s.close()
    assert r2.resolved and r2.applied


def test_copy_to_host_is_fenced_on_the_vectors_device_not_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 20, item 5: the vector on cuda:1 while cuda:0 is current (DDP with device_ids and
    no set_device): the event must be recorded on cuda:1's current stream, after the copy."""
    import nansentinel.step.gate as gate

    calls: list[tuple[str, object]] = []

    class Vector:
        device = torch.device("cuda", 1)
        dtype = torch.float32

        def numel(self) -> int:
            return SIZE

    class Host:
        def numel(self) -> int:
            return SIZE

        def copy_(self, src: object, non_blocking: bool) -> None:
            calls.append(("copy", non_blocking))

    class Event:
        def record(self, stream: object = None) -> None:
            calls.append(("record", stream))

    def current_stream(device: object = None) -> str:
        calls.append(("stream", device))
        return f"stream of {device}"

    monkeypatch.setattr(gate, "_pinned", lambda numel, dtype: Host())
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    # Built for the CPU (no CUDA here); to_host reads only the vector's device.
    dg = GatedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
                    torch.device("cpu"))
    host, event = dg.to_host(Vector())  # type: ignore[arg-type]
    assert isinstance(host, Host) and isinstance(event, Event)
    cuda1 = torch.device("cuda", 1)
    assert calls == [("stream", cuda1), ("copy", True), ("record", f"stream of {cuda1}")]


def test_no_gradient_is_held_until_the_decision(tmp_path: Path) -> None:
    """Issue 35 item 2: after step() on the device gate and the user's zero_grad, no second
    set of gradients lives on (counted by weak references) through the next forward."""
    import weakref

    model, opt, s = make(tmp_path, gate="device")
    one_step(model, s).resolve()
    opt.zero_grad(set_to_none=True)
    one_step(model, s)
    grads = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
    assert grads
    opt.zero_grad(set_to_none=True)  # the user's: the step is not decided yet
    assert all(g() is None for g in grads), "the device gate kept gradients alive"
    s.check_batch({"x": torch.ones(2)})
    s.close()


def test_zeroed_in_place_gradients_still_name_the_poisoned_parameter(tmp_path: Path) -> None:
    """A loop that zeroes in place (set_to_none=False) before the decision: the parameters
    are named from the norms kept before the reduction, not from the zeroed gradients."""
    model, opt, s = make(tmp_path, gate="device", inject="kind=grad,rank=0,step=1")
    one_step(model, s).resolve()
    opt.zero_grad(set_to_none=False)
    r = one_step(model, s)
    opt.zero_grad(set_to_none=False)
    s.check_batch({"x": torch.ones(2)})
    assert r.outcome == "skipped" and r.kinds == ["grad"]
    assert r.parameters == {0: ["0.weight"]}  # the drill writes into the first gradient
    s.close()


def test_a_step_goes_through_its_states_in_order() -> None:
    from nansentinel.checks.health import LocalHealth
    from nansentinel.step.record import NEXT, Stage, StepRecord

    record = StepRecord(3, LocalHealth(torch.device("cpu")))
    for stage in (Stage.LAUNCHED, Stage.READ, Stage.DECIDED, Stage.DONE):
        record.to(stage)
    with pytest.raises(AssertionError, match="step 3 cannot go from done to open"):
        record.to(Stage.OPEN)
    assert all(Stage.ABANDONED in NEXT[s] for s in Stage if s not in (Stage.DONE,
                                                                        Stage.ABANDONED))
    skipping = StepRecord(4, LocalHealth(torch.device("cpu")))
    with pytest.raises(AssertionError, match="from open to decided"):
        skipping.to(Stage.DECIDED)


def test_a_pending_result_declares_every_field_of_a_step_result_with_its_type() -> None:
    import dataclasses
    import typing

    from nansentinel.step.record import EARLY_FIELDS, _Decided, _Early

    hints = typing.get_type_hints(nansentinel.StepResult)
    declared = {name: value for name, value in vars(PendingResult).items()
                if isinstance(value, _Early | _Decided)}
    fields = {f.name for f in dataclasses.fields(nansentinel.StepResult)}
    assert set(declared) == fields | {"healthy", "stop_requested"}
    for name, descriptor in declared.items():
        if name in hints:
            (arg,) = typing.get_args(descriptor.__orig_class__)  # type: ignore[attr-defined]
            assert arg == hints[name], (name, arg, hints[name])
    assert {"step", "applied", "injected"} <= EARLY_FIELDS and "outcome" not in EARLY_FIELDS
