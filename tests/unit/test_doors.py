"""Types checked at every public door, from the annotations (common/doors.py; issue 59): each
wrong type is a ConfigError or an ArgumentTypeError (a SentinelUsageError and a TypeError)
naming the field or argument, the type given and the type wanted; what the checks cannot read
(a meta tensor) is refused by name, what they can (sparse tensors, a 10**400 loss) is
checked."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import nansentinel
from nansentinel import ArgumentTypeError, ConfigError, SentinelConfig
from nansentinel.common import doors

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("inject", 5, "inject=5 is an int, not a string or None"),
    ("spikes", [], "spikes=[] is a list, not a string (one of 'warn', 'recover')"),
    ("exclusion_file", 3, "is an int, not a string or None"),
    ("job_id", 1.5, "job_id=1.5 is a float, not a string or None"),
    ("metrics_addr", None, "metrics_addr=None is None, not a string"),
    ("run_dir", b"x", "is a bytes, not a string or None"),
    ("skip_list", {}, "skip_list={} is a dict, not a string or None"),
    ("max_dropped", True, "is a bool, not a number"),
    ("host_strikes", 2.0, "host_strikes=2.0 is a float, not an integer"),
    ("policy", ["skip"], "is a list, not a string (one of 'skip'"),
    ("replay", 1, "replay=1 is an int, not True or False"),
])
def test_a_wrong_type_names_the_field_the_type_given_and_wanted(
        field: str, value: object, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        SentinelConfig(**{field: value})
    assert words in str(caught.value) and caught.value.field == field


def test_every_field_refuses_an_object_by_name() -> None:
    """Every annotated field, including any added later, checks its type."""
    for field in dataclasses.fields(SentinelConfig):
        with pytest.raises(ConfigError, match=f"^{field.name}=.* is an object, not "):
            SentinelConfig(**{field.name: object()})


def test_a_path_is_taken_for_a_path_field_and_huge_ints_are_named(tmp_path: Path) -> None:
    assert SentinelConfig(report_dir=tmp_path, exclusion_file=tmp_path / "x").exclusion_file \
        == str(tmp_path / "x")
    with pytest.raises(ConfigError, match="metrics_port=<an integer of 16610 bits> is above"):
        SentinelConfig(metrics_port=10**5000)


@pytest.mark.parametrize(("env", "words"), [
    ([], "env=[] is a list, not a mapping"), ({"A": 1}, "env= holds 'A': 1 (a str to an int)"),
    ({1: "x"}, "env= holds 1: 'x' (an int to a str)")])
def test_an_env_that_is_not_strings_is_named(env: Any, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        SentinelConfig.from_env(env)
    assert words in str(caught.value)


@pytest.fixture
def model() -> torch.nn.Linear:
    return torch.nn.Linear(2, 1)


@pytest.mark.parametrize(("kw", "words"), [
    ({"scopes": [1]}, "scopes=[1] is a list, not a sequence of Scopes"),
    ({"scopes": "abc"}, "scopes='abc' is a str, not a sequence"),
    ({"env": [1]}, "env=[1] is a list, not a mapping of strings to strings or None"),
    ({"replay": 3}, "replay=3 is an int, not a callable or True or False or None"),
    ({"snapshots": [1, 2]}, "snapshots=[1, 2] is a list, not a tuple"),
    ({"group": "g"}, "group='g' is a str, not a ProcessGroup or None"),
])
def test_sentinel_arguments_are_checked_before_anything_is_built(
        model: torch.nn.Linear, kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ArgumentTypeError) as caught:
        nansentinel.Sentinel(model, None, **kw)
    assert words in str(caught.value)
    assert isinstance(caught.value, TypeError | nansentinel.SentinelUsageError)


def test_none_as_the_model_is_named(model: torch.nn.Linear) -> None:
    with pytest.raises(nansentinel.SentinelUsageError, match=r"needs a torch.*NoneType"):
        nansentinel.Sentinel(None, torch.optim.SGD(model.parameters(), 0.1))  # type: ignore[arg-type]


def _sentinel(model: torch.nn.Module, tmp_path: Path) -> nansentinel.Sentinel:
    opt = torch.optim.SGD(model.parameters(), 0.1)
    return nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), metrics_port=0,
                                replay=False, save_batches=False)


def test_sparse_batches_are_checked_a_meta_one_refused_and_a_huge_loss_is_inf(
        model: torch.nn.Linear, tmp_path: Path) -> None:
    s = _sentinel(model, tmp_path)
    try:
        s.check_batch({"coo": torch.randn(3, 2).to_sparse(),
                       "csr": torch.randn(3, 2).to_sparse_csr()})
        with pytest.raises(ArgumentTypeError, match="tensor #1 is a meta tensor"):
            s.check_batch([torch.ones(2), torch.empty(3, device="meta")])
        with pytest.raises(ArgumentTypeError, match=r"check_loss .* a meta tensor"):
            s.check_loss(torch.empty((), device="meta"))
        s.check_loss(10**400)
        model(torch.randn(3, 2)).sum().backward()
        result = s.step()
        assert result.kinds == ["loss"] and not result.applied
        s.check_loss(1e308)  # past fp32: torch.full refused it (found by the fuzz)
        model(torch.randn(3, 2)).sum().backward()
        assert s.step().kinds == ["loss"]
        bad = torch.sparse_coo_tensor([[0], [1]], [float("nan")], (3, 2))
        s.check_batch({"x": bad})
        s.check_loss(1.0)
        model(torch.randn(3, 2)).sum().backward()
        assert s.step().kinds == ["batch"]
    finally:
        s.close()


@pytest.mark.parametrize(("state", "words"), [
    (None, "got None"), ({"step": "x"}, "whose 'step' is a str"), ([1], "got a list"),
    ({"step": 10**400}, "whose 'step' is an int"),
    ({"step": 3, "spikes": []}, "does not load (AttributeError"),
    ({"step": 3, "consecutive_skips": "x"}, "does not load (ValueError"),
])
def test_a_malformed_state_is_refused_and_the_state_kept(
        model: torch.nn.Linear, tmp_path: Path, state: Any, words: str) -> None:
    s = _sentinel(model, tmp_path)
    try:
        s.load_state_dict({"step": 5, **s.state_dict()} | {"step": 5})
        saved = s.state_dict()
        with pytest.raises(ArgumentTypeError, match="load_state_dict") as caught:
            s.load_state_dict(state)
        assert words in str(caught.value)
        assert s.step_index == 5 and s.state_dict() == saved
    finally:
        s.close()


def test_doors_describe_the_types_they_hold_values_to() -> None:
    assert doors.refusal("x", True, int) == "x=True is a bool, not an integer"
    assert doors.refusal("x", 3, float) is None and doors.refusal("x", 3, int | None) is None
    assert doors.refusal("x", (1,), tuple[Any, Any]) == "x=(1,) is a tuple, not a tuple"
    assert doors.conforms({"a": "b"}, dict[str, str]) and not doors.conforms({"a": 1},
                                                                              dict[str, str])


def test_a_path_field_that_cannot_be_what_it_names_is_refused_by_its_variable(
        tmp_path: Path) -> None:
    """NANSENTINEL_RUN_DIR set to a file was accepted, and close() then raised a bare
    NotADirectoryError; a FIFO as the exclusion file blocked the launcher."""
    import os

    afile, fifo = tmp_path / "file", tmp_path / "fifo"
    afile.write_text("")
    os.mkfifo(fifo)
    for var, value, words in (
            ("NANSENTINEL_RUN_DIR", afile, "exists and is not a directory"),
            ("NANSENTINEL_REPORT_DIR", afile / "sub", "exists and is not a directory"),
            ("NANSENTINEL_EXCLUSION_FILE", fifo, "is not a regular file"),
            ("NANSENTINEL_SKIP_LIST", tmp_path, "is not a regular file")):
        with pytest.raises(ConfigError) as caught:
            SentinelConfig.from_env({var: str(value)})
        assert words in str(caught.value) and str(caught.value).endswith(
            f"(from environment variable {var})"), str(caught.value)
