"""What a newcomer hit on the command line (issue 59): ``--version``, ``incidents --json |
head`` without a "Broken pipe" line, the reading commands without torch, ``run missing.py``
refused before a worker starts, and a variable's error naming the variable, not a flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nansentinel import __version__, cli

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _reports(directory: Path, count: int) -> Path:
    for step in range(count):
        report = {"step": step, "time": 1700000000 + step, "job_id": "job", "bad_ranks": [1],
                  "bad_hosts": ["node1"], "kinds": ["grad"], "outcome": "skipped"}
        (directory / f"incident-job-step{step:08d}.json").write_text(json.dumps(report))
    return directory


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"nansentinel {__version__} ")


def test_a_reader_that_stops_early_gets_no_broken_pipe_line(tmp_path: Path) -> None:
    _reports(tmp_path, 400)  # ~150 KB of JSON: more than a pipe holds
    proc = subprocess.Popen([sys.executable, "-m", "nansentinel", "incidents", "--json",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env())
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(10).startswith(b"[")
    proc.stdout.close()  # what `head` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == cli.EXIT_BROKEN_PIPE
    assert err == "", err


@pytest.mark.parametrize("command", ["incidents", "excluded"])
def test_the_reading_commands_do_not_import_torch(tmp_path: Path, command: str) -> None:
    _reports(tmp_path, 3)
    exclusions = tmp_path / "excluded.jsonl"
    exclusions.write_text('{"host": "n", "reason": "r", "step": 1, "time": 1}\n')
    argv = [command, str(tmp_path)] if command == "incidents" else [
        command, "--exclusion-file", str(exclusions)]
    code = ("import sys; from nansentinel.cli import main; code = main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("node1" if command == "incidents" else "n  step 1") in done.stdout


def test_run_of_a_missing_script_starts_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reports = tmp_path / "reports"
    code = cli.main(["run", f"--report-dir={reports}", "--standalone", "--nproc-per-node=1",
                     str(tmp_path / "missing.py")])
    err = capsys.readouterr().err
    assert code == 2 and "missing.py: no such file (nothing was started)" in err
    assert not reports.exists() or not any((reports / "runs").glob("*"))


@pytest.mark.parametrize(("variable", "value"), [
    ("NANSENTINEL_METRICS_PORT", "abc"), ("NANSENTINEL_METRICS_PORT", "70000"),
    ("NANSENTINEL_REPORT_DIR", ""), ("NANSENTINEL_RUN_DIR", "FILE")])
def test_a_variables_error_names_the_variable_not_a_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        variable: str, value: str) -> None:
    if value == "FILE":
        value = str(tmp_path / "a-file")
        Path(value).write_text("")
    monkeypatch.setenv(variable, value)
    assert cli.main(["demo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert variable in err and "--metrics-port" not in err and "--report-dir" not in err, err
    assert len(err.splitlines()) == 1


def test_a_path_that_is_not_utf8_is_printed_escaped(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the type-drawn fuzz: a path argument with bytes that are not UTF-8 (Python
    keeps them as lone surrogates) failed the command with a UnicodeEncodeError."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["excluded", "--exclusion-file", "ex\udcff"]) == 0
    assert "ex\\udcff" in capsys.readouterr().out
