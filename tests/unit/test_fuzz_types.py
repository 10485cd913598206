"""Fuzz drawn from the types themselves (issue 59): hostile values for every annotated
SentinelConfig field and typed Sentinel(...) argument (from the annotations the doors check),
for every flag of every command (from the commands' own parsers), and hostile files for every
reader of files from outside: huge integers, special files (FIFO, /dev/zero, a directory),
invalid UTF-8, deep nesting, wrong types.

The oracle: success, or one clear line / the documented exception (ConfigError,
ArgumentTypeError and SentinelUsageError in Python; exit 0 or 2 without a traceback from the
CLI; ReportError, OSError or ValueError from a reader), within a time bound, and no byte of
any other file changed. Derandomized and bounded: the file runs in well under a minute."""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nansentinel
from nansentinel import cli
from nansentinel.common import doors, untrusted
from nansentinel.common.exclusion import ExclusionStore, names_host
from nansentinel.common.verdicts import read_verdicts
from nansentinel.config import _HINTS, KNOWN_ENV, ConfigError, SentinelConfig, maximum
from nansentinel.reading import incidents
from nansentinel.skip_list import load as load_skip_list
from nansentinel.step.sentinel import _argument_hints

pytestmark = pytest.mark.timeout(120)

FAST = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
#: A call of the package on one hostile value, at most (a hang or an unbounded read is a fail).
BOUND_S = 5.0

# --- hostile values, from a type ----------------------------------------------------------------


class _Huge(int):
    """An int past ``str()``'s 4,300 digits whose own repr is safe (hypothesis prints it)."""

    def __repr__(self) -> str:
        return f"<an int of {self.bit_length()} bits>"


WRONG = st.sampled_from([
    None, True, False, 0, -1, 10**400, -(10**400), _Huge(10**5000), math.nan, math.inf, -math.inf,
    1e308, "", "x", "\udcff", "\x1b[2J", b"\xff", [], {}, (), [[[[]]]], {"a": 1}, object(),
    Path("/dev/zero"), 1.5, "9" * 5000,
])


def _of(hint: Any) -> st.SearchStrategy[Any]:
    """Values of the type ``hint`` names, biased to its edges."""
    origin = get_origin(hint)
    if origin in (typing.Union, __import__("types").UnionType):
        return st.one_of(*(_of(arm) for arm in get_args(hint)))
    if origin is Literal:
        choices = get_args(hint)
        return st.one_of(st.sampled_from(choices), st.sampled_from(choices).map(str.upper))
    if hint is type(None) or hint is None:
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.one_of(st.integers(), st.sampled_from([0, -1, 2**31, 2**63, 10**400]))
    if hint is float:
        return st.one_of(st.floats(), st.integers(-10, 10), st.sampled_from([10**400, 1e308]))
    if hint is str:
        return st.one_of(st.text(max_size=12), st.sampled_from(["", " ", "\udcff", "/dev/zero"]))
    return WRONG


def hostile(hint: Any) -> st.SearchStrategy[Any]:
    """What a user may hand a door annotated ``hint``: its own type at the edges, or another."""
    return st.one_of(_of(hint), WRONG)


# --- every annotated field -----------------------------------------------------------------------

FIELDS = sorted(_HINTS)


@st.composite
def field_values(draw: st.DrawFn) -> tuple[str, Any]:
    name = draw(st.sampled_from(FIELDS))
    return name, draw(hostile(_HINTS[name]))


@settings(FAST, max_examples=300)
@given(field_values())
def test_any_value_of_any_field_is_held_to_its_type_or_named(case: tuple[str, Any]) -> None:
    name, value = case
    started = time.monotonic()
    try:
        cfg = SentinelConfig(**{name: value})
    except ConfigError as exc:
        message = str(exc)
        assert name in message and "\n" not in message and len(message) < 600, message
    else:
        held = getattr(cfg, name)
        assert doors.conforms(held, _HINTS[name]) or name == "inject", (name, held)
        if isinstance(held, int | float) and not isinstance(held, bool):
            assert math.isfinite(held) and held <= maximum(name), (name, held)
    assert time.monotonic() - started < BOUND_S


ARGUMENTS = {name: hint for name, hint in _argument_hints().items()
             if name not in ("model", "optimizer", "return", "overrides") and hint is not Any}


@settings(FAST, max_examples=25)
@given(st.sampled_from(sorted(ARGUMENTS)).flatmap(
    lambda name: st.tuples(st.just(name), hostile(ARGUMENTS[name]))))
