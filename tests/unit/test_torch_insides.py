"""Torch's insides in one room: every private seam read there, adapted or refused there.

The refusals are tested by making the running torch look older (a probe answering False, an
object with the old attribute names), so they run on every lane; the lanes themselves
(tests/run_torch_lane.sh) run the real releases.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from nansentinel.common import torch_insides as insides
from nansentinel.engines import fsdp
from nansentinel.result import SentinelUsageError

PACKAGE = Path(__file__).resolve().parents[2] / "nansentinel"
ROOM = PACKAGE / "common" / "torch_insides.py"


@pytest.fixture
def missing(monkeypatch: pytest.MonkeyPatch):
    """``missing(key)``: the running torch lacks feature ``key``'s seam."""

    def make(key: str) -> None:
        absent = dataclasses.replace(insides.FEATURES[key], present=lambda: False)
        monkeypatch.setitem(insides.FEATURES, key, absent)
        insides._probed.cache_clear()

    yield make
    insides._probed.cache_clear()


@pytest.mark.parametrize("key", sorted(insides.FEATURES))
def test_a_missing_seam_is_refused_naming_feature_torch_and_minimum(missing, key: str) -> None:
    missing(key)
    f = insides.FEATURES[key]
    with pytest.raises(insides.TorchTooOld) as raised:
        insides.require(key)
    message = str(raised.value)
    assert f.name in message
    assert f"torch >= {f.minimum}" in message
    assert f"this is torch {torch.__version__}" in message
    assert isinstance(raised.value, SentinelUsageError)  # what users already catch


def test_every_feature_at_or_below_this_torch_is_present() -> None:
    """The lanes run only supported releases: every feature whose minimum they reach must be
    found on each of them, and none above it (a probe that lies either way fails here)."""
    for key, feature in insides.FEATURES.items():
        assert insides.supported(key) == insides._at_least(feature.minimum), key


def test_the_minimum_is_pyprojects_lower_bound() -> None:
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    bound = re.search(r'"torch>=([\d.]+),', pyproject)
    assert bound is not None and bound.group(1) == insides.MIN_TORCH


def test_sentinel_refuses_a_torch_below_the_oldest_lane(missing) -> None:
    from nansentinel import Sentinel

    missing("torch")
    model = nn.Linear(2, 2)
    with pytest.raises(insides.TorchTooOld, match=rf"torch >= {insides.MIN_TORCH}"):
        Sentinel(model, torch.optim.SGD(model.parameters(), lr=0.1), env={})


def test_fsdp2_below_its_minimum_is_refused_at_construction(missing) -> None:
    missing("fsdp2")
    version = torch.__version__.replace("+", r"\+")
    with pytest.raises(SentinelUsageError,
                       match=rf"FSDP2 .*torch >= 2\.9; this is torch {version}.*or use DDP"):
        fsdp.FSDPPath(nn.Linear(2, 2), sink=None)  # type: ignore[arg-type]


class _Module:
    def __init__(self, state: object) -> None:
        self.state = state

    def _get_fsdp_state(self) -> object:
        return self.state


def test_fsdp_param_groups_reads_both_names() -> None:
    group = object()
    new = SimpleNamespace(_fsdp_param_groups=[group])  # torch >= 2.13
    old = SimpleNamespace(_fsdp_param_group=group)  # torch 2.9-2.12
    assert insides.fsdp_param_groups(_Module(new)) == [group]
    assert insides.fsdp_param_groups(_Module(old)) == [group]
    assert insides.fsdp_param_groups(_Module(SimpleNamespace(_fsdp_param_group=None))) == []
    with pytest.raises(insides.TorchTooOld, match="_fsdp_param_groups nor _fsdp_param_group"):
        insides.fsdp_param_groups(_Module(SimpleNamespace()))


