"""torchft's replica groups as an agreement scope of the Sentinel (step/assembly.Scope): one
veto on every replica group, and a poisoned group leaves live (docs/torchft.md).

torchft's ``Manager.should_commit()`` agrees within one replica group only. Each rank's small
health row (its non-finite flags) leaves with its last gradients, appended to the last DDP
bucket or FSDP all-reduce hook call, through ``Manager.allreduce`` (wire/group_rows.py),
and comes back summed over the same rank of every group; where a group cannot carry it
(``policy="drop"``, a spike action ``skip``, gradients reduced by hand) every group sums one
row of its own decision through ``Manager.allreduce`` at ``step()`` instead. A step that some
rank of some group flagged (or that this group did not apply) is reported to the manager
(``report_error``), so that ``should_commit()`` is False on every group at the same step and
nothing non-finite is ever committed, or served to a healing peer. The culprits are named
(group, the culprit's rank inside it, its host) on every rank of every group: each group rank
tells the other groups its group's agreed blame, and a group that did not commit shares what
its ranks were told inside the group. A host struck ``host_strikes`` times
raises :class:`HostExcludedError` in its group after it shut its manager down: the lighthouse
drops it at the next quorum and the others train on. Under ``policy="drop"`` a group whose
batch or loss was non-finite sends zeros instead, and every group commits the others' mean.

This module does not import torchft: nansentinel/torchft.py builds the scope from the
manager (and its ids) and hands it to the Sentinel.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore, ExclusionWriteError
from nansentinel.config import ConfigError, SentinelConfig, resolve_hostname
from nansentinel.decide.groups import Decided, group_result
from nansentinel.decide.policy import max_dropped_ranks
from nansentinel.effects.drop import rescale
from nansentinel.result import (
    FTStepResult,
    HostExcludedError,
    NonFiniteError,
    Outcome,
    SentinelUsageError,
    StepResult,
)
from nansentinel.step.usage import chained
from nansentinel.wire.group_rows import (
    agree,
    carried,
    device_row,
    excluded_in_group,
    gather_names,
    health_row,
    shared_in_group,
)
from nansentinel.wire.schema import GroupTotals, O, R

if TYPE_CHECKING:
    from nansentinel.step.assembly import Parts

log = logging.getLogger("nansentinel")


class ReplicaGroups:
    """The replica groups of a torchft job, deciding each step together (see the module
    docstring).

    Args:
        manager: this group's torchft ``Manager``.
        group: this replica group's id (as the user gave it).
        group_rank: this process's rank inside its replica group.
        rollback: why rollbacks are refused on torchft (the policy and spike actions).
        by_hand: the gradients are reduced by the user's own ``Manager.allreduce``, where
            ``policy="drop"`` cannot put zeros in place of a group's contribution.
        carrier: what carries the health row where the gradient path does not (torchft's
            FSDP2 all-reduce hooks); it wraps them at :meth:`bind` and gives them back at
            the end (its ``install`` and ``release``).
    """

    def __init__(self, manager: Any, *, group: str, group_rank: int, rollback: str,
                 by_hand: bool, carrier: Any = None) -> None:
        self.manager, self.group, self.group_rank = manager, group, group_rank
        #: The replica group's own process group, its ranks' exchange (None: the default
        #: group when one is initialised; set where the Sentinel is given ``group=``): where
        #: its ranks learn at construction whether one of them is on an excluded host.
        self.peers: Any = None
        self._gathered = False  # this construction's gather inside the group was made
        #: What carries the health row with the gradients where the gradient path does not
        #: (torchft's FSDP2 all-reduce hooks: engines/torchft.AllReduceHookRider).
        self.carrier = carrier
        self.rollback, self.by_hand = rollback, by_hand
        #: ``policy="drop"`` is carried out across the groups here; each group decides its
        #: own step as ``skip`` (a group of one cannot leave itself out).
        self.drop = False
        #: torchft's step when the step in progress began (the count reports are named by).
        self.began = 0
        #: torchft steps at which each of this group's hosts was struck (within
        #: ``strike_window``); every rank of the group counts the same strikes (the group's
        #: blame is agreed inside it), and only the struck host's ranks act on them.
        self.strikes: dict[str, list[int]] = {}
        self._grads: list[Any] = []
        self._parts: Parts | None = None
        #: The health rows leave with the gradients' last all-reduce (no round trip of their
        #: own), where the gradient path carries them and the groups' decision is the
        #: non-finite rule alone (not under ``policy="drop"`` or a spike action ``skip``).
        self.riding = False
        #: This step's rows as they came back with the gradients (set by the gradient path).
        self.carried: Any = None

    # --- the Scope's calls -------------------------------------------------------------------

    def configure(self, config: SentinelConfig, environ: Mapping[str, str]) -> SentinelConfig:
        """Refuses what torchft cannot do (before anything is started); ``policy="drop"``
        becomes each group's ``skip``; the job id names the replica group (groups share a
        report_dir): the run id where torchrun was given one (``--rdzv-id``), else
        ``torchft``, then the group's id."""
        host = resolve_hostname(config.hostname, environ)
        changes: dict[str, Any] = {}
        if config.policy == "drop":
            if self.by_hand:
                how = ("under FSDP2 with torchft's all-reduce hooks: each rank's shard leaves "
                       "in a hook before the group's ranks know each other's batch and loss "
                       "(one rank's NaN reaches every rank's shard in the reduce-scatter), so "
                       "a group cannot be left out whole" if self.carrier is not None else
                       "for gradients reduced by hand: the sentinel cannot put zeros in place "
                       "of a group's contribution to your own Manager.allreduce")
                raise ConfigError(
                    f"policy='drop' is refused on torchft {how}. Use policy='skip' (or "
                    "nansentinel.torchft.DistributedDataParallel); nothing was started.",
                    field="policy")
            self.drop = True
            changes["policy"] = "skip"
        if config.rolls_back:
            raise ConfigError(
                f"policy={config.policy!r} (spike actions {config.loss_spike_action!r}, "
                f"{config.grad_spike_action!r}, collapse action {config.collapse_action!r}) "
                f"is refused on torchft (replica group "
                f"{self.group}, host {host}): {self.rollback}. Use policy='skip' and a spike "
                "action 'skip' or 'warn'; nothing was started.", field="policy")
        self._refuse_excluded(config, host)
        if config.gate != "host" and (self.by_hand or self.carrier is not None):
            # nansentinel's torchft DDP says so through its capabilities; FSDP2's and a
            # plain module's would let a fused optimizer take the device gate on CUDA
            if self.group_rank == 0 and config.gate == "device":
                log.info("nansentinel: host gate on torchft (replica group %s): torchft "
                         "decides a step on the host, at Manager.should_commit()", self.group)
            changes["gate"] = "host"
        if config.job_id is None:
            run = environ.get("TORCHELASTIC_RUN_ID")
            # torchrun without --rdzv-id says "none": the replica group names the job then.
            base = run if run and run != "none" else "torchft"
            changes["job_id"] = f"{base}-{self.group}"
        return dataclasses.replace(config, **changes) if changes else config

    def bind(self, parts: Parts) -> None:
        """Keeps the parts; wraps the FSDP2 all-reduce hooks that carry the row (given back
        at the end); under ``policy="drop"`` the gradient path withholds a poisoned group's
        buckets; reports are named by torchft's step."""
        self._parts = parts
        if self.carrier is not None:  # built: the user's hooks are wrapped from here on,
            # and given back when the sentinel closes (or fails to finish its construction)
            parts.end.release = chained(parts.end.release, self.carrier.release)
            self.carrier.install()
        if self.drop:
            current = parts.current
            parts.gradients.drop_flag = lambda: current.local.poisoned()  # type: ignore[attr-defined]
        parts.detector.incidents.step_of = lambda _: self.began
        config = parts.ctx.config
        spikes_skip = "skip" in (config.loss_spike_action, config.grad_spike_action)
        carrier = self.carrier if self.carrier is not None else parts.gradients
        if self.carrier is not None:  # the step's health leaves in its hooks
            self.carrier.sink = parts.current
        if hasattr(carrier, "rider") and not self.drop and not spikes_skip:
            self.riding = True
            carrier.rider = self

    def row(self) -> Any:
        """This rank's row for the gradients' last all-reduce, on the device (no host sync):
        read from the vector the step's exchange launched with the last gradients (its own
        section is the health row; on the CPU, the host floats it was packed from), so the
        row is computed once a step."""
        current = self._bound().current
        packed = current.packed
        assert packed is not None, "the ride-along row is read after the exchange launched"
        row = current.host_row if current.host_row is not None else packed[
            O.start:O.start + R.size]
        return device_row(row, self.manager.participating_rank)

    def begin(self) -> None:
        parts = self._bound()
        self.began = int(self.manager.current_step())
        # The reduced gradients, before this group's own skip lets them go (policy="drop").
        self._grads = [p.grad for p in parts.watched.module.parameters()] if self.drop else []

    def agree(self, local: StepResult, stopping: NonFiniteError | None, *,
              optimizer_step: bool) -> tuple[StepResult, NonFiniteError | None]:
        """The step as every replica group decided it: this group's own decision (``local``),
        then the groups' sum, then ``should_commit()``; the optimizer steps only when it is
        True on this (and so on every) group. A group struck out raises
        :class:`HostExcludedError`, and under ``policy="abort"`` every group raises
        :class:`NonFiniteError` at the same step."""
        parts, manager = self._bound(), self.manager
        config, began, device = parts.ctx.config, self.began, parts.ctx.device
        here = not local.applied
        if self.riding:  # the rows came back with the last gradients
            summed, self.carried = self.carried, None
            if self.carrier is not None:
                self.carrier.reset()
            if manager.errored() is not None:
                health = None
            elif summed is None:  # no last hook call this step (every group runs the same
                # model, so none had one): the row goes on its own, on every group alike
                health = agree(manager, health_row(here, local.kinds,
                                                   manager.participating_rank()), device)
            else:
                health = carried(summed, manager.num_participants)
        else:
            withheld = self.drop and parts.gradients.take_withheld()  # type: ignore[attr-defined]
            health = agree(manager, health_row(here, local.kinds, manager.participating_rank(),
                                               withheld), device)
        names: list[dict[str, Any]] | None = []
        strikes, out, mine = 0, False, None
        kept = self._kept(health, config)
        culprits = self._culprits(local, parts.ctx.world_size)
        if here and health is not None:
            # A strike only while some group is healthy: when every group is poisoned the
            # cause is global (learning rate, data), and striking hosts would shrink the job.
            if culprits and health.bad < int(manager.num_participants()):
                struck = self._strike(began, {h for _, h in culprits}, local.verdict, config)
                strikes = struck.get(parts.ctx.identity.hostname, 0)
                out = max(struck.values(), default=0) >= config.host_strikes
            mine = self._name(local, culprits, stopping is not None or out, strikes)
        if health is not None and health.bad:  # the same count on every group of this ring
            names = gather_names(manager, mine, device)
        if health is not None and (health.bad or here) and kept is None:
            manager.report_error(RuntimeError(
                f"nansentinel: replica group {self.group} or a peer did not apply step {began}"))
        regrouped = health is None or names is None
        committed = bool(manager.should_commit())
        if not committed and manager.errored() is None:
            # Another ring of this group saw the fault: errored like its peers, so that a
            # managed collective later in the step (torchtitan's loss sync) is skipped on
            # every rank alike instead of waiting out the process group's timeout.
            manager.report_error(RuntimeError(
                f"nansentinel: replica group {self.group} did not commit step {began}"))
        if self.riding and not committed and parts.ctx.world_size > 1:
            # Agreed inside the group: every rank learns what any ring of it was told.
            names = shared_in_group(parts.ctx.peers.group, [*(names or []),
                                                            *([mine] if mine else [])])
        optimizer = parts.judge.optimizer
        if committed and kept is not None:  # dropped: the others' mean, on every group
            for p, g in zip(parts.watched.module.parameters(), self._grads, strict=True):
                p.grad = g  # the reduced gradients this group's own skip let go
            rescale(optimizer, manager.num_participants() / kept)
        if committed and optimizer_step:
            optimizer.step()
        elif not committed:  # another group's NaN, or a failed all-reduce's leftovers
            optimizer.zero_grad(set_to_none=True)
        self._grads = []
        # Applied where committed: stepped here, or by the caller (optimizer_step=False).
        result: FTStepResult = group_result(local, names or [], Decided(
            began, committed, regrouped, kept))
        self._say(result)
        if strikes >= config.host_strikes:  # only the culprit host's ranks leave with it
            recorded = isinstance(stopping, HostExcludedError) and (
                parts.ctx.identity.hostname in stopping.result.excluded_hosts)
            stopping = self._struck_out(result, strikes, recorded)
            result = stopping.result  # type: ignore[assignment]  # built as an FTStepResult
        if stopping is None and config.policy == "abort" and result.poisoned:
            result = dataclasses.replace(result, outcome=Outcome.ABORTED)
            stopping = NonFiniteError(f"nansentinel: policy is abort: {result.reason}; every "
                                      "replica group stops at this step", result)
        elif stopping is not None and not isinstance(stopping.result, FTStepResult):
            stopping = type(stopping)(str(stopping), result)  # the groups' view of the step
        return result, stopping

    def leave(self, metrics: Any) -> None:
        """The lighthouse drops this group at the next quorum; its final state is served at
        once, and kept up ``metrics_linger`` seconds so that Prometheus scrapes it."""
        self.manager.shutdown(wait=False)
        if metrics is None:
            return
        metrics.flush()
        config = self._bound().ctx.config
        if config.metrics_linger > 0 and config.metrics_port:
            log.info("nansentinel: replica group %s keeps its exporter up %g s for the final "
                     "scrape", self.group, config.metrics_linger)
            time.sleep(config.metrics_linger)

    # --- internals ---------------------------------------------------------------------------

    def _bound(self) -> Parts:
        assert self._parts is not None, "ReplicaGroups used before the Sentinel bound it"
        return self._parts

    def refused(self, error: Exception, hostname: str | None,
                environ: Mapping[str, str]) -> None:
        """This rank's construction failed before it reached the group's gather (a setting
        refused here, its file unreadable on this host, ...): it joins the gather all the same,
        saying so, so that its peers refuse with the reason instead of waiting in the gather,
        or pairing it with a later construction's. No collective once it was reached."""
        if self._gathered:
            return
        host = resolve_hostname(hostname or environ.get("NANSENTINEL_HOSTNAME"), environ)
        self._gather({"host": host, "error": f"{type(error).__name__}: {error}"[:500]})

    def _gather(self, mine: dict[str, Any] | None) -> list[dict[str, Any] | None]:
        self._gathered = True
        return excluded_in_group(self.peers, mine)

    def _refuse_excluded(self, config: SentinelConfig, host: str) -> None:
        """A host struck out stays out: a replica group with a rank on it leaves before its
        first quorum, every rank of it (one small all-gather inside the group, on every rank
        alike, the excluded one's included: its peers would otherwise be let in and wait for
        it until their launcher ends them). A peer whose construction failed first is named
        on every rank (:meth:`refused`)."""
        path = config.exclusion_file
        mine: dict[str, Any] | None = None
        if path:
            try:
                if ExclusionStore(path).is_excluded(host):
                    mine = {"host": host, "file": path}
            except OSError as exc:  # said on every rank of the group, after the gather
                mine = {"host": host, "error": f"exclusion_file {path}: {exc}"[:500]}
        found = self._gather(mine)
        alone = len(found) == 1
        on = {(self.group_rank if alone else rank): e for rank, e in enumerate(found) if e}
        failed = [f"rank {rank} on {e['host']}: {e['error']}" for rank, e in sorted(on.items())
                  if "error" in e]
        if failed:
            raise SentinelUsageError(
                f"nansentinel: replica group {self.group} does not join the torchft quorum: "
                f"its construction failed on {'; '.join(failed)}. Fix that and start the "
                "group again; the sentinel started nothing.")
        if not on:
            return
        self.manager.shutdown(wait=False)
        hosts = sorted({e["host"] for e in on.values()})
        files = sorted({e["file"] for e in on.values()})
        where = ", ".join(f"rank {rank} on {e['host']}" for rank, e in sorted(on.items()))
        which = (f"host {hosts[0]} is excluded" if len(hosts) == 1 else
                 f"hosts {', '.join(hosts)} are excluded")
        clear = " ".join(f"--clear {h}" for h in hosts)
        message = (f"nansentinel: {which} ({', '.join(files)}): replica group {self.group} "
                   f"does not join the torchft quorum ({where}"
                   + ("" if mine else f"; this rank, {self.group_rank} on {host}, leaves "
                      "with its group") +
                   f"). Clear it with `nansentinel excluded --exclusion-file {files[0]} "
                   f"{clear}` once repaired, then start the group again.")
        raise HostExcludedError(message, StepResult(
            step=0, applied=False, outcome=Outcome.EXCLUDED, bad_ranks=sorted(on),
            bad_hosts=hosts, kinds=[], local_kinds=[], local_loss=None, local_grad_norm=None,
            consecutive_skips=0, excluded_hosts=hosts, reason=message))

    def _kept(self, health: GroupTotals | None, config: SentinelConfig) -> int | None:
        """Under ``policy="drop"``: the groups whose gradients the step keeps, when every group
        that did not apply it sent zeros (its batch or loss was non-finite before its
        gradients left) and they are at most ``max_dropped`` of the participants and not all;
        None: the step is vetoed (or healthy)."""
        if not self.drop or health is None or not health.bad:
            return None
        total = int(self.manager.num_participants())
        if health.dropped != health.bad or health.bad >= total:
            return None
        if health.bad > max_dropped_ranks(total, config.max_dropped):
            return None
        return total - health.bad

    def _strike(self, step: int, hosts: set[str], verdict: str | None,
                config: SentinelConfig) -> dict[str, int]:
        """One strike against each culprit host of this group at torchft's ``step`` (not when
        a replay blamed the data or a divergence); each host's strikes within
        ``strike_window``."""
        if verdict in ("data", "divergence"):
            return {}
        horizon = step - config.strike_window
        for host in hosts:
            self.strikes[host] = [s for s in self.strikes.get(host, []) if s > horizon] + [step]
        return {host: len(self.strikes[host]) for host in hosts}

    def _culprits(self, local: StepResult, world_size: int) -> list[tuple[int, str]]:
        """The ranks (inside the replica group) and hosts this group blames, as its ranks
        agreed them: the same on every rank of the group, so every group rank tells the
        other groups the group's own blame, not its own position. A sentinel alone in its
        process group (a rank of a group whose ranks share no exchange) blames itself. With
        several culprit hosts whose ranks cannot be paired (the result keeps them apart),
        each host is named with rank -1."""
        if not local.bad_ranks:
            return []
        if world_size == 1:
            return [(self.group_rank, self._bound().ctx.identity.hostname)]
        if len(local.bad_hosts) == 1:
            return [(rank, local.bad_hosts[0]) for rank in local.bad_ranks]
        if len(local.bad_ranks) == 1 == len(local.bad_hosts):
            return [(local.bad_ranks[0], local.bad_hosts[0])]
        return [(-1, host) for host in local.bad_hosts]

    def _struck_out(self, result: FTStepResult, strikes: int, recorded: bool
                    ) -> HostExcludedError:
        """This group's host was struck ``host_strikes`` times: its record for the launcher
        (``exclusion_file``; not again where the group's own ranks already excluded it,
        ``recorded``), and the error this group raises once it has left."""
        ctx = self._bound().ctx
        config, host = ctx.config, ctx.identity.hostname
        message = (f"nansentinel: host {host} (replica group {self.group}, rank "
                   f"{self.group_rank}) blamed {strikes} times within "
                   f"{config.strike_window} steps, at torchft step {result.torchft_step}: "
                   "this replica group leaves the quorum (Manager.shutdown); the others go on "
                   "at the next quorum without a restart")
        if config.exclusion_file and not recorded:
            record = ExclusionRecord(
                host=host, reason=f"host {host} blamed {strikes} times within "
                f"{config.strike_window} steps", step=result.torchft_step,
                evidence={"replica_group": self.group, "rank": self.group_rank,
                          "kinds": result.kinds, "strikes": strikes,
                          "report_path": result.report_path},
                job_id=ctx.job_id)
            try:
                ExclusionStore(config.exclusion_file).add(record)
            except ExclusionWriteError as exc:  # the group leaves all the same
                message += (f". Its exclusion could not be recorded ({exc}): it holds until "
                            "this process ends; the record, to append once the file is "
                            f"writable: {record.to_json()}")
        log.error("%s", message)
        excluded = dataclasses.replace(result, outcome=Outcome.EXCLUDED,
                                       excluded_hosts=sorted({*result.excluded_hosts, host}))
        return HostExcludedError(message, excluded)

    def _name(self, local: StepResult, culprits: list[tuple[int, str]], leaving: bool,
              strikes: int) -> dict[str, Any]:
        """What this poisoned group tells every group: the culprits (rank inside the group,
        host) its ranks agreed on, or none when it skipped without one (a spike, a
        quarantined batch). Bounded: it travels in
        :data:`~nansentinel.wire.group_rows.NAME_BYTES`."""
        return {"group": self.group[:100], "step": self.began, "kinds": local.kinds,
                "reason": local.reason[:80], "leaving": leaving, "strikes": strikes,
                "culprits": [[rank, host[:100]] for rank, host in culprits[:3]]}

    def _say(self, result: FTStepResult) -> None:
        """One line on every group naming the poisoned groups, and what happens next."""
        host = self._bound().ctx.identity.hostname
        if result.poisoned:
            log.error("nansentinel: replica group %s (rank %d, host %s): %s%s", self.group,
                      self.group_rank, host, result.reason,
                      "" if result.committed else "; gradients discarded, weights unchanged "
                      "on every group")
        elif result.regrouped:
            log.warning("nansentinel: replica group %s (host %s): %s", self.group, host,
                        result.reason)
