"""Start a worker that the kernel kills when its launcher dies, then become that worker.

Usage (by ``nansentinel run``, as torchrun's worker command)::

    python -I -S orphan_guard.py LAUNCHER_PID COMMAND [ARGS...]

torchrun starts each worker in a session of its own, so nothing reaches it when the launcher
is killed outright (SIGKILL, the OOM killer): it would keep its GPUs and its place in the
collectives of a job that has lost this host. ``PR_SET_PDEATHSIG`` asks the kernel to
SIGKILL this process when the thread that started it ends; it survives ``exec``, so the
worker runs with the same pid and environment, and torchrun sees no difference. If the
launcher died before the request was made, the parent is no longer ``LAUNCHER_PID`` and the
worker is not started. Run as a script, importing nothing beyond the standard library: it
is on every worker's start-up path.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

#: ``prctl`` option (linux/prctl.h): the signal sent to this process when its parent dies.
PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: orphan_guard.py LAUNCHER_PID COMMAND [ARGS...]")
    launcher, command = int(argv[0]), argv[1:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        sys.stderr.write(f"nansentinel: PR_SET_PDEATHSIG failed ({os.strerror(errno)}); this "
                         "worker may outlive its launcher\n")
    if os.getppid() != launcher:
        sys.stderr.write(f"nansentinel: the launcher (pid {launcher}) is gone; not starting "
                         f"{command[0]}\n")
        os._exit(128 + int(signal.SIGKILL))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
