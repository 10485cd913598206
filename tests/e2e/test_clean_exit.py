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
#: All at once, one round. A plain DDP script aborted at exit in about half its runs under load
#: (issue 26): four runs miss that with a chance of 1 in 16 (six, in two rounds of three, 1 in
#: 64 for 16 s more of the CI's budget; 20 cost 110 s).
RUNS = 4


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

    # Every job at once on the CI machine's two cores: exits that overlap other jobs' work.
    with concurrent.futures.ThreadPoolExecutor(max_workers=RUNS) as pool:
        failures = [f for f in pool.map(one, range(RUNS)) if f is not None]
    assert not failures, f"{len(failures)}/{RUNS} runs did not exit cleanly: {failures[:2]}"


#: 2 of 8 runs failed before the fix: 4 runs (one round of four) see a regression of that rate
#: 68% of the time, and two CI runs in a row 90% (6 runs, in two rounds of three, 82%, for 20 s
#: more of the CI's 30 minutes).
DEMO_RUNS = 4
DEMO_AT_ONCE = 4


@pytest.mark.timeout(900)
def test_the_demo_exits_0_every_time_under_cpu_load(tmp_path: Path) -> None:
    """Issue 26 item 4: the README's demo, 4 ranks, 6 steps (the fault at step 5 included),
    four times at once under CPU load: 2 of 8 runs had ended with a rank killed by SIGABRT at exit
    ("terminate called without an active exception": torch 2.13's gloo tearing its group down
    while a peer still used it), and `nansentinel run` reported a failed worker.
    ``Sentinel.close()`` now leaves every rank at one barrier before the group goes.

    The load is the demos themselves: four at a time put 16 ranks and 4 agents on the CI
    machine's two cores for the whole test, so every exit overlaps other jobs' work (a busy
    process beside two demos cost 45 s more and loaded the machine no more)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NANSENTINEL_")},
           "PYTHONPATH": str(REPO)}

    def one(run: int) -> tuple[int, int, str] | None:
        proc = subprocess.run(
            [sys.executable, "-m", "nansentinel", "demo", "--steps", "6",
             "--report-dir", str(tmp_path / f"r{run}")],
            capture_output=True, text=True, timeout=240, cwd=tmp_path,
            stdin=subprocess.DEVNULL, env=env,
        )
        out = proc.stdout + proc.stderr
        if proc.returncode != 0 or "terminate called" in out or "summary: 6 steps" not in out:
            return run, proc.returncode, out[-2000:]
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=DEMO_AT_ONCE) as pool:
        failures = [f for f in pool.map(one, range(DEMO_RUNS)) if f is not None]
    assert not failures, f"{len(failures)}/{DEMO_RUNS} demos did not exit 0: {failures[:2]}"
