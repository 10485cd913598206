"""Verdict files: how a dying rank tells its launcher *why* it stopped.

When the sentinel stops the run (abort, host exclusion, exchange timeout) every rank raises.
To torchrun's agent that is just "exit code 1"; the reason would be lost in a traceback.
So just before raising, each rank writes a small JSON verdict to
``$NANSENTINEL_RUN_DIR/verdicts/rank-{rank}.json``; the launcher on the same host reads the
verdicts of the last attempt to print a per-rank root-cause summary and to choose its exit
code (see :mod:`nansentinel.common.exitcodes`).

A verdict is a :class:`RankVerdict`; its JSON keys are its fields: ``rank, local_rank,
hostname, step, outcome`` (``"aborted"`` | ``"excluded"`` | ``"exchange_timeout"`` |
``"stopped"``: a signal asked every rank to stop | ``"store_gone"``: the launchers stopped the
run because the rendezvous store is gone | ``"closed"``: the rank's sentinel closed cleanly,
training was over),
``message, bad_ranks, bad_hosts, kinds, excluded_host`` (or null: the first host excluded),
``excluded_hosts`` (every host excluded at that step), ``report_path`` (or null)
``missing`` (the ranks an exchange timeout names) and ``record_error`` (or null: why rank 0
could not write the exclusion record of an ``excluded`` verdict).

Files are written atomically (temporary file, fsync, ``os.replace``) because a rank may be
killed a moment later; a reader sees the old file or the new one, never half of one. The
launcher moves the verdicts of a failed attempt aside (:func:`archive_verdicts`) before the
next rendezvous, so verdicts always describe the latest attempt and earlier ones are kept.

A disk that fills or turns read-only must not cost the launcher its reasons, so each verdict
also travels without a disk: the launcher opens the run directory's :class:`VerdictInbox`, a
Unix datagram socket in Linux's abstract namespace named after the run directory (nothing on
any filesystem; the workers share the launcher's network namespace), and a rank sends its
verdict there as well (:func:`send_verdict`). While the inbox is open, :func:`read_verdicts`
and :func:`archive_verdicts` of that run directory include what arrived by socket, so a rank
whose file could not be written is still told apart from one that failed without a verdict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import select
import socket
import struct
import sys
import tempfile
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from nansentinel.common import untrusted
from nansentinel.common.exitcodes import (
    EXIT_EXCHANGE_TIMEOUT,
    EXIT_HOST_EXCLUDED,
    EXIT_NONFINITE_ABORT,
    EXIT_NONFINITE_STATE,
    EXIT_WORKER_FAILED,
)
from nansentinel.common.tempfiles import sweep_orphans
from nansentinel.result import STATE as STATE_KIND
from nansentinel.result import Outcome

log = logging.getLogger("nansentinel")

#: A verdict's outcome when the step's collectives failed or hung (no step was decided).
EXCHANGE_TIMEOUT = "exchange_timeout"
#: A verdict's outcome when the rank's sentinel closed cleanly (``Sentinel.close()``): the
#: rank finished training; a failure after it is a failure at exit, not mid-run.
CLOSED = "closed"
#: A verdict's outcome when a signal (``signal``: SIGTERM, SIGINT) asked the run to stop and
#: every rank stopped after the same step (effects/stop.py): the launcher exits 128 + it.
STOPPED = "stopped"
#: A verdict's outcome when the launchers stopped the run because the rendezvous store is
#: gone (its process died or stops answering): every rank stopped after the same step, as for
#: a signal, and the launcher exits 5. The launcher says so first (:func:`write_stop_cause`).
STORE_GONE = "store_gone"

VERDICTS_SUBDIR = "verdicts"
_RANK_FILE = re.compile(r"^rank-(\d{1,9})\.json$")
#: Where a launcher leaves why it is about to stop its workers (in the attempt's verdicts).
_STOP_CAUSE = "launcher-stop-cause.json"


@dataclasses.dataclass(frozen=True, slots=True)
class RankVerdict:
    """Why one rank stopped, as it tells the launcher on its host."""

    rank: int
    """Global rank of the attempt that wrote it."""
    outcome: str
    """The two ways the cluster stops (``aborted``, ``excluded``), a timeout
    (:data:`EXCHANGE_TIMEOUT`), a stop a signal asked for (:data:`STOPPED`) or the clean end
    (:data:`CLOSED`); a later version may add words: they read as a plain worker failure."""
    step: int
    """The step the sentinel stopped at."""
    message: str = ""
    """The exception's message, naming step, ranks, hosts and kinds."""
    hostname: str = ""
    local_rank: int | None = None
    bad_ranks: list[int] = dataclasses.field(default_factory=list)
    bad_hosts: list[str] = dataclasses.field(default_factory=list)
    kinds: list[str] = dataclasses.field(default_factory=list)
    excluded_host: str | None = None
    """The host the cluster excluded (outcome ``excluded``; the first, where several were)."""
    excluded_hosts: list[str] = dataclasses.field(default_factory=list)
    """Every host the cluster excluded at that step (outcome ``excluded``)."""
    report_path: str | None = None
    """The incident report (on the rank that wrote it)."""
    missing: list[int] = dataclasses.field(default_factory=list)
    """Ranks that did not answer (outcome ``exchange_timeout``)."""
    record_error: str | None = None
    """Why rank 0 could not write the exclusion record (outcome ``excluded``): the launcher
    then need not wait for it."""
    signal: int | None = None
    """The signal's number (outcome ``stopped``)."""

    @property
    def excludes(self) -> list[str]:
        """The hosts this verdict excludes (none: ``[]``); a verdict of a version that knew
        only ``excluded_host`` names that one."""
        if self.outcome != Outcome.EXCLUDED:
            return []
        hosts = [str(h) for h in self.excluded_hosts if h]
        return hosts or ([self.excluded_host] if self.excluded_host else [])

    def to_json(self) -> str:
        """One line of JSON, without a newline. Values JSON cannot encode are written as
        ``str(value)``: this runs on the failure path, just before the sentinel raises, and
        must not replace the real error with a serialization error."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str, rank: int | None = None) -> RankVerdict:
        """Parse :meth:`to_json`'s output; raises ``ValueError`` naming what is wrong.
        ``rank`` (the file's) stands in for a missing ``rank`` key. Unknown keys (from a
        later version) are ignored."""
        data = untrusted.parse_json(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if rank is not None:
            data.setdefault("rank", rank)
        outcome = data.get("outcome")
        if not isinstance(outcome, str) or not outcome:
            raise ValueError(f"outcome={outcome!r} is not a non-empty string")
        ints = {"rank": data.get("rank"), "step": data.get("step", -1)}
        for key, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{key}={value!r} is not an integer")
        local_rank, signum = data.get("local_rank"), data.get("signal")
        lists: dict[str, list[Any]] = {}
        for key in ("bad_ranks", "bad_hosts", "kinds", "missing", "excluded_hosts"):
            value = data.get(key) or []
            if not isinstance(value, list):
                raise ValueError(f"{key}={value!r} is not a list")
            lists[key] = value
        return cls(
            rank=ints["rank"],
            outcome=outcome,
            step=ints["step"],
            message=str(data.get("message") or ""),
            hostname=str(data.get("hostname") or ""),
            local_rank=local_rank if isinstance(local_rank, int) else None,
            excluded_host=_optional_str(data.get("excluded_host")),
            report_path=_optional_str(data.get("report_path")),
            record_error=_optional_str(data.get("record_error")),
            signal=(signum if isinstance(signum, int) and not isinstance(signum, bool)
                    and 0 < signum < 65 else None),
            **lists,
        )


def _optional_str(value: object) -> str | None:
    return None if value is None or value == "" else str(value)


def verdict_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its verdict under ``run_dir``."""
    return Path(run_dir) / VERDICTS_SUBDIR / f"rank-{int(rank)}.json"


