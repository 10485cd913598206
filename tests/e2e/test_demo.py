"""The README's first command, run as a user runs it: ``nansentinel demo`` in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nansentinel.common.exitcodes import EXIT_CONFIG, EXIT_NONFINITE_ABORT

pytestmark = pytest.mark.e2e


def demo(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANSENTINEL_")}
    return subprocess.run(
        [sys.executable, "-m", "nansentinel", "demo", "--report-dir", str(tmp_path / "r"), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(150)
def test_demo_names_the_poisoned_rank_and_finishes(tmp_path: Path) -> None:
    proc = demo(tmp_path, "--steps", "8")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "step   5 skipped" in out and "bad ranks [2]" in out, out
    assert "rank 2 (host" in out and "grad" in out
    assert out.count(" applied ") == 7
    reports = [p for p in (tmp_path / "r").glob("incident-*.json")]
    assert len(reports) == 1 and json.loads(reports[0].read_text())["bad_ranks"] == [2]
    # A calm first run: no numpy or OMP_NUM_THREADS noise, and a closing summary.
    assert "Failed to initialize NumPy" not in out and "OMP_NUM_THREADS" not in out, out
    assert "summary: 8 steps: 7 applied, 1 skipped" in out, out
    incident = next(line for line in out.splitlines() if "incident at step 5" in line)
    assert "rank 2 on host" in incident and "non-finite grad" in incident
    assert "verdict " in incident and reports[0].name in incident
    assert "weights: finite and identical on all 4 rank(s) (checked)" in out


@pytest.mark.timeout(150)
def test_abort_exits_non_zero_within_seconds_with_the_report_written(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = demo(tmp_path, "--steps", "50", "--policy", "abort",
                "--inject", "kind=loss,rank=1,step=3,value=inf")
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_NONFINITE_ABORT, out  # through `nansentinel run`
    assert "aborting at step 3" in out and "rank(s) 1" in out, out
    # One line per rank before the launcher's summary, not a traceback per rank.
    assert "Traceback" not in out, out
    assert all(f"rank {r}: stopped: aborting at step 3" in out for r in range(4)), out
    assert "step   4" not in out  # no rank went on
    report = json.loads(next((tmp_path / "r").glob("incident-*step00000003.json")).read_text())
    assert report["outcome"] == "aborted" and report["bad_ranks"] == [1]
    assert elapsed < 60, f"abort took {elapsed:.1f} s"


@pytest.mark.timeout(60)
def test_a_bad_value_is_one_clear_line(tmp_path: Path) -> None:
    proc = demo(tmp_path, "--policy", "explode")
    assert proc.returncode == EXIT_CONFIG
    assert "policy='explode' is not a known policy" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.timeout(90)
def test_demo_checkpoints_and_resumes_where_it_left_off(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NANSENTINEL_")},
           "NANSENTINEL_METRICS_PORT": "0", "NANSENTINEL_REPORT_DIR": str(tmp_path / "r")}

    def run(steps: int) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", "nansentinel.demo", "--checkpoint-dir", str(tmp_path / "ck"),
             "--checkpoint-every", "3", "--steps", str(steps)],
            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    first = run(6)
    assert "step   5 applied" in first and "resumed" not in first
    assert f"checkpoint saved to {tmp_path / 'ck' / 'demo-checkpoint.pt'} after step 5" in first
    second = run(8)
    assert "at step 6" in second.splitlines()[0] and "step   6 applied" in second
    assert "step   5" not in second


@pytest.mark.timeout(150)
def test_demo_fsdp_checks_before_the_reduce_scatter(tmp_path: Path) -> None:
    """``nansentinel demo --fsdp``: FSDP2 on 4 ranks under ``nansentinel run``; the drill
    poisons rank 2's local gradients before their reduce-scatter and every rank names it."""
    proc = demo(tmp_path, "--steps", "8", "--fsdp")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "(FSDP2)" in out
    assert "step   5 skipped" in out and "bad ranks [2]" in out, out
    assert out.count("replay is off") == 1 and "verdict None" not in out, out  # said once
    assert out.count(" applied ") == 7
    assert "weights: finite and identical on all 4 rank(s) (checked)" in out, out
    reports = [p for p in (tmp_path / "r").glob("incident-*.json")]
    assert len(reports) == 1
    report = json.loads(reports[0].read_text())
    assert report["bad_ranks"] == [2] and report["poisoned"][0]["parameters"]
