"""What the ``nansentinel run`` launcher writes to the operator's terminal.

Every launcher message goes to stderr with one prefix, so that it stands out from the
workers' output that torchrun interleaves with it, and every time is UTC, so that blocks
printed by launchers on different hosts can be lined up. Kept apart from the launcher so
that the rendezvous guard, the failure summary and ``nansentinel excluded`` share one
voice without importing each other.
"""

from __future__ import annotations

import datetime
import sys

from nansentinel.common.exitcodes import EXIT_CONFIG, EXIT_OK

#: The prefix of every launcher message, and the program name in its usage line.
PROG = "nansentinel run"


def say(message: str) -> None:
    """One launcher message on stderr, flushed at once (a worker may be killed next)."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def format_time(epoch: float | int | None) -> str:
    """An epoch time as UTC to the second; ``"time unknown"`` when there is none."""
    if not epoch:
        return "time unknown"
    when = datetime.datetime.fromtimestamp(float(epoch), tz=datetime.timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M:%SZ")


def exit_status(exc: SystemExit) -> int:
    """The exit code for argparse's ``SystemExit`` (help: 0, usage error: its code), so a
    command can return it instead of leaving the process."""
    if exc.code is None:
        return EXIT_OK
    return exc.code if isinstance(exc.code, int) else EXIT_CONFIG
