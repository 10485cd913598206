"""``nansentinel incidents`` as a user runs it, after real demo runs into one directory:
``nansentinel demo`` as it comes (4 ranks, one fault) and a 2-rank run with two incidents;
then the page, rendered by a real headless Chromium (screenshot and DOM)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_demo import demo
from tests.unit.test_incidents_cli import with_history

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TWO_FAULTS = "kind=grad,rank=1,step=3;kind=loss,rank=0,step=6"


def incidents(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANSENTINEL_")}
    return subprocess.run(
        [sys.executable, "-m", "nansentinel", "incidents", *args], capture_output=True,
        text=True, timeout=60, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report directory after ``nansentinel demo`` and a run with two incidents."""
    base = tmp_path_factory.mktemp("incidents")
    for args in (("--steps", "6"), ("--steps", "7", "--nproc", "2", "--inject", TWO_FAULTS)):
        proc = demo(base, *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return base / "r"


@pytest.mark.timeout(240)
def test_the_listing_shows_both_runs_newest_first(runs: Path) -> None:
    proc = incidents(str(runs), cwd=runs.parent)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 4, proc.stdout
    rows = [line.split() for line in lines[1:]]
    # ID STEP OUTCOME RANKS KINDS VERDICT, with the date, time, job and hosts between.
    assert [(r[0], r[4], r[5], r[6], r[8]) for r in rows] == [
        ("6", "6", "skipped", "0", "loss"), ("3", "3", "skipped", "1", "grad"),
        ("5", "5", "skipped", "2", "grad")]
    assert all(r[-1].startswith(str(runs)) and r[-1].endswith(".json") for r in rows)

    as_json = json.loads(incidents(str(runs), "--json", cwd=runs.parent).stdout)
    assert [r["id"] for r in as_json] == ["6", "3", "5"]
    assert [r["bad_ranks"] for r in as_json] == [[0], [1], [2]]
    assert as_json[0]["job"] == as_json[1]["job"] != as_json[2]["job"]
    assert all(r["injected"] and Path(r["path"]).is_file() for r in as_json)


@pytest.mark.timeout(240)
def test_show_explains_each_incident(runs: Path) -> None:
    rows = json.loads(incidents(str(runs), "--json", cwd=runs.parent).stdout)
    for row in rows:
        proc = incidents("show", row["id"], "--dir", str(runs), cwd=runs.parent)
        assert proc.returncode == 0, proc.stderr
        out = proc.stdout
        host = row["bad_hosts"][0]
        assert f"Incident at step {row['step']} of job {row['job']}" in out
        assert f"rank {row['bad_ranks'][0]} (host {host})" in out
        assert f"rank {row['bad_ranks'][0]}: host {host}, local rank" in out
        assert "skipped the step on every rank" in out and "What to do next" in out
        assert "fires this by design" in out  # the demo's faults are drills
        assert "cluster loss: mean" in out


@pytest.mark.timeout(60)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = incidents(str(tmp_path / "none"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"nansentinel incidents: error: no report directory "
                           f"{tmp_path / 'none'} (give DIR, or set NANSENTINEL_REPORT_DIR)\n")


def png_colours(path: Path) -> tuple[int, float]:
    """Distinct colours in the screenshot, and the share of pixels that are not white."""
    import numpy as np
    from matplotlib import image

    pixels = (image.imread(path)[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    distinct = len(np.unique(pixels, axis=0))
    return distinct, float((pixels.min(axis=1) < 250).mean())


@pytest.mark.timeout(240)
def test_the_page_renders_in_a_real_browser(runs: Path, tmp_path: Path) -> None:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (tests/run.sh installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    pytest.importorskip("matplotlib")
    source = next(runs.glob("incident-*-step00000005.json"))
    report = json.loads(source.read_text())
    if "history" not in report:  # a sentinel that does not write it yet: add a realistic one
        report = with_history(report)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / source.name).write_text(json.dumps(report))
    out = tmp_path / "page.html"
    proc = incidents("show", "5", "--dir", str(tmp_path / "r"), "--html", str(out), cwd=tmp_path)
    assert proc.returncode == 0 and f"written to {out}" in proc.stdout, proc.stderr
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600"]
    shot = tmp_path / "page.png"
    subprocess.run([*browser, f"--screenshot={shot}", out.as_uri()], capture_output=True,
                   timeout=90, check=True, cwd=tmp_path)
    distinct, inked = png_colours(shot)
    assert distinct > 50 and 0.02 < inked < 0.9, (distinct, inked)  # text and a plot, not blank
    dom = subprocess.run([*browser, "--dump-dom", out.as_uri()], capture_output=True, text=True,
                         timeout=90, check=True, cwd=tmp_path).stdout
    host = report["bad_hosts"][0]
    assert f"<h1>Incident at step 5: rank 2 on host {host}</h1>" in dom
    assert f"rank 2 (host {host})" in dom and "incident, step 5" in dom
    assert dom.count("<svg") == 1 and "<path" in dom  # the plot, drawn
