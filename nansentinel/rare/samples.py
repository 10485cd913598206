"""Sample ids, and a skip list that survives a restart.

``check_batch(batch, ids=...)`` takes one id per row of the batch's leading dimension: a
dataset index, or a ``(shard, offset)`` pair. A detection names the ids of the rows that held
non-finite values (in the report and the log line), and when the batch is at fault (a
non-finite batch, or a ``data`` verdict) rank 0 appends them to the job's skip list: JSON
lines, one ``os.write`` each of a whole line under ``O_APPEND`` by a single writer, fsynced,
so a crash leaves whole lines. Megatron reads an ``iterations_to_skip`` list at start-up; this
is the same idea by sample, which stays right when the batch size or the order changes.

On resume, a loader honours it in three lines::

    from nansentinel import skip_list
    skip = skip_list.load()                                  # the job's ids (a set)
    sampler = skip_list.SkipSampler(DistributedSampler(dataset), skip)

(or :func:`skip_list.without` for an iterable dataset, with a ``key`` that reads a sample's id).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nansentinel import checks
from nansentinel.common import untrusted
from nansentinel.common.report import FILE_MODE, make_private_dirs
from nansentinel.config import DEFAULT_REPORT_DIR, env_var

#: The most ids of one rank named in a report (a batch's rows beyond are counted, not listed).
MAX_IDS = 4096
#: The most ids of one rank a degenerate stretch rolled back over lists in the skip list (a
#: 60-step stretch of 1,000-row batches); the stretch's later rows are not listed.
MAX_STRETCH_IDS = 65_536

SampleId = int | tuple[int, ...]


def default_path(report_dir: str | os.PathLike[str], job_id: str | None) -> Path:
    """The job's skip list when ``skip_list`` is not set: one file per job in the report
    directory."""
    return Path(report_dir) / f"skip-list-{job_id or 'local'}.jsonl"


def path_from_env(env: Mapping[str, str] | None = None) -> Path:
    """Where this job's skip list is: ``NANSENTINEL_SKIP_LIST``, else the default in
    ``NANSENTINEL_REPORT_DIR`` for ``NANSENTINEL_JOB_ID`` or ``TORCHELASTIC_RUN_ID``."""
    env = os.environ if env is None else env
    explicit = env.get(env_var("skip_list"))
    if explicit:
        return Path(explicit)
    job = env.get(env_var("job_id")) or env.get("TORCHELASTIC_RUN_ID")
    return default_path(env.get(env_var("report_dir"), DEFAULT_REPORT_DIR), job)


def check_ids(ids: Any, batch: Any, *, rank: int, step: int) -> Any:
    """``ids`` as given, once its length is known to match the batch's leading dimension (a
    host check: a tensor's shape, a sequence's length; nothing is copied)."""
    if isinstance(ids, torch.Tensor):
        n = ids.shape[0] if ids.dim() else None
    elif isinstance(ids, list | tuple):
        n = len(ids)
    else:
        raise TypeError(
            f"nansentinel: check_batch(ids=...) takes a list, tuple or tensor of sample ids, "
            f"got {type(ids).__name__} (rank {rank}, step {step})"
        )
    first = next(checks.tensors(batch), None)
    rows = first.shape[0] if first is not None and first.dim() else None
    if n is None or rows is None or n != rows:
        raise ValueError(
            f"nansentinel: check_batch got {n} sample ids for a batch whose leading dimension "
            f"is {rows} (rank {rank}, step {step}); pass one id per row"
        )
    return ids


def as_ids(ids: Any) -> list[SampleId]:
    """Sample ids as JSON-able values: ints, or tuples of ints (a detection only)."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return [tuple(int(y) for y in v) if isinstance(v, list | tuple) else int(v) for v in values]


def nonfinite_rows(batch: Any) -> list[int]:
    """The rows (of the leading dimension) where some floating tensor of ``batch`` holds a
    non-finite value: one host copy per tensor, after a detection only."""
    bad: set[int] = set()
    for t in checks.float_tensors(batch):
        if t.dim() == 0 or t.shape[0] == 0:
            continue
        d = t.detach()
        if d.is_complex():
            d = torch.view_as_real(d)
        rows = (~torch.isfinite(d)).reshape(d.shape[0], -1).any(dim=1)
        bad.update(int(i) for i in rows.nonzero().flatten().tolist())
    return sorted(bad)


def append(path: Path, record: dict[str, Any]) -> Path:
    """Append one JSON line to the skip list at ``path`` (created 0600 in a 0700 directory)."""
    make_private_dirs(path.parent)
    line = (json.dumps({"time": time.time(), **record}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
    try:
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"short write to {path}: {written} of {len(line)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def load(path: str | os.PathLike[str] | None = None) -> set[SampleId]:
    """The ids in a skip list (default: this job's, see :func:`path_from_env`); an absent
    file is an empty list. A malformed line is an error naming the file and the line."""
    where = Path(path) if path is not None else path_from_env()
    try:  # a FIFO, a device or a file past the size cap is refused by name, never waited on
        data = untrusted.read_bytes(where, what="skip list")
    except FileNotFoundError:
        return set()
    except untrusted.InputFileError as exc:
        raise ValueError(f"nansentinel: {exc}") from None
    ids: set[SampleId] = set()
    for n, raw in enumerate(untrusted.split_lines(data), start=1):
        text = untrusted.decode(raw)
        if not text.strip():
            continue
        try:
            record = untrusted.parse_json(text)
            if not isinstance(record, dict) or "ids" not in record:
                raise ValueError("not a JSON object with 'ids'")
            ids.update(as_ids(record["ids"]))
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"nansentinel: skip list {where}, line {n} is not a skip record "
                f"({type(exc).__name__}: {exc})"
            ) from None
    return ids


class SkipSampler(torch.utils.data.Sampler):
    """A sampler that never yields an index in ``skip``.

    Args:
        sampler: any sampler of dataset indices (e.g. ``DistributedSampler``: its
            ``set_epoch`` and other attributes pass through).
        skip: the ids to leave out (:func:`load`).
        key: maps a sampler's index to its sample id when they differ.
    """

    def __init__(self, sampler: Iterable[Any], skip: Iterable[Hashable], *,
                 key: Callable[[Any], Hashable] | None = None) -> None:
        self.sampler = sampler
        self.skip = set(skip)
        self.key = key

    def __iter__(self) -> Iterator[Any]:
        key = self.key
        for index in self.sampler:
            if (key(index) if key is not None else index) not in self.skip:
                yield index

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __getattr__(self, name: str) -> Any:  # set_epoch, num_replicas, ...
        if name in ("sampler", "skip", "key"):
            raise AttributeError(name)
        return getattr(self.sampler, name)


def without(samples: Iterable[Any], skip: Iterable[Hashable],
            key: Callable[[Any], Hashable]) -> Iterator[Any]:
    """The samples of an iterable dataset whose ``key(sample)`` is not in ``skip``."""
    skipping = set(skip)
    return (s for s in samples if key(s) not in skipping)
