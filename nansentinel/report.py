"""Incident reports: one JSON per incident, plus the poisoned rank's batch for reproduction.

Written atomically (temp file, fsync, then a hard link to the final name) so a reader never
sees half a report, and never over an existing file: a name that is taken gets a numbered
suffix, so re-running a job in the same directory keeps the earlier incidents.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def write_new(path: Path, write: Callable[[Path], None]) -> Path:
    """Write a file with ``write(tmp)`` and publish it at ``path`` or ``path`` with a
    ``-1``, ``-2``, … suffix, whichever is free. Returns the path written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
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


def write_json(path: Path, payload: dict) -> Path:
    """Atomically write ``payload`` as JSON to a new file at ``path`` (see :func:`write_new`)."""

    def dump(tmp: Path) -> None:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, allow_nan=False) + "\n")

    return write_new(path, dump)


def save_batch(path: Path, batch: object) -> Path:
    """Save the offending batch with ``torch.save`` (tensors moved to CPU) for a replay."""

    def dump(tmp: Path) -> None:
        torch.save(to_cpu(batch), tmp)

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
