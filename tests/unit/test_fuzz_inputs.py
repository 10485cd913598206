"""Fuzz: every input a user or another host can hand the package -- a NANSENTINEL_* variable, a
command line, an incident report, an exclusion file -- gives either success or our own clear
error (ConfigError / SentinelUsageError in Python; exit 2 with one line on stderr from the CLI),
never a hang and never a bare traceback.

Property-based (hypothesis), bounded: a few dozen examples a property, the CLI called in-process
(``nansentinel.cli.main(argv)``), nothing launched (the launch itself is stubbed), so the whole
file runs in seconds."""

from __future__ import annotations

import json
import math
import string
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nansentinel import cli
from nansentinel.common.exclusion import ExclusionStore
from nansentinel.config import _PARSERS, KNOWN_ENV, ConfigError, SentinelConfig, maximum

FAST = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# --- what hostile values look like ------------------------------------------------------------

NUMBERS = st.sampled_from([
    "inf", "-inf", "nan", "NaN", "1e999", "-1e999", "1e300", "1e40", str(10**40), "-1", "0",
    "0.0", "1", "2", "3", "1.5", "65535", "65536", "86400", "86401", "3600", "1000000",
    "2147483647", "2147483648", "9" * 400, "1_0", "0x10", " 7 ", "٣",
])
TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
               max_size=30)
RAW = st.one_of(NUMBERS, TEXT, st.sampled_from(["", " ", "\x1b[31m", "true", "skip", "abort"]))
JSON_ATOMS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), TEXT,
    st.sampled_from([1e300, -1e300, 1e999, float("nan"), "nan", "\x1b[2J", "x" * 300]),
)
JSON_VALUES = st.recursive(JSON_ATOMS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)


# --- NANSENTINEL_* -------------------------------------------------------------------------------


@FAST
@given(st.dictionaries(st.sampled_from(sorted(KNOWN_ENV)), RAW, min_size=1, max_size=4))
def test_any_environment_gives_a_sound_config_or_a_config_error(env: dict[str, str]) -> None:
    try:
        cfg = SentinelConfig.from_env(env)
    except ConfigError as exc:
        assert any(var in str(exc) for var in env), (env, str(exc))
        assert len(str(exc)) < 600, "the message buries the point"
        return
    for field, kind in _PARSERS.items():
        value = getattr(cfg, field)
        if kind in ("int", "float") and value is not None and not isinstance(value, bool):
            assert math.isfinite(value) and value <= maximum(field), (field, value)


# --- the command line ----------------------------------------------------------------------------

RUN_FLAGS = ["--metrics-port", "--report-dir", "--exclusion-file", "--host-strikes",
             "--strike-window", "--exchange-timeout", "--job-id", "--on-exclude"]
TORCHRUN = st.lists(st.sampled_from([
    "--standalone", "--nproc-per-node=0", "--nproc-per-node=-1", "--nproc-per-node=2",
    "--nproc-per-node=x", "--nnodes=3:1", "--nnodes=0", "--nnodes=a", "--max-restarts=-1",
    "--rdzv-backend=static", "--rdzv-backend=bogus", "--bogus", "-m",
]), max_size=3)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """Nothing is launched: ``run`` stops where torchrun would start, ``demo`` before ``run``."""
    from nansentinel.launcher import run

    calls: list[list[str]] = []
    monkeypatch.setattr(run, "launch", lambda *a, **k: calls.append(["launch"]) or 0)
    monkeypatch.chdir(tmp_path)
    for var in KNOWN_ENV:
        monkeypatch.delenv(var, raising=False)
    return calls


def _clean_exit(code: object, err: str) -> None:
    assert isinstance(code, int), code
    assert "Traceback" not in err, err
    if code != 0:
        assert code == 2, (code, err)
        assert err.strip(), "a refusal says why"


@FAST
@given(st.lists(st.tuples(st.sampled_from(RUN_FLAGS), RAW), max_size=3), TORCHRUN)
def test_run_refuses_any_bad_option_in_one_line(
    no_launch: list[list[str]], capsys: pytest.CaptureFixture[str],
    flags: list[tuple[str, str]], torchrun: list[str],
) -> None:
    argv = ["run", *(f"{f}={v}" for f, v in flags), *torchrun, "script.py"]
    try:
        code = cli.main(argv)
    finally:
        err = capsys.readouterr().err
    _clean_exit(code, err)


