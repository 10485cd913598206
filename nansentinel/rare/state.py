"""The model's state on the rare path: is what the ranks hold finite, and can it be repaired?

A NaN that entered the weights, the floating buffers or the optimizer state (a bit flip, a
restored checkpoint, a BatchNorm statistic broadcast from a bad rank) is not a fault of the
step's numbers, and no skip can end it: every step after it is poisoned again. So the whole
state is read (checks/state.py) where a NaN enters, never every step:

- at construction and at each documented restore (:meth:`StateCheck.refuse`): a non-finite
  tensor on any rank is refused on every rank before any step, naming the tensor, the rank,
  the host and the element count (:class:`~nansentinel.result.NonFiniteStateError`, exit 6);
- on an incident, and before a snapshot is kept (:meth:`StateCheck.examine`): every rank reads
  its own state; one small all-reduce says whether any rank holds a non-finite tensor (the
  common incident, a bad batch, ends there); only then do the poisoned ranks name theirs
  (one byte per rank, then their names alone: O(world) for a detection only).

What follows is the policy's (decide/policy.py), from :class:`StateFindings`, the same on
every rank: where every poisoned tensor has a finite copy on another rank of its replica group
(DDP, HSDP's replicate dimension) the state is **repaired** in process from it
(:meth:`StateCheck.repair`, a broadcast per tensor within the group) and the poisoned ranks'
hosts are struck (a memory fault is a hardware suspect). Non-finite loses to finite, so two
replicas are enough: no majority vote is needed. Where no replica holds a finite copy (every
replica poisoned, or the state sharded: FSDP, ZeRO), the run rolls back to a snapshot whose
whole state is finite, or stops at once naming the tensors (verdict ``state``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from nansentinel.checks.state import (
    SHOWN,
    Poisoned,
    StateFindings,
    describe_hyperparameters,
    describe_ranks,
    named_state,
    poisoned,
    poisoned_hyperparameters,
)
from nansentinel.engines import EXCHANGE, Capabilities
from nansentinel.result import STATE, NonFiniteStateError, Outcome, StepResult
from nansentinel.wire.collectives import Peers
from nansentinel.wire.context import Context, Watched

log = logging.getLogger("nansentinel")

#: The verdict of an incident whose cause is the model's state, and the kind a result names.
VERDICT = KIND = STATE


class StateCheck:
    """Reads, names and repairs this rank's state on the rare path (see the module docstring).

    Args:
        ctx: the run (the exchange's peers, this rank's identity, the deadline).
        watched: the module (DDP's inner one) and the optimizer whose state is read.
        caps: the gradient path's capabilities: ``replica_group`` holds this rank's replicas
            where ``fingerprints`` is None (DDP, HSDP, local gradients); otherwise no rank
            holds a copy of this rank's state (FSDP, ZeRO, pipelines, torchft's groups).
    """

    def __init__(self, ctx: Context, watched: Watched, caps: Capabilities, *,
                 constants: frozenset[str] = frozenset()) -> None:
        self.ctx, self.peers, self.identity = ctx, ctx.peers, ctx.identity
        self.module, self.optimizer = watched.module, watched.optimizer
        self.skip = watched.unreplicated
        #: Floating buffers holding +-Inf by design (an attention mask): only a NaN counts.
        self.constants = constants
        group = caps.replica_group if caps.fingerprints is None else None
        replicas: Peers | None = None
        if group is EXCHANGE or (group is not None and group is self.peers.group):
            replicas = self.peers
        elif group is not None:
            replicas = Peers(group, ctx.device)
        self.replicas = replicas if replicas is not None and not replicas.alone else None
        #: Why no replica holds a copy of this rank's state, in words (None: one may).
        self.no_replicas = None if self.replicas is not None else (
            caps.fingerprints or f"{caps.label} keeps no replica of a rank's state")
        #: Called before a repair writes into the state (a snapshot's side copies may still
        #: be reading it: recovery.SideCopies).
        self.before_write: Callable[[], None] | None = None
        #: Every examination that found something, for tests and the drill.
        self.found: list[StateFindings] = []
        #: The last examination's poisoned tensors by global rank (what a repair reads).
        self._poisoned: dict[int, list[Poisoned]] = {}

    # --- the reads ----------------------------------------------------------------------------

    def local(self) -> list[Poisoned]:
        """This rank's non-finite state tensors (one pass over the whole state)."""
        return poisoned(named_state(self.module, self.optimizer), self.constants)

    def refuse(self, when: str, step: int) -> None:
        """At construction or at a documented restore, on every rank: raise
        :class:`NonFiniteStateError` on every rank if any rank's weights, floating buffers,
        optimizer state or hyperparameters hold a non-finite value (one small all-reduce, then
        the names of the poisoned ranks only)."""
        mine = self.local()
        hyper = poisoned_hyperparameters(self.optimizer) if self.optimizer is not None else []
        with self.ctx.guarded():
            anywhere = self.peers.max_floats([float(bool(mine or hyper))])[0]
        if not anywhere:
            return
        with self.ctx.guarded():
            ranks = self.peers.flagged(bool(mine or hyper))
            said = self.peers.gather_from(ranks, {
                "host": self.identity.hostname, "tensors": [p.to_json() for p in mine],
                "hyper": describe_hyperparameters(hyper)})
        rows: dict[int, tuple[str, list[str]]] = {}
        for rank in ranks:
            row = said.get(rank)
            row = row if isinstance(row, dict) else {}
            words = [Poisoned.from_json(w).describe() for w in row.get("tensors", [])]
            if row.get("hyper"):
                words.append(str(row["hyper"]))
            rows[rank] = (str(row.get("host", "?")), words)
        message = (f"nansentinel: the model's state is not finite {when}: {describe_ranks(rows)}. "
                   "Nothing was applied and every rank stops here: restore another checkpoint "
                   "(or, where one rank alone holds it, check that host: a memory fault)")
        result = StepResult(step=step, applied=False, outcome=Outcome.ABORTED,
                            bad_ranks=ranks, bad_hosts=sorted({h for h, _ in rows.values()}),
                            kinds=[KIND], local_kinds=[KIND] if mine or hyper else [],
                            local_loss=None, local_grad_norm=None, consecutive_skips=0,
                            verdict=VERDICT, reason=message,
                            poisoned_state={r: words for r, (_, words) in rows.items()},
                            state_action=str(Outcome.ABORTED))
        raise NonFiniteStateError(message, result)

    def examine(self, step: int) -> StateFindings | None:
        """On every rank, on the rare path: the poisoned ranks' state, named, and whether a
        replica holds a finite copy of each poisoned tensor; None when every rank's state is
        finite (the usual answer, after one pass and one small all-reduce)."""
        mine = self.local()
        with self.ctx.guarded():
            if not self.peers.max_floats([float(bool(mine))])[0]:
                return None
            ranks = self.peers.flagged(bool(mine))
            said = self.peers.gather_from(ranks, {
                "host": self.identity.hostname, "global": self.peers.global_rank,
                "tensors": [p.to_json() for p in mine]})
        rows = {r: s for r, s in said.items() if isinstance(s, dict)}
        found = {r: [Poisoned.from_json(w) for w in rows[r]["tensors"]] for r in rows}
        hosts = {r: str(rows[r]["host"]) for r in rows}
        by_global = {int(rows[r]["global"]): found[r] for r in rows}
        ok, why = self._repairable_here(by_global)
        world = self.peers.world_size
        with self.ctx.guarded():  # repairable only where every group is (the same answer)
            first = self.peers.min_ints([world if ok else self.peers.rank])[0]
            repairable = first == world
            if not repairable:  # why, in the words of the first rank that knows (the same)
                why = str(self.peers.gather_from([first], why).get(first, why))
        findings = StateFindings(step, found, hosts, repairable, "" if repairable else why)
        self._poisoned = by_global
        self.found.append(findings)
        return findings

    def _repairable_here(self, by_global: dict[int, list[Poisoned]]) -> tuple[bool, str]:
        """Whether every poisoned tensor of a member of this rank's replica group has a finite
        copy on another member (True where no member is poisoned), and why not."""
        if self.replicas is None:
            return not by_global, str(self.no_replicas)
        members = self._members()
        poisoned_here = {g: ps for g, ps in by_global.items() if g in members}
        layouts = {name: t.layout for name, _, t in named_state(self.module, self.optimizer)}
        for name in sorted({p.name for ps in poisoned_here.values() for p in ps}):
            if layouts.get(name, torch.strided) != torch.strided:
                return False, f"{name} is a sparse tensor (its replicas' structure may differ)"
            holders = [g for g, ps in poisoned_here.items() if any(p.name == name for p in ps)]
            if len(holders) == len(members):
                return False, f"every replica of rank(s) {sorted(holders)} holds {name} non-finite"
            if any(name == s or name.startswith(f"{s}.") for s in self.skip):
                return False, f"{name} is not replicated (DDP's parameters_to_ignore)"
        return True, ""

    def _members(self) -> list[int]:
        """The global ranks of this rank's replica group."""
        assert self.replicas is not None
        return self.replicas.members()

    # --- the repair ---------------------------------------------------------------------------

    @torch.no_grad()
    def repair(self, findings: StateFindings) -> list[str]:
        """Overwrite this replica group's poisoned tensors from a finite copy: for each tensor
        poisoned on some member, a broadcast from the lowest member holding it finite (only the
        groups with a poisoned member broadcast; every member of such a group takes part, in
        the same order). Only the members holding it poisoned take the copy: the others
        receive into a scratch tensor and keep their own (a floating buffer is each rank's
        own where nothing broadcasts it). Returns the names repaired here."""
        if self.replicas is None or not findings.repairable:
            return []
        members = self._members()
        poisoned_here = {g: ps for g, ps in self._poisoned.items() if g in members}
        names = sorted({p.name for ps in poisoned_here.values() for p in ps})
        if not names:
            return []
        state = {name: t for name, _, t in named_state(self.module, self.optimizer)}
        comm = self.replicas.comm_device
        if self.before_write is not None:
            self.before_write()
        mine = self._poisoned.get(self.peers.global_rank, [])
        held = {p.name for p in mine}
        with self.ctx.guarded():
            for name in names:
                source = next(g for g in members if not any(
                    p.name == name for p in poisoned_here.get(g, [])))
                tensor = state[name]
                takes = name in held
                buf = tensor if takes and tensor.device == comm and tensor.is_contiguous() else (
                    tensor.to(comm, copy=True).contiguous())
                self.replicas.broadcast_in_place(buf, source)
                if takes and buf is not tensor:
                    tensor.copy_(buf)
        if mine:
            log.error("nansentinel: rank %d on host %s: its %s repaired from a finite replica at "
                      "step %d", self.identity.rank, self.identity.hostname,
                      ", ".join(p.describe() for p in mine[:SHOWN]), findings.step)
        return names