def write_verdict(run_dir: str | Path, verdict: RankVerdict) -> Path:
    """Atomically write ``verdict`` as its rank's verdict; returns the file's path."""
    path = verdict_path(run_dir, verdict.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".rank-{int(verdict.rank)}.", suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(verdict.to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_verdicts(run_dir: str | Path) -> dict[int, RankVerdict]:
    """All verdicts under ``run_dir``, by global rank; ``{}`` when there are none. With the
    run directory's :class:`VerdictInbox` open in this process, the verdicts that arrived by
    socket count too (a rank's latest one wins over its file: they are the same verdict, or
    the file is one the disk kept from an attempt it would not let us move aside).

    An unreadable or malformed file is skipped with a warning naming it: the launcher must
    still print its summary when one rank died in an odd way.
    """
    inbox = _INBOXES.get(_key(run_dir))
    verdicts: dict[int, RankVerdict] = {}
    directory = Path(run_dir) / VERDICTS_SUBDIR
    for path in sorted(directory.iterdir()) if directory.is_dir() else ():
        match = _RANK_FILE.match(path.name)
        if not match or (inbox is not None and inbox.is_stale(path)):
            continue
        rank = int(match.group(1))
        try:
            verdicts[rank] = RankVerdict.from_json(
                untrusted.read_text(path, what="verdict file"), rank)
        except (OSError, ValueError) as exc:
            log.warning("skipping unreadable verdict file %s: %s", path, exc)
    if inbox is not None:
        verdicts.update(inbox.current())
    return verdicts


def write_stop_cause(run_dir: str | Path, outcome: str, message: str) -> None:
    """The launcher, before it stops its workers for a cause of its own (the rendezvous store
    is gone): ``outcome`` and ``message`` for the verdict each rank then leaves, instead of
    blaming the signal that stops it. Written atomically; raises ``OSError``. Moved aside with
    the attempt's verdicts."""
    path = Path(run_dir) / VERDICTS_SUBDIR / _STOP_CAUSE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{_STOP_CAUSE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"outcome": outcome, "message": message}, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def stop_cause(run_dir: str | Path | None) -> tuple[str, str] | None:
    """What :func:`write_stop_cause` left for this attempt, as ``(outcome, message)``; None
    where it left nothing (or it cannot be read: the rank then names the signal)."""
    if not run_dir:
        return None
    path = Path(run_dir) / VERDICTS_SUBDIR / _STOP_CAUSE
    try:
        data = untrusted.parse_json(untrusted.read_text(path, what="launcher's stop cause"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("outcome") != STORE_GONE:  # the one cause
        return None
    return str(data["outcome"]), str(data.get("message") or "")


def archive_verdicts(run_dir: str | Path) -> Path | None:
    """Move the current verdicts aside to ``verdicts.attempt-N``; returns the new path.

    Called by the launcher before each new rendezvous so that a later summary never mixes
    ranks of two attempts (global ranks are reassigned when membership changes). Returns
    None when there was nothing to move. With the run directory's :class:`VerdictInbox` open,
    the verdicts that arrived by socket are set aside too, and a folder the disk will not let
    us move (read-only) is one warning: its files are then ignored from here on.
    """
    inbox = _INBOXES.get(_key(run_dir))
    if inbox is not None:
        inbox.archive()
    directory = Path(run_dir) / VERDICTS_SUBDIR
    # Between attempts no worker writes here: a temporary file is a killed rank's, never read.
    sweep_orphans(directory, min_age=0)
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    for n in itertools.count():
        target = directory.with_name(f"{VERDICTS_SUBDIR}.attempt-{n}")
        if target.exists():
            continue
        try:
            os.rename(directory, target)
        except OSError as exc:
            if target.exists():  # another process took this number first
                continue
            if inbox is None:
                raise
            inbox.set_stale(directory)
            log.warning("could not move the verdicts of the last attempt aside (%s: %s); "
                        "their files are ignored from now on", directory, _reason(exc))
            return None
        return target
    raise AssertionError("unreachable")


# -- the verdict socket: verdicts that need no disk ------------------------------------------

#: Largest verdict sent by socket (bytes of JSON); a longer message is cut to fit.
MAX_DATAGRAM = 60_000
#: Seconds a rank waits to hand its verdict over (a launcher that reads nothing).
SEND_TIMEOUT_S = 2.0
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _key(run_dir: str | Path) -> str:
    return os.path.realpath(run_dir)


def verdict_address(run_dir: str | Path) -> bytes | None:
    """The abstract socket address of ``run_dir``'s inbox (None off Linux, where there is
    no abstract namespace: verdicts then travel as files only)."""
    if not sys.platform.startswith("linux"):
        return None
    digest = hashlib.sha256(_key(run_dir).encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return b"\0nansentinel-verdicts-" + digest.encode()


def send_verdict(run_dir: str | Path, verdict: RankVerdict) -> bool:
    """Hand ``verdict`` to the launcher's inbox of ``run_dir``; True when it was taken. False,
    silently, when nobody listens (not launched by ``nansentinel run``, or not on Linux)."""
    address = verdict_address(run_dir)
    if address is None:
        return False
    data = verdict.to_json().encode("utf-8")
    if len(data) > MAX_DATAGRAM:
        cut = dataclasses.replace(verdict, message=verdict.message[: MAX_DATAGRAM // 2])
        data = cut.to_json().encode("utf-8")[:MAX_DATAGRAM]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.sendto(data, address)
    except OSError:
        return False
    return True


class VerdictInbox:
    """The launcher's end of the verdict socket of ``run_dir`` (see the module docstring).

    Open it for the length of a launch (``with VerdictInbox(run_dir):``); while it is open
    :func:`read_verdicts` and :func:`archive_verdicts` of ``run_dir`` include what it
    received. Only datagrams from processes of this user count (the kernel's credentials,
    ``SO_PASSCRED``): another user on the host cannot make this launcher exit 4. A thread
    drains the socket as verdicts arrive (the kernel queues only a few datagrams); every
    read drains it again under the same lock, so a verdict sent before its worker exited is
    always counted in that worker's attempt.

    Args:
        run_dir: the run directory the workers were given (``NANSENTINEL_RUN_DIR``).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.address = verdict_address(run_dir)
        self.problem: str | None = None
        """Why the inbox could not open (verdicts then travel as files only)."""
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._current: dict[int, RankVerdict] = {}
        self._stale: set[tuple[str, int, int]] = set()
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def __enter__(self) -> VerdictInbox:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Bind the socket and start draining; a failure is :attr:`problem`, not raised."""
        if self.address is None:
            self.problem = "no abstract Unix sockets on this platform"
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(self.address)
        except OSError as exc:  # another launcher with the same NANSENTINEL_RUN_DIR
            sock.close()
            self.problem = _reason(exc)
            log.warning("verdicts of %s travel as files only: its socket could not be "
                        "opened (%s)", self.run_dir, self.problem)
            return
        sock.setblocking(False)
        self._sock = sock
        _INBOXES[_key(self.run_dir)] = self
        self._thread = threading.Thread(target=self._drain_loop, name="nansentinel-verdicts",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop draining and release the address."""
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if _INBOXES.get(_key(self.run_dir)) is self:
            del _INBOXES[_key(self.run_dir)]
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def current(self) -> dict[int, RankVerdict]:
        """The verdicts of the current attempt received so far, by rank."""
        with self._lock:
            self._drain()
            return dict(self._current)

    def archive(self) -> dict[int, RankVerdict]:
        """Set the current attempt's verdicts aside (returned); the next attempt starts empty."""
        with self._lock:
            self._drain()
            done, self._current = self._current, {}
            return done

    def set_stale(self, directory: Path) -> None:
        """The files now in ``directory`` belong to an attempt that is over."""
        with self._lock:
            for path in directory.iterdir():
                with_stat = _identity(path)
                if with_stat is not None:
                    self._stale.add(with_stat)

    def is_stale(self, path: Path) -> bool:
        """``path`` was left by an attempt that is over (see :meth:`set_stale`)."""
        with self._lock:
            return bool(self._stale) and _identity(path) in self._stale

    def _drain_loop(self) -> None:
        while not self._closing.is_set():
            sock = self._sock
            if sock is None:
                return
            try:
                ready, _, _ = select.select([sock], [], [], 0.2)
            except (OSError, ValueError):
                return
            if ready:
                with self._lock:
                    self._drain()

    def _drain(self) -> None:
        """Take every queued datagram (the lock held)."""
        if self._sock is None:
            return
        while True:
            try:
                data, ancillary, _flags, _addr = self._sock.recvmsg(
                    MAX_DATAGRAM + 1024, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("verdict socket of %s: %s", self.run_dir, _reason(exc))
                return
            if not self._ours(ancillary):
                continue
            try:
                verdict = RankVerdict.from_json(data.decode("utf-8", "replace"))
            except (ValueError, RecursionError) as exc:
                log.warning("skipping an unreadable verdict received for %s: %s",
                            self.run_dir, exc)
                continue
            self._current[verdict.rank] = verdict

    @staticmethod
    def _ours(ancillary: list[tuple[int, int, bytes]]) -> bool:
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                _pid, uid, _gid = _UCRED.unpack(payload[: _UCRED.size])
                return uid == os.getuid()
        return False


#: The inboxes open in this process, by run directory (see :func:`read_verdicts`).
_INBOXES: dict[str, VerdictInbox] = {}


def _identity(path: Path) -> tuple[str, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (path.name, st.st_ino, st.st_mtime_ns)


def _reason(exc: OSError) -> str:
    """An OSError as one short line: its message, without the file name it may repeat."""
    return exc.strerror or str(exc) or type(exc).__name__


@dataclasses.dataclass(frozen=True, slots=True)
class VerdictOutcome:
    """What the verdicts of one failed attempt mean for this host's launcher."""

    exit_code: int
    """One of :mod:`nansentinel.common.exitcodes`."""
    explanation: str
    """One line for the summary: what happened and what happens next."""
    excluded_host: str | None = None
    """The host the cluster excluded, when a verdict says so."""
    verdict: RankVerdict | None = None
    """The verdict the decision rests on (None when there was none)."""


def outcome_from_verdicts(
    verdicts: Mapping[int, RankVerdict], hostname: str, failed: Collection[int] = ()
) -> VerdictOutcome:
    """Map the verdicts of a failed attempt to this host's exit code.

    Precedence, strongest first: this host excluded (4) > the sentinel stopped the run
    by excluding another host (3) > on a non-finite state of the model's own (6) > by abort
    (3) > the rendezvous store is gone (5) > a rank missed the health exchange (5) > a
    signal asked every rank to stop after the same step (128 + the signal: 143, 130) > no
    verdict at all, an ordinary worker failure (1). An abort outranks a timeout because
    the sentinel aborts on every rank at the same step, so a timeout next to an abort is a
    consequence of it, not the cause. ``failed``: the ranks that failed; when every one of
    them had closed its sentinel cleanly, the failure came at exit, after training: still
    exit 1 (a failed process is one), but the explanation says so.
    """
    by_outcome: dict[str, list[RankVerdict]] = {}
    for rank in sorted(verdicts):
        by_outcome.setdefault(verdicts[rank].outcome, []).append(verdicts[rank])

    excluded = by_outcome.get(Outcome.EXCLUDED, [])
    for v in excluded:
        if hostname in v.excludes:
            return VerdictOutcome(
                EXIT_HOST_EXCLUDED,
                f"this host ({hostname}) was excluded by the sentinel: {v.message}".rstrip(": "),
                excluded_host=hostname,
                verdict=v,
            )
    if excluded:
        v = excluded[0]
        hosts = v.excludes or [str(v.excluded_host)]
        return VerdictOutcome(
            EXIT_NONFINITE_ABORT,
            f"host(s) {', '.join(hosts)} excluded by the sentinel and no restart is left to "
            f"continue without them (raise --max-restarts and use --nnodes=MIN:MAX to keep "
            "going)",
            excluded_host=hosts[0],
            verdict=v,
        )
    aborted = by_outcome.get(Outcome.ABORTED, [])
    poisoned = [v for v in aborted if STATE_KIND in v.kinds]
    if poisoned:
        v = poisoned[0]
        return VerdictOutcome(
            EXIT_NONFINITE_STATE,
            f"the model's own state is not finite: {v.message or 'a poisoned state'}",
            verdict=v,
        )
    if aborted:
        v = aborted[0]
        return VerdictOutcome(
            EXIT_NONFINITE_ABORT,
            f"the sentinel aborted the run: {v.message or 'non-finite values'}",
            verdict=v,
        )
    gone = by_outcome.get(STORE_GONE, [])
    if gone:
        v = gone[0]
        return VerdictOutcome(EXIT_EXCHANGE_TIMEOUT, v.message or "the rendezvous store is gone",
                              verdict=v)
    timeouts = by_outcome.get(EXCHANGE_TIMEOUT, [])
    if timeouts:
        v = timeouts[0]
        return VerdictOutcome(
            EXIT_EXCHANGE_TIMEOUT,
            f"the sentinel's health exchange timed out: {v.message}".rstrip(": "),
            verdict=v,
        )
    stopped = [v for v in by_outcome.get(STOPPED, []) if v.signal]
    if stopped:
        v = stopped[0]
        return VerdictOutcome(
            128 + int(v.signal or 0),
            f"a signal asked the run to stop: {v.message}".rstrip(": "),
            verdict=v,
        )
    closed = {v.rank for v in by_outcome.get(CLOSED, [])}
    if failed and set(failed) <= closed:
        ranks = ", ".join(str(r) for r in sorted(failed))
        return VerdictOutcome(
            EXIT_WORKER_FAILED,
            f"rank(s) {ranks} failed at exit, after the sentinel had closed cleanly (training "
            "had finished); the process ended badly while shutting down (see its output)",
            verdict=verdicts[min(failed)],
        )
    return VerdictOutcome(
        EXIT_WORKER_FAILED, "a worker failed without a sentinel verdict (see its traceback)"
    )