def test_any_typed_sentinel_argument_is_checked(tmp_path: Path, case: tuple[str, Any]) -> None:
    name, value = case
    model = torch.nn.Linear(2, 1)
    try:
        sentinel = nansentinel.Sentinel(model, None, report_dir=str(tmp_path), metrics_port=0,
                                        **{name: value})
    except (nansentinel.ArgumentTypeError, ConfigError) as exc:
        assert name in str(exc) or isinstance(exc, ConfigError), str(exc)
    except nansentinel.SentinelUsageError:
        pass  # documented: a refusal of what the argument names (a scope's configure)
    else:
        sentinel.close()


LOSSES = st.one_of(hostile(float), st.sampled_from([
    torch.tensor(1.0), torch.tensor([1, 2]), torch.tensor([]), torch.empty((), device="meta"),
    torch.tensor(1.0 + 1j), torch.tensor([1.0, 2.0]).to_sparse(), torch.tensor(math.nan)]))
BATCHES = st.recursive(st.one_of(LOSSES, st.sampled_from([
    torch.ones(2, 2).to_sparse_csr(), torch.empty(2, device="meta")])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=6)
STATES = st.recursive(hostile(int), lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(
        ["step", "spikes", "cooldown", "lr_guard", "quarantine", "consecutive_skips",
         "strikes", "x"]), inner, max_size=4)), max_leaves=6)


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[nansentinel.Sentinel]:
    model = torch.nn.Linear(2, 1)
    s = nansentinel.Sentinel(model, torch.optim.SGD(model.parameters(), 0.1), metrics_port=0,
                             report_dir=str(tmp_path_factory.mktemp("r")), replay=False,
                             save_batches=False)
    yield s
    s.close()


@FAST
@given(BATCHES, LOSSES, STATES)
def test_the_loops_calls_take_any_value_or_refuse_it_by_name(
        sentinel: nansentinel.Sentinel, batch: Any, loss: Any, state: Any) -> None:
    for call, value in ((sentinel.check_batch, batch), (sentinel.check_loss, loss)):
        try:
            call(value)
        except nansentinel.SentinelUsageError as exc:  # ArgumentTypeError included
            assert "\n" not in str(exc), str(exc)
    before = sentinel.state_dict()
    try:
        sentinel.load_state_dict(state)
    except nansentinel.ArgumentTypeError:
        assert sentinel.state_dict() == before  # nothing half-loaded
    else:
        sentinel.load_state_dict(before)


# --- every flag of every command, every file a reader takes -------------------------------


def _parsers() -> dict[str, list[argparse.Action]]:
    """Each command's parser's actions, read from the parsers themselves (a flag added later
    is fuzzed too): every command is started with parse_args stopped at once."""
    seen: dict[str, list[argparse.Action]] = {}

    def grab(self: argparse.ArgumentParser, *_: Any, **__: Any) -> Any:
        seen[self.prog.removeprefix("nansentinel ")] = list(self._actions)
        raise SystemExit(0)

    real = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab  # type: ignore[method-assign]
    try:
        for argv in (["demo"], ["incidents"], ["incidents", "show", "1"], ["excluded"],
                     ["run", "x.py"]):
            cli.main(argv)
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    return seen


FLAGS = [(command, action) for command, actions in _parsers().items() for action in actions
         if action.dest != "help" and action.nargs != 0]

