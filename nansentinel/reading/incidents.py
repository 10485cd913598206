"""Reading incident reports after the page: ``nansentinel incidents``.

The sentinel writes one JSON report per incident (incident.py); at 3 a.m. nobody wants to read
it raw. This module lists a directory's reports, newest first, one line each, and explains one
in plain words: what was non-finite, where, what the sentinel did, what its verdict means and
what the runbook says to do next, then the numbers. It only reads, and it reads reports of
every version: a field an older version did not write is left out of the explanation, never
an error. A file that is not a report at all is one line naming it (:class:`ReportError`).

The explanation is data (:class:`Section`), so the CLI prints it and the HTML page
(page.py) shows the same words.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path
from typing import Any

from nansentinel.common import untrusted
from nansentinel.common.text import printable
from nansentinel.result import KINDS, NanSentinelError

#: A report's file name (incident.py's stem; ``-N`` when a re-run found the name taken).
REPORT_NAME = re.compile(r"^incident-(?P<job>.+)-step(?P<step>\d{8})(-\d+)?\.json$")

#: The runbook the "what to do next" steps come from (``nansentinel files monitoring DIR``
#: writes it out; nansentinel/files/monitoring/ in the repository).
RUNBOOK = "runbook.md"

_KIND_WORDS = {
    "batch": "the input batch",
    "loss": "the loss",
    "grad": "the local gradients (before their all-reduce)",
    "buffer": "the floating buffers (BatchNorm statistics)",
    "hyperparameter": "an optimizer hyperparameter",
    "state": "the model's own state (weights, buffers, optimizer state)",
}

_VERDICT_WORDS = {
    "transient": "the poisoned rank replayed its own batch with the same weights and it came "
    "out finite: the fault did not reproduce. A flipped bit: a hardware suspect, and a strike "
    "against the host.",
    "data": "the batch was non-finite again when replayed on its own rank and on a healthy "
    "rank of another host: the data is at fault, not the host. The batch is quarantined "
    "(recognised and skipped without blame if it comes round again); no strike.",
    "host": "the batch was non-finite on its own rank but finite on a healthy peer: the "
    "poisoned rank's host or GPU is at fault. A strike against the host (feeds exclusion).",
    "divergence": "every rank went non-finite or spiked together: a global cause (learning "
    "rate, loss formula, fp16), not one host. No replay.",
    "state": "the model's own state held a non-finite value (a weight, a floating buffer, an "
    "optimizer-state tensor): no batch, loss or learning rate made it. On one rank with a "
    "finite replica: a memory fault, repaired in place and struck against the host; on every "
    "replica: the checkpoint or an update carried it. No replay.",
}
_NO_VERDICT = ("no verdict: no replay ran (the sentinel was not given a replay function, or "
               "a rank had no batch to replay).")


@dataclasses.dataclass(frozen=True, slots=True)
class Advice:
    """What to do next: the runbook section it comes from and its steps, summarised."""

    section: str
    steps: tuple[str, ...]


_BAD_HOST = "NanSentinelBadHost"
_STATE = "NanSentinelStateNonFinite"
_HYPER = "NanSentinelHyperparameterNonFinite"
_NONFINITE = "NanSentinelNonFiniteDetected"
_SKIPPED = "NanSentinelStepsSkipped"
_CAUSES = "Causes of non-finite values"

_ADVICE = {
    "host": Advice(_BAD_HOST, (
        "Suspect the GPU: check DCGM for XID errors, ECC (DCGM_FI_DEV_ECC_DBE_VOL_TOTAL), "
        "temperature and clocks for the rank's gpu_uuid.",
        "Drain/cordon the host (kubectl cordon, scontrol update nodename=… state=drain) so the "
        "next restart does not land on it; run dcgmi diag -r 3 after draining.",
        "If the sentinel excluded it, the launcher keeps it out of the next rendezvous; keep it "
        "drained until diagnosed.",
    )),
    "transient": Advice(_BAD_HOST, (
        "Is it always the same rank (one GPU) or every rank of the host (memory, network, "
        "power)? List the incidents: the same rank again and again is a faulty host.",
        "Check DCGM for XID and ECC errors for the rank's gpu_uuid.",
        "One event needs no action; repeats page as NanSentinelBadHost and the sentinel "
        "excludes the host after NANSENTINEL_HOST_STRIKES strikes.",
    )),
    "data": Advice(_CAUSES, (
        "Bad input data: fix the sample or shard in the saved batch (torch.load it); a sharded "
        "dataset gives the same shard to the same rank each epoch.",
        "Normalise with std.clamp_min(eps) ((x - mean) / std with std == 0 is NaN); validate "
        "the data offline.",
    )),
    "divergence": Advice(_SKIPPED, (
        "Lower the learning rate or add warm-up; clip gradients (clip_grad_norm_).",
        "Check the loss formula (log_softmax / F.cross_entropy, not log(softmax(x))).",
        "Restart from the last good checkpoint.",
    )),
    "state_host": Advice(_STATE, (
        "One rank's state was poisoned and repaired from a finite replica: suspect that "
        "host's GPU memory. Check DCGM for XID and ECC errors "
        "(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL) for the rank's gpu_uuid; run dcgmi diag -r 3.",
        "A second incident on the same host means drain it (the sentinel excludes it after "
        "NANSENTINEL_HOST_STRIKES strikes).",
    )),
    "state_checkpoint": Advice(_STATE, (
        "Every replica held it (or the state is sharded and had no replica): the checkpoint "
        "or an update carried the NaN. Restore an earlier checkpoint; the tensors are named "
        "above (with the count of non-finite elements).",
        "Do not resume from a checkpoint saved after this step: it holds the same NaN.",
    )),
    "hyperparameter": Advice(_HYPER, (
        "The schedule returned NaN or Inf for a param group's hyperparameter: look for a "
        "warm-up dividing by a zero step count, a cosine schedule read past its end, a "
        "scheduler chained on a NaN.",
        "Fix it and resume from the last checkpoint; the step itself was skipped, nothing was "
        "applied from it.",
    )),
    "overflow": Advice(_CAUSES, (
        "AMP fp16 overflow: normal occasionally (GradScaler skips and lowers the scale).",
        "Persistent: use bf16, lower the initial scale, find the layer whose activations "
        "exceed 65504.",
    )),
    "batch": Advice(_CAUSES, (
        "Bad input data: look at the saved batch in the report; it is usually data, not the "
        "host.",
        "Fix the sample or shard; validate the data offline.",
    )),
    "rank": Advice(_NONFINITE, (
        "One event is usually a bad batch and needs no action beyond fixing the data; find the "
        "cause in the runbook's cause table.",
        "The same rank again and again becomes NanSentinelBadHost: suspect its host or GPU.",
    )),
    "spike": Advice(_CAUSES, (
        "Exploding gradients: clip gradients, lower the learning rate, check residual scaling "
        "and initialisation.",
    )),
}
_DRILL = "A fire drill (NANSENTINEL_INJECT) fires this by design: nothing to fix."

_OUTCOME_WORDS = {
    "skipped": "skipped the step on every rank: the gradients were discarded, the weights "
    "untouched",
    "aborted": "stopped the run on every rank (each raised NonFiniteError; `nansentinel run` "
    "exits with code 3)",
    "rolled_back": "rolled every rank back to the last good snapshot",
    "applied": "applied the step (warn only: the policy let it through)",
    "overflow": "left the step to GradScaler (fp16 overflow: it skips and lowers the scale)",
    "excluded": "excluded a host: its launcher left the job, the others go on without it",
    "dropped": "applied the step on every rank from the other ranks' gradients: the poisoned "
    "ranks' contribution was replaced by zeros before the reduction (policy drop)",
}


class ReportError(NanSentinelError):
    """A report directory, file or id that cannot be read; the message names it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Section:
    """A titled paragraph of an explanation: the CLI prints it, the page shows it."""

    title: str
    lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Incident:
    """One report as read back: the fields a listing shows, and the raw report."""

    path: Path
    report: dict[str, Any]
    time: float | None
    job: str
    step: int
    outcome: str
    bad_ranks: tuple[int, ...]
    bad_hosts: tuple[str, ...]
    kinds: tuple[str, ...]
    verdict: str | None

    @property
    def key(self) -> str:
        """``JOB:STEP``, the id that tells incidents of several jobs apart."""
        return f"{self.job}:{self.step}"

    def ranks(self) -> dict[str, dict[str, Any]]:
        """The named ranks by str(rank), from a version-2 dict or a version-1 list."""
        ranks = self.report.get("ranks") or {}
        if isinstance(ranks, list):
            return {str(r.get("rank")): r for r in ranks if isinstance(r, dict)}
        return {k: v for k, v in ranks.items() if isinstance(v, dict)}

    def row(self, ident: str) -> dict[str, Any]:
        """The listing's fields, for ``--json``."""
        return {
            "id": ident, "time": self.time, "time_text": when(self.time), "job": self.job,
            "step": self.step, "outcome": self.outcome, "bad_ranks": list(self.bad_ranks),
            "bad_hosts": list(self.bad_hosts), "kinds": list(self.kinds),
            "verdict": self.verdict, "injected": bool(self.report.get("injected")),
            "path": str(self.path),
        }


