"""Incidents: what one says (the log line, the exception message, the report's content) and
how it is recorded (:class:`IncidentWriter`).

The messages are pure functions of the decision and the cluster view, so that every message
names the same step, ranks, hosts and kinds, and can be tested without a training loop. The
writer is the side effect: one gather of the ranks' details after a detection, the poisoned
ranks' batches and rank 0's report on disk (atomically, never over an existing file).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nansentinel.common import report
from nansentinel.decide.policy import Decision
from nansentinel.decide.spikes import CLUSTER, Spikes
from nansentinel.rare import samples as skip_list
from nansentinel.rare.curves import Curves
from nansentinel.result import KINDS, NAMED, Outcome, StepResult
from nansentinel.wire.context import Context
from nansentinel.wire.schema import SIGNALS
from nansentinel.wire.view import ClusterView, RankHealth

log = logging.getLogger("nansentinel")

#: Ranks named in a log line or an exception message (the rest are counted).
_LOGGED = 8
#: Ranks listed in a report (the rest are counted; the cluster is summed up).
REPORTED = NAMED

#: What happens next, by outcome (an exclusion names its host instead).
_NEXT = {
    Outcome.SKIPPED: "step skipped on every rank, gradients discarded",
    Outcome.ABORTED: "aborting on every rank",
    Outcome.ROLLED_BACK: "rolled back on every rank",
    Outcome.APPLIED: "step applied (warn only)",
    Outcome.OVERFLOW: "step left to GradScaler",
    Outcome.EXCLUDED: "excluding a host",
    Outcome.DROPPED: "step applied on every rank from the other ranks' gradients",
}


def first(names: list[str], n: int) -> str:
    """The first ``n`` names, and how many more there are."""
    more = f", … ({len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def describe(view: ClusterView, decision: Decision, result: StepResult, spikes: Spikes) -> str:
    """One log line for an incident: what, where (rank, host, local rank, device), what next."""
    parts = []
    for r in decision.bad[:_LOGGED]:
        ident = r.identity
        params = result.parameters.get(r.rank)
        parts.append(
            f"rank {r.rank} (host {ident.hostname}, local rank {ident.local_rank}, "
            f"{ident.device}): {', '.join(r.kinds)}" + (f" [{first(params, 5)}]" if params else "")
        )
    if len(decision.bad) > _LOGGED:
        parts.append(f"… and {len(decision.bad) - _LOGGED} more rank(s) (see the report)")
    if result.reached:
        parts.append(f"reached from there (not blamed): rank(s) "
                     f"{first([str(r) for r in result.reached], _LOGGED)}")
    for signal in spikes.signals():
        ranks = spikes.ranks[signal]
        for rank in ranks[:_LOGGED]:
            named = view.named(rank)
            where = "cluster mean" if rank == CLUSTER else (
                f"rank {rank} (host {named.identity.hostname})" if named else f"rank {rank}"
            )
            ratio = spikes.ratios[signal][rank]
            parts.append(f"{signal} spike on {where}: {ratio:.1f}x its running median")
        if len(ranks) > _LOGGED:
            parts.append(f"… and {len(ranks) - _LOGGED} more {signal} spike(s)")
    for signal, ratio in spikes.collapsed.items():
        parts.append(f"{signal} collapse on cluster mean: {ratio:.2f}x its running median "
                     "(no snapshot kept while it lasts)")
    nxt = _excluding(decision) if decision.exclude_host else _NEXT[result.outcome]
    if result.rolled_back_to is not None:
        nxt += f" to step {result.rolled_back_to}, learning rate x{result.lr_factor:g}"
    what = "non-finite values" if decision.bad else "non-finite model state" if (
        result.poisoned_state) else "non-finite hyperparameter" if view.totals.bad_hyper else (
        "spike" if spikes else "collapse" if spikes.collapsed else "recovery")
    injected = " (injected by NANSENTINEL_INJECT)" if view.injected else ""
    verdict = f"; verdict: {result.verdict}" if result.verdict else ""
    listed = f": {'; '.join(parts)}" if parts else ""
    return (
        f"nansentinel: {what} at step {view.step}{injected}{listed}{verdict} "
        f"— {nxt}" + (f" ({decision.reason})" if decision.reason else "")
    )


def _excluding(decision: Decision) -> str:
    hosts = [host for host, _ in decision.exclusions]
    return f"excluding host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)}"


def describe_abort(decision: Decision, result: StepResult) -> str:
    """The message of the exception raised on every rank."""
    what = _excluding(decision) if decision.exclude_host else "aborting"
    if not result.bad_ranks:
        return f"nansentinel: {what} at step {result.step}: {decision.reason}."
    if decision.cause == "replica":  # the reason names the groups, ranks and parameters
        return f"nansentinel: {what} at step {result.step}: {decision.reason}."
    return (
        f"nansentinel: {what} at step {result.step}: non-finite {', '.join(result.kinds)} on "
        f"rank(s) {first([str(r) for r in result.bad_ranks], _LOGGED)} (host(s) "
        f"{first(result.bad_hosts, _LOGGED)}); {decision.reason}."
        + (f" Verdict: {result.verdict}." if result.verdict else "")
        + (f" Report: {result.report_path}" if result.report_path else "")
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One incident as the rare path records it: the cluster's view and decision, this rank's
    result and the step's spikes (the same on every rank but ``result``'s ``local_*``), and
    what this rank alone knows of its step: its share of the evidence (``detail``: the
    gradient path's parameter naming, the replay's findings), its last batch and its ids
    (``[(batch, ids), …]``, every batch checked with ids this step), and the ids of the
    batches a rollback over a degenerate stretch discarded (``discarded``: this rank's, each
    rank appends its own to the skip list)."""

    view: ClusterView
    decision: Decision
    result: StepResult
    spikes: Spikes
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch: Any = None
    ids: Any = None
    discarded: list[Any] | None = None


