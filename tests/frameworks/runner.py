"""Run a framework worker script in its own processes, bounded in time, and read what each
rank wrote. Every process of the run is killed when it overruns: nothing is left behind."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run(argv: list[str], out: Path, *, timeout: float, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a new session (so that a timeout kills the launcher's children too),
    with this checkout first on the path, reports under ``out/reports`` and Python's fault
    handler on."""
    out.mkdir(parents=True, exist_ok=True)
    full = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "NANSENTINEL_REPORT_DIR": str(out / "reports"),
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "NANSENTINEL_METRICS_PORT": "0",  # no fixed port shared with other runs on this host
        # A rank that crashes in C++ (SIGSEGV, SIGABRT) prints every thread's Python stack:
        # without it a crash in CI leaves only its peers' "connection reset" to read.
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
    proc = subprocess.Popen(argv, cwd=out, env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        raise AssertionError(f"{argv} overran {timeout} s; output:\n{stdout[-6000:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, "")


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, str(HERE / script), *args]


def torchrun(script: str, *args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(HERE / script), *args]


def nansentinel_run(script: str, *args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "nansentinel", "run", "--standalone",
            f"--nproc-per-node={nproc}", "--monitor-interval=0.2", str(HERE / script), *args]


def ranks(out: Path, world: int, proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """Each rank's JSON, in rank order; a missing one fails with the run's output."""
    found = []
    for r in range(world):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing (exit {proc.returncode}):\n" \
            f"{proc.stdout[-6000:]}"
        found.append(json.loads(path.read_text()))
    return found


def assert_same_finite_weights(results: list[dict[str, Any]]) -> None:
    first = results[0]["weights"]
    for res in results:
        flat = [v for t in res["weights"] for v in t]
        assert flat and all(math.isfinite(v) for v in flat), f"rank {res['rank']}: non-finite"
        assert res["weights"] == first, f"rank {res['rank']}'s weights differ from rank 0's"


def assert_two_rank_faults_skipped(results: list[dict[str, Any]], steps: int) -> None:
    """The fit both framework tests run: a forward log(0) on rank 0 at step 2 and a
    backward-only NaN on rank 1 at step 4, skipped on both ranks, found by the framework's own
    DDP comm hook, replayed to ``host``, with weights and optimizer state unchanged exactly on
    the skipped steps, one report per fault and the same finite weights on every rank."""
    for res in results:
        assert res["world"] == 2
        assert res["sentinel_model"] == "DistributedDataParallel"  # its comm hook, not local
        assert sorted(res["skipped"]) == ["2", "4"], res["skipped"]
        assert res["skipped"]["2"]["bad_ranks"] == [0]
        assert "loss" in res["skipped"]["2"]["kinds"]
        assert res["skipped"]["4"]["bad_ranks"] == [1]
        assert res["skipped"]["4"]["kinds"] == ["grad"]
        # Replayed through the framework's own step: the fault follows the rank, not the data.
        assert res["skipped"]["2"]["verdict"] == res["skipped"]["4"]["verdict"] == "host"
        # Skipped steps leave weights and optimizer state exactly as they were; others change.
        assert res["unchanged"] == {str(s): s in (2, 4) for s in range(steps)}
    assert_report_names(results[0]["skipped"]["2"]["report_path"], 0, "loss")
    assert_report_names(results[0]["skipped"]["4"]["report_path"], 1, "grad")
    assert_same_finite_weights(results)


def assert_aborted_with_one_report(
    proc: subprocess.CompletedProcess[str], out: Path, rank: int, kind: str
) -> None:
    """An abort at step 1 under ``nansentinel run``: exit 3, no rank went on to write its
    results, and one report blaming ``rank`` for ``kind`` says ``aborted``."""
    assert proc.returncode == 3, proc.stdout[-6000:]
    assert not list(out.glob("rank*.json")), "training went on past the abort"
    reports = sorted((out / "reports").glob("incident-*step00000001.json"))
    assert len(reports) == 1, list((out / "reports").iterdir())
    report = assert_report_names(str(reports[0]), rank, kind)
    assert report["outcome"] == "aborted"


def assert_report_names(path: str | None, rank: int, kind: str) -> dict[str, Any]:
    """The incident report exists and blames ``rank`` for ``kind`` (and no other rank)."""
    assert path and Path(path).exists(), f"no report at {path}"
    report = json.loads(Path(path).read_text())
    assert report["bad_ranks"] == [rank], report["bad_ranks"]
    assert kind in report["ranks"][str(rank)]["kinds"], report["ranks"]
    return report