def _field(report: dict[str, Any], name: str, types: type | tuple[type, ...], path: Path,
           default: Any = None) -> Any:
    value = report.get(name, default)
    if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
        raise ReportError(f"{path}: field {name!r} is {value!r:.60}, not a valid value; "
                          "is this an incident report?")
    return value


def _list(report: dict[str, Any], name: str, item: type, path: Path) -> tuple[Any, ...]:
    value = _field(report, name, list, path) or []
    if not all(isinstance(v, item) and not isinstance(v, bool) for v in value):
        raise ReportError(f"{path}: field {name!r} is {value!r:.60}, not a list of {item.__name__}")
    return tuple(value)


def load(path: Path) -> Incident:
    """Read one report; a file that is not a report is a :class:`ReportError` naming it."""
    try:
        report = untrusted.parse_json(untrusted.read_text(path, what="report"))
    except FileNotFoundError:
        raise ReportError(f"no report file {path}") from None
    except untrusted.InputFileError as exc:
        raise ReportError(str(exc)) from None
    except untrusted.JsonInputError as exc:
        raise ReportError(f"{path}: malformed report, {exc}") from None
    if not isinstance(report, dict):
        raise ReportError(f"{path}: malformed report, a JSON {type(report).__name__} instead "
                          "of an object")
    named = REPORT_NAME.match(path.name)
    step = _field(report, "step", int, path)
    if step is None:
        if named is None:
            raise ReportError(f"{path}: malformed report, no 'step' field")
        step = int(named["step"])
    job = _field(report, "job_id", str, path) or (named["job"] if named else "local")
    stamp = _field(report, "time", (int, float), path)
    if stamp is not None and not 0 <= stamp <= MAX_TIME:  # NaN fails both
        raise ReportError(f"{path}: malformed report, field 'time' is {stamp!r:.40}, not a time "
                          "in seconds since the epoch")
    if step < 0:
        raise ReportError(f"{path}: malformed report, field 'step' is {step}, below 0")
    for name in ("cluster", "spikes", "origin_trace"):
        _field(report, name, dict, path)
    _field(report, "ranks", (dict, list), path)
    incident = Incident(
        path=path, report=report, time=float(stamp) if stamp is not None else None, job=job,
        step=step, outcome=_field(report, "outcome", str, path) or "unknown",
        bad_ranks=_list(report, "bad_ranks", int, path),
        bad_hosts=_list(report, "bad_hosts", str, path),
        kinds=_list(report, "kinds", str, path),
        verdict=_field(report, "verdict", str, path),
    )
    try:  # what the listing shows must also explain: a report that cannot is named here
        explain(incident)
    except (AttributeError, TypeError, ValueError, KeyError, OverflowError,
            RecursionError) as exc:
        raise ReportError(f"{path}: malformed report, cannot be explained "
                          f"({type(exc).__name__}: {printable(exc, 120)})") from None
    return incident