def payload(
    case: Case, details: dict[int, dict[str, Any]], message: str, *, job_id: str | None,
    policy: str,
) -> dict[str, Any]:
    """The incident report's JSON content (no NaN: JSON has none; non-finite numbers become
    strings such as ``"nan"``).

    It names the blamed ranks (``poisoned``) and every rank the detection named (``ranks``,
    by rank: the blamed and spiking ranks and the replay's peer), at most ``REPORTED`` of
    each, and sums up the rest of the cluster in ``cluster``: never one row per rank, so a
    report is as small at 100,000 ranks as at 8.
    """

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
        if r.spikes:
            entry["spikes"] = {s: round(x, 3) for s, x in r.spikes.items()}
        if r.reached:
            entry["reached"] = True
        if r.boundary:
            entry["boundary"] = list(r.boundary)
        entry.update(details.get(r.rank) or {})
        return entry

    view, decision, result = case.view, case.decision, case.result
    replay = next((d["replay"] for d in details.values() if d and "replay" in d), None)
    named = view.listed[:REPORTED]
    return {
        "version": 2,
        "message": message,
        "job_id": job_id,
        "time": time.time(),
        "step": view.step,
        "outcome": result.outcome,
        "reason": decision.reason,
        "policy": policy,
        "bad_ranks": result.bad_ranks,
        "bad_hosts": result.bad_hosts,
        "reached": result.reached[:REPORTED],
        "reached_not_listed": max(0, len(result.reached) - REPORTED),
        "kinds": result.kinds,
        "injected": view.injected,
        "overflow": decision.overflow,
        "excluded_host": decision.exclude_host,
        "excluded_hosts": [host for host, _ in decision.exclusions],
        "consecutive_skips": result.consecutive_skips,
        "world_size": view.world_size,
        "verdict": result.verdict,
        "spikes": case.spikes.to_json(),
        "rolled_back_to": result.rolled_back_to,
        "recovery": result.recovery,
        "lr_factor": result.lr_factor,
        "buffers_restored": result.buffers_restored,
        "first_nonfinite_module": replay.get("first_module") if replay else None,
        "first_nonfinite_parameter": replay.get("first_parameter") if replay else None,
        "origin_trace": view.origin_trace,
        "poisoned_state": {str(r): found for r, found in
                           list(result.poisoned_state.items())[:REPORTED]},
        "state_action": result.state_action or None,
        "poisoned": [rank_entry(r) for r in decision.bad[:REPORTED]],
        "ranks": {str(r.rank): rank_entry(r) for r in named},
        "ranks_not_listed": max(0, len(view.listed) - len(named)),
        "cluster": cluster_summary(view),
    }


def cluster_summary(view: ClusterView) -> dict[str, Any]:
    """The whole cluster in a few numbers: counts from the exchange's totals, and per signal
    the mean and spread over the ranks with a finite value (min and max after a detection)."""
    t = view.totals
    out: dict[str, Any] = {
        "world_size": view.world_size,
        "nonfinite": {k: t.bad(k) for k in KINDS},
        "blamed": t.blamed,
        "reached": t.reached,
        "spiking": {"loss": t.spike_loss, "grad_norm": t.spike_grad, "any": t.spike_any,
                    "with_their_batch": t.data_spike},
        "quarantined": t.quarantined,
        "injected": t.injected,
    }
    for signal in SIGNALS:
        entry: dict[str, Any] = {"ranks": t.sums(signal)[0], "mean": t.mean(signal),
                                 "std": t.std(signal)}
        if signal in view.extremes:
            entry["min"], entry["max"] = view.extremes[signal]
        out[signal] = {k: report.json_float(v) if isinstance(v, float) else v
                       for k, v in entry.items()}
    return out


