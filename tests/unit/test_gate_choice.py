"""Which gate each run takes (issue 46), and that the device gate's step never waits on the
host before the optimizer: on the CPU, with a CUDA device handed to the choice."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import nansentinel
import nansentinel.step.assembly as sentinel_module
from nansentinel.common import torch_insides as insides
from nansentinel.config import SentinelConfig
from nansentinel.engines import registry
from nansentinel.engines.ddp import DDPPath
from nansentinel.engines.deepspeed import DeepSpeedPath
from nansentinel.engines.fsdp import FSDPPath
from nansentinel.engines.fsdp1 import FSDP1Path
from nansentinel.engines.local import LocalGradPath
from nansentinel.engines.prehook import PreHookPath
from nansentinel.result import StepResult
from nansentinel.step.gate import GateChoice, GatedOptimizer, choose_gate, gated_steps
from nansentinel.step.record import PendingResult, StepRecord
from nansentinel.wire.exchange import HealthExchange

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
ENGINES = {"DDP": DDPPath.CAPS, "FSDP2": FSDPPath.CAPS, "FSDP1": FSDP1Path.CAPS,
           "local": LocalGradPath.CAPS, "pre-hooks": PreHookPath.CAPS,
           "DeepSpeed": DeepSpeedPath.CAPS, "DDP, pipeline": DDPPath.CAPS.staged(),
           "FSDP2, pipeline": FSDPPath.CAPS.staged()}


def _optimizer(kind: str) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.ones(2))]
    return {
        "AdamW fused": lambda: torch.optim.AdamW(params, fused=True),
        "Adam fused": lambda: torch.optim.Adam(params, fused=True),
        "SGD fused": lambda: torch.optim.SGD(params, lr=0.1, fused=True),
        "Adagrad fused": lambda: torch.optim.Adagrad(params, fused=True),
        "AdamW foreach": lambda: torch.optim.AdamW(params, foreach=True),
        "AdamW": lambda: torch.optim.AdamW(params),
        "SGD": lambda: torch.optim.SGD(params, lr=0.1),
    }[kind]()


FUSED = ("AdamW fused", "Adam fused", "SGD fused", "Adagrad fused")
DEVICE_ENGINES = ("DDP", "FSDP2", "FSDP1", "local", "pre-hooks")


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("optimizer", [*FUSED, "AdamW foreach", "AdamW", "SGD"])
@pytest.mark.parametrize("device", [CUDA, CPU], ids=["cuda", "cpu"])
def test_the_default_gate_for_each_engine_optimizer_and_device(
    engine: str, optimizer: str, device: torch.device,
) -> None:
    """The default (``auto``): the device gate, decided in ``step()``, exactly on CUDA with a
    fused optimizer on DDP, FSDP2 or the local path; the host gate everywhere else, with a
    reason that names what kept it there."""
    choice = choose_gate(SentinelConfig(), device, _optimizer(optimizer), scaler=None,
                         caps=ENGINES[engine])
    skips = insides.skips_on_device(_optimizer(optimizer))  # fused Adagrad: from torch 2.13
    expected = device.type == "cuda" and skips and engine in DEVICE_ENGINES
    assert choice.device is expected, (engine, optimizer, device, choice)
    assert not choice.deferred  # auto never hands out a PendingResult
    if expected:
        assert choice.name == "device"
    elif device.type != "cuda":
        assert "not CUDA" in choice.why
    elif optimizer not in FUSED and "pipeline" not in engine:
        assert "use fused=True" in choice.why
    elif not skips and "pipeline" not in engine:
        assert "does not say it skips a step on the device" in choice.why
    else:
        assert choice.why == ENGINES[engine].device_gate


def test_every_registered_engine_is_in_the_table() -> None:
    assert {p.CAPS.label for p in registry()} <= {c.label for c in ENGINES.values()}


@pytest.mark.parametrize("setting, words", [
    ({"policy": "drop"}, "policy drop"), ({"loss_spike_action": "skip"}, "spike"),
    ({"spikes": "recover"}, "spike"), ({"gate": "host"}, "gate='host'"),
    ({"collapse_action": "skip"}, "collapse_action='skip'"),
    ({"collapse_action": "rollback"}, "collapses are judged on the host"),
])
def test_the_setups_that_keep_the_host_gate_on_cuda(setting: dict[str, Any],
                                                     words: str) -> None:
    fused = _optimizer("AdamW fused")
    choice = choose_gate(SentinelConfig.from_env({}, **setting), CUDA, fused, scaler=None,
                         caps=DDPPath.CAPS)
    assert not choice.device and words in choice.why
    scaled = choose_gate(SentinelConfig(), CUDA, fused, scaler=object(), caps=DDPPath.CAPS)
    assert not scaled.device and "GradScaler" in scaled.why


def test_device_defers_on_any_device_and_auto_never_does() -> None:
    fused = _optimizer("AdamW fused")
    for device in (CUDA, CPU):
        asked = choose_gate(SentinelConfig(gate="device"), device, fused, scaler=None,
                            caps=FSDPPath.CAPS)
        assert asked == GateChoice(True, True, asked.why) and asked.name == "device, deferred"
    assert not choose_gate(SentinelConfig(), CUDA, fused, scaler=None,
                           caps=FSDPPath.CAPS).deferred


def _run(tmp_path: Path, choice: GateChoice | None, monkeypatch: pytest.MonkeyPatch,
         steps: int = 3, poison: int | None = None, host: bool = False,
         **kw: Any) -> tuple[list[Any], list[str]]:
    """Train a tiny model with a fused AdamW under ``choice`` (forced, as if on CUDA, where
    given); every step's result and what happened inside each ``step()``, in order. A
    blocking read of the exchange (the host gate's) fails the run unless ``host``."""
    if choice is not None:
        monkeypatch.setattr(sentinel_module, "choose_gate", lambda *a, **k: choice)
    events: list[str] = []
    optimizer_step, read = GatedOptimizer.step, StepRecord.read

    def gated_step(self: GatedOptimizer, found_inf: torch.Tensor) -> None:
        events.append("optimizer")
        optimizer_step(self, found_inf)

    def record_read(self: StepRecord) -> list[float]:
        if self.values is None:
            events.append("read")
        return read(self)

    blocking = HealthExchange.wait

    def blocking_read(self: HealthExchange) -> Any:
        assert host, "the device gate read the exchange with a blocking copy"
        events.append("blocking read")
        return blocking(self)

    monkeypatch.setattr(GatedOptimizer, "step", gated_step)
    monkeypatch.setattr(StepRecord, "read", record_read)
    monkeypatch.setattr(HealthExchange, "wait", blocking_read)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    s = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path / "r"), env={},
                             metrics_port=0, **kw)
    results = []
    for step in range(steps):
        x = torch.randn(8, 4)
        if step == poison:
            x[0, 0] = float("nan")
        s.check_batch({"x": x})
        loss = model(x).pow(2).mean()
        s.check_loss(loss)
        loss.backward()
        events.append("step()")
        results.append(s.step())
        events.append("returned")
        opt.zero_grad(set_to_none=True)
    s.close()
    return results, events