#: The latest report time accepted (the year 9999): any later cannot be printed as a date.
MAX_TIME = 253402300799.0


def scan(directory: Path) -> tuple[list[Incident], list[str]]:
    """The directory's reports, newest first, and one error line per malformed report.

    Files other than reports (batches, temporary files, the launcher's run directory) are
    ignored; a missing directory, or one without reports, is a :class:`ReportError`.
    """
    if not directory.is_dir():
        raise ReportError(f"no report directory {directory} (give DIR, or set "
                          "NANSENTINEL_REPORT_DIR)")
    paths = sorted(p for p in directory.iterdir() if REPORT_NAME.match(p.name))
    if not paths:
        raise ReportError(f"no incident reports in {directory}")
    found, errors = _load_all(paths)
    return found, [message for _, message in errors]


def _load_all(paths: list[Path]) -> tuple[list[Incident], list[tuple[Path, str]]]:
    """Each path's incident, newest first, and (path, message) for each malformed one."""
    found, errors = [], []
    for p in paths:
        try:
            found.append(load(p))
        except ReportError as exc:
            errors.append((p, str(exc)))
    found.sort(key=lambda i: (i.time if i.time is not None else i.path.stat().st_mtime,
                              i.step, i.path.name), reverse=True)
    return found, errors


def ids(incidents: list[Incident]) -> list[str]:
    """The shortest id :func:`find` resolves to each incident among ``incidents``: the step,
    else ``JOB:STEP``, else the file name."""
    steps = [i.step for i in incidents]
    keys = [i.key for i in incidents]
    return [str(i.step) if steps.count(i.step) == 1 else
            _short_key(i, incidents) if keys.count(i.key) == 1 else i.path.name
            for i in incidents]


