"""Signals: the launcher answers SIGTERM within a bound it can name, and its workers never
outlive it.

torchrun's agent handles SIGTERM, SIGINT, SIGHUP and SIGQUIT with a Python handler that
raises in its main thread, then stops the workers (the same signal, SIGKILL 30 s later). A
Python handler runs only when the main thread returns to Python, and the agent's main thread
spends its time in C++ calls on the rendezvous store (``num_nodes_waiting`` every monitor
interval, the rendezvous itself): on a host cut off from the store each such call blocks for
the store's timeout, and a scheduler's SIGTERM went unanswered for minutes. So
:class:`SignalBound` also has the C-level handler wake a thread of its own
(``signal.set_wakeup_fd``), which does not wait for the main thread: it sends the signal to
every worker's process group at once, SIGKILLs what is left after :data:`WORKER_GRACE_S`,
gives the main thread :data:`EXIT_MARGIN_S` to print its summary, and otherwise ends the
process with 128 + the signal (143 for SIGTERM, 130 for SIGINT). Where the main thread is
free, torchrun's own path gets there first, and the thread does nothing more.

A launcher killed outright (SIGKILL, the OOM killer, a lost host's power) runs no code at
all, so the workers are started through :mod:`nansentinel.launcher.orphan_guard`, which asks
the kernel to SIGKILL the worker when its launcher dies (``PR_SET_PDEATHSIG``), then execs the
worker's command in place (same pid, same environment).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nansentinel.launcher.console import say

#: Seconds the workers get between the signal and SIGKILL: torchrun's own grace (its
#: ``PContext.close`` timeout), which a worker that checkpoints on SIGTERM may need.
WORKER_GRACE_S = 30.0
#: Seconds the main thread then gets to finish its summary before the process ends anyway.
EXIT_MARGIN_S = 3.0
#: The signals torchrun's agent stops on (``TORCHELASTIC_SIGNALS_TO_HANDLE``'s default).
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                     if hasattr(signal, n))
_ORPHAN_GUARD = Path(__file__).with_name("orphan_guard.py")


def signal_exit_code(signum: int) -> int:
    """The launcher's exit code after signal ``signum``: 128 + its number, as a shell says."""
    return 128 + int(signum)


def guarded_command(cmd: Any, cmd_args: list[str]) -> tuple[Any, list[str]]:
    """``cmd cmd_args`` started so that the kernel kills it when this process dies (see the
    module's docstring); unchanged off Linux or where the entry point is a Python function
    (torchrun's ``--run-path``), which multiprocessing starts."""
    if sys.platform != "linux" or not isinstance(cmd, str):
        return cmd, cmd_args
    return sys.executable, ["-I", "-S", str(_ORPHAN_GUARD), str(os.getpid()), cmd, *cmd_args]


class SignalBound:
    """A context manager for the launch: while it is open, a stop signal ends this process
    and the workers it started within :data:`WORKER_GRACE_S` + :data:`EXIT_MARGIN_S`
    seconds, whatever the main thread is blocked in. Needs the main thread (signal
    handlers); elsewhere it does nothing.

    Args:
        grace: seconds between the signal and SIGKILL for the workers.
        margin: seconds then left to the main thread.
        exit: how the process ends when the main thread does not (tests inject it).
    """

    def __init__(self, grace: float = WORKER_GRACE_S, margin: float = EXIT_MARGIN_S, *,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.grace, self.margin, self._exit = grace, margin, exit
        self._done = threading.Event()
        self._pipe: tuple[int, int] | None = None
        self._saved: dict[int, Any] = {}
        self._saved_fd = -1
        self._thread: threading.Thread | None = None
        #: The signal that arrived, if one did.
        self.received: int | None = None

    def __enter__(self) -> SignalBound:
        if threading.current_thread() is not threading.main_thread():
            return self
        from nansentinel.common import torch_insides

        _terminate_process_handler = torch_insides.elastic_terminate_handler()
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        self._saved_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        # torchrun installs the same handlers when its workers start; before that (the
        # rendezvous) a signal must raise too, or the wakeup byte is never written.
        for sig in STOP_SIGNALS:
            self._saved[sig] = signal.signal(sig, _terminate_process_handler)
        self._thread = threading.Thread(target=self._watch, name="nansentinel-signals",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._saved_fd)
        for sig, handler in self._saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        read, write = self._pipe
        with contextlib.suppress(OSError):
            os.write(write, b"\0")  # wakes the thread, which then leaves
        if self._thread is not None and self.received is None:
            self._thread.join(timeout=5)
        for fd in (read, write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _watch(self) -> None:
        assert self._pipe is not None
        while not self._done.is_set():
            try:
                data = os.read(self._pipe[0], 1)
            except OSError:
                return
            if not data or self._done.is_set():
                return
            if data[0] in STOP_SIGNALS:
                self._stop(data[0])
                return

    def _stop(self, signum: int) -> None:
        self.received = signum
        name = signal.Signals(signum).name
        code = signal_exit_code(signum)
        say(f"received {name}: stopping the workers (SIGKILL after {self.grace:g} s); this "
            f"launcher exits {code} at the latest {self.grace + self.margin:g} s from now")
        stop_children(signal.Signals(signum), self.grace)
        if self._done.wait(self.margin):
            return  # the main thread ended the launch itself
        say(f"the agent did not return within {self.margin:g} s of its workers' end (blocked "
            f"on the rendezvous store?): exiting {code} now")
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self._exit(code)


def stop_children(sig: signal.Signals, grace: float, *, parent: int | None = None) -> list[int]:
    """Send ``sig`` to each child of ``parent`` (this process), to its whole process group
    where it leads one (torchrun starts each worker in a session of its own, which its data
    loader workers share), SIGKILL what is still alive after ``grace`` seconds; the pids
    that needed SIGKILL."""
    kids = children(os.getpid() if parent is None else parent)
    for pid in kids:
        _signal(pid, sig)
    deadline = time.monotonic() + grace
    alive = kids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if _alive(pid)]
    for pid in alive:
        _signal(pid, signal.SIGKILL)
    return alive


def children(parent: int) -> list[int]:
    """The pids whose parent is ``parent`` (from /proc; empty where there is none)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:
                found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """Running, or stopped, but not a zombie waiting for its parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)

