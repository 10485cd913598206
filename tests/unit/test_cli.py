"""The ``nansentinel`` command: usage, unknown commands, ``demo`` validation, ``excluded``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nansentinel
from nansentinel import cli
from nansentinel.common import exitcodes
from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.config import KNOWN_ENV

REPO = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000  # 2023-11-14 22:13:20Z


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No NANSENTINEL_* from the caller's shell; and a demo that got past its validation would
    fail here instead of starting torchrun."""
    for var in KNOWN_ENV:
        monkeypatch.delenv(var, raising=False)

    def no_launch(argv: list[str] | None = None) -> int:
        raise AssertionError(f"nansentinel run was called with {argv}")

    import nansentinel.launcher.run as run

    monkeypatch.setattr(run, "main", no_launch)


def test_no_arguments_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == exitcodes.EXIT_CONFIG == 2
    assert capsys.readouterr().out == cli.USAGE


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_exits_0(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([flag]) == exitcodes.EXIT_OK
    out = capsys.readouterr().out
    assert out == cli.USAGE
    assert out.startswith("usage: nansentinel {run,demo,excluded,incidents,files,store} ...\n")
    for command in ("run", "demo", "excluded", "incidents", "store"):
        assert f"\n  {command}  " in out


def test_unknown_command_is_2_and_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["frobnicate", "--x"]) == exitcodes.EXIT_CONFIG
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"nansentinel: unknown command 'frobnicate'\n{cli.USAGE}"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--policy", "bogus"],
         "nansentinel demo: error: policy='bogus' is not a known policy; expected one of skip, "
         "abort, rollback, drop"),
        (["--inject", "kind=nope"], "nansentinel demo: error: inject='kind=nope': "),
    ],
)
def test_demo_bad_value_is_one_config_error_line(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["demo", *argv]) == exitcodes.EXIT_CONFIG
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(line)
    assert captured.err.count("\n") == 1 and captured.err.endswith("\n")
    assert "Traceback" not in captured.err
    assert "NANSENTINEL_POLICY" not in os.environ  # validated, nothing exported
    # The value came from the command line: the option is named, no variable is blamed.
    assert f"(from {argv[0]})" in captured.err and "environment variable" not in captured.err


def test_demo_bad_policy_from_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("NANSENTINEL_POLICY", "bogus")
    assert cli.main(["demo"]) == exitcodes.EXIT_CONFIG
    assert capsys.readouterr().err == (
        "nansentinel demo: error: policy='bogus' is not a known policy; expected one of skip, "
        "abort, rollback, drop (from environment variable NANSENTINEL_POLICY)\n"
    )


def test_demo_bad_number_is_argparses_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--nproc", "four"]) == 2  # returned: main(argv) never exits
    assert "argument --nproc: invalid int value: 'four'" in capsys.readouterr().err


#: A stop the sentinel decided, as the demo's loop meets it, and the code its worker exits with.
_STOPS = [
    (nansentinel.NonFiniteError("nansentinel: aborted at step 5", None),  # type: ignore[arg-type]
     exitcodes.EXIT_NONFINITE_ABORT),
    (nansentinel.HostExcludedError("nansentinel: node-b excluded", None),  # type: ignore[arg-type]
     exitcodes.EXIT_HOST_EXCLUDED),
    (nansentinel.ExchangeTimeoutError("nansentinel: no answer from rank 1", [1]),
     exitcodes.EXIT_EXCHANGE_TIMEOUT),
]


@pytest.mark.parametrize(("error", "code"), _STOPS)
def test_a_demo_worker_stopped_by_the_sentinel_exits_with_the_launchers_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    error: Exception, code: int,
) -> None:
    """Under plain torchrun the worker's own code says which stop it was (abort 3, exclusion
    4, a missing rank 5), as ``nansentinel run`` says from the verdicts; one line, no
    traceback."""
    from nansentinel import demo

    def stopped(args: object) -> int:
        raise error

    monkeypatch.setattr(demo, "_train", stopped)
    monkeypatch.setenv("RANK", "1")
    assert demo.main(["--steps", "1"]) == code
    said = str(error).removeprefix("nansentinel: ")
    assert capsys.readouterr().err == f"rank 1: stopped: {said}\n"


def _store(tmp_path: Path) -> ExclusionStore:
    store = ExclusionStore(tmp_path / "excluded.jsonl")
    store.add(ExclusionRecord(host="node-b", reason="3 strikes in 100 steps", step=42,
                              evidence={"bad_ranks": [2, 3], "report_path": None}, time=T0,
                              job_id="job-7"))
    store.add(ExclusionRecord(host="node-c", reason="r", step=50, time=T0, job_id=None))
    return store


def test_excluded_lists_the_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = _store(tmp_path)
    assert cli.main(["excluded", "--exclusion-file", str(store.path)]) == exitcodes.EXIT_OK
    assert capsys.readouterr().out == (
        "node-b  step 42  2023-11-14 22:13:20Z  job job-7\n"
        "    reason:   3 strikes in 100 steps\n"
        "    evidence: bad_ranks=[2, 3]\n"
        "node-c  step 50  2023-11-14 22:13:20Z  job None\n"
        "    reason:   r\n"
    )


def test_excluded_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = _store(tmp_path)
    assert cli.main(["excluded", "--exclusion-file", str(store.path), "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["host"], r["step"], r["job_id"]) for r in records] == [
        ("node-b", 42, "job-7"), ("node-c", 50, None),
    ]


def test_excluded_clear_removes_only_that_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path)
    argv = ["excluded", "--exclusion-file", str(store.path), "--clear", "node-b"]
    assert cli.main(argv) == exitcodes.EXIT_OK
    assert capsys.readouterr().out == (
        f"cleared 1 exclusion record(s) of host node-b from {store.path}\n"
    )
    assert [r.host for r in store.records()] == ["node-c"]
    assert cli.main(argv) == exitcodes.EXIT_OK  # again: nothing left to clear
    assert capsys.readouterr().out.startswith("cleared 0 exclusion record(s) of host node-b")


def test_excluded_empty_file_and_missing_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "none.jsonl"
    assert cli.main(["excluded", "--exclusion-file", str(path)]) == exitcodes.EXIT_OK
    assert capsys.readouterr().out == f"no excluded hosts in {path}\n"
    assert cli.main(["excluded"]) == exitcodes.EXIT_CONFIG
    assert capsys.readouterr().err == (
        "nansentinel excluded: error: no exclusion file; pass --exclusion-file FILE or set "
        "NANSENTINEL_EXCLUSION_FILE\n"
    )


def test_python_dash_m_nansentinel_help() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "nansentinel", "--help"], cwd=REPO, env=env,
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == cli.USAGE
    assert done.stderr == ""
