"""What torchft's replica groups tell each other about a step, through torchft's own managed
all-reduce (``Manager.allreduce``).

Each rank's row (:func:`device_row`, laid out by :class:`~nansentinel.wire.schema.GroupTotals`)
is built on the device before its last gradients leave and travels appended to them; it comes
back summed over the same rank of every group (:func:`carried`). Where it cannot ride, every
group sums one row of its own decision at ``step()`` (:func:`agree`). Only when a count is
not zero, the groups' identities travel (:func:`gather_names`): one row of bytes per
participating group, where only the poisoned ones write, then, in a group of several ranks,
are shared inside it (:func:`shared_in_group`). All go through the manager at the same point
of every step on every group, so a dead peer errors the manager (a regroup at the next
quorum) instead of raising; a group that heals contributes zeros.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from nansentinel.checks.health import constant
from nansentinel.result import KINDS
from nansentinel.wire.collectives import Peers
from nansentinel.wire.schema import G, GroupTotals, R

#: Bytes of one group's identity on a detection (JSON: group, rank, host, step, kinds).
NAME_BYTES = 512


def health_row(bad: bool, kinds: list[str], replica_rank: int | None,
               dropped: bool = False) -> list[float]:
    """This group's row for :func:`agree` (zeros on a healthy step)."""
    row = [0.0] * G.size
    if bad:
        row[G.bad] = 1.0
        row[G.index] = float((replica_rank or 0) + 1)
        for kind in KINDS:
            row[getattr(G, kind)] = float(kind in kinds)
        row[G.dropped] = float(dropped)
    return row


def device_row(row: torch.Tensor | list[float], replica_rank: Callable[[], int | None]
               ) -> torch.Tensor:
    """This rank's row for the gradients' own all-reduce (:func:`carried`), from its health
    row (``checks.health.Row``, fp32: the own section of the step's packed vector) where the
    row lies, without a host sync: flagged where its batch, loss or gradients are non-finite
    or its batch is quarantined (the rule ``wire.schema.skip_count`` applies), which kinds,
    and its ``replica_rank()`` + 1 when flagged. On the CPU, where reading the row syncs
    nothing, :func:`health_row` of its values (one read, one tensor made; the replica rank,
    which waits on torchft's quorum, asked only for a flagged row), or of the host floats
    the step's row was packed from (``row`` a list); elsewhere :func:`row_on_device`
    (tests/unit/test_torchft_blame.py holds the two equal)."""
    if isinstance(row, torch.Tensor) and row.device.type != "cpu":
        return row_on_device(row, replica_rank())
    values = row if isinstance(row, list) else row.tolist()
    kinds = [kind for kind, v in zip(KINDS, values[R.batch_norm:R.grad_norm_value + 1],
                                     strict=True) if not math.isfinite(v)]
    bad = bool(kinds) or values[R.quarantined] > 0
    return torch.tensor(health_row(bad, kinds, replica_rank() if bad else None),
                        dtype=torch.float32)


def row_on_device(row: torch.Tensor, replica_rank: int | None) -> torch.Tensor:
    """:func:`device_row` on an accelerator: a handful of operations, no host-made tensor (it
    is on every step's path)."""
    nonfinite = 1.0 - torch.isfinite(row[R.batch_norm:R.grad_norm_value + 1]).to(torch.float32)
    bad = (nonfinite.sum() + row[R.quarantined]).clamp(max=1.0).reshape(1)
    scale = constant((1.0, 1.0, 1.0, 1.0, float((replica_rank or 0) + 1), 0.0), row.device)
    return torch.cat([bad, nonfinite, bad, bad]) * scale


def carried(summed: torch.Tensor | None, participants: Callable[[], int]
            ) -> GroupTotals | None:
    """The ranks' rows as they came back averaged with the last gradients (torchft's
    ``Manager.allreduce`` divides by the ``participants()``, asked only when some group
    flagged: a healthy step's row is zeros): the counts over this group rank's ring of
    replica groups. None: the all-reduce failed (a regroup)."""
    if summed is None:
        return None
    values = summed.float().tolist()
    if not any(values):
        return GroupTotals()
    count = int(participants())
    return GroupTotals.from_values([v * count for v in values])


def agree(manager: Any, row: list[float], device: torch.device) -> GroupTotals | None:
    """Sum this group's row over the replica groups, through ``Manager.allreduce`` (every
    group issues it at the same point of every step: after its gradients). None when the
    manager errored (a dead peer, a failed quorum): the step is not committed and the next
    quorum regroups. A group that heals contributes zeros (torchft zeroes what a
    non-participant sends)."""
    if manager.errored() is not None:
        return None
    vector = torch.tensor(row, dtype=torch.float32, device=device)
    manager.allreduce(vector, reduce_op=ReduceOp.SUM).wait()
    if manager.errored() is not None:
        return None
    return GroupTotals.from_values(vector.tolist())


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


def shared_in_group(group: Any, names: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """On a step the group did not commit: the names each rank of this replica group was told
    on its own ring of groups, shared inside the group (one small all-gather over the group's
    own process group), so that every rank of every group names every culprit. Without
    repeats, a group's entry saying it leaves kept over one that does not."""
    gathered = _everyone(group, names)
    merged: dict[str, dict[str, Any]] = {}
    for name in (n for part in gathered for n in part or []):
        key = json.dumps([name.get("group"), name.get("culprits")])
        if key not in merged or name.get("leaving"):
            merged[key] = name
    return sorted(merged.values(), key=lambda n: str(n.get("group")))


def excluded_in_group(group: Any, mine: dict[str, Any] | None
                      ) -> list[dict[str, Any] | None]:
    """At construction only: each rank of this replica group's own process group (``group``;
    None: the default group) tells the others where it is excluded or failed (``mine``: its
    host and the exclusion file that names it, or the error its construction met; None:
    neither), so that every rank of the group refuses together instead of waiting for a
    peer. One small all-gather on every rank alike, indexed by rank in the group; none for a
    group of one process (the list is ``[mine]``)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [mine]
    return [{str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else None
            for found in _everyone(group, mine)]


def _everyone(group: Any, mine: object) -> list[Any]:
    """Every rank's JSON-able ``mine`` in the group's rank order, on every rank: the rare
    path's gather (:meth:`Peers.gather_from`, every rank a speaker), not ``all_gather_object``,
    which reads its bytes back through numpy, an optional dependency of torch that nansentinel
    does not require. Under NCCL on this process's CUDA device, as ``all_gather_object``."""
    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    peers = Peers(group, device)
    said = peers.gather_from(list(range(peers.world_size)), mine)
    return [said[rank] for rank in range(peers.world_size)]
