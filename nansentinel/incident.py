"""Incidents: what one says (the log line, the exception message, the report's content) and
how it is recorded (:class:`IncidentWriter`).

The messages are pure functions of the decision and the cluster view, so that every message
names the same step, ranks, hosts and kinds, and can be tested without a training loop. The
writer is the side effect: one gather of the ranks' details after a detection, the poisoned
ranks' batches and rank 0's report on disk (atomically, never over an existing file).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nansentinel import report
from nansentinel.collectives import Peers
from nansentinel.config import SentinelConfig
from nansentinel.policy import Decision
from nansentinel.result import Outcome, RankIdentity, StepResult
from nansentinel.spikes import CLUSTER, Spikes
from nansentinel.view import ClusterView, RankHealth

log = logging.getLogger("nansentinel")

#: What happens next, by outcome (an exclusion names its host instead).
_NEXT = {
    Outcome.SKIPPED: "step skipped on every rank, gradients discarded",
    Outcome.ABORTED: "aborting on every rank",
    Outcome.ROLLED_BACK: "rolled back on every rank",
    Outcome.APPLIED: "step applied (warn only)",
    Outcome.OVERFLOW: "step left to GradScaler",
    Outcome.EXCLUDED: "excluding a host",
}


def first(names: list[str], n: int) -> str:
    """The first ``n`` names, and how many more there are."""
    more = f", … ({len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def describe(view: ClusterView, decision: Decision, result: StepResult, spikes: Spikes) -> str:
    """One log line for an incident: what, where (rank, host, local rank, device), what next."""
    parts = []
    for r in decision.bad:
        ident = r.identity
        params = result.parameters.get(r.rank)
        parts.append(
            f"rank {r.rank} (host {ident.hostname}, local rank {ident.local_rank}, "
            f"{ident.device}): {', '.join(r.kinds)}" + (f" [{first(params, 5)}]" if params else "")
        )
    for signal in spikes.signals():
        for rank in spikes.ranks[signal]:
            where = "cluster mean" if rank == CLUSTER else (
                f"rank {rank} (host {view.ranks[rank].identity.hostname})"
            )
            ratio = spikes.ratios[signal][rank]
            parts.append(f"{signal} spike on {where}: {ratio:.1f}x its running median")
    if decision.exclude_host:
        nxt = f"excluding host {decision.exclude_host}"
    else:
        nxt = _NEXT[result.outcome]
    if result.rolled_back_to is not None:
        nxt += f" to step {result.rolled_back_to}, learning rate x{result.lr_factor:g}"
    what = "non-finite values" if decision.bad else "spike"
    injected = " (injected by NANSENTINEL_INJECT)" if view.injected else ""
    verdict = f"; verdict: {result.verdict}" if result.verdict else ""
    return (
        f"nansentinel: {what} at step {view.step}{injected}: {'; '.join(parts)}{verdict} "
        f"— {nxt}" + (f" ({decision.reason})" if decision.reason else "")
    )


def describe_abort(decision: Decision, result: StepResult) -> str:
    """The message of the exception raised on every rank."""
    what = "excluding host " + str(decision.exclude_host) if decision.exclude_host else "aborting"
    if not result.bad_ranks:
        return f"nansentinel: {what} at step {result.step}: {decision.reason}."
    return (
        f"nansentinel: {what} at step {result.step}: non-finite {', '.join(result.kinds)} on "
        f"rank(s) {', '.join(map(str, result.bad_ranks))} (host(s) "
        f"{', '.join(result.bad_hosts)}); {decision.reason}."
        + (f" Verdict: {result.verdict}." if result.verdict else "")
        + (f" Report: {result.report_path}" if result.report_path else "")
    )


def payload(
    view: ClusterView,
    decision: Decision,
    result: StepResult,
    spikes: Spikes,
    details: list[dict[str, Any]],
    message: str,
    *,
    job_id: str | None,
    policy: str,
    world_size: int,
) -> dict[str, Any]:
    """The incident report's JSON content (no NaN: JSON has none; non-finite numbers become
    strings such as ``"nan"``)."""

    def rank_entry(r: RankHealth) -> dict[str, Any]:
        ident = r.identity
        entry: dict[str, Any] = {
            "rank": r.rank,
            "hostname": ident.hostname,
            "local_rank": ident.local_rank,
            "device": ident.device,
            "gpu_uuid": ident.gpu_uuid,
            "kinds": list(r.kinds),
            "injected": r.injected,
            "loss": report.json_float(r.loss),
            "grad_norm": report.json_float(r.grad_norm),
        }
        entry.update(details[r.rank])
        return entry

    replay = next((d["replay"] for d in details if "replay" in d), None)
    return {
        "version": 1,
        "message": message,
        "job_id": job_id,
        "time": time.time(),
        "step": view.step,
        "outcome": result.outcome,
        "reason": decision.reason,
        "policy": policy,
        "bad_ranks": result.bad_ranks,
        "bad_hosts": result.bad_hosts,
        "kinds": result.kinds,
        "injected": view.injected,
        "overflow": decision.overflow,
        "excluded_host": decision.exclude_host,
        "consecutive_skips": result.consecutive_skips,
        "world_size": world_size,
        "verdict": result.verdict,
        "spikes": spikes.to_json(),
        "rolled_back_to": result.rolled_back_to,
        "lr_factor": result.lr_factor,
        "first_nonfinite_module": replay.get("first_module") if replay else None,
        "first_nonfinite_parameter": replay.get("first_parameter") if replay else None,
        "poisoned": [rank_entry(r) for r in decision.bad],
        "ranks": [rank_entry(r) for r in view.ranks],
    }


class IncidentWriter:
    """Records incidents for one rank: after a detection (or a spike, or a rollback) the
    poisoned ranks save their batch, every rank shares its detail in one gather (only now,
    never on a healthy step), rank 0 writes the report and every rank logs its part."""

    def __init__(
        self, config: SentinelConfig, identity: RankIdentity, peers: Peers,
        job_id: str | None,
    ) -> None:
        self.config = config
        self.identity = identity
        self.peers = peers
        self.job_id = job_id
        #: Told about each incident file that could not be written (the metrics counter).
        self.failed: Callable[[str], None] | None = None

    def write(
        self,
        view: ClusterView,
        decision: Decision,
        result: StepResult,
        spikes: Spikes,
        *,
        replays: list[dict[str, Any]],
        naming: dict[str, Any],
        resolve: Callable[[list[dict[str, Any]]], dict[int, list[str]]],
        batch: Any,
        guarded: Callable[[], Any],
    ) -> StepResult:
        """Record one incident; returns ``result`` with ``parameters`` and ``report_path``.

        ``naming`` is this rank's share of the parameter naming (the gradient path's
        ``naming_detail``) and ``resolve`` turns every rank's share into rank -> names.
        """
        rank = self.identity.rank
        stem = report.incident_stem(self.job_id, view.step)
        base = Path(self.config.report_dir)
        detail: dict[str, Any] = dict(naming)
        if rank in decision.bad_ranks and batch is not None and not self.config.save_batches:
            detail["batch_not_saved"] = "save_batches=False"
        elif rank in decision.bad_ranks and batch is not None:
            path, error = report.attempt(
                "batch", lambda: report.save_batch(base / f"{stem}-rank{rank}-batch.pt", batch),
                rank=rank, step=view.step, failed=self.failed,
            )
            detail.update({"batch_path": str(path)} if path else {"batch_error": error})
        with guarded():
            details: list[dict[str, Any]] = self.peers.gather_json(detail)  # type: ignore[assignment]
        parameters = resolve(details)
        result = dataclasses.replace(result, parameters=parameters)
        for d, r in zip(details, replays or [{}] * len(details), strict=True):
            d.update(r)
        message = describe(view, decision, result, spikes)
        if rank == 0:
            content = payload(
                view, decision, result, spikes, details, message, job_id=self.job_id,
                policy=self.config.policy, world_size=self.peers.world_size,
            )
            path, _ = report.attempt(
                "report", lambda: report.write_json(base / f"{stem}.json", content),
                rank=rank, step=view.step, failed=self.failed,
            )
            if path is not None:
                result = dataclasses.replace(result, report_path=str(path))
            log.log(
                logging.ERROR if decision.stops else logging.WARNING,
                "%s%s", message, f"; report: {result.report_path}" if result.report_path else "",
            )
        if rank in decision.bad_ranks:
            mine = view.ranks[rank]
            ident = self.identity
            params, batch_path = parameters.get(rank), details[rank].get("batch_path")
            log.warning(
                "nansentinel: rank %d on host %s (local rank %d, %s): non-finite %s at step %d%s%s",
                rank, ident.hostname, ident.local_rank, ident.device, ", ".join(mine.kinds),
                view.step, f"; parameters: {first(params, 8)}" if params else "",
                f"; batch saved to {batch_path}" if batch_path else "",
            )
        return result