def test_auto_on_cuda_launches_the_optimizer_before_any_read_and_returns_a_step_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default on CUDA: no blocking read of the exchange at all, the optimizer step
    queued before the totals are read, and a plain, decided StepResult (the host gate's
    contract: a loop reading ``applied`` and ``outcome`` each step, a NaN step too)."""
    results, events = _run(tmp_path, GateChoice(True, False, "as on CUDA"), monkeypatch,
                           poison=1)
    assert events == ["step()", "optimizer", "read", "returned"] * 3
    assert all(isinstance(r, StepResult) for r in results)
    assert [r.applied for r in results] == [True, False, True]
    assert [r.outcome for r in results] == ["applied", "skipped", "applied"]
    assert results[1].bad_ranks == [0] and results[1].report_path


def test_auto_on_cuda_raises_an_abort_from_step_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(nansentinel.NonFiniteError, match="step 1"):
        _run(tmp_path, GateChoice(True, False, "as on CUDA"), monkeypatch, poison=1,
             policy="abort")


def test_the_deferred_device_gate_reads_nothing_on_the_step_it_launched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    results, events = _run(tmp_path, None, monkeypatch, gate="device")
    # Each step's totals are read at the next sentinel call (check_batch; close for the last).
    assert events == ["step()", "optimizer", "returned", "read"] * 3
    assert all(isinstance(r, PendingResult) for r in results)


def test_auto_on_the_cpu_keeps_the_host_gate_and_says_so_at_debug_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="nansentinel"):
        results, events = _run(tmp_path, None, monkeypatch, steps=2, host=True)
    said = [r for r in caplog.records if "host gate" in r.message]
    assert len(said) == 1 and "not CUDA" in said[0].message
    assert said[0].levelno == logging.DEBUG  # a CPU run loses nothing by it
    assert events == ["step()", "blocking read", "returned"] * 2
    assert all(isinstance(r, StepResult) for r in results)


@pytest.mark.parametrize("rank, said", [(0, 1), (1, 0)])
def test_a_cuda_run_kept_on_the_host_gate_is_told_why_once_by_rank_0(
    caplog: pytest.LogCaptureFixture, rank: int, said: int,
) -> None:
    ctx = SimpleNamespace(rank=rank, device=CUDA, config=SentinelConfig())
    choice = choose_gate(ctx.config, CUDA, _optimizer("AdamW foreach"), scaler=None,
                         caps=DDPPath.CAPS)
    with caplog.at_level(logging.INFO, logger="nansentinel"):
        assert gated_steps(ctx, None, choice, rearm=print, stop_if=print) is None  # type: ignore[arg-type]
    lines = [r.message for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == said and all("host gate" in m and "fused=True" in m for m in lines)
