"""The ``--on-exclude`` hook: the command an excluded host runs before its launcher exits.

It is how a scheduler learns of the exclusion beyond exit code 4 (``scontrol update ...
state=drain``, ``kubectl cordon``). Host names come from each rank's environment and reasons
are written from data (parameter and module names), so neither may ever reach a shell as
code: the template is split into arguments first (``shlex.split``, as a shell would split
it), ``{host}`` and ``{reason}`` are replaced inside each argument, and the argument list is
executed directly, without a shell. The two values are also passed as environment variables
(``NANSENTINEL_EXCLUDED_HOST``, ``NANSENTINEL_EXCLUSION_REASON``); a hook that needs a shell
names one and reads them from there::

    --on-exclude='sh -c "echo drained >> /var/log/x-$NANSENTINEL_EXCLUDED_HOST"'

The template is checked before anything is started, so a typo is a usage error and not a
surprise on the night a host goes bad, and the command is bounded in time, because a hung hook
must not keep a dead host in the job.
"""

from __future__ import annotations

import os
import shlex
import string
import subprocess

from nansentinel.launcher.console import say

#: Seconds the ``--on-exclude`` hook may run; a hung ``scontrol`` must not hang the launcher.
HOOK_TIMEOUT_S = 120.0
#: Environment variables that carry the excluded host and the reason to the hook.
ENV_EXCLUDED_HOST = "NANSENTINEL_EXCLUDED_HOST"
ENV_EXCLUSION_REASON = "NANSENTINEL_EXCLUSION_REASON"


def hook_fields(template: str) -> set[str]:
    """Replacement fields of an ``--on-exclude`` template; raises ``ValueError`` on a
    malformed template."""
    return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}


def format_hook(template: str, host: str, reason: str) -> list[str]:
    """The hook's argument list: the template split like a shell would split it, then
    ``{host}`` and ``{reason}`` replaced inside each argument. The values are data: whatever
    they hold (quotes, ``$(...)``, ``;``, newlines) stays inside its argument."""
    return [arg.format(host=host, reason=reason) for arg in shlex.split(template)]


def run_hook(template: str | None, host: str, reason: str) -> int | None:
    """Run the ``--on-exclude`` hook without a shell; returns its exit status (None when there
    is none, or when it could not be started or did not finish).

    A failing or hung hook is reported and does not change the launcher's exit code: the
    host is excluded either way, and exit code 4 still tells the scheduler so.
    """
    if not template:
        return None
    argv = format_hook(template, host, reason)
    env = {**os.environ, ENV_EXCLUDED_HOST: host, ENV_EXCLUSION_REASON: reason}
    say(f"running --on-exclude hook: {shlex.join(argv)}")
    try:
        done = subprocess.run(argv, env=env, timeout=HOOK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        say(f"--on-exclude hook did not finish within {HOOK_TIMEOUT_S:.0f} s; left behind")
        return None
    except (OSError, ValueError) as exc:  # not found, not executable, NUL in an argument
        say(f"--on-exclude hook {argv[0]!r} could not be started: {exc}")
        return None
    if done.returncode != 0:
        say(f"--on-exclude hook exited with status {done.returncode}")
    return done.returncode


def check_hook(template: str) -> str | None:
    """What is wrong with an ``--on-exclude`` template, or None when it is usable."""
    try:
        unknown = hook_fields(template) - {"host", "reason"}
        argv = shlex.split(template)
        for arg in argv:  # braces are checked per argument, as they will be replaced
            hook_fields(arg)
    except ValueError as exc:
        return f"--on-exclude {template!r} is malformed: {exc}"
    if unknown:
        return (
            f"--on-exclude {template!r} uses {{{', '.join(sorted(unknown))}}}; only {{host}} "
            "and {reason} are replaced (write {{ and }} for literal braces)"
        )
    if not argv:
        return "--on-exclude is empty; give a command, e.g. 'kubectl cordon {host}'"
    return None
