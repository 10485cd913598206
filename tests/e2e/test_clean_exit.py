"""No restart lost at exit: a finished job whose script just returns exits 0, every time.

Under torchrun an abort at interpreter exit ("terminate called without an active exception")
counts as a failed worker and can cost a healthy job a restart. The worker script has no
``Sentinel.close()``, no ``destroy_process_group()`` and no ``os._exit``: whatever the
sentinel leaves running (watchdog, check-in thread, exporter) must be stopped by the library.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "exit_worker.py"
RUNS = 10  # two at a time: ~55 s; 20 cost 110 s of the suite's 20-minute budget


@pytest.mark.timeout(900)
def test_a_script_that_just_returns_exits_cleanly_every_time(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NANSENTINEL_")},
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "NANSENTINEL_REPORT_DIR": str(tmp_path / "r"), "NANSENTINEL_METRICS_ADDR": "127.0.0.1"}

    def one(run: int) -> tuple[int, int, str] | None:
        # The exporter on (a free base port per run), as in production.
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=2", "--monitor-interval=0.2", str(WORKER), "5"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL,
            env={**env, "NANSENTINEL_METRICS_PORT": str(21000 + 10 * run)},
        )
        out = proc.stdout + proc.stderr
        if proc.returncode != 0 or "terminate called" in out:
            return run, proc.returncode, out[-2000:]
        return None

    # Two jobs at a time: half the wall time, and exits that overlap another job's start.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(one, range(RUNS)) if f is not None]
    assert not failures, f"{len(failures)}/{RUNS} runs did not exit cleanly: {failures[:2]}"