def _short_key(incident: Incident, incidents: list[Incident]) -> str:
    """``JOB:STEP`` with the job cut to its shortest prefix of 8 or more characters that no
    other job at that step shares (a torchrun job id is a 36-character UUID)."""
    others = [i.job for i in incidents if i.step == incident.step and i.job != incident.job]
    for n in range(8, len(incident.job)):
        prefix = incident.job[:n]
        if not any(o.startswith(prefix) for o in others) and not any(
            i.job == prefix for i in incidents
        ):
            return f"{prefix}:{incident.step}"
    return incident.key


def find(spec: str, directory: Path) -> Incident:
    """The incident ``spec`` names: a report file's path, or in ``directory`` a step, a
    ``JOB:STEP`` or a file name. Unknown or ambiguous ids are a :class:`ReportError`."""
    given = Path(spec)
    if spec.endswith(".json") and (given.exists() or given.parent != Path(".")):
        return load(given)
    incidents, _ = scan(directory)
    matches = _matches(spec, incidents)
    if len(matches) == 1:
        return matches[0]
    if not matches:
        broken = [message for path, message in _broken(directory) if _names(spec, path)]
        if broken:
            raise ReportError(f"incident {spec!r} in {directory} cannot be shown: {broken[0]}")
        known = ", ".join(ids(incidents)[:8]) or "none readable"
        raise ReportError(f"no incident {spec!r} in {directory} (ids there: {known})")
    names = ", ".join(i.key if [m.key for m in matches].count(i.key) == 1 else i.path.name
                      for i in matches)
    raise ReportError(f"incident id {spec!r} matches {len(matches)} reports in {directory}: "
                      f"{names}; give one of these")


