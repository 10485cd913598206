"""Replica fingerprints: find the replica whose numbers silently diverged, name it, repair it.

After the gradient reduction every replica holds bitwise-identical gradients (the reduced sum
is sent unchanged to every rank), and after the optimizer step bitwise-identical weights and
optimizer state: DDP's ranks, and under HSDP the ranks of one replicate group (same shard
index). Any difference between replicas is therefore a fault (a GPU writing finite garbage),
not noise — and NaN checks never see it.

Every ``fingerprint_every`` steps (decided by step index, so every rank checks at the same
step) each rank hashes its replicated tensors on the device (``torch.hash_tensor``: an XOR of
the elements' 64-bit patterns, one 8-byte value per parameter or optimizer-state tensor) and
the replica group compares them with one all-reduce MAX of ``[fp, -fp]``: every replica agrees
on a slot iff ``max(fp) == -max(-fp)`` (``min``). Its size is the number of tensors, never
the world. Under HSDP one more all-reduce of one number over the exchange's group tells every
rank whether any replica group disagreed, so that every rank takes the same path.

Only on a mismatch: the group's ranks share their fingerprints and hosts (``Peers.gather_from``,
O(replica group)), a majority vote names the diverged ranks, the findings of every group reach
every rank (only each mismatching group's first rank speaks), and ``divergence_action`` says
what follows: ``repair`` broadcasts the diverged tensors from a majority rank within the group,
``abort`` stops every rank, ``warn`` reports and goes on. Without a majority nothing is
repaired (repair then aborts): two replicas that disagree cannot say which one is right.

An XOR hash misses what cancels out (the same bit flipped in two elements of one tensor, two
elements swapped); one flipped bit, the common silent fault, always changes it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from nansentinel import checks
from nansentinel.checks.state import any_nonfinite
from nansentinel.common import torch_insides as insides
from nansentinel.decide.policy import ABORT, APPLY, EXCLUDE, Decision, History
from nansentinel.engines import EXCHANGE, Capabilities
from nansentinel.result import RankIdentity, StepResult
from nansentinel.wire.collectives import Peers
from nansentinel.wire.context import Context, Watched

log = logging.getLogger("nansentinel")

#: The entry of ``StepResult.kinds``. Not ``divergence``: that word is already a replay
#: verdict (a global divergence, which earns no host strike); this is one replica's fault.
KIND = "replica"
#: The verdict of a step whose replicas disagreed: silent data corruption.
VERDICT = "sdc"
#: Hashes are kept to 63 bits, so that ``-fp`` never overflows an int64.
_MASK = (1 << 63) - 1
#: Parameter names listed in a log line or message (the report has them all).
_NAMED = 8


# --- the pure parts ------------------------------------------------------------------------


def fingerprint(
    tensors: list[torch.Tensor], device: torch.device | None = None
) -> torch.Tensor:
    """One int64 (63-bit) hash per tensor, on ``device`` (default: the first tensor's); no
    host sync.

    The device rule (the sentinel's, for every tensor it makes): the fingerprint follows the
    device of the tensors it came from. A tensor that lives elsewhere -- the CPU ``step`` that
    non-fused, non-capturable Adam and AdamW keep beside CUDA moments, a CPU-offloaded shard --
    is hashed where it lives (its bytes never move) and the hashes of each other device are
    moved together, once per device and check: stacking a CUDA hash with a CPU one raises. The
    move towards an accelerator is non-blocking (a host hash from pageable memory is staged at
    once; the stream does not wait on the host).
    """
    target = device if device is not None else (
        tensors[0].device if tensors else torch.device("cpu"))
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=target)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    parts = {where: _hashes([tensors[i] for i in indices], where, target)
             for where, indices in by_device.items()}
    if len(parts) == 1:  # the usual case: one device, one stack, nothing moved
        return next(iter(parts.values())) & _MASK
    hashed: dict[int, torch.Tensor] = {}  # back in the tensors' order, on the target
    for where, indices in by_device.items():
        hashed.update(zip(indices, parts[where].unbind(), strict=True))
    return torch.stack([hashed[i] for i in range(len(tensors))]) & _MASK


def _hashes(tensors: list[torch.Tensor], where: torch.device, target: torch.device
            ) -> torch.Tensor:
    """The int64 hashes of ``tensors`` (all on ``where``), made there and moved to ``target``
    in one copy."""
    # An empty local shard (FSDP2 shards a bias of 1 over 2 ranks) cannot be hashed: 0.
    zero = torch.zeros((), dtype=torch.uint64, device=where)
    here = torch.stack([_hash(t.detach(), zero) if t.numel() else zero
                        for t in tensors]).view(torch.int64)
    return checks.moved(here, target)


def _hash(t: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``hash_tensor`` of ``t``, which has no complex and no sparse kernel: a complex tensor
    as its real pairs; a sparse one (SGD's momentum buffer of an embedding's sparse gradient)
    as its stored values' and indices' hashes XORed, so that a flipped bit in either shows
    (``zero`` where it stores nothing). Replicas hold the same sparse representation, coalesced
    or not: the same operations on the same reduced gradients."""
    if t.layout != torch.strided:
        coo = t if t.layout == torch.sparse_coo else t.to_sparse_coo()
        values = insides.stored_values(coo)
        if not values.numel():
            return zero
        return _hash(values, zero) ^ torch.hash_tensor(insides.coo_indices(coo))
    return torch.hash_tensor(torch.view_as_real(t) if t.is_complex() else t)


def comparand(fp: torch.Tensor) -> torch.Tensor:
    """What the replica group all-reduces with MAX: ``[fp, -fp]`` (never a bool tensor)."""
    return torch.cat([fp, -fp])


def disagreeing(reduced: list[int]) -> list[int]:
    """The slots where the replicas disagree, from the MAX-reduced :func:`comparand`: a slot
    agrees iff its max equals its min (``-max(-fp)``)."""
    n = len(reduced) // 2
    return [i for i in range(n) if reduced[i] != -reduced[n + i]]


@dataclasses.dataclass(frozen=True, slots=True)
class Vote:
    """A majority vote over one replica group's fingerprints."""

    majority: bool
    """More than half of the group holds the same fingerprints."""
    agreed: list[int]
    """The ranks holding the most common fingerprints (the majority, when there is one)."""
    bad: list[int]
    """The ranks outside the majority; without one, every rank of the group."""


def vote(prints: dict[int, tuple[int, ...]]) -> Vote:
    """The majority of ``rank -> fingerprints``: ties and pluralities are no majority, since
    two replicas that disagree cannot say which one is right."""
    counts = collections.Counter(prints.values())
    # max() keeps the first of equals: a tie goes to the fingerprints of the lowest rank.
    common = prints[max(sorted(prints), key=lambda r: counts[prints[r]])]
    n = counts[common]
    agreed = sorted(r for r, p in prints.items() if p == common)
    if 2 * n > len(prints):
        return Vote(True, agreed, sorted(r for r in prints if r not in agreed))
    return Vote(False, agreed, sorted(prints))


@dataclasses.dataclass(frozen=True, slots=True)
class Finding:
    """What one replica group found, the same on every rank of the job."""

    group: list[int]
    """The group's global ranks."""
    majority: bool
    agreed: list[int]
    bad: list[int]
    hosts: dict[int, str]
    """Global rank -> host, for every rank of the group."""
    parameters: list[str]
    """Names of the tensors that differ (optimizer state as ``param.state_key``)."""
    source: int | None
    """A majority rank to repair from (None without a majority)."""

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "hosts": {str(k): v for k, v in self.hosts.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Finding:
        return cls(**{**d, "hosts": {int(k): v for k, v in d["hosts"].items()}})

    @property
    def bad_hosts(self) -> list[str]:
        return sorted({self.hosts[r] for r in self.bad})

    def describe(self) -> str:
        """One clause: which group, which ranks diverged, which agreed, which parameters."""
        ranks = ", ".join(f"rank {r} (host {self.hosts[r]})" for r in self.bad)
        params = ", ".join(self.parameters[:_NAMED]) + (
            f", … ({len(self.parameters) - _NAMED} more)" if len(self.parameters) > _NAMED
            else "")
        if self.majority:
            return (f"replica group {self.group}: {ranks} diverged from ranks {self.agreed} "
                    f"(which agreed) in [{params}]")
        return f"replica group {self.group}: no majority, {ranks} disagree in [{params}]"


def action_for(findings: list[Finding], configured: str) -> str:
    """``repair``, ``abort`` or ``warn``: a group without a majority cannot be repaired, so
    ``repair`` becomes ``abort`` there."""
    if configured == "repair" and not all(f.majority for f in findings):
        return "abort"
    return configured


def replicated_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, skip: Iterable[str] = ()
) -> list[tuple[str, torch.Tensor]]:
    """``(name, local tensor)`` of every parameter and every tensor of its optimizer state, in
    the same order on every replica (a DTensor's local shard: the same within a replicate
    group). ``skip``: parameters that are not replicated (DDP's ``parameters_to_ignore``)."""
    skipped = set(skip)
    out = []
    for name, p in module.named_parameters():
        if name in skipped:
            continue
        out.append((name, checks.local(p).detach()))
        state = optimizer.state.get(p, {})
        for key in sorted(state, key=str):
            value = state[key]
            if isinstance(value, torch.Tensor):
                out.append((f"{name}.{key}", checks.local(value).detach()))
    return out


#: Explicit mantissa bits by dtype (torch.finfo does not say): the flipped bit is 11 below
#: the top one, or the lowest where there are fewer.
_MANTISSA = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def flip_bit(tensor: torch.Tensor) -> None:
    """Flip one low mantissa bit of the first element in place: the value moves by ~0.05% in
    fp32 and stays finite, as a silent fault does (the drill ``kind=bitflip``)."""
    flat = tensor.view(-1)
    mantissa = _MANTISSA.get(tensor.dtype, 12)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    flat[:1].view(bits).bitwise_xor_(1 << max(0, mantissa - 11))


def repair_row(identity: RankIdentity, global_rank: int, fp: torch.Tensor, slots: list[int]
               ) -> dict[str, Any]:
    """What each rank of a disagreeing replica group tells the others: who it is and its
    fingerprints of the disagreeing ``slots`` only (the same list on every rank of the group).
    All of them would be O(world x parameters) summed on every GPU and parsed on every host
    at the moment a repair is needed (~3 GB under DDP at 131,072 ranks); these are
    O(world x differing tensors), usually one or two a rank."""
    wanted = fp[torch.tensor(slots, dtype=torch.long, device=fp.device)] if slots else fp[:0]
    return {"rank": identity.rank, "global": global_rank, "host": identity.hostname,
            "fp": wanted.tolist()}


# --- the side effects ----------------------------------------------------------------------


class ReplicaCheck:
    """The fingerprint check of one rank; see the module docstring.

    Args:
        ctx: the run (``fingerprint_every``, ``divergence_action``, this rank, the exchange's
            peers: every rank of the job).
        watched: the unwrapped module and its optimizer, whose state is fingerprinted (the
            model's unreplicated parameters left out).
        group: the replica group.
        inject: ``fn(step) -> bool``, a bitflip drill due now.
        incidents: the run's incident writer, for rank 0's report (None: no report).
    """

    def __init__(self, ctx: Context, watched: Watched, group: Any, *,
                 inject: Callable[[int], bool] | None = None, incidents: Any = None) -> None:
        self.ctx = ctx
        self.module, self.optimizer = watched.module, watched.optimizer
        self.group = group
        self.replicas = Peers(group, ctx.device)
        #: Where the fingerprints are made (replicas.fingerprint's device rule).
        self.device = ctx.device
        self.peers = ctx.peers
        self.every = ctx.config.fingerprint_every
        self.action = ctx.config.divergence_action
        self.identity = ctx.identity
        self.inject = inject
        #: Rank 0's reports go through the run's one incident writer (incident.py).
        self.incidents = incidents
        self.skip = watched.unreplicated
        #: The replica group is the whole job (DDP): no second flag is needed.
        self.whole_job = self.replicas.world_size == self.peers.world_size
        #: The step of the last check at which every replica agreed (None: none yet).
        self.last_agreed: int | None = None
        #: Findings of every check that disagreed, for tests and the drill.
        self.found: list[tuple[int, list[Finding]]] = []
        self._source: int | None = None  # the global rank a repair broadcasts from
        #: Called before this check writes into the state (a repair, the bitflip drill): a
        #: snapshot's copies may still be reading it on a side stream (recovery.SideCopies).
        self.before_write: Callable[[], None] | None = None
        #: The last check found a non-finite value in some replica's state (the same on every
        #: rank): the state is read at the next step (step/judge.py).
        self.nonfinite = False

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    @torch.no_grad()
    def compare(self) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor, list[int]]:
        """Fingerprint this rank's state and compare it within the replica group: the state,
        its fingerprints and the slots that differ (the same on every rank of the group).
        Whether some replica's state (or a floating buffer) holds a non-finite value rides in
        the same all-reduce (:attr:`nonfinite`): a NaN every replica agrees on has the same
        fingerprint everywhere, and only this says it."""
        state = replicated_state(self.module, self.optimizer, self.skip)
        tensors = [t for _, t in state]
        fp = fingerprint(tensors, self.device)
        flag = any_nonfinite([*tensors, *(b for b in self.module.buffers()
                                          if b.is_floating_point())], fp.device)
        both = torch.cat([comparand(fp), flag.reshape(1)]).to(self.replicas.comm_device)
        self.replicas.max_in_place(both)
        reduced = both.tolist()  # the check's one host read
        self.nonfinite = reduced[-1] > 0
        return state, fp, disagreeing(reduced[:-1])

    def check(
        self, step: int, result: StepResult, decision: Decision, history: History,
    ) -> tuple[StepResult, Decision]:
        """Run the check if it is due; on a divergence name, act, record. Returns the step's
        result and decision, changed only when replicas disagreed."""
        # The drill flips its bit at its own step (after the optimizer step), whether or not
        # a check is due then: the next check finds it, as it would a real fault.
        if self.inject is not None and self.inject(step):
            params = [t for _, t in replicated_state(self.module, self.optimizer, self.skip)]
            nonempty = next((t for t in params if t.numel()), None)
            if nonempty is not None:
                self._writing()
                flip_bit(nonempty)
        if not self.due(step):
            return result, decision
        with self.ctx.guarded():
            state, fp, slots = self.compare()
            anywhere = [float(bool(slots)), float(self.nonfinite)]
            if not self.whole_job:
                anywhere = self.peers.max_floats(anywhere)
            # A non-finite value is the state check's: named and repaired from a finite copy
            # (no vote needed) or rolled back over at the next step's decision (rare/state.py).
            self.nonfinite = anywhere[1] > 0
            if not anywhere[0] or self.nonfinite:
                if not self.nonfinite:
                    self.last_agreed = step
                elif self.identity.rank == 0:
                    log.error("nansentinel: step %d: the replica fingerprints found a "
                              "non-finite value in the model's state; every rank reads its "
                              "state at the next step", step)
                return result, decision
            findings = self._name(state, fp, slots)
        act = action_for(findings, self.action)
        if act == "repair":
            with self.ctx.guarded():
                self._repair(state, findings)
        since = self.last_agreed
        lasted = step - since if since is not None else step + 1
        if act == "repair":
            self.last_agreed = step
        self.found.append((step, findings))
        return self._record(step, (result, decision), history, findings, act, (lasted, since))

    def _name(self, state: list[tuple[str, torch.Tensor]], fp: torch.Tensor, slots: list[int]
              ) -> list[Finding]:
        """Every rank learns the findings of every replica group that disagreed."""
        mine: Finding | None = None
        if slots:
            members = list(range(self.replicas.world_size))
            shared = self.replicas.gather_from(members, repair_row(
                self.identity, self.replicas.global_rank, fp, slots))
            ranks = {m: int(shared[m]["rank"]) for m in members}  # type: ignore[index]
            hosts = {ranks[m]: str(shared[m]["host"]) for m in members}  # type: ignore[index]
            prints = {ranks[m]: tuple(shared[m]["fp"])  # type: ignore[index]
                      for m in members}
            v = vote(prints)
            self._source = next((int(shared[m]["global"]) for m in members  # type: ignore[index]
                                 if v.majority and ranks[m] == v.agreed[0]), None)
            mine = Finding(sorted(ranks.values()), v.majority, v.agreed, v.bad, hosts,
                           [state[i][0] for i in slots], v.agreed[0] if v.majority else None)
        if self.whole_job:
            assert mine is not None
            return [mine]
        leader = mine is not None and self.identity.rank == mine.group[0]
        speakers = self.peers.flagged(leader)
        gathered = self.peers.gather_from(speakers, mine.to_json() if leader and mine else None)
        return [Finding.from_json(gathered[s]) for s in speakers]  # type: ignore[arg-type]

    @torch.no_grad()
    def _repair(self, state: list[tuple[str, torch.Tensor]], findings: list[Finding]) -> None:
        """Overwrite the diverged tensors from a majority rank, within this rank's group (only
        the group that disagreed broadcasts; every rank of it takes part)."""
        mine = next((f for f in findings if self.identity.rank in f.group), None)
        if mine is None or mine.source is None or self._source is None:
            return
        wanted = set(mine.parameters)
        comm = self.replicas.comm_device
        self._writing()
        for name, tensor in state:
            if name not in wanted:
                continue
            buf = tensor if tensor.device == comm and tensor.is_contiguous() else (
                tensor.to(comm).contiguous())
            self.replicas.broadcast_in_place(buf, self._source)
            if buf is not tensor:
                tensor.copy_(buf)

    def _writing(self) -> None:
        if self.before_write is not None:
            self.before_write()

    def _record(
        self, step: int, decided: tuple[StepResult, Decision], history: History,
        findings: list[Finding], act: str, lasted_since: tuple[int, int | None],
    ) -> tuple[StepResult, Decision]:
        """The result, strikes, decision, log lines and report of a divergence (``decided``:
        the step's result and decision before it)."""
        (result, decision), (lasted, since) = decided, lasted_since
        config = self.ctx.config
        bad = sorted({r for f in findings for r in f.bad})
        hosts = sorted({h for f in findings for h in f.bad_hosts})
        strike = sorted({h for f in findings if f.majority for h in f.bad_hosts})
        excluded = history.strike(strike, step, config)
        what = "; ".join(f.describe() for f in findings)
        nxt = {"repair": "repaired from the majority in place", "abort": "aborting on every rank",
               "warn": "not repaired (divergence_action=warn)"}[act]
        if act == "abort" and self.action == "repair":
            nxt = "no majority to repair from: aborting on every rank"
        reason = (f"replicas diverged at step {step} (within the last {lasted} step(s), since "
                  f"the last agreeing check): {what} — {nxt}")
        if excluded is not None:
            host, n = excluded
            history.exclude(host)
            decision = Decision(EXCLUDE, (), reason, cause=KIND, exclude_host=host, strikes=n)
        elif act == "abort":
            decision = Decision(ABORT, (), reason, cause=KIND)
        elif decision.action == APPLY:
            decision = dataclasses.replace(decision, reason=reason, cause=KIND)
        outcome = decision.outcome if decision.stops else result.outcome
        params = {r: f.parameters for f in findings for r in f.bad}
        result = dataclasses.replace(
            result, outcome=outcome, applied=result.applied, bad_ranks=sorted(
                {*result.bad_ranks, *bad}), bad_hosts=sorted({*result.bad_hosts, *hosts}),
            kinds=[*result.kinds, KIND], verdict=VERDICT, parameters={**result.parameters,
                                                                     **params},
            local_kinds=[*result.local_kinds, KIND] if self.identity.rank in bad
            else result.local_kinds, excluded_hosts=list(history.excluded),
            reason=reason,
        )
        message = f"nansentinel: silent data corruption: {reason}"
        if self.identity.rank in bad:
            log.error("nansentinel: rank %d on host %s: its replica diverged at step %d in %s",
                      self.identity.rank, self.identity.hostname, step,
                      ", ".join(params[self.identity.rank][:_NAMED]))
        if self.identity.rank == 0:
            content = {
                "version": 2, "message": message, "step": step, "verdict": VERDICT,
                "kinds": [KIND], "action": act, "outcome": str(result.outcome),
                "bad_ranks": bad, "bad_hosts": hosts, "lasted_steps": lasted,
                "last_agreed_step": since,
                "groups": [f.to_json() for f in findings],
                "excluded_host": decision.exclude_host, "strikes": {
                    h: len(history.strikes.get(h, [])) for h in strike},
            }
            path = (self.incidents.write_report(step, "-replicas", content)
                    if self.incidents is not None else None)
            if path is not None:
                result = dataclasses.replace(result, report_path=str(path))
            log.log(logging.ERROR if decision.stops or act != "repair" else logging.WARNING,
                    "%s%s", message, f"; report: {path}" if path else "")
        return result, decision


def replica_check(ctx: Context, watched: Watched, caps: Capabilities, *,
                  inject: Callable[[int], bool] | None,
                  incidents: Any = None) -> ReplicaCheck | None:
    """The check for this run, or None: ``fingerprint_every=0``, one process, or a gradient
    path that knows no replicas (``caps.fingerprints`` says why, once, by rank 0: pure FSDP,
    DeepSpeed, local gradients under a pipeline or tensor parallelism)."""
    if ctx.config.fingerprint_every == 0 or ctx.peers.alone:
        return None
    if caps.fingerprints is not None:
        if ctx.rank == 0:
            log.info("nansentinel: no replica fingerprints under %s", caps.fingerprints)
        return None
    insides.require("fingerprints")
    group = ctx.peers.group if caps.replica_group is EXCHANGE else caps.replica_group
    check = ReplicaCheck(ctx, watched, group, inject=inject, incidents=incidents)
    return None if check.replicas.alone else check