class IncidentWriter:
    """Records incidents for one rank: after a detection (or a spike, or a rollback) the
    poisoned ranks save their batch, the blamed ranks and the replay's peer share their
    detail in one gather (only now, never on a healthy step, and only they speak), rank 0
    writes the report and every rank logs its part."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.identity = ctx.identity
        #: Told about each incident file that could not be written (the metrics counter).
        self.failed: Callable[[str], None] | None = None
        #: The count a report names its step by, from the sentinel's own (None: that one):
        #: an integration that counts steps its own way (torchft's ``current_step()``, which
        #: a vetoed step does not advance) names reports, logs and exclusions by one count.
        self.step_of: Callable[[int], int] | None = None

    def write(self, case: Case, curves: Curves | None = None
              ) -> tuple[StepResult, dict[int, dict[str, Any]]]:
        """Record one incident; returns the case's result with ``parameters`` and
        ``report_path``, and the named ranks' details (rank -> detail).

        The case's ``detail`` (this rank's share) travels if this rank is one of the first
        ``REPORTED`` blamed ranks or the replay's peer, and the batch of a blamed rank is saved
        beside the report. A blamed rank adds its curves and the ids of its rows at fault;
        rank 0 appends those to the skip list when the batch is at fault (see
        :func:`skipped_ids`).
        """
        if self.step_of is not None:
            case = dataclasses.replace(case, view=dataclasses.replace(
                case.view, step=self.step_of(case.view.step)))
        view, decision, result = case.view, case.decision, case.result
        rank = self.identity.rank
        stem = report.incident_stem(self.ctx.job_id, view.step)
        base = Path(self.config.report_dir)
        bad = decision.bad_ranks
        speakers = sorted({*bad[:REPORTED], *([view.replay_peer] if view.replay_peer is not
                                               None else [])})
        detail = dict(case.detail)
        if rank in bad:
            # Local work only, before the gather every rank joins: whatever fails here is
            # said in the report, never raised (a rank that raised would miss the gather).
            _, error = report.attempt(
                "detail", lambda: self._own_detail(detail, case, base / stem, curves),
                rank=rank, step=view.step, failed=self.failed,
            )
            if error is not None:
                detail["detail_error"] = error
        with self.ctx.guarded():
            gathered = self.ctx.peers.gather_from(speakers, detail)
        details = {r: d for r, d in gathered.items() if isinstance(d, dict)}
        parameters = {r: d["parameters"] for r, d in details.items() if d.get("parameters")}
        result = dataclasses.replace(result, parameters=parameters)
        case = dataclasses.replace(case, result=result)
        message = describe(view, decision, result, case.spikes)
        # A degenerate stretch's batches were every rank's: each rank appends its own line,
        # never gathered (that would be every rank's ids on every rank).
        discarded = self._skip(view.step, {rank: case.discarded}, "data") if (
            case.discarded) else {}
        if rank == 0:
            path, _ = report.attempt(
                "report", lambda: self._report(case, details, message, curves,
                                               base / f"{stem}.json", discarded),
                rank=rank, step=view.step, failed=self.failed, where=base / f"{stem}.json",
            )
            if path is not None:
                result = dataclasses.replace(result, report_path=str(path))
            log.log(
                logging.ERROR if decision.stops else logging.WARNING,
                "%s%s", message, f"; report: {result.report_path}" if result.report_path else "",
            )
        if rank in bad:
            mine = view.named(rank)
            ident = self.identity
            params = detail.get("parameters")
            batch_path = detail.get("batch_path")
            samples = detail.get("sample_ids")
            log.warning(
                "nansentinel: rank %d on host %s (local rank %d, %s): non-finite %s at step "
                "%d%s%s%s",
                rank, ident.hostname, ident.local_rank, ident.device,
                ", ".join(mine.kinds if mine else ()), view.step,
                f"; parameters: {first(params, 8)}" if params else "",
                f"; samples: {first([str(i) for i in samples], 16)}" if samples else "",
                f"; batch saved to {batch_path}" if batch_path else "",
            )
        return result, details

    def write_report(self, step: int, suffix: str, content: dict[str, Any]) -> Path | None:
        """Write an incident report that is not a step's NaN (``suffix`` ``-replicas``: a
        replica divergence) as every report is written: atomically, never over a file, a
        failure one line and a count. Rank 0 calls it; returns the path, None on failure."""
        stem = report.incident_stem(self.ctx.job_id, step)
        target = Path(self.config.report_dir) / f"{stem}{suffix}.json"
        path, _ = report.attempt(
            "report", lambda: report.write_json(target, content),
            rank=self.identity.rank, step=step, failed=self.failed, where=target,
        )
        return path

    def _own_detail(self, detail: dict[str, Any], case: Case, stem: Path,
                    curves: Curves | None) -> Path:
        """A blamed rank's share: its curves, its sample ids, its batch saved beside the
        report (``stem``: the report's path without its suffix; ``detail`` is filled in
        place). Returns the report directory."""
        rank, batch = self.identity.rank, case.batch
        if curves is not None:
            detail["history"] = curves.own()
        if case.ids:
            detail.update(sample_detail(case.ids, verdict=case.result.verdict))
        if batch is not None and not self.config.save_batches:
            detail["batch_not_saved"] = "save_batches=False"
        elif batch is not None:
            target = stem.with_name(f"{stem.name}-rank{rank}-batch.pt")
            path, error = report.attempt(
                "batch", lambda: report.save_batch(target, batch),
                rank=rank, step=case.view.step, failed=self.failed, where=target,
            )
            detail.update({"batch_path": str(path)} if path else {"batch_error": error})
        return stem.parent

    def _report(self, case: Case, details: dict[int, dict[str, Any]], message: str,
                curves: Curves | None, path: Path, discarded: dict[str, Any]) -> Path:
        """Rank 0: the report's content, the skip list's new lines (and where its own
        ``discarded`` ids of a stretch went), the file."""
        content = payload(case, details, message, job_id=self.ctx.job_id,
                          policy=self.config.policy)
        if curves is not None:
            content["history"] = curves.cluster()
        skipped = skipped_ids(details, case.result.verdict)
        if skipped:
            content.update(self._skip(case.view.step, skipped, case.result.verdict))
        content.update(discarded)
        return report.write_json(path, content)

    def _skip(self, step: int, skipped: dict[int, list[Any]], verdict: str | None
              ) -> dict[str, Any]:
        """Append the ids at fault to the job's skip list: rank 0 the gathered ranks', each
        rank its own of a degenerate stretch rolled back over."""
        path = (Path(self.config.skip_list) if self.config.skip_list
                else skip_list.default_path(self.config.report_dir, self.ctx.job_id))
        for r, ids in skipped.items():
            entry = {
                "job": self.ctx.job_id, "step": step, "rank": r, "verdict": verdict,
                "ids": [list(i) if isinstance(i, tuple) else i for i in ids],
            }
            written, error = report.attempt(
                "skip_list", functools.partial(skip_list.append, path, entry),
                rank=self.identity.rank, step=step, failed=self.failed, where=path,
            )
            if written is None:
                return {"skip_list_error": error}
        return {"skip_list": str(path), "skipped_ids": {str(r): ids for r, ids in skipped.items()}}


def sample_detail(samples: Any, ids: Any = None, verdict: str | None = None
                  ) -> dict[str, Any]:
    """A blamed rank's sample ids: the rows holding non-finite values (``sample_ids``), and
    when there are none but the batch itself is at fault (verdict ``data``: it made NaN on
    another host too) every row's of the last batch, the one replayed (``batch_ids``). At
    most ``MAX_IDS`` each.

    ``samples``: ``[(batch, ids), …]``, one pair per batch checked with ids this step (every
    micro-batch under gradient accumulation); a single ``(batch, ids)`` may be passed as
    ``sample_detail(batch, ids, verdict)``."""
    pairs = [(samples, ids)] if ids is not None else list(samples)
    found: list[Any] = []
    for batch, batch_ids in pairs:
        every = skip_list.as_ids(batch_ids)
        found.extend(every[i] for i in skip_list.nonfinite_rows(batch))
    out: dict[str, Any] = {"sample_ids": found[:skip_list.MAX_IDS]}
    if len(found) > skip_list.MAX_IDS:
        out["sample_ids_not_listed"] = len(found) - skip_list.MAX_IDS
    if not found and verdict == "data" and pairs:
        out["batch_ids"] = skip_list.as_ids(pairs[-1][1])[:skip_list.MAX_IDS]
    return out


def skipped_ids(details: dict[int, dict[str, Any]], verdict: str | None
                ) -> dict[int, list[Any]]:
    """Per blamed rank, the ids that go to the skip list: its non-finite rows (a batch that
    held NaN or Inf is at fault whatever the verdict), else its whole batch on a ``data``
    verdict. Empty when nobody passed ids."""
    out: dict[int, list[Any]] = {}
    for r, d in details.items():
        ids = d.get("sample_ids") or (d.get("batch_ids") if verdict == "data" else None)
        if ids:
            out[r] = [tuple(i) if isinstance(i, list) else i for i in ids]
    return out