def _broken(directory: Path) -> list[tuple[Path, str]]:
    paths = sorted(p for p in directory.iterdir() if REPORT_NAME.match(p.name))
    return _load_all(paths)[1]


def _names(spec: str, path: Path) -> bool:
    """Whether ``spec`` names the report at ``path`` by its file name alone (the file may
    not be readable enough to know its step and job otherwise)."""
    named = REPORT_NAME.match(path.name)
    if named is None:
        return False
    if re.fullmatch(r"\d+", spec):
        return int(named["step"]) == _as_step(spec)
    if re.fullmatch(r".+:\d+", spec):
        job, _, step = spec.rpartition(":")
        return named["job"].startswith(job) and int(named["step"]) == _as_step(step)
    return spec in (path.name, path.stem)


def _as_step(digits: str) -> int:
    """The step an id's digits name; -1 (no report's step) for more digits than any step
    has, which ``int`` would refuse past 4,300 of them."""
    significant = digits.lstrip("0")
    return int(significant or "0") if len(significant) <= 20 else -1


def _matches(spec: str, incidents: list[Incident]) -> list[Incident]:
    """The incidents ``spec`` names: a step, ``JOB:STEP`` (or a prefix of the job, as the
    listing shortens it, when no job is exactly that), or a file name."""
    if re.fullmatch(r"\d+", spec):
        matches = [i for i in incidents if i.step == _as_step(spec)]
    elif re.fullmatch(r".+:\d+", spec):
        job, _, step = spec.rpartition(":")
        matches = [i for i in incidents if i.job == job and i.step == _as_step(step)] or [
            i for i in incidents if i.job.startswith(job) and i.step == _as_step(step)]
    else:
        matches = [i for i in incidents if spec in (i.path.name, i.path.stem)]
    return matches


def when(stamp: float | None) -> str:
    """A report's time as local ``YYYY-MM-DD HH:MM:SS`` (``-`` when the report has none)."""
    return "-" if stamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


def number(x: Any) -> float | None:
    """A report's number: floats, ints and the strings ``"nan"``/``"inf"``/``"-inf"``
    (JSON has no NaN); None for a missing value."""
    if isinstance(x, bool):
        return None
    if isinstance(x, int | float):
        return float(x)
    if isinstance(x, str) and x.strip().lower() in ("nan", "inf", "-inf", "+inf"):
        return float(x)
    return None


def fmt(x: Any) -> str:
    """A number as the explanation prints it (``-`` when missing)."""
    v = number(x)
    if v is None:
        return "-"
    return f"{v:.4g}" if math.isfinite(v) else str(v)


def names(items: list[Any] | tuple[Any, ...], n: int = 8) -> str:
    """The first ``n`` items joined, and how many more (``-`` when none)."""
    items = [str(i) for i in items]
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return (", ".join(items[:n]) + more) if items else "-"


def table(incidents: list[Incident]) -> str:
    """The listing: a header and one aligned line per incident."""
    head = ("ID", "TIME", "JOB", "STEP", "OUTCOME", "RANKS", "HOSTS", "KINDS", "VERDICT",
            "REPORT")
    rows = [head] + [
        (ident, when(i.time), i.job, str(i.step), i.outcome, names(i.bad_ranks, 4),
         names(i.bad_hosts, 3), names(i.kinds), i.verdict or "-", str(i.path))
        for ident, i in zip(ids(incidents), incidents, strict=True)
    ]
    shown = [tuple(printable(v, 200) for v in r) for r in rows]
    widths = [max(len(r[c]) for r in shown) for c in range(len(head) - 1)]
    return "\n".join("  ".join(f"{v:<{w}}" for v, w in zip(r, widths, strict=False)) + "  "
                     + r[-1] for r in shown)


