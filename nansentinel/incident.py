"""What an incident says: the log line, the exception message and the report's content.

Pure functions of the decision and the cluster view, so that every message names the same
step, ranks, hosts and kinds, and can be tested without a training loop.
"""

from __future__ import annotations

import time
from typing import Any

from nansentinel.exchange import ClusterView, RankHealth, nan_to_none
from nansentinel.policy import Decision
from nansentinel.result import StepResult
from nansentinel.spikes import CLUSTER, Spikes

_NEXT = {
    "skipped": "step skipped on every rank, gradients discarded",
    "aborted": "aborting on every rank",
    "rolled_back": "rolled back on every rank",
    "applied": "step applied (warn only)",
    "overflow": "step left to GradScaler",
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
        nxt = _NEXT.get(result.outcome, result.outcome)
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
            "loss": nan_to_none(r.loss),
            "grad_norm": nan_to_none(r.grad_norm),
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
