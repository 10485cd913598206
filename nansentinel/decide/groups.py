"""The step as every torchft replica group decided it, from this group's own decision and the
poisoned groups' names (pure: step/group_scope.py runs the collectives and acts)."""

from __future__ import annotations

import dataclasses
from typing import Any

from nansentinel.result import FTStepResult, Outcome, PoisonedGroup, StepResult


@dataclasses.dataclass(frozen=True, slots=True)
class Decided:
    """What became of one step across the groups, as this group saw it."""

    began: int
    """torchft's step when it began."""
    committed: bool
    """``should_commit()`` was True on this group: the step is applied (the optimizer stepped
    by ``step()``, or by the caller right after it under ``step(optimizer_step=False)``)."""
    regrouped: bool
    """The manager errored in the step."""
    kept: int | None = None
    """On a dropped step, the groups whose gradients it applied."""


def group_result(local: StepResult, names: list[dict[str, Any]], decided: Decided
                 ) -> FTStepResult:
    """The step as every group decided it, from this group's own ``local`` result and the
    poisoned groups' ``names`` (:func:`gather_names`): one :class:`PoisonedGroup` for each
    culprit a group named (its rank inside the group and its host), or one for the group
    (rank -1, no host) where it skipped without a culprit."""
    began, committed, regrouped, kept = (decided.began, decided.committed, decided.regrouped,
                                         decided.kept)
    poisoned = [PoisonedGroup(str(n.get("group", "?")), int(rank), str(host),
                              int(n.get("step", began)), list(n.get("kinds", [])),
                              str(n.get("reason", "")), bool(n.get("leaving", False)))
                for n in names for rank, host in (n.get("culprits") or [(-1, "")])]
    fields = {name: getattr(local, name) for name in _STEP_FIELDS}
    reason = local.reason
    if poisoned:
        who = "; ".join(f"replica group {p.group} "
                        f"({f'rank {p.rank}, host {p.host}' if p.host else 'no culprit rank'})"
                        f"{': ' + ', '.join(p.kinds) if p.kinds else ''}"
                        f"{', struck out: leaves the quorum' if p.leaving else ''}"
                        for p in poisoned)
        reason = (f"torchft step {began} applied on every replica group from the other "
                  f"{kept} groups' gradients, left out: {who}" if committed and kept
                  else f"torchft step {began} not committed on any replica group: {who}")
    elif regrouped:
        reason = (f"torchft step {began} not committed: the manager errored (a peer died "
                  "or an all-reduce failed); the next quorum regroups")
    if not committed:
        fields.update(applied=False, outcome=local.outcome if not local.applied
                      else Outcome.SKIPPED)
    else:
        fields.update(applied=True,
                      outcome=Outcome.DROPPED if kept else Outcome.APPLIED)
    leaving = {p.host for p in poisoned if p.leaving and p.host}
    fields.update(bad_hosts=sorted({p.host for p in poisoned if p.host}
                                 | set(local.bad_hosts)),
                  excluded_hosts=sorted(leaving | set(local.excluded_hosts)),
                  kinds=sorted({k for p in poisoned for k in p.kinds} | set(local.kinds)),
                  reason=reason)
    return FTStepResult(**fields, committed=committed, poisoned=poisoned,
                        regrouped=regrouped, torchft_step=began)


#: A step result's fields, read once (``dataclasses.fields`` on every step costs more than
#: the copy it serves).
_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(StepResult))
