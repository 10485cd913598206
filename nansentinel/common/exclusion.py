"""The exclusion store: which hosts the cluster has decided to keep out, and why.

When a host keeps poisoning the run (``host_strikes`` non-finite blames within
``strike_window`` steps), the sentinel on global rank 0 appends an :class:`ExclusionRecord`
here and every rank raises :class:`nansentinel.HostExcludedError`. The ``nansentinel run``
launcher reads the same file: on the excluded host it leaves the job instead of rejoining
the next rendezvous, and a launcher started later on that host refuses to join at all
(exit code 4) until an operator clears the record with ``nansentinel excluded --clear HOST``.

Format and locking. One JSON object per line (append-only, easy to ``tail`` and ``grep``),
on a filesystem every host sees (NFS, Lustre, a PVC). Writers take an exclusive
``flock`` on a sidecar lock file ``<file>.lock`` -- not on the data file, because
:meth:`ExclusionStore.clear` replaces the data file and a lock on the replaced inode would
protect nothing. Each append is flushed and fsynced before the lock is released, so a record
is durable before the ranks exit and the launchers look for it; an append that cannot be
written (a read-only or full filesystem) raises :class:`ExclusionWriteError`, naming the file
and what failed, and the stop path shares that with every rank (docs/launch.md, "Disks that
fill or turn read-only"). Readers take a shared lock
when they can (a read-only operator account may not be able to create the lock file) and
skip a torn or garbled line with a warning naming the file and the line, so one bad write
never hides the other records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nansentinel.common import untrusted
from nansentinel.common.tempfiles import sweep
from nansentinel.common.text import finite_json
from nansentinel.result import NanSentinelError

log = logging.getLogger("nansentinel")

# On local filesystems flock excludes every open file description, threads included; on
# NFS Linux emulates flock with POSIX record locks, which belong to the process, so two
# threads of one process would both "hold" the lock. This lock covers that case.
_PROCESS_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True, slots=True)
class ExclusionRecord:
    """One decision to exclude a host."""

    host: str
    """The host's identity as the sentinel names it (``NANSENTINEL_HOSTNAME``, ``NODE_NAME``
    or the machine's hostname), which is also what the launcher on that host resolves."""
    reason: str
    """One human line: what was non-finite, how often, on which ranks."""
    step: int
    """Training step at which the cluster decided."""
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Whatever supports the decision: strikes, bad ranks, kinds, report paths."""
    time: float = dataclasses.field(default_factory=time.time)
    """Seconds since the epoch when the decision was made."""
    job_id: str | None = None
    """The job (torchrun run id) that decided, so an operator can find its logs."""

    def to_json(self) -> str:
        """One line of JSON, without a newline."""
        return json.dumps(self.to_dict(), sort_keys=True, default=str, allow_nan=False)

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-able values (a non-finite number in the evidence as a
        string)."""
        return finite_json(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: Any) -> ExclusionRecord:
        """Rebuild a record; raises ``ValueError`` naming what is missing or wrong."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        host = data.get("host")
        if not isinstance(host, str) or not host:
            raise ValueError(f"host={host!r} is not a non-empty string")
        evidence = data.get("evidence") or {}
        if not isinstance(evidence, dict):
            raise ValueError(f"evidence={evidence!r} is not an object")
        raw_step, raw_time = data.get("step", -1), data.get("time", 0.0)
        if isinstance(raw_step, bool) or not isinstance(raw_step, int | float) or not (
            math.isfinite(raw_step) and float(raw_step).is_integer() and -1 <= raw_step < 2**63
        ):
            raise ValueError(f"step={raw_step!r:.40} is not a whole step number")
        if isinstance(raw_time, bool) or not isinstance(raw_time, int | float) or not (
            0 <= raw_time <= MAX_TIME
        ):
            raise ValueError(f"time={raw_time!r:.40} is not an epoch time in seconds")
        step, when = int(raw_step), float(raw_time)
        job_id = data.get("job_id")
        return cls(
            host=host,
            reason=str(data.get("reason", "")),
            step=step,
            evidence=finite_json(evidence),
            time=when,
            job_id=None if job_id is None else str(job_id),
        )


#: The latest record time accepted (seconds since the epoch: the year 9999), so that every
#: record's time can be printed as a date.
MAX_TIME = 253402300799.0


class ExclusionWriteError(NanSentinelError, OSError):
    """An exclusion record could not be written; the message names the file and the step
    that failed (its folder, its lock, the append, the sync). An ``OSError``, with the
    cause's ``errno``."""

    def __str__(self) -> str:
        return str(self.strerror)