def advice(incident: Incident) -> Advice:
    """The runbook section and steps for this incident, by verdict, outcome and kinds."""
    r = incident.report
    if incident.verdict == "state":
        return _ADVICE["state_host" if r.get("state_action") == "repaired"
                       else "state_checkpoint"]
    if "hyperparameter" in incident.kinds:
        return _ADVICE["hyperparameter"]
    if incident.verdict in _ADVICE:
        return _ADVICE[incident.verdict]
    if incident.outcome == "overflow" or r.get("overflow"):
        return _ADVICE["overflow"]
    world = number(r.get("world_size"))
    if world and len(incident.bad_ranks) == world > 1:
        return _ADVICE["divergence"]
    if r.get("excluded_host"):
        return _ADVICE["host"]
    if not incident.bad_ranks:
        return _ADVICE["spike"]
    return _ADVICE["batch"] if incident.kinds == ("batch",) else _ADVICE["rank"]


def _where(rank: str, entry: dict[str, Any]) -> list[str]:
    out = [f"rank {rank}: host {entry.get('hostname', '-')}, local rank "
           f"{entry.get('local_rank', '-')}, device {entry.get('device', '-')}, GPU "
           f"{entry.get('gpu_uuid') or '-'}" + (f"; non-finite {names(entry['kinds'])}"
                                                if entry.get("kinds") else "")]
    if entry.get("parameters"):
        out.append(f"  parameters with non-finite gradients: {names(entry['parameters'])}")
    if entry.get("sample_ids"):
        out.append("  rows of its batch holding non-finite values, by sample id: "
                   f"{names([json.dumps(s) for s in entry['sample_ids']], 12)}")
    if entry.get("batch_path"):
        out.append(f"  batch saved to {entry['batch_path']}")
    return out


def explain(incident: Incident) -> list[Section]:
    """The incident in plain words: what, where, what the sentinel did, the verdict, what
    to do next (from the runbook), then the numbers."""
    r = incident.report
    ranks = incident.ranks()
    world = r.get("world_size") or (r.get("cluster") or {}).get("world_size")
    of = f" of {world}" if world else ""
    drill = " (a fire drill: injected by NANSENTINEL_INJECT)" if r.get("injected") else ""
    head = (f"Incident at step {incident.step} of job {incident.job}, {when(incident.time)}"
            f"{drill}.", f"Report: {incident.path}")
    if incident.bad_ranks:
        kinds = [_KIND_WORDS.get(k, k) for k in incident.kinds] or ["values"]
        what = [f"Non-finite values in {' and '.join(kinds)} on {len(incident.bad_ranks)}{of} "
                f"rank(s): "
                f"rank {names(incident.bad_ranks)} (host {names(incident.bad_hosts)})."]
    else:
        what = ["No rank was non-finite: a spike."] if r.get("spikes") else [
            "No rank was blamed." + (" fp16 overflow under GradScaler." if r.get("overflow")
                                     else "")]
    for signal, spiked in (r.get("spikes") or {}).items():
        what.append(f"{signal} spike on {names(list(spiked))} (times its running median: "
                    f"{names([fmt(x) for x in spiked.values()])})"
                    if isinstance(spiked, dict) else f"{signal} spike: {spiked}")
    where: list[str] = []
    for rank in [str(b) for b in incident.bad_ranks] or list(ranks):
        if rank in ranks:
            where += _where(rank, ranks[rank])
    state = r.get("poisoned_state")
    if isinstance(state, dict):
        for rank, found in state.items():
            if isinstance(found, list):
                where.append(f"rank {rank}'s own state: {names([str(f) for f in found], 8)}")
    for name, label in (("first_nonfinite_module", "first module with a non-finite output"),
                        ("first_nonfinite_parameter", "first parameter with a non-finite "
                         "gradient")):
        if r.get(name):
            where.append(f"{label} (replay): {r[name]}")
    trace = r.get("origin_trace")
    if isinstance(trace, dict) and trace.get("origins"):
        where.append(f"began on rank {names(trace['origins'])}: its input to collective "
                     f"#{trace.get('collective')} ({trace.get('op') or '?'}) went non-finite "
                     "first (the trace replay); the others were reached")
    elif isinstance(trace, dict) and trace.get("reason"):
        where.append(f"where it began could not be told (the trace replay): {trace['reason']}")
    if r.get("skip_list"):
        where.append(f"sample ids appended to the skip list {r['skip_list']}")
    did = _OUTCOME_WORDS.get(incident.outcome, f"outcome {incident.outcome}")
    if r.get("rolled_back_to") is not None:
        did += f" (step {r['rolled_back_to']}, learning rate x{fmt(r.get('lr_factor'))})"
    if r.get("excluded_host"):
        hosts = r.get("excluded_hosts")
        hosts = ([str(h) for h in hosts] if isinstance(hosts, list) and hosts
                 else [str(r["excluded_host"])])
        did += f"; host{'s' if len(hosts) > 1 else ''} {', '.join(hosts)} excluded"
    if r.get("state_action") == "repaired":
        did += "; the poisoned state was repaired in place from a finite replica"
    acted = [f"The sentinel {did}" + (f", policy {r['policy']}" if r.get("policy") else "")
             + "." + (f" Reason: {r['reason']}." if r.get("reason") else "")]
    verdict = (f"{incident.verdict}: {_VERDICT_WORDS.get(incident.verdict, '')}".rstrip(": ")
               if incident.verdict else _NO_VERDICT)
    todo = advice(incident)
    steps = [f"{n}. {s}" for n, s in enumerate(todo.steps, 1)]
    if r.get("injected"):
        steps.append(f"{len(steps) + 1}. {_DRILL}")
    return [
        Section("Incident", head),
        Section("What was non-finite", tuple(what)),
        Section("Where", tuple(where) or ("no rank is named in the report",)),
        Section("What the sentinel did", tuple(acted)),
        Section("Verdict", (verdict,)),
        Section(f'What to do next ({RUNBOOK}, "{todo.section}")', tuple(steps)),
        Section("Numbers", tuple(numbers(incident))),
    ]


