"""Options and directories a command cannot use are one line and exit 2, before any worker
starts: never a bare PermissionError/NotADirectoryError, an empty AssertionError, or a
traceback from every rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nansentinel import cli
from nansentinel.common import exitcodes


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("")
    return path


def test_run_with_an_impossible_report_dir_names_it(
    a_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NANSENTINEL_RUN_DIR", raising=False)
    argv = ["run", f"--report-dir={a_file}/reports", "--standalone", "--nproc-per-node=1",
            "script.py"]
    assert cli.main(argv) == exitcodes.EXIT_CONFIG
    assert "--report-dir" in _one_line(capsys)


def test_run_with_an_impossible_run_dir_names_the_variable(
    a_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NANSENTINEL_RUN_DIR", str(a_file / "run"))
    argv = ["run", "--standalone", "--nproc-per-node=1", "script.py"]
    assert cli.main(argv) == exitcodes.EXIT_CONFIG
    assert "NANSENTINEL_RUN_DIR" in _one_line(capsys)


@pytest.mark.parametrize("n", ["0", "-2"])
def test_run_with_no_worker_per_node_says_so(
    n: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NANSENTINEL_RUN_DIR", raising=False)
    argv = ["run", f"--report-dir={tmp_path}", "--standalone", f"--nproc-per-node={n}",
            "script.py"]
    assert cli.main(argv) == exitcodes.EXIT_CONFIG
    assert f"--nproc-per-node={n}" in _one_line(capsys)
    assert not any((tmp_path / "runs").iterdir()) if (tmp_path / "runs").exists() else True


@pytest.mark.parametrize(("argv", "named"), [
    (["--sleep", "-1"], "--sleep"), (["--sleep", "nan"], "--sleep"),
    (["--nproc", "0"], "--nproc"), (["--steps", "-1"], "--steps"),
    (["--nproc", "2", "--inject", "kind=grad,rank=2,step=1"], "rank 2"),
    (["--exchange-timeout", "1"], "unrecognized"),
])
def test_demo_refuses_before_starting_a_rank(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nansentinel.launcher import run

    monkeypatch.setattr(run, "main", lambda *a: pytest.fail("a rank was started"))
    assert cli.main(["demo", *argv]) == exitcodes.EXIT_CONFIG
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_a_small_demo_moves_its_default_fault_onto_a_rank_it_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nansentinel.launcher import run

    monkeypatch.delenv("NANSENTINEL_INJECT", raising=False)
    seen: dict[str, str] = {}

    def fake(argv: list[str]) -> int:
        import os

        seen["inject"] = os.environ["NANSENTINEL_INJECT"]
        return 0

    monkeypatch.setattr(run, "main", fake)
    before = dict(os.environ)
    assert cli.main(["demo", "--nproc", "2"]) == 0
    assert "rank=1" in seen["inject"]
    # The ranks' settings were the launch's alone: an in-process caller keeps its environment.
    assert dict(os.environ) == before
