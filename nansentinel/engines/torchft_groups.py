"""What the replica groups of a torchft job tell each other about a step, through torchft's
own managed all-reduce, and the step as every group decided it.

Every step, every group sums one small health row (:func:`agree`): how many groups did not
apply the step, which kinds, how many of them sent zeros (``policy="drop"``). Only when that
count is not zero, the groups' identities travel (:func:`gather_names`): one row of bytes per
participating group, where only the poisoned ones write. Both go through ``Manager.allreduce``,
at the same point of every step on every group, so a dead peer errors the manager (a regroup
at the next quorum) instead of raising; a group that heals contributes zeros.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch.distributed import ReduceOp

from nansentinel.result import Outcome, StepResult

#: Places in the row every replica group sums each step (see :func:`agree`).
BAD, BATCH, LOSS, GRAD, INDEX, DROPPED = range(6)
ROW = 6
#: Bytes of one group's identity on a detection (JSON: group, rank, host, step, kinds).
NAME_BYTES = 512


@dataclasses.dataclass(frozen=True, slots=True)
class PoisonedGroup:
    """A replica group (one of its ranks) that did not apply a step, as it named itself."""

    group: str
    """The replica group's id (``Manager(replica_id=...)``)."""
    rank: int
    """The rank inside the replica group."""
    host: str
    step: int
    """torchft's step (``Manager.current_step()``), the same on every group."""
    kinds: list[str]
    """Which of ``batch``, ``loss``, ``grad`` were non-finite there (empty: a spike or a
    quarantined batch made it skip)."""
    reason: str = ""
    leaving: bool = False
    """It was struck out and leaves the quorum after this step."""


@dataclasses.dataclass(frozen=True, slots=True)
class FTStepResult(StepResult):
    """The step as every replica group decided it: :class:`StepResult`'s fields (``applied``
    true only when this group committed and stepped), and torchft's side."""

    committed: bool = False
    """``Manager.should_commit()`` was True on this group."""
    poisoned: list[PoisonedGroup] = dataclasses.field(default_factory=list)
    """The groups that did not apply the step, named by themselves, the same on every group."""
    regrouped: bool = False
    """The manager errored in this step (a peer died, an all-reduce or the quorum failed):
    not committed; the next quorum regroups."""
    torchft_step: int = 0
    """``Manager.current_step()`` when the step began."""


@dataclasses.dataclass(frozen=True, slots=True)
class GroupHealth:
    """The replica groups' summed health for one step (the same on every group)."""

    bad: int
    """Replica groups (of this group rank) whose batch, loss or gradients were non-finite."""
    kinds: tuple[str, ...]
    """Which of ``batch``, ``loss``, ``grad`` were non-finite in some group."""
    index: int
    """With one bad group: its participating replica rank (else -1)."""
    dropped: int
    """Bad groups whose gradients went as zeros (``policy="drop"``)."""


def agree(manager: Any, row: list[float], device: torch.device) -> GroupHealth | None:
    """Sum this group's health row (:data:`ROW` floats) over the replica groups, through
    ``Manager.allreduce`` (every group issues it at the same point of every step: after its
    gradients). None when the manager errored (a dead peer, a failed quorum): the step is not
    committed and the next quorum regroups. A group that heals contributes zeros (torchft
    zeroes what a non-participant sends)."""
    if manager.errored() is not None:
        return None
    vector = torch.tensor(row, dtype=torch.float32, device=device)
    manager.allreduce(vector, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    values = [round(v) for v in vector.tolist()]
    kinds = tuple(k for k, i in (("batch", BATCH), ("loss", LOSS), ("grad", GRAD)) if values[i])
    index = values[INDEX] - 1 if values[BAD] == 1 else -1
    return GroupHealth(values[BAD], kinds, index, values[DROPPED])


def health_row(bad: bool, kinds: list[str], replica_rank: int | None,
               dropped: bool = False) -> list[float]:
    """This group's row for :func:`agree`."""
    row = [0.0] * ROW
    if bad:
        row[BAD] = 1.0
        row[INDEX] = float((replica_rank or 0) + 1)
        for kind, place in (("batch", BATCH), ("loss", LOSS), ("grad", GRAD)):
            row[place] = float(kind in kinds)
        row[DROPPED] = float(dropped)
    return row


def gather_names(manager: Any, mine: dict[str, Any] | None, device: torch.device
                 ) -> list[dict[str, Any]] | None:
    """On a detection only: every participating group's identity, where ``mine`` is given
    (a poisoned group's), in one all-reduce of one row of :data:`NAME_BYTES` per group (the
    others send zeros). None when the manager errored."""
    width = max(1, int(manager.num_participants()))
    table = torch.zeros(width, NAME_BYTES, dtype=torch.float32, device=device)
    me = manager.participating_rank()
    if mine is not None and me is not None and me < width:
        data = json.dumps(mine, separators=(",", ":")).encode()[:NAME_BYTES]
        table[me, :len(data)] = torch.tensor(list(data), dtype=torch.float32)
    manager.allreduce(table, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    names: list[dict[str, Any]] = []
    for row in table.to(torch.uint8).cpu().tolist():
        data = bytes(row).rstrip(b"\0")
        if data:
            try:
                names.append(json.loads(data))
            except ValueError:
                names.append({"group": "?", "detail": data.decode(errors="replace")})
    return names


@dataclasses.dataclass(frozen=True, slots=True)
class Decided:
    """What became of one step across the groups, as this group saw it."""

    began: int
    """torchft's step when it began."""
    committed: bool
    """``should_commit()`` was True on this group."""
    stepped: bool
    """The optimizer stepped (committed, and the caller asked ``step()`` to step it)."""
    regrouped: bool
    """The manager errored in the step."""
    kept: int | None = None
    """On a dropped step, the groups whose gradients it applied."""


def group_result(local: StepResult, names: list[dict[str, Any]], decided: Decided
                 ) -> FTStepResult:
    """The step as every group decided it, from this group's own ``local`` result and the
    poisoned groups' ``names`` (:func:`gather_names`)."""
    began, committed, regrouped, kept = (decided.began, decided.committed, decided.regrouped,
                                         decided.kept)
    poisoned = [PoisonedGroup(str(n.get("group", "?")), int(n.get("rank", -1)),
                              str(n.get("host", "?")), int(n.get("step", began)),
                              list(n.get("kinds", [])), str(n.get("reason", "")),
                              bool(n.get("leaving", False))) for n in names]
    fields = {f.name: getattr(local, f.name) for f in dataclasses.fields(StepResult)}
    reason = local.reason
    if poisoned:
        who = "; ".join(f"replica group {p.group} (rank {p.rank}, host {p.host})"
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
        fields.update(applied=decided.stepped,
                      outcome=Outcome.DROPPED if kept else Outcome.APPLIED)
    leaving = {p.host for p in poisoned if p.leaving}
    fields.update(bad_hosts=sorted({p.host for p in poisoned} | set(local.bad_hosts)),
                  excluded_hosts=sorted(leaving | set(local.excluded_hosts)),
                  kinds=sorted({k for p in poisoned for k in p.kinds} | set(local.kinds)),
                  reason=reason)
    return FTStepResult(**fields, committed=committed, poisoned=poisoned,
                        regrouped=regrouped, torchft_step=began)
