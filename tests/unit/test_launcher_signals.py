"""The launcher's signal bound and its orphan guard, on real processes (issue 58, item 5):
a SIGTERM is answered with 143 within the bound while the main thread is blocked in C++
(a rendezvous store that never answers), the children are stopped (SIGKILL for one that
ignores SIGTERM), and a child started through the guard dies with a SIGKILLed parent."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nansentinel.common.exitcodes import EXIT_SIGTERM

REPO = Path(__file__).resolve().parents[2]
GRACE, MARGIN = 2.0, 1.0

_BLOCKED_LAUNCHER = textwrap.dedent(f"""
    import datetime, subprocess, sys
    import torch.distributed as dist
    from nansentinel.launcher.signals import SignalBound
    kids = [subprocess.Popen(["sleep", "600"], start_new_session=True),
            subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 600 & wait"],
                             start_new_session=True)]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    with SignalBound(grace={GRACE}, margin={MARGIN}):
        print(" ".join(str(k.pid) for k in kids), flush=True)
        store.get("never")  # blocks in C++: no Python handler runs until it returns
""")

_GUARDED_PARENT = textwrap.dedent("""
    import subprocess, time
    from nansentinel.launcher.signals import guarded_command
    cmd, args = guarded_command("sleep", ["600"])
    kid = subprocess.Popen([cmd, *args], start_new_session=True)
    print(kid.pid, flush=True)
    time.sleep(600)
""")


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for a parent that will never reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _start(code: str) -> tuple[subprocess.Popen[str], list[int]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    assert proc.stdout is not None
    return proc, [int(p) for p in proc.stdout.readline().split()]


def _cleanup(proc: subprocess.Popen[str], pids: list[int]) -> None:
    for pid in [proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and PR_SET_PDEATHSIG are Linux's")
@pytest.mark.timeout(60)
def test_sigterm_is_answered_within_the_bound_while_the_main_thread_is_blocked() -> None:
    proc, kids = _start(_BLOCKED_LAUNCHER)
    try:
        assert len(kids) == 2 and all(_running(k) for k in kids)
        time.sleep(0.5)  # in the store's get by now
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=GRACE + MARGIN + 10)
        took = time.monotonic() - sent
        assert code == EXIT_SIGTERM
        # The plain child went at once; the one ignoring SIGTERM was killed after the grace.
        assert GRACE <= took < GRACE + MARGIN + 3, took
        assert not any(_running(k) for k in kids)
    finally:
        _cleanup(proc, kids)


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and PR_SET_PDEATHSIG are Linux's")
@pytest.mark.timeout(60)
def test_a_guarded_worker_dies_with_its_sigkilled_launcher() -> None:
    proc, (kid,) = _start(_GUARDED_PARENT)
    try:
        deadline = time.monotonic() + 10
        while b"sleep" not in Path(f"/proc/{kid}/cmdline").read_bytes():  # exec'd in place
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 3
        while _running(kid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(kid), "the worker outlived its launcher"
    finally:
        _cleanup(proc, [kid])


def test_the_guard_wraps_a_command_and_leaves_a_function_alone() -> None:
    from nansentinel.launcher.signals import guarded_command

    def entry() -> None: ...

    assert guarded_command(entry, ["a"]) == (entry, ["a"])
    if sys.platform == "linux":
        cmd, args = guarded_command("/usr/bin/python3", ["-u", "train.py"])
        assert cmd == sys.executable and args[-3:] == ["/usr/bin/python3", "-u", "train.py"]
        assert args[3] == str(os.getpid()) and args[2].endswith("orphan_guard.py")