HOSTILE_BYTES = st.one_of(
    st.sampled_from([
        b'{"step": ' + b"1" * 5000 + b"}", b"[" * 100_000, b'{"time": NaN}', b"\xef\xbb\xbf{}",
        b'{"step": 1, "ti', b"\xff\xfe\x00", b'{"host": "h", "step": 1, "time": 1}\n' * 3,
        b'{"host": "h", "evidence": ' + b"[" * 5000 + b"]" * 5000 + b"}\n", b"",
        b'{"ids": [1, 2]}\n{"ids": [' + b"9" * 5000 + b"]}\n", b'{"outcome": "x"}']),
    st.binary(max_size=64))


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A scratch directory with special files, hostile files, and canary files whose bytes
    must never change; nothing is launched (``run`` stops before torchrun starts)."""
    from nansentinel.launcher import run

    monkeypatch.setattr(run, "launch", lambda *a, **k: 0)
    monkeypatch.setattr(run, "main", run.main)
    for var in KNOWN_ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "x.py").write_text("")
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "bytes").write_bytes(b"\xff\xfe keep me\r\n")
    (canary / "excluded.jsonl").write_bytes(b'{"host": "other", "step": 1, "time": 1}\n\xff\n')
    return {"root": tmp_path, "canary": canary}


def _digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.is_file()}


def _path_values(root: Path) -> st.SearchStrategy[str]:
    return st.sampled_from([str(root / "fifo"), "/dev/zero", str(root / "dir"),
                            str(root / "missing" / "x"), "", str(root / "hostile"),
                            str(root / "incident-j-step00000001.json"), "\udcff"])


@st.composite
def command_lines(draw: st.DrawFn, root: Path) -> list[str]:
    command, action = draw(st.sampled_from(FLAGS))
    if action.type in (int, float):
        value = draw(st.sampled_from(["nan", "inf", "-1", "9" * 5000, "1e999", "0x10", "", "3"]))
    elif action.dest == "html":
        value = str(root / "dir" / draw(st.sampled_from(["page.html", "", "x/y.html"])))
    elif action.dest in ("dir", "report_dir", "exclusion_file", "id"):
        value = draw(_path_values(root))
    else:
        value = draw(st.one_of(st.text(max_size=10), st.sampled_from(["9" * 5000, "\udcff"])))
    head = command.split()
    flag = f"{action.option_strings[0]}={value}" if action.option_strings else value
    tail = {"incidents show": ["1"], "run": ["--standalone", "x.py"]}.get(command, [])
    if command == "incidents show" and not action.option_strings:
        tail = []
    return [*head, flag, *tail]


@FAST
@given(st.data(), HOSTILE_BYTES)
def test_any_flag_of_any_command_ends_in_one_clear_line(
        world: dict[str, Any], capsys: pytest.CaptureFixture[str], data: st.DataObject,
        content: bytes) -> None:
    root = world["root"]
    (root / "hostile").write_bytes(content)
    (root / "incident-j-step00000001.json").write_bytes(content)
    argv = data.draw(command_lines(root))
    before = _digest(world["canary"])
    started = time.monotonic()
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert time.monotonic() - started < BOUND_S * 4, argv
    assert code in (0, 2) and "Traceback" not in err, (argv, code, err)
    assert _digest(world["canary"]) == before


READERS: dict[str, Callable[[Path], object]] = {
    "report": incidents.load,
    "exclusion file": lambda p: ExclusionStore(p).records(),
    "skip list": load_skip_list,
    "verdicts": lambda p: read_verdicts(p.parent.parent),
    "json": untrusted.load_json,
}


@FAST
@given(st.sampled_from(sorted(READERS)), HOSTILE_BYTES, st.sampled_from(
    ["file", "fifo", "/dev/zero", "dir", "big"]))
def test_any_file_a_reader_takes_is_read_or_refused_by_name(
        world: dict[str, Any], reader: str, content: bytes, kind: str) -> None:
    root = world["root"]
    verdicts = root / "run" / "verdicts"
    verdicts.mkdir(parents=True, exist_ok=True)
    path = verdicts / "rank-0.json"
    path.unlink(missing_ok=True)
    if kind == "file":
        path.write_bytes(content)
    elif kind == "big":
        path.write_bytes(b" " * (untrusted.MAX_BYTES + 1))
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    before = _digest(world["canary"])
    started = time.monotonic()
    try:
        READERS[reader](path)
    except (incidents.ReportError, OSError, ValueError) as exc:
        assert "\n" not in str(exc).strip(), str(exc)
    assert time.monotonic() - started < BOUND_S
    assert _digest(world["canary"]) == before
    if kind == "dir":
        path.rmdir()
    else:
        path.unlink()


@FAST
@given(st.lists(st.one_of(HOSTILE_BYTES, st.sampled_from([
    b'{"host": "h", "step": ' + b"1" * 5000 + b"}", b'{"host": "h", "st', b"\xef\xbb\xbf"
    b'{"host": "h"}', b'{"evidence": {"host": "h"}, "host": "o", "step": 1, "time": 1}'])),
    max_size=6), st.sampled_from(["h", "o", "\udcff"]))
def test_clear_changes_only_the_lines_that_name_the_host(
        world: dict[str, Any], lines: list[bytes], host: str) -> None:
    path = world["root"] / "excluded.jsonl"
    data = b"\n".join(lines) + (b"\n" if lines else b"")
    path.write_bytes(data)
    before = _digest(world["canary"])
    ExclusionStore(path).clear(host)
    kept = [line for line in untrusted.split_lines(data) if not names_host(line, host)]
    assert path.read_bytes() == b"".join(kept)
    assert _digest(world["canary"]) == before
