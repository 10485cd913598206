"""The learning rate each group steps at, written around the optimizer step and put back after.

The decision is :mod:`nansentinel.decide.lr_guard`'s (pure); this is its effect: read the
rates the user's schedule wrote into ``param_groups``, write the planned ones (the rollback's
backoff factor, the known-good cap, a held jump), let the optimizer step, and put the user's
values back, so that any scheduler keeps its own arithmetic. Host floats only: no device
sync, on either gate (the device gate queues its step between :meth:`LearningRates.apply` and
:meth:`LearningRates.restore`).

Groups whose ``lr`` is not a step size are left alone, said once: schedule-free optimizers
(their ``lr`` also weights the averaging), Prodigy and D-Adaptation (a multiplier of the step
size they estimate), Adafactor with ``relative_step`` (its ``lr`` is ignored), and a tensor
``lr`` on an accelerator (reading it would sync the host). The backoff factor still scales
them, as before issue 52.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nansentinel.config import SentinelConfig, env_var
from nansentinel.decide.lr_guard import LrGuard, LrRules, Plan, Rate
from nansentinel.decide.spikes import SpikeDetector
from nansentinel.effects.recovery import Cooldown
from nansentinel.wire.view import ClusterView

log = logging.getLogger("nansentinel")

#: Optimizer class names whose ``lr`` is not a step size (the package each comes from).
NOT_A_STEP_SIZE = {
    "ScheduleFree": "schedule-free (its lr also weights the iterate averaging)",
    "Prodigy": "Prodigy (its lr multiplies the step size it estimates)",
    "DAdapt": "D-Adaptation (its lr multiplies the step size it estimates)",
}

#: What :meth:`LearningRates.apply` wrote: (group index, the user's value, the value written).
Saved = list[tuple[int, Any, Any]]


def rules_of(config: SentinelConfig) -> LrRules:
    return LrRules(cap=config.rollback_lr_cap, jump_ratio=float(config.lr_jump_ratio),
                   quiet_steps=config.rollback_lr_quiet_steps,
                   clean_snapshots=config.rollback_clean_snapshots)


def left_alone(optimizer: Any, group: dict[str, Any]) -> str | None:
    """Why the rules leave this group's ``lr`` alone, or None: they apply."""
    names = [type(optimizer).__name__, type(getattr(optimizer, "optimizer", None)).__name__]
    for key, why in NOT_A_STEP_SIZE.items():
        if any(key in name for name in names):
            return why
    if group.get("relative_step"):
        return "Adafactor with relative_step=True (its lr is not used)"
    lr = group.get("lr")
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
        return f"a tensor lr on {lr.device} (reading it would sync the host)"
    if not isinstance(lr, int | float | torch.Tensor) or isinstance(lr, bool):
        return f"an lr of type {type(lr).__name__}"
    return None


class LearningRates:
    """The rollback's backoff and the rules of :mod:`~nansentinel.decide.lr_guard`, applied.

    Args:
        optimizer: whose ``param_groups`` are written around its step.
        config: the rules (see :func:`rules_of`) and the backoff's factor and bound.
        spikes: the references a step's quiet and update size are judged by.
        rank: rank 0 logs. report: writes an incident report (rank 0; step, content).
    """

    def __init__(self, optimizer: Any, config: SentinelConfig, spikes: SpikeDetector, *,
                 rank: int = 0,
                 report: Callable[[int, dict[str, Any]], str | None] | None = None) -> None:
        self.optimizer, self.config, self.spikes = optimizer, config, spikes
        self.rank, self.report = rank, report
        self.cooldown = Cooldown()
        self.guard = LrGuard(rules_of(config))
        #: The plan of the step being taken (None once counted), and the last one made.
        self.pending: Plan | None = None
        self.last_plan: Plan | None = None
        self._said: set[str] = set()
        self._held_step: int | None = None

    @property
    def lr_factor(self) -> float:
        return self.cooldown.lr_factor

    @property
    def active(self) -> bool:
        return self.guard.rules.any

    def held_at(self, step: int) -> bool:
        """Whether a group's rate was held at ``step`` (the jump rule)."""
        return self._held_step == step

    # --- around the step ---------------------------------------------------------------------

    def apply(self, step: int) -> Saved | None:
        """Write this step's rates; return what :meth:`restore` puts back (None: nothing
        written)."""
        factor = self.cooldown.lr_factor
        groups = self.optimizer.param_groups
        if not self.active:  # the backoff factor alone, as before issue 52
            self.pending = None
            rates: list[Rate] = [None] * len(groups)
        else:
            before = self.guard.holding
            plan = self.guard.plan([self._asked(g) for g in groups], factor)
            self.pending = self.last_plan = plan
            if plan.held:
                self._held(step, plan, self.guard.newly_held(plan, before))
            rates = [rate if rate != asked else None
                     for rate, asked in zip(plan.lrs, plan.asked, strict=True)]
        saved: Saved = []
        for i, (group, rate) in enumerate(zip(groups, rates, strict=True)):
            if rate is None and (factor == 1.0 or (self.active and self.pending is not None
                                                   and self.pending.asked[i] is not None)):
                continue  # left as the schedule wrote it
            lr = group.get("lr")
            if lr is None or isinstance(lr, bool):
                continue  # a group without a rate of its own (a container's view): nothing
            if rate is None:
                wrote = lr * factor  # a group the rules leave alone: the factor alone
            elif isinstance(lr, torch.Tensor):
                wrote = torch.tensor(rate, dtype=lr.dtype, device=lr.device)
            else:
                wrote = rate
            group["lr"] = wrote
            saved.append((i, lr, wrote))
        return saved or None

    def restore(self, saved: Saved | None) -> None:
        """Put the user's rates back (the device gate: before it knows the step applied),
        where they still hold what :meth:`apply` wrote: a scheduler that the step itself runs
        (a DeepSpeed engine's) keeps the rate it wrote for the next step."""
        if saved is None:
            return
        groups = self.optimizer.param_groups
        for i, user, wrote in saved:
            if groups[i]["lr"] is wrote:
                groups[i]["lr"] = user

    def count(self, view: ClusterView | None) -> None:
        """One step applied: the backoff counts it, the references move, and the backoff ends
        early after a quiet window (``view``: the step's, None when unknown)."""
        plan, self.pending = self.pending, None
        backoff = self.cooldown.steps_left > 0
        self.cooldown.count()
        if plan is None:
            return
        quiet = view is not None and self.spikes.quiet(view.totals)
        grad = view.totals.mean("grad_norm") if view is not None else None
        ratio = self.spikes.cluster["grad_norm"].ratio_of(grad) if grad is not None else 1.0
        self.guard.applied(plan, quiet=quiet,
                           update_ratio=self.guard.update_ratio(plan.lrs, ratio))
        if backoff and self.guard.quiet_enough():
            self.end_backoff(view.step if view is not None else -1,
                             f"after {self.guard.rules.quiet_steps} quiet steps under the "
                             "known-good rate (rollback_lr_quiet_steps)")
        elif self.cooldown.steps_left <= 0:
            self.guard.end_backoff()

    @contextlib.contextmanager
    def stepping(self, view: ClusterView) -> Iterator[None]:
        """Around the host gate's own optimizer step."""
        saved = self.apply(view.step)
        try:
            yield
        finally:
            self.undo(saved, view)

    def undo(self, saved: Saved | None, view: ClusterView | None) -> None:
        """The rates put back and the step counted (``view`` None: the caller did not step)."""
        self.restore(saved)
        if view is not None:
            self.count(view)
            return
        self.pending = None  # nothing applied: the references stay
        if saved is not None and not self.active:
            self.cooldown.count()  # as the backoff counted such a step before issue 52

    # --- rollbacks and snapshots ---------------------------------------------------------------

    def rolled_back(self) -> None:
        self.cooldown.start(self.config.rollback_lr_factor, self.config.rollback_lr_steps)
        self.guard.rolled_back(self.config.rollback_lr_factor)
        if self.cooldown.steps_left <= 0:  # rollback_lr_steps=0: no backoff at all
            self.guard.end_backoff()

    def snapshot_taken(self) -> None:
        self.guard.snapshot_taken()

    def may_snapshot(self) -> bool:
        return self.guard.may_snapshot(self.pending)

    def reset(self) -> None:
        """Forget the jump rule's reference: a deliberate change of the learning rate (a
        resume with another schedule, an LR range test, a batch-size ramp) is taken as it is
        from the next step, and becomes the reference."""
        self.guard.reset()
        if self.rank == 0:
            log.warning("nansentinel: learning-rate reference reset: the next rates applied "
                        "become the reference of the jump rule (lr_jump_ratio)")

    # --- the checkpoint --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state, reference=not self.config.lr_jump_reset)

    # --- inside ----------------------------------------------------------------------------------

    def _asked(self, group: dict[str, Any]) -> Rate:
        why = left_alone(self.optimizer, group)
        if why is not None:
            self._say_once(why)
            return None
        lr = group["lr"]
        return float(lr)

    def _say_once(self, why: str) -> None:
        if why in self._said:
            return
        self._said.add(why)
        if self.rank == 0:
            log.info("nansentinel: the learning-rate rules (rollback_lr_cap, lr_jump_ratio) "
                     "leave %s's groups alone: %s; the rollback's backoff factor still scales "
                     "them", type(self.optimizer).__name__, why)

    def _held(self, step: int, plan: Plan, new: list[int]) -> None:
        self._held_step = step
        if not new or self.rank != 0:
            return
        groups = []
        for g in new:
            high = self.guard.highest[g]
            asked = plan.asked[g]
            assert asked is not None and high is not None
            groups.append({"group": g, "asked": asked, "highest_applied": high,
                           "held_at": plan.lrs[g], "ratio": asked / high})
        said = "; ".join(
            f"param group {e['group']} asked {e['asked']:.3g}, {e['ratio']:.1f}x the highest "
            f"it has applied ({e['highest_applied']:.3g}): held at {e['held_at']:.3g}"
            for e in groups)
        how = (f"If the change is deliberate (a resume with another schedule, an LR range "
               f"test, a batch-size ramp), call sentinel.lr_guard.reset() once, set "
               f"{env_var('lr_jump_reset')}=1 for a resume, or turn the rule off with "
               f"lr_jump_ratio=0 ({env_var('lr_jump_ratio')}=0)")
        message = (f"nansentinel: learning-rate jump at step {step}: {said} (lr_jump_ratio="
                   f"{self.guard.rules.jump_ratio:g}); every rank steps at the held rate until "
                   f"the schedule comes back under the limit. {how}.")
        path = None
        if self.report is not None:
            path = self.report(step, {
                "version": 2, "message": message, "step": step, "outcome": "lr_held",
                "kinds": ["lr"], "bad_ranks": [], "bad_hosts": [], "groups": groups,
                "lr_jump_ratio": self.guard.rules.jump_ratio, "how_to_allow": how})
        log.warning("%s%s", message, f" Report: {path}" if path else "")

    def end_backoff(self, step: int, why: str) -> None:
        """The backoff (its factor and cap) ends at ``step``, ``why`` said on rank 0 (if one
        was in force)."""
        was = self.cooldown.steps_left > 0 or self.guard.known_good is not None
        self.cooldown.factor, self.cooldown.steps_left = 1.0, 0
        self.guard.end_backoff()
        if was and self.rank == 0:
            log.info("nansentinel: step %d: the learning-rate backoff ends %s", step, why)
