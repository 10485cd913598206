"""Incident reports: one JSON per incident, plus the poisoned rank's batch for reproduction.

Written atomically (temp file, fsync, then a hard link to the final name) so a reader never
sees half a report, and never over an existing file: a name that is taken gets a numbered
suffix, so re-running a job in the same directory keeps the earlier incidents.

A saved batch is the user's training data, and a report names parameters and hosts: files are
created 0600 and the directories the sentinel creates 0700 (narrower still under a stricter
umask; a directory that already exists keeps its mode). A report that cannot be written (a
full disk, a value JSON cannot hold, anything else) is one log line and a counted failure,
never an exception in the training loop. JSON has no NaN or Inf: :func:`json_safe` spells every
non-finite number as a string (``"nan"``, ``"inf"``, ``"-inf"``) wherever it sits in a report.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nansentinel.common.tempfiles import sweep_orphans

log = logging.getLogger("nansentinel")

#: Modes of what the sentinel creates, before the umask narrows them further.
FILE_MODE = 0o600
DIR_MODE = 0o700


def write_new(path: Path, write: Callable[[Path], None]) -> Path:
    """Write a file with ``write(tmp)`` and publish it at ``path`` or ``path`` with a
    ``-1``, ``-2``, … suffix, whichever is free. Returns the path written."""
    make_private_dirs(path.parent)
    sweep_orphans(path.parent)  # what writes killed here before left behind (an hour old)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE & ~_umask())  # mkstemp's 0600, or what a stricter umask says
    finally:
        os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        for n in range(10_000):
            candidate = path if n == 0 else path.with_name(f"{path.stem}-{n}{path.suffix}")
            try:
                os.link(tmp, candidate)  # fails if the name is taken: never overwrite
            except FileExistsError:
                continue
            return candidate
        raise FileExistsError(f"no free name for {path} after 10000 tries")
    finally:
        tmp.unlink(missing_ok=True)


def make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents 0700 (less under a stricter umask)."""
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        if d.parent == d:
            break
        d = d.parent
    for d in reversed(missing):
        d.mkdir(mode=DIR_MODE, exist_ok=True)  # the umask applies on top; another rank may race


def _umask() -> int:
    """The process umask, read without changing it (Linux), else by the set-and-restore idiom."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def attempt(
    what: str, write: Callable[[], Path], *, rank: int, step: int,
    failed: Callable[[str], None] | None = None, where: Path | None = None,
) -> tuple[Path | None, str | None]:
    """Run ``write()`` (which writes an incident file, ``where`` when known); a failure such
    as a full disk is one error line naming the rank, step and file, a call of
    ``failed(what)`` (the metrics counter), and ``(None, reason)`` — never an exception: the
    training goes on.

    Any ``Exception`` counts (a full disk's ``OSError``, torch.save's ``RuntimeError``, a
    value JSON cannot hold): what guards the job must not end it over a file. Only what is
    not an ``Exception`` (KeyboardInterrupt, SystemExit) passes through.
    """
    try:
        return write(), None
    except Exception as exc:
        if isinstance(exc, OSError) and exc.strerror:  # the file is named below, once
            reason = f"{type(exc).__name__}: [Errno {exc.errno}] {exc.strerror}"
        else:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.error(
            "nansentinel: rank %d could not write the incident %s of step %d%s (%s); training "
            "goes on without it", rank, what, step, f" to {where}" if where else "", reason,
        )
        if failed is not None:
            failed(what)
        return None, reason


def json_float(x: float | None) -> float | str | None:
    """``x`` as JSON can hold it: JSON has no NaN or Inf, so reports spell them as strings
    (``"nan"``, ``"inf"``, ``"-inf"``); finite numbers and None pass through."""
    if x is None or math.isfinite(x):
        return x
    return str(x)


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float, at any depth of dicts, lists and tuples, replaced
    by :func:`json_float`'s string; tuples become lists, as JSON has them. The one place a
    report's content is made JSON-able, so that a NaN somewhere new (a batch's sums, a loss)
    cannot fail the write."""
    if isinstance(obj, float):
        return json_float(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: Path, payload: dict) -> Path:
    """Atomically write ``payload`` as JSON to a new file at ``path`` (see :func:`write_new`);
    non-finite numbers are written as strings (:func:`json_safe`)."""
    text = json.dumps(json_safe(payload), indent=2, sort_keys=True, allow_nan=False) + "\n"

    def dump(tmp: Path) -> None:
        tmp.write_text(text)

    return write_new(path, dump)


def save_batch(path: Path, batch: object) -> Path:
    """Save the offending batch with ``torch.save`` (tensors moved to CPU) for a replay."""

    def dump(tmp: Path) -> None:
        # Serialised in memory, written by Python: a full disk is then "No space left on
        # device", not torch's "basic_ios::clear: iostream error".
        buf = io.BytesIO()
        torch.save(to_cpu(batch), buf)
        tmp.write_bytes(buf.getbuffer())

    return write_new(path, dump)


def incident_stem(job_id: str | None, step: int) -> str:
    """File-name stem shared by an incident's JSON and batch files."""
    job = "".join(c if c.isalnum() or c in "-_." else "_" for c in (job_id or "local"))
    return f"incident-{job}-step{step:08d}"


def to_cpu(obj: Any, *, copy: bool = False) -> Any:
    """``obj`` with every tensor (in any nesting of dicts, lists, tuples) moved to host memory.

    ``copy=True`` copies tensors that are already on the CPU too, for a snapshot that later
    in-place updates must not reach; containers are rebuilt either way.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: to_cpu(v, copy=copy) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        items = [to_cpu(v, copy=copy) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj
