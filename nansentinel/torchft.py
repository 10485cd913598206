"""nansentinel on torchft: one veto on every replica group, and a poisoned group leaves live.

torchft's ``Manager.should_commit()`` agrees within one replica group only. A NaN in group
1's gradients is all-reduced into every group; group 1 does not commit, the others commit the
NaN-averaged gradients, and at the next quorum group 1 heals *from* them: the run is lost on
every group. This sentinel closes that hole (the recipe: docs/torchft.md).

Each group checks its own batch, loss and gradients before they leave it (the core sentinel,
engines/torchft.py's hook); at ``step()`` every group sums one small health row through
``Manager.allreduce``, so every group sees the same count of groups that did not apply; a
step that some group did not apply is reported to every manager (``report_error``), so that
``should_commit()`` is False on every group at the same step and nothing non-finite is ever
committed, or served to a healing peer. The poisoned groups are named (group, rank, host) on
every group. A host struck ``host_strikes`` times raises :class:`HostExcludedError` in its
group, after it shut its manager down (``Manager.shutdown``): the lighthouse drops it at the
next quorum and the others train on, without a restart. With ``exclusion_file`` set, a new
process on an excluded host refuses to join until the operator clears it
(``nansentinel excluded --clear HOST``). A failed all-reduce or a dead peer is torchft's
regroup (the step not committed, ``result.regrouped``), never an exception in the survivors.
Under ``policy="drop"`` a group whose batch or loss was non-finite sends zeros instead, and
every group commits the others' mean.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch

from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.config import ConfigError
from nansentinel.decide.policy import max_dropped_ranks
from nansentinel.effects.drop import rescale
from nansentinel.result import (
    HostExcludedError,
    NonFiniteError,
    Outcome,
    SentinelUsageError,
    StepResult,
)
from nansentinel.step.sentinel import Sentinel as _Sentinel

try:
    from nansentinel.engines import torchft as _ft
    from nansentinel.engines import torchft_groups as _groups
    from nansentinel.engines.torchft_groups import FTStepResult, PoisonedGroup
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("nansentinel.torchft needs torchft: pip install torchft==0.2.0") from exc

DistributedDataParallel = _ft.DistributedDataParallel

log = logging.getLogger("nansentinel")

__all__ = ["DistributedDataParallel", "FTStepResult", "PoisonedGroup", "Sentinel"]


def _manager_of(model: torch.nn.Module, manager: Any) -> Any:
    """The manager the sentinel decides with: the DDP's, or the one given with a plain module;
    torchft's own DDP (or any other DDP) is refused, naming what to build instead."""
    if isinstance(model, DistributedDataParallel):
        if manager is not None and manager is not model.manager:
            raise SentinelUsageError("nansentinel.torchft.Sentinel: manager= is not the "
                                     "manager the DistributedDataParallel was built with")
        return model.manager
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or manager is None:
        raise SentinelUsageError(
            "nansentinel.torchft.Sentinel watches nansentinel.torchft.DistributedDataParallel"
            f"(manager, module), or a plain module with manager=, not "
            f"{type(model).__module__}.{type(model).__name__}"
            f"{'' if manager is not None else ' without manager='}: torchft's own DDP "
            "registers the one communication hook DDP allows, and its hook fails an assert "
            "when a peer dies. Build the model with nansentinel's.")
    return manager


class Sentinel(_Sentinel):
    """The sentinel of one rank of a torchft replica group (see the module's docstring).

    Args:
        model: a :class:`DistributedDataParallel` (nansentinel's, built like torchft's), or
            a plain module whose gradients you reduce with ``manager.allreduce`` yourself:
            call :meth:`check_grads` after ``backward()`` and before that all-reduce.
        optimizer: the optimizer, or torchft's ``OptimizerWrapper`` (its inner optimizer is
            stepped; call its ``zero_grad()`` as usual, never its ``step()``).
        manager: the torchft ``Manager`` (a plain module only: the DDP brings its own).
        **kwargs: as :class:`nansentinel.Sentinel` (``policy``, ``host_strikes``, ...).
            ``policy="drop"`` is carried out across the groups (on nansentinel's DDP only);
            rollbacks and a GradScaler are refused on torchft.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any, *, manager: Any = None,
                 **kwargs: Any) -> None:
        self._manager = _manager_of(model, manager)
        if kwargs.get("scaler") is not None:
            raise SentinelUsageError(
                "nansentinel.torchft.Sentinel takes no GradScaler: an fp16 overflow would be "
                "decided by each group's scaler apart from should_commit(); use bf16")
        inner = getattr(optimizer, "optim", None)
        wrapped = type(optimizer).__name__ == "OptimizerWrapper" and inner is not None
        env = kwargs.get("env")
        environ = os.environ if env is None else env
        #: ``policy="drop"`` is carried out across the groups here; each group decides its
        #: own step as ``skip`` (a group of one cannot leave itself out).
        self._drop = (kwargs.get("policy") or environ.get("NANSENTINEL_POLICY")) == "drop"
        if self._drop:
            if not isinstance(model, DistributedDataParallel):
                raise ConfigError(
                    "policy='drop' is refused on torchft for gradients reduced by hand: the "
                    "sentinel cannot put zeros in place of a group's contribution to your own "
                    "Manager.allreduce. Use nansentinel.torchft.DistributedDataParallel, or "
                    "policy='skip'; nothing was started.", field="policy")
            kwargs["policy"] = "skip"
        if "job_id" not in kwargs and not environ.get("NANSENTINEL_JOB_ID"):
            # The replica group in every report's name and job_id: groups share a report_dir.
            base = environ.get("TORCHELASTIC_RUN_ID") or "torchft"
            kwargs["job_id"] = f"{base}-{_ft.replica_id(self._manager)}"
        #: torchft steps at which this group's host was struck (within ``strike_window``).
        self._strikes: list[int] = []
        super().__init__(model, inner if wrapped else optimizer, **kwargs)
        self._refuse_unsupported()
        self._refuse_excluded_host()
        if self._drop:
            path = self.gradients
            path.drop_flag = lambda: self._parts.current.local.poisoned()

    @property
    def manager(self) -> Any:
        """The torchft ``Manager`` of this replica group."""
        return self._manager

    @property
    def group(self) -> str:
        """This replica group's id."""
        return _ft.replica_id(self._manager)

    def _refuse_unsupported(self) -> None:
        """Rollbacks (the policy or a spike action) are refused on torchft, with torchft's
        reason, whatever the gradient path (a plain module too)."""
        cfg, why = self.config, _ft.TorchFTPath.CAPS.rollback
        if "rollback" not in (cfg.policy, cfg.loss_spike_action, cfg.grad_spike_action):
            return
        self.abandon()
        raise ConfigError(
            f"policy={cfg.policy!r} (spike actions {cfg.loss_spike_action!r}, "
            f"{cfg.grad_spike_action!r}) is refused on torchft (replica group {self.group}, "
            f"host {self.identity.hostname}): {why}. Use policy='skip' and a spike action "
            "'skip' or 'warn'; nothing was started.",
            field="policy")

    def _refuse_excluded_host(self) -> None:
        """A host struck out stays out: this process leaves before its first quorum."""
        path = self.config.exclusion_file
        host = self.identity.hostname
        if not path or not ExclusionStore(path).is_excluded(host):
            return
        self._manager.shutdown(wait=False)
        self.abandon()
        message = (f"nansentinel: host {host} is excluded ({path}): replica group "
                   f"{self.group} does not join the torchft quorum. Clear it with "
                   f"`nansentinel excluded --clear {host}` once the host is repaired.")
        raise HostExcludedError(message, StepResult(
            step=self.step_index, applied=False, outcome=Outcome.EXCLUDED, bad_ranks=[],
            bad_hosts=[host], kinds=[], local_kinds=[], local_loss=None, local_grad_norm=None,
            consecutive_skips=0, excluded_hosts=[host], reason=message))

    def step(self, *, optimizer_step: bool = True) -> FTStepResult:
        """Decide this step with every replica group: this group's own decision (the core
        sentinel's), then the groups' sum, then ``should_commit()``; the optimizer steps only
        when it is True on this (and so on every) group. Raises :class:`HostExcludedError` in a
        group struck out (after its manager shut down, so the others go on), and under
        ``policy="abort"`` :class:`NonFiniteError` on every group at the same step."""
        manager = self._manager
        began = int(manager.current_step())
        stopping: NonFiniteError | None = None
        # The core decides this group's own step without the exporter: the step is observed
        # once, after every group decided it (a step another group vetoed is not "applied"),
        # and a stop lingers for the final scrape only after the groups have agreed.
        metrics, self.metrics = self.metrics, None
        grads = [p.grad for p in self.module.parameters()] if self._drop else []
        spent, started = self._parts.current.record.spent, time.perf_counter()
        try:
            local = super().step(optimizer_step=False)
        except NonFiniteError as exc:  # the core's abort (max_consecutive_skips, policy)
            local, stopping = exc.result, exc
        finally:
            self.metrics = metrics
        spent += time.perf_counter() - started
        assert local is not None
        here = not local.applied
        withheld = self._drop and self.gradients.take_withheld()
        row = _groups.health_row(here, local.kinds, manager.participating_rank(), withheld)
        health = _groups.agree(manager, row, self.device)
        names: list[dict[str, Any]] | None = []
        strikes = 0
        kept = self._kept(health)
        if health is not None and health.bad:
            # A strike only while some group is healthy: when every group is poisoned the
            # cause is global (learning rate, data), and striking hosts would shrink the job.
            if here and local.bad_ranks and health.bad < manager.num_participants():
                strikes = self._strike(began, local.verdict)
            leaving = stopping is not None or strikes >= self.config.host_strikes
            mine = self._name(local, began, leaving, strikes) if here else None
            names = _groups.gather_names(manager, mine, self.device)
            if kept is None:
                manager.report_error(RuntimeError(
                    f"nansentinel: {health.bad} replica group(s) did not apply step {began}"))
        regrouped = health is None or names is None
        committed = bool(manager.should_commit())
        if committed and kept is not None:  # dropped: the others' mean, on every group
            for p, g in zip(self.module.parameters(), grads, strict=True):
                p.grad = g  # the reduced gradients this group's own skip let go
            rescale(self.optimizer, manager.num_participants() / kept)
        if committed and optimizer_step:
            self.optimizer.step()
        elif not committed:  # another group's NaN, or a failed all-reduce's leftovers
            self.optimizer.zero_grad(set_to_none=True)
        result = _groups.group_result(local, names or [], _groups.Decided(
            began, committed, committed and optimizer_step, regrouped, kept))
        self._say(result)
        if strikes >= self.config.host_strikes:
            stopping = self._struck_out(result, strikes)
            result = stopping.result  # type: ignore[assignment]  # built as an FTStepResult
        if stopping is None and self.config.policy == "abort" and result.poisoned:
            result = dataclasses.replace(result, outcome=Outcome.ABORTED)
            stopping = NonFiniteError(f"nansentinel: policy is abort: {result.reason}; every "
                                      "replica group stops at this step", result)
        elif stopping is not None and not isinstance(stopping.result, FTStepResult):
            stopping = type(stopping)(str(stopping), result)  # the groups' view of the step
        if metrics is not None:  # the step as every group decided it, observed once
            metrics.observe_step(result, spent)
        if stopping is not None:
            manager.shutdown(wait=False)  # the lighthouse drops this group at the next quorum
            self._linger(metrics)
            raise stopping
        return result

    def _linger(self, metrics: Any) -> None:
        """Before this group raises: its final state served at once, and kept up
        ``metrics_linger`` seconds so that Prometheus scrapes it (as the core's stop does)."""
        if metrics is None:
            return
        metrics.flush()
        if self.config.metrics_linger > 0 and self.config.metrics_port:
            log.info("nansentinel: replica group %s keeps its exporter up %g s for the final "
                     "scrape", self.group, self.config.metrics_linger)
            time.sleep(self.config.metrics_linger)

    def _kept(self, health: _groups.GroupHealth | None) -> int | None:
        """Under ``policy="drop"``: the groups whose gradients the step keeps, when every group
        that did not apply it sent zeros (its batch or loss was non-finite before its
        gradients left) and they are at most ``max_dropped`` of the participants and not all;
        None: the step is vetoed (or healthy)."""
        if not self._drop or health is None or not health.bad:
            return None
        total = int(self._manager.num_participants())
        if health.dropped != health.bad or health.bad >= total:
            return None
        if health.bad > max_dropped_ranks(total, self.config.max_dropped):
            return None
        return total - health.bad

    def _strike(self, step: int, verdict: str | None) -> int:
        """One strike against this group's host at torchft's ``step`` (not when a replay
        blamed the data or a divergence); the strikes within ``strike_window``."""
        if verdict in ("data", "divergence"):
            return 0
        horizon = step - self.config.strike_window
        self._strikes = [s for s in self._strikes if s > horizon] + [step]
        return len(self._strikes)

    def _struck_out(self, result: FTStepResult, strikes: int) -> HostExcludedError:
        """This group's host was struck ``host_strikes`` times: its record for the launcher
        (``exclusion_file``), and the error this group raises once it has left."""
        host = self.identity.hostname
        message = (f"nansentinel: host {host} (replica group {self.group}, rank "
                   f"{_ft.group_rank(self._manager)}) blamed {strikes} times within "
                   f"{self.config.strike_window} steps, at torchft step {result.torchft_step}: "
                   "this replica group leaves the quorum (Manager.shutdown); the others go on "
                   "at the next quorum without a restart")
        if self.config.exclusion_file:
            ExclusionStore(self.config.exclusion_file).add(ExclusionRecord(
                host=host, reason=f"host {host} blamed {strikes} times within "
                f"{self.config.strike_window} steps", step=result.torchft_step,
                evidence={"replica_group": self.group, "rank": _ft.group_rank(self._manager),
                          "kinds": result.kinds, "strikes": strikes,
                          "report_path": result.report_path},
                job_id=self.job_id))
        log.error("%s", message)
        excluded = dataclasses.replace(result, outcome=Outcome.EXCLUDED,
                                       excluded_hosts=sorted({*result.excluded_hosts, host}))
        return HostExcludedError(message, excluded)

    def _name(self, local: StepResult, step: int, leaving: bool, strikes: int
              ) -> dict[str, Any]:
        """What this poisoned group tells every group (bounded: it travels in
        :data:`~nansentinel.engines.torchft_groups.NAME_BYTES`)."""
        return {"group": self.group[:100], "rank": _ft.group_rank(self._manager),
                "host": self.identity.hostname[:100], "step": step, "kinds": local.kinds,
                "reason": local.reason[:120], "leaving": leaving, "strikes": strikes}

    def _say(self, result: FTStepResult) -> None:
        """One line on every group naming the poisoned groups, and what happens next."""
        if result.poisoned:
            log.error("nansentinel: replica group %s (rank %d, host %s): %s%s", self.group,
                      _ft.group_rank(self._manager), self.identity.hostname, result.reason,
                      "" if result.committed else "; gradients discarded, weights unchanged "
                      "on every group")
        elif result.regrouped:
            log.warning("nansentinel: replica group %s (host %s): %s", self.group,
                        self.identity.hostname, result.reason)