class ExclusionStore:
    """Append-only JSON-lines file of :class:`ExclusionRecord`, safe across processes and
    hosts that share the file.

    Args:
        path: the exclusion file; its directory is created on the first :meth:`add`.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def __repr__(self) -> str:
        return f"ExclusionStore({str(self.path)!r})"

    def add(self, record: ExclusionRecord) -> None:
        """Append ``record`` durably (flushed and fsynced before returning).

        A previous writer that died mid-line leaves the file without a final newline; the
        new record then starts on a fresh line, so the torn line costs only itself.

        Raises:
            ExclusionWriteError: the record is not on disk (a read-only or full filesystem, a
                missing permission); its message names the file and what failed.
        """
        line = record.to_json() + "\n"
        doing = f"create its folder {self.path.parent}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            doing = f"take its lock {self.lock_path}"
            with self._locked(fcntl.LOCK_EX):
                doing = "open it for appending"
                with open(self.path, "a+b") as f:
                    f.seek(0, os.SEEK_END)
                    if f.tell() > 0:
                        f.seek(-1, os.SEEK_END)
                        if f.read(1) != b"\n":
                            line = "\n" + line
                    doing = "append the record"
                    f.write(line.encode("utf-8"))
                    f.flush()
                    doing = "sync it to disk"
                    os.fsync(f.fileno())
        except OSError as exc:
            raise ExclusionWriteError(
                exc.errno, f"cannot write the exclusion file {self.path}: could not {doing} "
                f"({exc.strerror or exc})") from exc
        log.info("recorded exclusion of host %s in %s: %s", record.host, self.path, record.reason)

    def records(self) -> list[ExclusionRecord]:
        """Every readable record, oldest first; ``[]`` when the file does not exist.

        Raises :class:`~nansentinel.common.untrusted.InputFileError` (an ``OSError`` naming
        the path) when the path is not a regular file (a FIFO is refused, never waited on) or
        is larger than :data:`~nansentinel.common.untrusted.MAX_BYTES`.
        """
        try:
            with self._locked(fcntl.LOCK_SH, required=False):
                data = untrusted.read_bytes(self.path, what="exclusion file")
        except FileNotFoundError:
            return []
        return list(self._parse(data))

    def excluded_hosts(self) -> set[str]:
        """Hosts with at least one record."""
        return {r.host for r in self.records()}

    def is_excluded(self, host: str) -> bool:
        """True when ``host`` has a record."""
        return host in self.excluded_hosts()

    def records_for(self, host: str) -> list[ExclusionRecord]:
        """The records of ``host``, oldest first."""
        return [r for r in self.records() if r.host == host]

    def clear(self, host: str) -> int:
        """Remove every record of ``host``; returns how many were removed.

        The file is rewritten to a temporary file and swapped in with ``os.replace`` under
        the exclusive lock: a crash leaves the old file or the new one. Lines this store
        cannot parse are kept as they were -- clearing one host must not destroy evidence
        an operator may still want to read -- unless they name ``host``: those go too.
        """
        with self._locked(fcntl.LOCK_EX):
            try:
                data = untrusted.read_bytes(self.path, what="exclusion file")
            except FileNotFoundError:
                return 0
            kept: list[bytes] = []
            removed = 0
            for raw in untrusted.split_lines(data):
                if names_host(raw, host):
                    removed += 1
                else:
                    kept.append(raw)  # byte for byte, blank lines and line endings included
            if removed == 0:
                return 0
            # Under the exclusive lock no other clear is writing: any temporary file of ours
            # here is from a clear that was killed before its rename.
            sweep(self.path.parent, f".{self.path.name}.", min_age=0)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(b"".join(kept))
                    f.flush()
                    os.fsync(f.fileno())
                with contextlib.suppress(OSError):
                    os.chmod(tmp, self.path.stat().st_mode & 0o7777)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            _fsync_dir(self.path.parent)
        log.info("cleared %d exclusion record(s) of host %s from %s", removed, host, self.path)
        return removed

    # -- internals -------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, mode: int, *, required: bool = True) -> Iterator[None]:
        """Hold the sidecar lock in ``mode``. With ``required=False`` a lock file that
        cannot be created (read-only directory) means: read without the lock."""
        with _PROCESS_LOCK:
            fd: int | None = None
            try:
                if required:
                    self.lock_path.parent.mkdir(parents=True, exist_ok=True)
                # A reader uses the lock file when a writer made it and never creates one:
                # listing the exclusions leaves no file behind.
                fd = os.open(self.lock_path, os.O_RDWR | (os.O_CREAT if required else 0), 0o666)
            except OSError:
                if required:
                    raise
            if fd is None:
                yield
                return
            try:
                fcntl.flock(fd, mode)
                yield
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    def _parse(self, data: bytes) -> Iterator[ExclusionRecord]:
        for lineno, raw in enumerate(untrusted.split_lines(data), start=1):
            line = untrusted.decode(raw).rstrip("\r\n")
            if not line.strip():
                continue
            try:
                yield ExclusionRecord.from_dict(untrusted.parse_json(line))
            except ValueError as exc:  # JsonInputError included: one bad line costs itself
                torn = "; torn: the file ends without a newline" if not raw.endswith(
                    b"\n") else ""
                log.warning("%s line %d: skipping unreadable exclusion record (%s%s): %.80r",
                            self.path, lineno, exc, torn, line)


def names_host(raw: bytes, host: str) -> bool:
    """Whether the exclusion file's line ``raw`` names ``host``, as a person reading it would
    see it: its top-level ``"host"`` value, whether or not the rest of the line parses (a
    5,000-digit step, evidence nested 100,000 deep, a torn line, a byte-order mark), so that
    a record the launcher cannot read is never one the operator cannot remove. A host named
    only inside the evidence does not count."""
    line = untrusted.decode(raw).rstrip("\r\n").lstrip("\ufeff")
    if not line.strip():
        return False
    try:
        data = untrusted.parse_json(line)
    except ValueError:
        return host in _top_level_hosts(line)
    return isinstance(data, dict) and data.get("host") == host


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)


def _top_level_hosts(line: str) -> list[str]:
    """The values of ``"host"`` keys at the top level of a line that is not valid JSON,
    found by a scan that keeps track of nesting (strings skipped), without recursion."""
    found: list[str] = []
    level, pos, last_key = 0, 0, None
    while pos < len(line):
        char = line[pos]
        if char == '"':
            token = _STRING.match(line, pos)
            assert token is not None  # the pattern matches any text from a quote
            pos = token.end()
            text = _unquote(token.group())
            after = line[pos:pos + 64].lstrip()
            if level == 1 and after.startswith(":"):
                last_key = text
            elif level == 1 and last_key == "host" and text is not None:
                found.append(text)
                last_key = None
            continue
        if char in "{[":
            level += 1
        elif char in "}]":
            level -= 1
        if not char.isspace() and char != ":":  # a value that is not a string, or a comma
            last_key = None
        pos += 1
    return found


def _unquote(token: str) -> str | None:
    """A JSON string token's text (escapes decoded), or None when it is cut off or bad."""
    try:
        text = json.loads(token)
    except ValueError:
        return None
    return text if isinstance(text, str) else None


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable; some filesystems (and all of Windows) cannot, which is fine."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