DEMO = st.lists(st.tuples(st.sampled_from([
    "--nproc", "--steps", "--sleep", "--policy", "--inject", "--metrics-port"]), RAW), max_size=3)


@FAST
@given(DEMO)
def test_demo_refuses_any_bad_option_before_a_rank_starts(
    no_launch: list[list[str]], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, flags: list[tuple[str, str]],
) -> None:
    from nansentinel.launcher import run

    monkeypatch.setattr(run, "main", lambda argv: 0)
    try:
        code = cli.main(["demo", *(f"{f}={v}" for f, v in flags)])
    finally:
        err = capsys.readouterr().err
    _clean_exit(code, err)


# --- exclusion files ---------------------------------------------------------------------------

RECORD = st.fixed_dictionaries({}, optional={
    "host": st.one_of(st.sampled_from(["h1", "h2", "\x1b[31mred"]), JSON_ATOMS),
    "reason": JSON_ATOMS, "step": JSON_ATOMS, "time": JSON_ATOMS, "job_id": JSON_ATOMS,
    "evidence": JSON_VALUES,
})
LINE = st.one_of(
    RECORD.map(lambda r: json.dumps(r, allow_nan=True)),
    JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True)),
    st.text(string.printable, max_size=40),
    st.sampled_from(["[" * 5000, '{"host": "h1"', "NaN", "{}"]),
)


@FAST
@given(st.lists(LINE, max_size=6))
def test_any_exclusion_file_lists_clears_and_prints_valid_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[str]
) -> None:
    path = Path(tempfile.mkdtemp(dir=tmp_path)) / "excluded.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    records = ExclusionStore(path).records()
    base = ["excluded", "--exclusion-file", str(path)]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert cli.main([*base, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out,
                      parse_constant=lambda c: pytest.fail(f"bare {c} in --json"))
    assert len(rows) == len(records)
    for host in {r.host for r in records} | {"h1"}:
        assert cli.main([*base, "--clear", host]) == 0
    capsys.readouterr()
    assert not ExclusionStore(path).records()  # every readable record was cleared
    assert "h1" not in {_host(line) for line in path.read_text().splitlines()}


def _host(line: str) -> Any:
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return data.get("host") if isinstance(data, dict) else None


# --- incident reports --------------------------------------------------------------------------

REPORT = st.fixed_dictionaries({}, optional={
    "step": st.one_of(st.integers(-5, 10**12), JSON_ATOMS),
    "time": JSON_ATOMS, "job_id": JSON_ATOMS, "outcome": JSON_ATOMS, "verdict": JSON_ATOMS,
    "bad_ranks": JSON_VALUES, "bad_hosts": JSON_VALUES, "kinds": JSON_VALUES,
    "cluster": JSON_VALUES, "spikes": JSON_VALUES, "ranks": JSON_VALUES,
    "origin_trace": JSON_VALUES, "world_size": JSON_ATOMS, "policy": JSON_ATOMS,
    "rolled_back_to": JSON_ATOMS, "excluded_host": JSON_ATOMS, "injected": JSON_ATOMS,
    "history": JSON_VALUES,
})


@FAST
@given(st.lists(st.one_of(REPORT.map(lambda r: json.dumps(r, allow_nan=True)),
                          st.sampled_from(["[" * 5000, "{", "null", "[]"])),
                min_size=1, max_size=4))
def test_any_report_directory_lists_and_shows_in_one_line_per_bad_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], texts: list[str]
) -> None:
    reports = Path(tempfile.mkdtemp(dir=tmp_path))  # tmp_path is shared by the examples
    for n, text in enumerate(texts, 1):
        (reports / f"incident-job-step{n:08d}.json").write_text(text, encoding="utf-8")
    code = cli.main(["incidents", str(reports)])
    out, err = capsys.readouterr()
    _clean_exit(code, err)
    assert "\x1b" not in out + err
    assert len(err.splitlines()) <= len(texts)  # one line per bad report at most
    for n in range(1, len(texts) + 1):
        code = cli.main(["incidents", "show", str(n), "--dir", str(reports)])
        out, err = capsys.readouterr()
        _clean_exit(code, err)
        assert "\x1b" not in out + err
        if code:
            assert len(err.splitlines()) == 1, err
