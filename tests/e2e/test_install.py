"""What an install from an index holds: the wheel, built as ``pip wheel . --no-deps`` builds it,
installed with no source tree beside it, writes out every set of shipped files whole.

About 10 s (the build, in pip's isolated build environment, is most of it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nansentinel.files import SETS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done


def test_the_wheel_ships_every_set_and_writes_it_out(tmp_path: Path) -> None:
    # What a build reads, copied: a stale build/ folder of the checkout cannot ship a file
    # the source no longer has, and nothing beside the package can stand in for it.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "nansentinel", source / "nansentinel",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run(sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", tmp_path / "dist",
         cwd=source)
    (wheel,) = (tmp_path / "dist").glob("nansentinel-*.whl")
    site = tmp_path / "site"
    _run(sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site, wheel)
    shutil.rmtree(source)

    # A user's shell: the installed command, this interpreter's packages (torch) and the
    # target, no checkout on the path and none in the working directory.
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(site)}
    home = tmp_path / "home"
    home.mkdir()
    where = _run(sys.executable, "-c", "import nansentinel; print(nansentinel.__file__)",
                 env=env, cwd=home).stdout.strip()
    assert Path(where).is_relative_to(site), where
    for name in SETS:
        _run(site / "bin" / "nansentinel", "files", name, home / name, env=env, cwd=home)
        shipped = {p.relative_to(ROOT / "nansentinel" / "files" / name): p.read_bytes()
                   for p in (ROOT / "nansentinel" / "files" / name).rglob("*") if p.is_file()}
        written = {p.relative_to(home / name): p.read_bytes()
                   for p in (home / name).rglob("*") if p.is_file()}
        assert written == shipped, name
    assert os.access(home / "slurm" / "nansentinel.sbatch", os.X_OK)
