"""Verdict files: how a dying rank tells its launcher *why* it stopped.

When the sentinel stops the run (abort, host exclusion, exchange timeout) every rank raises.
To torchrun's agent that is just "exit code 1"; the reason would be lost in a traceback.
So just before raising, each rank writes a small JSON verdict to
``$NANSENTINEL_RUN_DIR/verdicts/rank-{rank}.json``; the launcher on the same host reads the
verdicts of the last attempt to print a per-rank root-cause summary and to choose its exit
code (see :mod:`nansentinel.exitcodes`).

Payload keys (written by the sentinel): ``rank, local_rank, hostname, step, outcome``
(``"aborted"`` | ``"excluded"`` | ``"exchange_timeout"``), ``message, bad_ranks, bad_hosts,
kinds, excluded_host`` (or null) and ``report_path``.

Files are written atomically (temporary file, fsync, ``os.replace``) because a rank may be
killed a moment later; a reader sees the old file or the new one, never half of one. The
launcher moves the verdicts of a failed attempt aside (:func:`archive_verdicts`) before the
next rendezvous, so verdicts always describe the latest attempt and earlier ones are kept.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nansentinel.exitcodes import (
    EXIT_EXCHANGE_TIMEOUT,
    EXIT_HOST_EXCLUDED,
    EXIT_NONFINITE_ABORT,
    EXIT_WORKER_FAILED,
)

log = logging.getLogger("nansentinel")

OUTCOME_ABORTED = "aborted"
OUTCOME_EXCLUDED = "excluded"
OUTCOME_EXCHANGE_TIMEOUT = "exchange_timeout"
#: The values of a verdict's ``outcome`` key.
VERDICT_OUTCOMES = (OUTCOME_ABORTED, OUTCOME_EXCLUDED, OUTCOME_EXCHANGE_TIMEOUT)

VERDICTS_SUBDIR = "verdicts"
_RANK_FILE = re.compile(r"^rank-(\d+)\.json$")


def verdict_path(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` writes its verdict under ``run_dir``."""
    return Path(run_dir) / VERDICTS_SUBDIR / f"rank-{int(rank)}.json"


def write_verdict(run_dir: str | Path, rank: int, payload: Mapping[str, Any]) -> Path:
    """Atomically write ``payload`` as rank ``rank``'s verdict; returns the file's path.

    Values JSON cannot encode are written as ``str(value)``: this runs on the failure path,
    just before the sentinel raises, and must not replace the real error with a
    serialization error.
    """
    path = verdict_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".rank-{int(rank)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(dict(payload), f, default=str, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_verdicts(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """All verdicts under ``run_dir``, by global rank; ``{}`` when there are none.

    An unreadable or malformed file is skipped with a warning naming it: the launcher must
    still print its summary when one rank died in an odd way.
    """
    directory = Path(run_dir) / VERDICTS_SUBDIR
    if not directory.is_dir():
        return {}
    verdicts: dict[int, dict[str, Any]] = {}
    for path in sorted(directory.iterdir()):
        match = _RANK_FILE.match(path.name)
        if not match:
            continue
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            log.warning("skipping unreadable verdict file %s: %s", path, exc)
            continue
        if not isinstance(payload, dict):
            log.warning("skipping verdict file %s: not a JSON object", path)
            continue
        verdicts[int(match.group(1))] = payload
    return verdicts


def archive_verdicts(run_dir: str | Path) -> Path | None:
    """Move the current verdicts aside to ``verdicts.attempt-N``; returns the new path.

    Called by the launcher before each new rendezvous so that a later summary never mixes
    ranks of two attempts (global ranks are reassigned when membership changes). Returns
    None when there was nothing to move.
    """
    directory = Path(run_dir) / VERDICTS_SUBDIR
    if not directory.is_dir() or not any(directory.iterdir()):
        return None
    for n in itertools.count():
        target = directory.with_name(f"{VERDICTS_SUBDIR}.attempt-{n}")
        if target.exists():
            continue
        try:
            os.rename(directory, target)
        except OSError:
            if target.exists():  # another process took this number first
                continue
            raise
        return target
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True, slots=True)
class VerdictOutcome:
    """What the verdicts of one failed attempt mean for this host's launcher."""

    exit_code: int
    """One of :mod:`nansentinel.exitcodes`."""
    explanation: str
    """One line for the summary: what happened and what happens next."""
    excluded_host: str | None = None
    """The host the cluster excluded, when a verdict says so."""
    verdict: dict[str, Any] | None = None
    """The verdict the decision rests on (None when there was none)."""


def outcome_from_verdicts(
    verdicts: Mapping[int, Mapping[str, Any]], hostname: str
) -> VerdictOutcome:
    """Map the verdicts of a failed attempt to this host's exit code.

    Precedence, strongest first: this host excluded (4) > the sentinel stopped the run,
    by abort or by excluding another host (3) > a rank missed the health exchange (5) >
    no verdict at all, an ordinary worker failure (1). An abort outranks a timeout because
    the sentinel aborts on every rank at the same step, so a timeout next to an abort is a
    consequence of it, not the cause.
    """
    by_outcome: dict[str, list[Mapping[str, Any]]] = {}
    for rank in sorted(verdicts):
        v = verdicts[rank]
        by_outcome.setdefault(str(v.get("outcome")), []).append(v)

    excluded = by_outcome.get(OUTCOME_EXCLUDED, [])
    for v in excluded:
        if v.get("excluded_host") == hostname:
            return VerdictOutcome(
                EXIT_HOST_EXCLUDED,
                f"this host ({hostname}) was excluded by the sentinel: {v.get('message', '')}"
                .rstrip(": "),
                excluded_host=hostname,
                verdict=dict(v),
            )
    if excluded:
        v = excluded[0]
        host = v.get("excluded_host")
        return VerdictOutcome(
            EXIT_NONFINITE_ABORT,
            f"host {host} was excluded by the sentinel and no restart is left to continue "
            f"without it (raise --max-restarts and use --nnodes=MIN:MAX to keep going)",
            excluded_host=str(host) if host else None,
            verdict=dict(v),
        )
    aborted = by_outcome.get(OUTCOME_ABORTED, [])
    if aborted:
        v = aborted[0]
        return VerdictOutcome(
            EXIT_NONFINITE_ABORT,
            f"the sentinel aborted the run: {v.get('message', 'non-finite values')}",
            verdict=dict(v),
        )
    timeouts = by_outcome.get(OUTCOME_EXCHANGE_TIMEOUT, [])
    if timeouts:
        v = timeouts[0]
        return VerdictOutcome(
            EXIT_EXCHANGE_TIMEOUT,
            f"the sentinel's health exchange timed out: {v.get('message', '')}".rstrip(": "),
            verdict=dict(v),
        )
    return VerdictOutcome(
        EXIT_WORKER_FAILED, "a worker failed without a sentinel verdict (see its traceback)"
    )
