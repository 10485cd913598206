"""``nansentinel files``: every shipped set is written out whole, scripts executable, and
nothing a user has is overwritten (tests/e2e/test_install.py does the same from a wheel)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from nansentinel import cli
from nansentinel.common.exitcodes import EXIT_CONFIG
from nansentinel.files import SETS, package_files

ROOT = Path(__file__).resolve().parents[2]
PACKAGED = ROOT / "nansentinel" / "files"


def test_each_set_is_a_folder_of_the_package_and_every_folder_a_set() -> None:
    folders = {p.name for p in PACKAGED.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(SETS)


@pytest.mark.parametrize("name", sorted(SETS))
def test_a_set_is_written_whole_with_scripts_executable(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert cli.main(["files", name, str(out)]) == 0
    written, said = capsys.readouterr()
    source = {str(p.relative_to(PACKAGED / name)) for p in (PACKAGED / name).rglob("*")
              if p.is_file()}
    got = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert got == source == set(package_files(name)) and got
    assert written.split() == [str(out / rel) for rel in package_files(name)]
    assert f"wrote {len(got)} files of set {name!r}" in said and SETS[name].docs in said
    for rel in got:
        data = (PACKAGED / name / rel).read_bytes()
        assert (out / rel).read_bytes() == data
        executable = bool((out / rel).stat().st_mode & stat.S_IXUSR)
        assert executable == data.startswith(b"#!"), rel


def test_the_slurm_scripts_run_from_where_they_were_written(tmp_path: Path) -> None:
    """Written out, the batch script still refuses outside a job with its own message (it
    found bash and its settings), and the drain program still parses its options."""
    assert cli.main(["files", "slurm", str(tmp_path)]) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    batch = subprocess.run([str(tmp_path / "nansentinel.sbatch"), "train.py"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert batch.returncode == 2 and "not inside a Slurm job" in batch.stderr, batch.stderr
    drain = subprocess.run([str(tmp_path / "nansentinel-drain"), "--help"],
                           capture_output=True, text=True, timeout=30)
    assert drain.returncode == 0 and "--exclusion-file" in drain.stdout, drain.stderr


def test_nothing_a_user_has_is_overwritten(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "prometheus" / "prometheus.yml"
    mine.parent.mkdir()
    mine.write_text("my own config\n")
    (tmp_path / "runbook.md").symlink_to(tmp_path / "nowhere")  # a dangling link counts too
    assert cli.main(["files", "monitoring", str(tmp_path)]) == EXIT_CONFIG
    out, err = capsys.readouterr()
    assert out == "" and "nothing was written" in err
    assert str(mine) in err and str(tmp_path / "runbook.md") in err
    assert mine.read_text() == "my own config\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["prometheus", "prometheus.yml",
                                                            "runbook.md"]


def test_the_listing_and_the_usage_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["files"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in SETS) and "nansentinel.sbatch" in listed
    assert "prometheus/rules/nansentinel.rules.yml" in listed
    assert cli.main(["files", "slurm"]) == EXIT_CONFIG
    assert "name the folder" in capsys.readouterr().err
    assert cli.main(["files", "grafana", str(tmp_path)]) == EXIT_CONFIG
    assert "invalid choice: 'grafana'" in capsys.readouterr().err
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert cli.main(["files", "torchrun", str(blocked / "sub")]) == EXIT_CONFIG
    assert "nansentinel files: error:" in capsys.readouterr().err
