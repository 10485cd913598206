"""The ``--on-exclude`` hook: the shell command an excluded host runs before its launcher exits.

It is how a scheduler learns of the exclusion beyond exit code 4 (``scontrol update ...
state=drain``, ``kubectl cordon``). The template is checked before anything is started, so a
typo is a usage error and not a surprise on the night a host goes bad; ``{host}`` and
``{reason}`` are shell-quoted, because the reason is text the sentinel wrote from data; and
the command is bounded in time, because a hung hook must not keep a dead host in the job.
"""

from __future__ import annotations

import shlex
import string
import subprocess

from nansentinel.console import say

#: Seconds the ``--on-exclude`` hook may run; a hung ``scontrol`` must not hang the launcher.
HOOK_TIMEOUT_S = 120.0


def hook_fields(template: str) -> set[str]:
    """Replacement fields of an ``--on-exclude`` template; raises ``ValueError`` on a
    malformed template."""
    return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}


def format_hook(template: str, host: str, reason: str) -> str:
    """The hook command with ``{host}`` and ``{reason}`` replaced, each shell-quoted, so a
    reason with spaces or quotes cannot change the command."""
    return template.format(host=shlex.quote(host), reason=shlex.quote(reason))


def run_hook(template: str | None, host: str, reason: str) -> int | None:
    """Run the ``--on-exclude`` hook; returns its exit status (None when there is none).

    A failing or hung hook is reported and does not change the launcher's exit code: the
    host is excluded either way, and exit code 4 still tells the scheduler so.
    """
    if not template:
        return None
    command = format_hook(template, host, reason)
    say(f"running --on-exclude hook: {command}")
    try:
        done = subprocess.run(command, shell=True, timeout=HOOK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        say(f"--on-exclude hook did not finish within {HOOK_TIMEOUT_S:.0f} s; left behind")
        return None
    except OSError as exc:
        say(f"--on-exclude hook could not be started: {exc}")
        return None
    if done.returncode != 0:
        say(f"--on-exclude hook exited with status {done.returncode}")
    return done.returncode


def check_hook(template: str) -> str | None:
    """What is wrong with an ``--on-exclude`` template, or None when it is usable."""
    try:
        unknown = hook_fields(template) - {"host", "reason"}
    except ValueError as exc:
        return f"--on-exclude {template!r} is malformed: {exc}"
    if unknown:
        return (
            f"--on-exclude {template!r} uses {{{', '.join(sorted(unknown))}}}; only {{host}} "
            "and {reason} are replaced (write {{ and }} for literal braces)"
        )
    return None
