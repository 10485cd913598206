"""What learning rate each parameter group may step at: never one that was not known to work.

A rollback restores good weights, but the run then resumes under the user's schedule, and if
the cause was the schedule (a learning rate blown up for longer than the discarded batches),
the next updates apply it again, too small to trip a spike rule and large enough to damage the
weights the next snapshot then keeps as good. The rules here close that path (issue 52):

1. **cap** — during the backoff after a rollback, a group steps at most at the learning rate
   its restored snapshot was trained at (the last one applied before the save), times the
   backoff factor, whatever the schedule asks. Where the rate rose between the snapshot and
   the spike, the rise is suspect and the snapshot's rate is only a step below the one that
   failed: the known-good rate is then at most the factor times the highest rate applied
   since the snapshot, so the cap is the factor squared times the failing rate (what a second
   rollback's halving gave before the cap, without waiting for the second spike);
2. **jump** — a group whose asked rate exceeds ``jump_ratio`` x the highest it has applied so
   far steps at its last applied rate instead (held): a schedule error never reaches the
   weights. A rollback puts the reference back to the snapshot's (the rates applied after it
   were not known to work);
3. **quiet** — the backoff ends once ``quiet_steps`` applied steps in a row were clean (below)
   *and* asked no more than the known-good rate (the schedule is back under it, no group
   held);
4. **clean snapshots** — during the backoff a snapshot is kept only after a *clean* step:
   quiet (no signal half-way to a spike), no group applying more than its known-good rate,
   the update no larger than a known-good one. A state damaged by the steps just after a
   rollback is never kept as good; one made at the capped rate is (it was made at a rate
   known to work, though the schedule still asks more).

Pure: the inputs are the rates the schedule wrote (the same on every rank), the step's
quiet/update numbers (from reduced values, the same on every rank) and this object's own
history, so every rank plans the same rates at the same step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

#: A group's asked rate: a float, or None for a group the rules leave alone.
Rate = float | None


@dataclasses.dataclass(frozen=True, slots=True)
class LrRules:
    """Which rules are on (config fields ``rollback_lr_cap``, ``lr_jump_ratio``,
    ``rollback_lr_quiet_steps``, ``rollback_clean_snapshots``)."""

    cap: bool = False
    jump_ratio: float = 0.0
    quiet_steps: int = 0
    clean_snapshots: bool = False

    @property
    def any(self) -> bool:
        return self.cap or self.jump_ratio > 0 or self.quiet_steps > 0 or self.clean_snapshots


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """The rates of one optimizer step.

    ``asked``: what the schedule wrote (None: a group left alone); ``lrs``: what each group
    steps at (None: left alone, the backoff factor alone applies); ``held``: groups held by the
    jump rule; ``capped``: groups whose rate the cap lowered; ``above``: a group's asked rate
    is above its known-good one during a backoff (the cause may still be there);
    ``applied_above``: a group steps above its known-good rate during a backoff (the cap off)."""

    asked: tuple[Rate, ...]
    lrs: tuple[Rate, ...]
    held: tuple[int, ...] = ()
    capped: tuple[int, ...] = ()
    above: bool = False
    applied_above: bool = False

    @property
    def under(self) -> bool:
        """The schedule asks no more than the known-good rates: no group held, none above."""
        return not self.held and not self.above


class LrGuard:
    """The rules' memory, per parameter group, and the plan of each step.

    ``highest``/``last``: the highest and the last rate each group applied (the jump rule's
    reference); ``saved``: both as they were at the last snapshot; ``known_good``: the
    snapshot's last applied rates, in force during a backoff (None outside one);
    ``clean_run``: clean applied steps in a row since the last rollback; ``quiet_run``: those
    of them that also asked no more than the known-good rates (rule 3's window).
    """

    def __init__(self, rules: LrRules) -> None:
        self.rules = rules
        self.highest: list[Rate] = []
        self.last: list[Rate] = []
        self.saved: tuple[list[Rate], list[Rate]] | None = None
        self.known_good: list[Rate] | None = None
        #: The highest rate each group applied since the last snapshot (the rates the
        #: rollback discards: the spike came after them).
        self.since: list[Rate] = []
        self.clean_run = 0
        self.quiet_run = 0
        #: Groups held at the last plan (a new hold is said once, not every step).
        self.holding: frozenset[int] = frozenset()

    # --- planning ---------------------------------------------------------------------------

    def plan(self, asked: list[Rate], factor: float) -> Plan:
        """The rate of each group for this step: ``asked`` from the schedule, ``factor`` the
        backoff in force (1 outside one)."""
        self._fit(len(asked))
        backoff = self.known_good is not None
        lrs: list[Rate] = []
        held, capped, above, applied_above = [], [], False, False
        for g, lr in enumerate(asked):
            if lr is None:
                lrs.append(None)
                continue
            high, last = self.highest[g], self.last[g]
            good = self.known_good[g] if self.known_good is not None else None
            if backoff and good is not None and lr > good:
                above = True
            if (self.rules.jump_ratio > 0 and high is not None and high > 0 and last is not None
                    and lr > self.rules.jump_ratio * high):
                held.append(g)
                lrs.append(min(last, lr))
                continue
            rate = lr
            if backoff and self.rules.cap and good is not None and lr > good:
                rate = good
                capped.append(g)
            lrs.append(rate * factor)
            if backoff and good is not None and rate * factor > good:
                applied_above = True
        self.holding = frozenset(held)
        return Plan(tuple(asked), tuple(lrs), tuple(held), tuple(capped), above,
                    applied_above)

    def newly_held(self, plan: Plan, before: frozenset[int]) -> list[int]:
        """Groups this plan holds that the one before did not (the start of a hold)."""
        return [g for g in plan.held if g not in before]

    # --- after the step ----------------------------------------------------------------------

    def applied(self, plan: Plan, *, quiet: bool, update_ratio: float) -> bool:
        """One step applied at ``plan``'s rates: the references move (a held group's do not),
        and the step counts towards the quiet window if it was clean and under the known-good
        rates. ``update_ratio``: the update's size over a known-good one's (1: as large),
        judged during a backoff only. Returns whether it was clean."""
        self._fit(len(plan.lrs))
        for g, lr in enumerate(plan.lrs):
            if lr is None or g in plan.held:
                continue
            self.last[g] = lr
            top = self.since[g]
            self.since[g] = lr if top is None else max(top, lr)
            high = self.highest[g]
            self.highest[g] = lr if high is None else max(high, lr)
        backoff = self.known_good is not None
        clean = quiet and not plan.applied_above and (not backoff or not update_ratio > 1.0)
        self.clean_run = self.clean_run + 1 if clean else 0
        self.quiet_run = self.quiet_run + 1 if clean and plan.under else 0
        return clean

    def quiet_enough(self) -> bool:
        """Rule 3: the backoff has had its quiet window (never, with the rule off)."""
        return (self.rules.quiet_steps > 0 and self.known_good is not None
                and self.quiet_run >= self.rules.quiet_steps)

    def end_backoff(self) -> None:
        self.known_good = None

    def may_snapshot(self, pending: Plan | None) -> bool:
        """Rule 4: during a backoff, keep a snapshot only of a state a clean step made (the
        last applied step was clean) and, where this step has not stepped yet, only if its own
        plan applies no more than the known-good rates either."""
        if not self.rules.clean_snapshots or self.known_good is None:
            return True
        return self.clean_run >= 1 and (pending is None or not pending.applied_above)

    # --- snapshots and rollbacks --------------------------------------------------------------

    def snapshot_taken(self) -> None:
        """The state a snapshot keeps was made at the rates applied so far: remember them."""
        self.saved = (list(self.last), list(self.highest))
        self.since = [None] * len(self.since)

    def rolled_back(self, factor: float = 1.0) -> None:
        """Back to the last snapshot: its rates are the known-good ones, and the jump rule's
        reference is the snapshot's again (the rates applied since were not known to work).

        A group whose rate rose between the snapshot and the spike (a schedule climbing past
        the edge of stability) may have spiked from the rise itself, and the snapshot's rate
        is then only a step below the failing one, at the edge: its known-good rate is at most
        ``factor`` (the backoff's) times the highest rate applied since the snapshot. Capped
        at that times the factor again, the run steps well under the edge instead of at half
        of it, where a rate that keeps climbing (bench/recovery.py's slow_climb) pinned it.
        A rate that jumped (x100) leaves the snapshot's rate as it is (x0.5 of the jump is
        above it); one that did not rise (a data spike on a flat or decaying schedule) too.
        The cost: a data spike during a rising schedule (a warm-up) backs off to a quarter of
        the snapshot's rate rather than a half, until the backoff ends."""
        self.clean_run = self.quiet_run = 0
        since, self.since = self.since, [None] * len(self.since)
        if self.saved is None:
            return
        last, highest = self.saved
        self.last, self.highest = list(last), list(highest)
        since += [None] * (len(last) - len(since))
        self.known_good = [good if good is None or top is None or top <= good
                           else min(good, factor * top)
                           for good, top in zip(last, since, strict=False)]

    def reset(self) -> None:
        """Forget the jump reference: the next rates applied become it (a deliberate change)."""
        n = len(self.highest)
        self.highest, self.last = [None] * n, [None] * n
        self.holding = frozenset()

    def update_ratio(self, lrs: tuple[Rate, ...], grad_ratio: float) -> float:
        """An update's size over a known-good one's, from its rates and the gradient norm over
        its running median: ``max_g(lr_g / known_good_g) x grad_ratio`` (1 when unknown)."""
        if self.known_good is None:
            return 1.0
        ratios = [lr / good for lr, good in zip(lrs, self.known_good, strict=False)
                  if lr is not None and good is not None and good > 0]
        if not ratios or not math.isfinite(grad_ratio):
            return 1.0 if not ratios else max(ratios)
        return max(ratios) * grad_ratio

    # --- the checkpoint -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"highest": list(self.highest), "last": list(self.last),
                "since": list(self.since),
                "saved": [list(s) for s in self.saved] if self.saved is not None else None,
                "known_good": list(self.known_good) if self.known_good is not None else None,
                "clean_run": self.clean_run, "quiet_run": self.quiet_run}

    def load_state_dict(self, state: dict[str, Any], *, reference: bool = True) -> None:
        """Restore :meth:`state_dict`; ``reference=False`` drops the jump reference (a
        deliberate change of the learning rate on resume)."""
        self.highest, self.last = list(state.get("highest", [])), list(state.get("last", []))
        self.since = list(state.get("since", [None] * len(self.highest)))
        saved = state.get("saved")
        self.saved = (list(saved[0]), list(saved[1])) if saved else None
        good = state.get("known_good")
        self.known_good = list(good) if good is not None else None
        self.clean_run = int(state.get("clean_run", 0))
        self.quiet_run = int(state.get("quiet_run", 0))
        if not reference:
            self.reset()

    def _fit(self, n: int) -> None:
        """A group added since (``add_param_group``) starts with no reference."""
        for seq in (self.highest, self.last, self.since):
            seq.extend([None] * (n - len(seq)))
        if self.known_good is not None:
            self.known_good.extend([None] * (n - len(self.known_good)))
