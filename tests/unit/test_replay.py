"""Replay: localisation of the first non-finite module and parameter, verdicts, fingerprints."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

import nansentinel
from nansentinel.checks.quarantine import signature
from nansentinel.rare.replay import Mode, replay, verdict_of


class LogLayer(nn.Module):
    """A hand-written log: log(0) = -inf for a zero input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.log = LogLayer()
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.log(self.act(self.inp(x)) + 1e-3 * (x[:, :1] != 0))))


def loss_fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (module(batch["x"]) - batch["y"]).pow(2).mean()


def batch(zero: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.rand(8, 4, generator=g) + 0.5
    if zero:
        x[0] = 0.0  # relu(inp(0)) + 0 can be exactly 0 for a unit -> log(0)
    return {"x": x, "y": torch.ones(8, 1)}


def make() -> Net:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.inp.bias.fill_(-10.0)  # every unit is 0 after relu for a zero input
    return net


def test_replay_names_first_module_and_parameter_and_leaves_no_trace() -> None:
    net = make()
    running = net.norm.running_mean.clone()
    rng = torch.get_rng_state()
    r = replay(net, batch(zero=True), loss_fn)
    assert not r.finite and r.error is None
    assert r.first_module == "log"
    assert r.first_parameter in ("head.bias", "head.weight")
    assert torch.equal(net.norm.running_mean, running) and torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in net.parameters())
    clean = replay(make(), batch(zero=False), loss_fn)
    assert clean.finite and clean.first_module is None and math.isfinite(clean.loss or 0)


def test_anomaly_mode_names_the_backward_operation() -> None:
    r = replay(make(), batch(zero=True), loss_fn, Mode(anomaly=True))
    assert not r.finite and r.anomaly and "Backward" in r.anomaly


def test_a_failing_replay_function_is_recorded_not_raised() -> None:
    r = replay(make(), {"wrong": 1}, loss_fn)
    assert r.error and "KeyError" in r.error and not r.finite


def test_verdicts_and_fingerprints() -> None:
    assert verdict_of(True, None) == "transient"
    assert verdict_of(False, False) == "data"
    assert verdict_of(False, True) == "host"
    assert verdict_of(False, None) == "data"  # no healthy peer: the best guess, reported so
    def fingerprint(b: object) -> str:
        return signature(b).fingerprint

    assert fingerprint(batch(True)) == fingerprint(batch(True)) != fingerprint(batch(False))
    ids = {"ids": torch.tensor([1, 2, 3])}
    assert fingerprint(ids) != fingerprint({"ids": torch.tensor([1, 2, 4])})


def test_sentinel_report_names_module_and_parameter(tmp_path: Path) -> None:
    net = make()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    s = nansentinel.Sentinel(net, opt, replay=loss_fn, metrics_port=0,
                             report_dir=str(tmp_path), env={}, replay_anomaly=True)
    b = s.check_batch(batch(zero=True))
    loss = loss_fn(net, b)
    s.check_loss(loss)
    loss.backward()
    r = s.step()
    assert r.bad_ranks == [0] and r.verdict == "data" and not r.applied
    import json

    rep = json.loads(Path(r.report_path).read_text())
    assert rep["first_nonfinite_module"] == "log"
    assert rep["first_nonfinite_parameter"] in ("head.bias", "head.weight")
    assert "Backward" in rep["poisoned"][0]["replay"]["anomaly"]
    assert rep["verdict"] == "data" and rep["poisoned"][0]["fingerprint"]
    # The same batch again: recognised and skipped, not fed into the weights.
    before = [p.clone() for p in net.parameters()]
    b = s.check_batch(batch(zero=True))
    loss = loss_fn(net, b)
    s.check_loss(loss)
    loss.backward()
    again = s.step()
    assert again.quarantined and not again.applied and again.reason.startswith("a quarantined")
    assert all(torch.equal(a, c) for a, c in zip(before, net.parameters(), strict=True))
