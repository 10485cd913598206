"""One assembly builds the Sentinel's parts (step/assembly.py); an integration adds a scope
instead of subclassing the Sentinel (torchft's replica groups: step/group_scope.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import nansentinel
from nansentinel.config import ConfigError, SentinelConfig
from nansentinel.result import FTStepResult, NonFiniteError, StepResult
from nansentinel.step.assembly import Parts
from nansentinel.step.group_scope import ReplicaGroups


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, sentinel: Any) -> Any:
    x = sentinel.check_batch(torch.randn(3, 4))
    loss = model(x).pow(2).mean()
    sentinel.check_loss(loss)
    loss.backward()
    return sentinel.step()


def test_the_parts_are_complete_and_frozen(tmp_path: Path) -> None:
    model, opt = _model()
    sentinel = nansentinel.Sentinel(model, opt, env={}, report_dir=str(tmp_path))
    parts = sentinel._parts
    assert all(getattr(parts, f.name) is not None for f in dataclasses.fields(Parts)
               if f.name not in ("engine", "device_gate"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.gate = None  # type: ignore[misc]
    # The ranks' exchange is the first scope; the public face reads the parts.
    assert sentinel.scopes == (sentinel.exchange,) and parts.wider == ()
    assert sentinel.gradients is parts.gradients and sentinel.gate is parts.gate
    assert sentinel.engine is None and sentinel.device_gate is None
    sentinel.close()


class Recorder:
    """A wider scope that records its calls and vetoes the step it is told to."""

    def __init__(self, veto: int | None = None) -> None:
        self.calls: list[str] = []
        self.veto = veto

    def configure(self, config: SentinelConfig, environ: Mapping[str, str]) -> SentinelConfig:
        self.calls.append("configure")
        return dataclasses.replace(config, job_id="scoped")

    def bind(self, parts: Parts) -> None:
        self.calls.append("bind")
        self.parts = parts

    def begin(self) -> None:
        self.calls.append("begin")

    def agree(self, local: StepResult, stopping: NonFiniteError | None, *,
              optimizer_step: bool) -> tuple[StepResult, NonFiniteError | None]:
        self.calls.append(f"agree applied={local.applied} optimizer_step={optimizer_step}")
        if local.step == self.veto:
            return local, NonFiniteError("vetoed by the scope", local)
        if optimizer_step:
            self.parts.judge.optimizer.step()
        return local, stopping

    def leave(self, metrics: Any) -> None:
        self.calls.append("leave")


def test_a_scope_is_added_not_subclassed(tmp_path: Path) -> None:
    """The scope configures the run, is bound to the parts, and decides each step after the
    ranks (which no longer step the optimizer); its stop is raised after it left."""
    model, opt = _model()
    scope = Recorder(veto=1)
    sentinel = nansentinel.Sentinel(model, opt, env={}, report_dir=str(tmp_path),
                                    scopes=[scope])
    assert type(sentinel) is nansentinel.Sentinel and sentinel.scopes[1] is scope
    assert sentinel.job_id == "scoped" and scope.calls == ["configure", "bind"]
    before = model.weight.detach().clone()
    assert _step(model, sentinel).applied
    assert not torch.equal(before, model.weight), "the scope stepped the optimizer"
    with pytest.raises(NonFiniteError, match="vetoed by the scope"):
        _step(model, sentinel)
    assert scope.calls[2:] == ["begin", "agree applied=True optimizer_step=True",
                               "begin", "agree applied=True optimizer_step=True", "leave"]
    sentinel.abandon()


class FakeManager:
    """What ReplicaGroups asks of a torchft Manager before any step."""

    def __init__(self) -> None:
        self.shut = False

    def shutdown(self, wait: bool = True) -> None:
        self.shut = True


def _groups(by_hand: bool = False, carrier: object = None) -> ReplicaGroups:
    return ReplicaGroups(FakeManager(), group="g1", group_rank=0, rollback="torchft heals",
                         by_hand=by_hand, carrier=carrier)


def test_replica_groups_configure_through_the_config() -> None:
    """Keyword > env > default for every setting; the job id names the replica group, and
    torchrun's "none" (no --rdzv-id) is not a job id; drop becomes each group's skip."""
    env = {"TORCHELASTIC_RUN_ID": "none"}
    config = _groups().configure(SentinelConfig.from_env(env), env)
    assert config.job_id == "torchft-g1"
    env = {"TORCHELASTIC_RUN_ID": "run7"}
    assert _groups().configure(SentinelConfig.from_env(env), env).job_id == "run7-g1"
    env = {"NANSENTINEL_JOB_ID": "mine", "NANSENTINEL_POLICY": "drop"}
    groups = _groups()
    config = groups.configure(SentinelConfig.from_env(env), env)
    assert config.job_id == "mine" and config.policy == "skip" and groups.drop
    with pytest.raises(ConfigError, match="reduced by hand"):
        _groups(by_hand=True).configure(SentinelConfig.from_env({}, policy="drop"), {})
    with pytest.raises(ConfigError, match="torchft heals"):
        _groups().configure(SentinelConfig.from_env({}, policy="rollback"), {})


def test_replica_groups_refuse_what_fsdp2_groups_cannot_do() -> None:
    """FSDP2 with torchft's all-reduce hooks (a carrier, the gradients not in nansentinel's
    DDP): policy="drop" is refused with the FSDP2 reason (a group's shards leave before its
    ranks know each other's batch), and the gate is the host's, as torchft decides a step
    at should_commit() (nansentinel's torchft DDP says so through its capabilities)."""
    hooks = object()
    with pytest.raises(ConfigError, match=r"under FSDP2 .* a group cannot be left out whole"):
        _groups(by_hand=True, carrier=hooks).configure(
            SentinelConfig.from_env({}, policy="drop"), {})
    for gate in ("device", "auto"):
        config = SentinelConfig.from_env({}, gate=gate)
        assert _groups(by_hand=True, carrier=hooks).configure(config, {}).gate == "host"
        assert _groups(by_hand=True).configure(config, {}).gate == "host"
        assert _groups().configure(config, {}).gate == gate  # the DDP path's caps refuse it


def test_the_torchft_sentinel_is_the_core_one_with_a_scope() -> None:
    """nansentinel.torchft.Sentinel builds the core Sentinel (no subclass) with torchft's
    replica groups as its wider scope; FTStepResult is result.py's."""
    pytest.importorskip("torchft")
    import nansentinel.torchft as nft
    assert not isinstance(nft.Sentinel, type)
    assert nft.FTStepResult is FTStepResult
    from torchft.optim import OptimizerWrapper

    _, opt = _model()
    wrapped = OptimizerWrapper(FakeManager(), opt)
    from nansentinel.engines.torchft import stepped

    assert stepped(wrapped) is opt and stepped(opt) is opt


def test_the_replica_groups_row_is_the_wire_schemas() -> None:
    """One bad group's row, summed with a healthy one's, decodes through the schema's
    GroupTotals: its count, kinds, participating rank and drop."""
    from nansentinel.wire.group_rows import health_row
    from nansentinel.wire.schema import G, GroupTotals

    bad = health_row(True, ["loss", "grad"], replica_rank=2, dropped=True)
    summed = [a + b for a, b in zip(bad, health_row(False, [], 0), strict=True)]
    totals = GroupTotals.from_values(summed)
    assert len(summed) == G.size
    assert (totals.bad, totals.kinds, totals.single, totals.dropped) == (1, ("loss", "grad"),
                                                                         2, 1)
    two = GroupTotals.from_values([a + b for a, b in zip(bad, bad, strict=True)])
    assert two.bad == 2 and two.single == -1
