"""Hidden temporary files left by a killed write, found and removed.

Every file the sentinel publishes atomically is first written to ``tempfile.mkstemp`` beside
its final name (``.<name>.<8 random characters>[suffix]``) and then renamed or linked into
place; a process killed between the two (SIGKILL, OOM, a node lost) leaves the hidden file for
good. Nothing reads these, but a report directory or an exclusion file's folder that a job
writes for months fills with them, so the next writer removes the ones old enough that no live
write can own them.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

#: A write in progress is at most this old (seconds): older temporary files are orphans.
STALE_AFTER_S = 3600.0

_RANDOM = re.compile(r"[a-z0-9_]{8}")


def sweep(directory: Path, prefix: str, suffix: str = "", *, min_age: float = STALE_AFTER_S,
          now: float | None = None) -> int:
    """Remove ``directory``'s mkstemp files ``prefix`` + 8 random characters + ``suffix``
    last modified at least ``min_age`` seconds ago; returns how many were removed. Any
    error (a directory that is gone, a file another host removed first) is ignored: the
    sweep is housekeeping, never a reason to fail a write."""
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(suffix)):
            continue
        middle = name[len(prefix): len(name) - len(suffix)]
        if not _RANDOM.fullmatch(middle):
            continue
        with contextlib.suppress(OSError):
            if entry.is_file(follow_symlinks=False) and (
                now - entry.stat(follow_symlinks=False).st_mtime >= min_age
            ):
                os.unlink(entry.path)
                removed += 1
    return removed


_ORPHAN = re.compile(r"\..+\.[a-z0-9_]{8}(\.tmp)?")


def sweep_orphans(directory: Path, *, min_age: float = STALE_AFTER_S,
                  now: float | None = None) -> int:
    """Remove every hidden mkstemp file (``.<name>.<8 characters>``, optionally ``.tmp``)
    in ``directory`` older than ``min_age`` seconds, whatever file it was meant to become:
    the report directory's writers publish many names. Returns how many were removed."""
    now = time.time() if now is None else now
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        if not _ORPHAN.fullmatch(entry.name):
            continue
        with contextlib.suppress(OSError):
            if entry.is_file(follow_symlinks=False) and (
                now - entry.stat(follow_symlinks=False).st_mtime >= min_age
            ):
                os.unlink(entry.path)
                removed += 1
    return removed