def numbers(incident: Incident) -> list[str]:
    """The report's numbers: each named rank's loss and gradient norm, the cluster's."""
    r = incident.report
    out = [f"rank {k}: loss {fmt(v.get('loss'))}, grad_norm {fmt(v.get('grad_norm'))}"
           + (f", replay loss {fmt(v['replay'].get('loss'))}"
              if isinstance(v.get("replay"), dict) else "")
           + (f" (the replay's peer: rank {v['replayed_for']}'s batch gave loss "
              f"{fmt(v['peer_replay'].get('loss'))})"
              if isinstance(v.get("peer_replay"), dict) and "replayed_for" in v else "")
           for k, v in incident.ranks().items()]
    cluster = r.get("cluster") or {}
    for signal in ("loss", "grad_norm"):
        s = cluster.get(signal)
        if isinstance(s, dict):
            out.append(f"cluster {signal}: mean {fmt(s.get('mean'))}, std {fmt(s.get('std'))}, "
                       f"min {fmt(s.get('min'))}, max {fmt(s.get('max'))} over "
                       f"{s.get('ranks', '-')} rank(s) with a finite value")
    bad = cluster.get("nonfinite")
    if isinstance(bad, dict):
        out.append("ranks non-finite: " + ", ".join(f"{k} {bad.get(k, '-')}" for k in KINDS))
    for name in ("consecutive_skips", "ranks_not_listed", "version"):
        if r.get(name) is not None:
            out.append(f"{name.replace('_', ' ')}: {r[name]}")
    return out


def render(sections: list[Section]) -> str:
    """The explanation as plain text."""
    return "\n\n".join(printable(s.title) + "\n" + "\n".join(
        "  " + printable(line, 2000) for line in s.lines) for s in sections) + "\n"