def test_shape_inference_methods_of_each_release() -> None:
    new = SimpleNamespace(_forward_metadata_inference=None, _backward_metadata_inference=None)
    old = SimpleNamespace(_shape_inference=None)
    assert insides.shape_inference_methods(new) == (
        "_forward_metadata_inference", "_backward_metadata_inference")
    assert insides.shape_inference_methods(old) == ("_shape_inference",)
    with pytest.raises(insides.TorchTooOld, match="shape-inference"):
        insides.shape_inference_methods(SimpleNamespace())


def test_pipelining_below_its_minimum_is_refused_at_construction(missing) -> None:
    from nansentinel.checks.pipeline import StageWatch

    missing("pipelining")
    stage = SimpleNamespace(submod=nn.Linear(2, 2), is_first=True, is_last=True, stage_index=0,
                            _shape_inference=None)  # the probe said no (patched)
    with pytest.raises(insides.TorchTooOld, match=r"pipeline stage boundary checks .*torch >= "):
        StageWatch(stage, torch.device("cpu"))


def test_a_stage_without_a_known_inference_pass_is_refused_not_watched() -> None:
    """The pass over zero tensors must never be taken for a micro-batch: no silent skip."""
    from nansentinel.checks.pipeline import StageWatch

    stage = SimpleNamespace(submod=nn.Linear(2, 2), is_first=True, is_last=True,
                            stage_index=0)
    with pytest.raises(insides.TorchTooOld):
        StageWatch(stage, torch.device("cpu"))


def test_the_real_stage_has_the_seam_the_room_names() -> None:
    from torch.distributed.pipelining import PipelineStage

    names = insides.shape_inference_methods(PipelineStage)
    assert all(callable(getattr(PipelineStage, n)) for n in names)


# --- the guard: nobody else reads torch's insides ---------------------------------------------

#: Private attributes of torch objects (groups, FSDP states, stages, schedules, handlers,
#: optimizers, backends) that the package reads through the room.
PRIVATE_SEAMS = {
    "_fsdp_param_groups", "_fsdp_param_group", "_get_fsdp_state", "_reduce_scatter_comm",
    "_all_reduce_process_group", "_step_supports_amp_scaling", "_get_backend", "_device_types",
    "_timeout", "_get_sequence_number_for_group", "_loss_fn", "_has_backward", "_stage",
    "_stages", "_stop_heartbeats", "_op_executor", "_store", "_shape_inference",
    "_forward_metadata_inference", "_backward_metadata_inference", "_get_default_group",
    "_get_default_store", "_world", "_resolve_process_group", "_dump_nccl_trace",
}
TORCH_NAMES = {"torch", "dist"}


def _chain(node: ast.Attribute) -> list[str]:
    parts: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    if isinstance(current, ast.Name):
        parts.append(current.id)
    return parts[::-1]


def _private_reads(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
            private = [p for p in node.module.split(".") if p.startswith("_")]
            private += [a.name for a in node.names if a.name.startswith("_")]
            if private:
                found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Attribute):
            chain = _chain(node)
            if chain and chain[0] in TORCH_NAMES and any(
                    p.startswith("_") and not p.startswith("__") for p in chain[1:]):
                found.append(f"{path.name}:{node.lineno} {'.'.join(chain)}")
            elif node.attr in PRIVATE_SEAMS and chain[:1] not in (["self"], ["cls"]):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in PRIVATE_SEAMS):
            found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_only_the_room_reads_torchs_insides() -> None:
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != ROOM
                 for hit in _private_reads(path)]
    assert offenders == [], "read torch's private seams through common/torch_insides.py"


def test_the_guard_sees_each_kind_of_read(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nimport torch.distributed as dist\n"
        "from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter\n"
        "torch._foreach_norm([])\n"
        "dist.distributed_c10d._get_default_group()\n"
        "state._fsdp_param_groups\n"
        "getattr(opt, '_step_supports_amp_scaling', False)\n"
        "self._store\n"
    )
    hits = _private_reads(sample)
    assert len(hits) == 5, hits
    assert _private_reads(ROOM)  # the room itself does read them
