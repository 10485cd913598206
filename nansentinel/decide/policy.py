"""The decision: a pure function of the cluster view, the history and the config.

Every rank holds the same view (the exchange's totals, and after a detection the same named
ranks), the same history (built from the
same views) and the same config, so every rank reaches the same decision without another
collective: no rank can step the optimizer while another skips or rolls back.
"""

from __future__ import annotations

import dataclasses
import math
import signal
from typing import Any

from nansentinel.checks.state import StateFindings
from nansentinel.config import SentinelConfig
from nansentinel.decide.spikes import Spikes, above
from nansentinel.result import ACTIVATION, ALL_KINDS, BUFFER, HYPERPARAMETER, STATE, Outcome
from nansentinel.wire.schema import Totals
from nansentinel.wire.view import ClusterView, RankHealth

APPLY, SKIP, OVERFLOW, ABORT, EXCLUDE, ROLLBACK, DROP = (
    "apply", "skip", "overflow", "abort", "exclude", "rollback", "drop",
)
# Why a step was not applied as is; planned skips do not count towards escalation.
NONFINITE, SPIKE, QUARANTINE, AFTER_ROLLBACK = "nonfinite", "spike", "quarantine", "after_rollback"
# issue 60: a collapse skipped (collapse_action="skip"); a recovery that ended (the step applies).
COLLAPSE, RECOVERY_OVER = "collapse", "recovery_over"
# issue 70: a degenerate stretch rolled back over at its end (collapse_action="rollback");
# applied: the batches that spiked against a rollback's restored state ended (its window too).
STRETCH, DATA_BACK = "stretch", "data_back"
# issue 68: a step decided on the model's own state (rare/state.py), or on a non-finite
# optimizer hyperparameter; the verdict of the former.
HYPER = HYPERPARAMETER
_SEVERITY = {"warn": 0, "skip": 1, "rollback": 2}
_OUTCOME = {
    APPLY: Outcome.APPLIED, SKIP: Outcome.SKIPPED, OVERFLOW: Outcome.OVERFLOW,
    ABORT: Outcome.ABORTED, EXCLUDE: Outcome.EXCLUDED, ROLLBACK: Outcome.ROLLED_BACK,
    DROP: Outcome.DROPPED,
}


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What every rank does with this step, and why."""

    action: str
    bad: tuple[RankHealth, ...]
    """Blamed ranks (for AMP runs: ranks whose batch or loss was non-finite)."""
    reason: str = ""
    cause: str = ""
    """``nonfinite``, ``spike``, ``quarantine``, ``after_rollback``, ``collapse``,
    ``stretch`` (a degenerate stretch that left the run worse, rolled back over),
    ``recovery_over`` (applied: a recovery that did not help ended), ``data_back`` (applied:
    the batches that spiked against a rollback's restored state ended, and so does the window
    of batches discarded after it, and the learning-rate backoff), ``state`` (the model's
    own state was non-finite: repaired, rolled back over or stopped for), ``hyperparameter``
    (an optimizer hyperparameter was non-finite: skipped) or empty (applied)."""
    overflow: bool = False
    """Gradients overflowed under GradScaler on some rank: counted, not blamed."""
    exclude_host: str | None = None
    strikes: int = 0
    """Strikes against ``exclude_host`` in the window."""
    also_exclude: tuple[tuple[str, int], ...] = ()
    """The other hosts excluded at this same step, each with its strikes: every blamed host
    that reached ``host_strikes`` leaves together, with one rendezvous change."""
    kept: int = 0
    """``DROP``: the ranks whose gradients the step averages (the world less the ranks left
    out of its reduction)."""

    @property
    def applies(self) -> bool:
        """The optimizer (or GradScaler) steps: nothing to skip, roll back or stop for, or
        the poisoned ranks were left out of the reduction (``DROP``)."""
        return self.action in (APPLY, OVERFLOW, DROP)

    @property
    def outcome(self) -> Outcome:
        """What the step's result, report, metrics and verdict call this decision."""
        return _OUTCOME[self.action]

    @property
    def stops(self) -> bool:
        """Every rank raises: the run is aborted or a host is excluded."""
        return self.action in (ABORT, EXCLUDE)

    @property
    def exclusions(self) -> list[tuple[str, int]]:
        """Every host this step excludes, with its strikes (``exclude_host`` first)."""
        first = [(self.exclude_host, self.strikes)] if self.exclude_host else []
        return [*first, *self.also_exclude]

    @property
    def bad_ranks(self) -> list[int]:
        return sorted(r.rank for r in self.bad)

    @property
    def bad_hosts(self) -> list[str]:
        return sorted({r.identity.hostname for r in self.bad})

    @property
    def kinds(self) -> list[str]:
        seen = {k for r in self.bad for k in r.kinds}
        return [k for k in ALL_KINDS if k in seen]


@dataclasses.dataclass(slots=True)
class History:
    """What the policy remembers between steps; identical on every rank."""

    consecutive_skips: int = 0
    strikes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    excluded: list[str] = dataclasses.field(default_factory=list)
    rollbacks: dict[int, int] = dataclasses.field(default_factory=dict)
    """Snapshot step -> rollbacks to it."""
    skip_batches: int = 0
    """Batches still to discard after a rollback."""
    window_spiked: bool = False
    """The batches discarded since the last rollback spiked against the state it restored
    (under a spike action that rolls back or skips): the data led in, not the weights or the
    schedule, so the window ends at the first batch back near the level that state was known
    to and quiet on every signal (``Evidence.near`` and ``.quiet``: a degenerate batch just
    under a spike's ratio is not back): the data is back, and what is left of the window is
    real data."""
    spike_streak: int = 0
    """Spiking steps in a row since the last rollback (``spike_patience``)."""
    lost: int = 0
    """Steps the recovery in progress left unapplied (skipped, rolled back over, discarded);
    back to 0 when a snapshot is kept or the recovery ends (``max_lost_steps``)."""
    applied: int = 0
    """Applied steps whose updates the weights hold (a rollback takes back what it undoes)."""
    snapshot_applied: dict[int, int] = dataclasses.field(default_factory=dict)
    """Snapshot step -> ``applied`` when it was kept: a rollback to it undoes the rest."""
    failed: list[int] = dataclasses.field(default_factory=list)
    """Snapshots a rollback to which did not bring the loss back (``rollback_check_steps``):
    never restored again."""
    watch: list[int] | None = None
    """``[snapshot step, steps left, 1 if it undid a stretch]`` while a rollback's effect is
    checked."""
    retry: bool = False
    """The last rollback's check just failed: the next step rolls back to an older snapshot
    (if one is kept that did not fail)."""
    retry_stretch: bool = False
    """... and that rollback undid a stretch: so does the next (no batch discarded after it,
    the learning rate as it was)."""
    state_restored: list[int] = dataclasses.field(default_factory=list)
    """Snapshots restored because the model's state was poisoned: never restored for that
    again (a rollback that leads back into the same poisoned update is not repeated)."""
    stretch: list[int] | None = None
    """``[first step, marked, steps back in band]`` while a stretch of low loss lasts
    (``collapse_action="rollback"``): dated from the step the cluster's loss left its band,
    marked once a collapse came within it, and judged on each of its first
    ``rollback_check_steps`` steps back in band (its return) against the level saved with
    the last snapshot before it. No snapshot is kept while it lasts."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the history (JSON-able; keys as saved since 0.1)."""
        return {
            "consecutive_skips": self.consecutive_skips,
            "strikes": {host: list(s) for host, s in self.strikes.items()},
            "excluded": list(self.excluded),
            "rollbacks": dict(self.rollbacks),
            "skip_batches": self.skip_batches,
            "window_spiked": self.window_spiked,
            "spike_streak": self.spike_streak,
            "lost": self.lost,
            "applied": self.applied,
            "snapshot_applied": dict(self.snapshot_applied),
            "failed_snapshots": list(self.failed),
            "watch": list(self.watch) if self.watch else None,
            "retry": self.retry,
            "retry_stretch": self.retry_stretch,
            "state_restored": list(self.state_restored),
            "stretch": list(self.stretch) if self.stretch else None,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> History:
        """The history :meth:`state_dict` saved (missing keys: a fresh history's values)."""
        return cls(
            consecutive_skips=int(state.get("consecutive_skips", 0)),
            strikes={h: [int(s) for s in v] for h, v in state.get("strikes", {}).items()},
            excluded=list(state.get("excluded", [])),
            rollbacks={int(k): int(v) for k, v in state.get("rollbacks", {}).items()},
            skip_batches=int(state.get("skip_batches", 0)),
            window_spiked=bool(state.get("window_spiked", False)),
            spike_streak=int(state.get("spike_streak", 0)),
            lost=int(state.get("lost", 0)),
            applied=int(state.get("applied", 0)),
            snapshot_applied={int(k): int(v)
                              for k, v in state.get("snapshot_applied", {}).items()},
            failed=[int(s) for s in state.get("failed_snapshots", [])],
            watch=[int(x) for x in state["watch"]] if state.get("watch") else None,
            retry=bool(state.get("retry", False)),
            retry_stretch=bool(state.get("retry_stretch", False)),
            state_restored=[int(s) for s in state.get("state_restored", [])],
            stretch=[int(x) for x in state["stretch"]] if state.get("stretch") else None,
        )

    def snapshot_kept(self, step: int, applied_after: int, kept: int = 4) -> None:
        """A snapshot of ``step`` was kept: the recovery in progress (if any) is over, and a
        rollback to it would undo ``applied_after`` steps so far (1: this step's update
        follows it). The last ``kept`` snapshots' counts are remembered."""
        self.lost = 0
        self.snapshot_applied[step] = self.applied - applied_after
        for old in sorted(self.snapshot_applied)[:-kept]:
            del self.snapshot_applied[old]

    def undone(self, snapshot_step: int) -> int:
        """Applied steps a rollback to the snapshot of ``snapshot_step`` would undo."""
        return max(0, self.applied - self.snapshot_applied.get(snapshot_step, self.applied))

    def recovery(self, config: SentinelConfig) -> dict[str, Any]:
        """What the report shows of the recovery in progress: steps left unapplied against the
        bound, the snapshots that did not help, the rollback being checked."""
        return {"lost_steps": self.lost, "max_lost_steps": config.max_lost_steps,
                "failed_snapshots": list(self.failed),
                "checking_snapshot": self.watch[0] if self.watch else None}

    def strikes_within(self, host: str, step: int, config: SentinelConfig) -> int:
        """Strikes against ``host`` within the strike window that ends at ``step``."""
        horizon = step - config.strike_window
        return sum(1 for s in self.strikes.get(host, ()) if s > horizon)

    def strike(self, hosts: list[str], step: int, config: SentinelConfig) -> tuple[str, int] | None:
        """One strike at ``step`` against each of ``hosts`` (strikes older than the window are
        forgotten); the first of them that now reaches ``host_strikes`` and is not excluded
        yet, with its strikes, or None. The one place strikes are counted: the NaN path and
        the replica fingerprints (replicas.py) both strike here."""
        if not hosts and not self.strikes:  # a healthy step with nothing to forget
            return None
        for host in hosts:
            self.strikes.setdefault(host, []).append(step)
        horizon = step - config.strike_window
        for host in list(self.strikes):
            self.strikes[host] = [s for s in self.strikes[host] if s > horizon]
            if not self.strikes[host]:
                del self.strikes[host]
        for host in sorted(set(hosts)):
            n = len(self.strikes.get(host, ()))
            if n >= config.host_strikes and host not in self.excluded:
                return host, n
        return None

    def exclude(self, host: str) -> None:
        if host not in self.excluded:
            self.excluded.append(host)

    def record(
        self,
        view: ClusterView,
        decision: Decision,
        config: SentinelConfig,
        evidence: Evidence | None = None,
    ) -> None:
        """Advance the history by one decided step (a dropped step is applied: not a skip),
        with the step's :class:`Evidence` (its verdict, spikes and snapshot step)."""
        evidence = evidence if evidence is not None else Evidence()
        snapshot_step, spikes = evidence.snapshot_step, evidence.spikes
        waited = spikes and _most_severe(spikes, config) != "warn"
        if not (spikes and spikes.in_data):  # the data's spike: the weights' streak waits
            self.spike_streak = (self.spike_streak + 1 if waited and decision.action != ROLLBACK
                                 else 0)
        if decision.cause in (NONFINITE, SPIKE, STATE, HYPER) and not decision.applies:
            self.consecutive_skips += 1
        elif decision.applies:
            self.consecutive_skips = 0
        self.strike(struck_hosts(view, decision, evidence), view.step, config)
        for host, _ in decision.exclusions:
            self.exclude(host)
        if decision.cause == AFTER_ROLLBACK:
            self.skip_batches -= 1
            self.window_spiked = self.window_spiked or bool(waited)
        elif decision.cause == DATA_BACK:  # the data came back within the window: it ends
            self.skip_batches, self.window_spiked = 0, False
        self._account(decision, config, evidence)
        self._track_stretch(view.step, decision, config, evidence)
        if decision.action == ROLLBACK and decision.cause == STATE and snapshot_step is not None:
            self.state_restored.append(snapshot_step)
        if decision.action == ROLLBACK and snapshot_step is not None and \
                decision.cause != STATE:  # a poisoned state was not the batches' doing
            n = self.rollbacks[snapshot_step] = self.rollbacks.get(snapshot_step, 0) + 1
            # The window widens on a repeat: the data (or the schedule) that led in lasted
            # longer than the batches skipped (PaLM skipped 200-500 at once). A stretch's
            # batches are behind the run already: the rollback itself discarded them.
            self.skip_batches = (0 if decision.cause == STRETCH
                                 else config.rollback_skip_batches * 2 ** min(n - 1, 10))
            self.window_spiked = False

    def _track_stretch(self, step: int, decision: Decision, config: SentinelConfig,
                       evidence: Evidence) -> None:
        """Open, mark or close the stretch of low loss (:attr:`stretch`, :func:`reading`):
        opened by a step below the band (or collapsed), marked by a collapse; closed by a
        rollback, by the recovery's end, by its first ``rollback_check_steps`` steps back in
        band (unmarked, a dip of the loss as a fast descent makes: the first), or unmarked
        after ``max_lost_steps`` steps (``spike_window`` without a bound)."""
        if config.collapse_action != "rollback":
            return
        out, learned, _ = reading(evidence, config)
        stretch = self.stretch
        if decision.action == ROLLBACK or decision.cause == RECOVERY_OVER:
            self.stretch = None
        elif out:
            if stretch is None:
                stretch = self.stretch = [step, 0, 0]
            stretch[1], stretch[2] = int(stretch[1] or learned), 0
        elif stretch is not None:
            stretch[2] += 1
            if not stretch[1] or stretch[2] >= max(1, config.rollback_check_steps):
                self.stretch = None
        if self.stretch is not None and not self.stretch[1] and \
                step - self.stretch[0] >= (config.max_lost_steps or config.spike_window):
            self.stretch = None

    def returning(self) -> bool:
        """A marked stretch is open: its return is judged."""
        return self.stretch is not None and bool(self.stretch[1])

    def _account(self, decision: Decision, config: SentinelConfig, evidence: Evidence) -> None:
        """Count the steps a recovery leaves unapplied, and check what a rollback did: the
        loss back in its normal band (``evidence.near``) within ``rollback_check_steps``, or
        the snapshot is marked failed."""
        self.retry = False
        if decision.cause == RECOVERY_OVER:
            self.lost, self.skip_batches, self.watch = 0, 0, None
            self.spike_streak = 0
        if self.watch is not None and decision.action != ROLLBACK:
            if evidence.near:
                self.watch = None
            elif evidence.spikes:  # the restored state meets batches it cannot fit: the
                pass               # data's (it lasts), not the snapshot's: the check waits
            else:
                self.watch[1] -= 1
                if self.watch[1] <= 0:
                    if self.watch[0] not in self.failed:
                        self.failed.append(self.watch[0])
                    self.retry_stretch = len(self.watch) > 2 and bool(self.watch[2])
                    self.watch, self.retry = None, True
        target = evidence.snapshot_step
        if decision.applies:
            self.applied += 1
        elif decision.action == ROLLBACK and target is not None:
            undone = self.undone(target)
            self.lost += undone + 1
            self.applied -= undone
            if config.rollback_check_steps:
                self.watch = [target, config.rollback_check_steps,
                              int(decision.cause == STRETCH)]
        elif not decision.stops:
            self.lost += 1


def struck_hosts(view: ClusterView, decision: Decision, evidence: Evidence) -> list[str]:
    """Hosts that earn a strike at this step: :func:`blamed_hosts`, or, where a finite
    replica repaired a poisoned state, the hosts whose memory held it alone (a hardware
    suspect): the ranks it only reached are not struck (FSDP's all-gather carries one rank's
    poisoned shard into its whole shard group's forward). Where every replica was poisoned
    the cause is the checkpoint or the numbers, and no host is struck for the state."""
    state = evidence.state
    if state is not None and state.repairable and not decision.stops:
        return state.bad_hosts
    return blamed_hosts(view, decision, evidence.verdict)


def blamed_hosts(view: ClusterView, decision: Decision, verdict: str | None = None) -> list[str]:
    """Hosts that earn a strike: those with a bad rank, but only while some host is healthy,
    and not when a replay found the data (or a global divergence) to blame.

    When every host is bad the cause is global (learning rate, model, overflow), not a host,
    and excluding hosts one by one would only shrink the job.
    """
    bad = set(decision.bad_hosts)
    if not bad or view.every_host_bad or verdict in ("data", "divergence"):
        return []
    return sorted(bad)


#: The kinds a rank is blamed for, without and with GradScaler (a detection may ask 131,072
#: times: no set is built per rank).
_BLAMED = frozenset(ALL_KINDS)
_AMP_BLAMED = frozenset(("batch", "loss", ACTIVATION, BUFFER))


def is_blamed(rank: RankHealth, *, amp: bool = False) -> bool:
    """A rank the step blames. Under AMP, non-finite gradients alone are GradScaler's fp16
    overflow, not a fault; a batch quarantined earlier (verdict data) is skipped, not blamed a
    second time; a rank a non-finite value only reached from another rank (a pipeline
    boundary, a collective in the forward: origins.py) is named, not blamed. (``schema.pack``
    computes the same flag on the device, before the forward collectives are weighed.)"""
    kinds = _AMP_BLAMED if amp else _BLAMED
    return not (rank.quarantined or rank.reached or kinds.isdisjoint(rank.kinds))


def blamed(view: ClusterView, *, amp: bool = False) -> tuple[RankHealth, ...]:
    """The ranks a step blames (see :func:`is_blamed`), by rank."""
    return tuple(r for r in view.flagged if is_blamed(r, amp=amp))


@dataclasses.dataclass(frozen=True, slots=True)
class Evidence:
    """What a step's decision weighs beside the view, the same on every rank.

    Args:
        amp: a loss scale is in use, so non-finite gradients alone are fp16 overflow that the
            scaler handles by skipping and lowering its scale, not a rank's fault.
        spikes: loss / gradient-norm spikes of this step.
        verdict: the replay verdict, when a replay ran.
        snapshot_step: the step of the snapshot a rollback would restore (None: none yet).
        near: the cluster's loss is in its normal band (a rollback's check, issue 60).
        quiet: no rank and not the cluster mean is even half-way to a spike on any signal
            (the batches after a rollback that spiked against it have ended: ``data_back``);
            judged only while ``History.window_spiked`` (True elsewhere, where nothing
            reads it).
        low: the cluster's loss is below its normal band (a stretch of degenerate data
            begins or lasts, issue 70).
        relative: the cluster's loss over the level saved with the snapshot a rollback would
            restore (the one before the stretch in progress, issue 70); None: no level.
        state: what the ranks hold that is not finite, where the state was examined and
            something was found (an incident, a snapshot about to be kept: rare/state.py).
        hyper: this rank's non-finite hyperparameters, in words (the reason of their skip).
    """

    amp: bool = False
    spikes: Spikes | None = None
    verdict: str | None = None
    snapshot_step: int | None = None
    near: bool = True
    quiet: bool = True
    low: bool = False
    relative: float | None = None
    state: StateFindings | None = None
    hyper: str = ""


def requested_stop(totals: Totals) -> int:
    """The signal every rank stops for after this step, from the summed stop requests (the
    same sums on every rank, so the same answer): SIGTERM (a scheduler's time limit or
    ``scancel``) before SIGINT; 0 when no rank was asked to stop. The step itself is decided
    as ever (a stop request is not a fault): the loop gets to checkpoint its result, and the
    next sentinel call ends the process (effects/stop.py)."""
    if totals.stop_term > 0:
        return int(signal.SIGTERM)
    if totals.stop_int > 0:
        return int(signal.SIGINT)
    return 0


def decide(view: ClusterView, history: History, config: SentinelConfig,
           evidence: Evidence = Evidence()) -> Decision:
    """Decide ``apply | skip | overflow | rollback | abort | exclude | drop`` for one step,
    from the cluster view (the same on every rank), the history before it (not modified
    here), the config and the step's :class:`Evidence`."""
    spikes, snapshot_step = evidence.spikes, evidence.snapshot_step
    bad = blamed(view, amp=evidence.amp)
    overflow = evidence.amp and view.totals.bad_grad > 0
    if evidence.state is not None:
        return _poisoned_state(view, bad, history, config, evidence, overflow)
    if bad:
        return _nonfinite(view, bad, history, config, evidence, overflow)
    if view.quarantined:
        return Decision(SKIP, (), "a quarantined batch came round again", QUARANTINE, overflow)
    if view.totals.dropped:  # withheld gradients are never applied as they are
        return Decision(SKIP, (), "gradients left out of the reduction on a rank not blamed",
                        NONFINITE, overflow)
    if view.totals.bad_hyper or view.totals.bad_buffer:
        return _unapplicable(view, history, config, evidence, overflow)
    if history.retry and snapshot_step is not None and snapshot_step not in history.failed:
        return _rollback(history, config, Decision(
            SKIP, (), f"the rollback to step {history.failed[-1]} did not bring the loss back "
            f"into its band within {config.rollback_check_steps} steps",
            STRETCH if history.retry_stretch else SPIKE, overflow), snapshot_step)
    if history.returning() and snapshot_step is not None and history.stretch is not None:
        stretched = _stretch(view, history, config, evidence, overflow)
        if stretched is not None:
            return stretched
    if spikes:
        reason = "spike in " + ", ".join(spikes.signals())
        if history.skip_batches > 0:  # discarded anyway: no rollback over a rollback
            return _bounded(history, config, Decision(
                SKIP, (), f"{reason}, in a batch discarded after a rollback "
                f"({history.skip_batches} left)", AFTER_ROLLBACK, overflow))
        action = _most_severe(spikes, config)
        if action == "rollback" and spikes.in_data:  # the batch changed: nothing to repair
            return _bounded(history, config, Decision(
                SKIP, (), f"{reason}, with a batch far from its running norm: the data's, not "
                "the weights'; skipped, not rolled back", SPIKE, overflow))
        streak = history.spike_streak + 1
        if action == "rollback" and streak < config.spike_patience:
            return _bounded(history, config, Decision(
                SKIP, (), f"{reason}: {streak} of {config.spike_patience} in a row before a "
                "rollback (spike_patience)", SPIKE, overflow))
        if action == "rollback":
            return _rollback(history, config, Decision(SKIP, (), reason, SPIKE, overflow),
                             snapshot_step)
        if action == "skip":
            skip = Decision(SKIP, (), reason, SPIKE, overflow)
            if history.consecutive_skips >= config.max_consecutive_skips and not spikes.in_data:
                # Every step spiking against a level the run has left: skipping cannot end
                # it, as a skipped step changes nothing (issue 60: nothing skips forever).
                return _over(skip, config, f"{reason}; {history.consecutive_skips} steps "
                             f"skipped in a row (max_consecutive_skips="
                             f"{config.max_consecutive_skips})")
            return skip
    if history.skip_batches > 0:
        if history.window_spiked and evidence.near and evidence.quiet:
            # The batches that spiked against the restored state are behind the run: what
            # is left of the window is real data (a stretch of degenerate data that ended).
            return Decision(OVERFLOW if overflow else APPLY, (), (
                "the loss is back near the level of the state restored, after the batches "
                "discarded since the rollback spiked against it: the data that led in has "
                f"ended, and the {history.skip_batches} batch(es) left of the window apply"),
                DATA_BACK, overflow)
        return _bounded(history, config, Decision(
            SKIP, (), f"discarding batches after a rollback ({history.skip_batches} left)",
            AFTER_ROLLBACK, overflow,
        ))
    if spikes is not None and spikes.collapsed and config.collapse_action == "skip":
        return _bounded(history, config, Decision(
            SKIP, (), "collapse in " + ", ".join(spikes.collapsed), COLLAPSE, overflow))
    return Decision(OVERFLOW if overflow else APPLY, (), overflow=overflow)


def reading(evidence: Evidence, config: SentinelConfig) -> tuple[bool, bool, bool]:
    """What one step says of a stretch of degenerate data (issue 70): ``(low, collapsed,
    worse)``. ``low``: the loss is below its band or some signal collapsed (the stretch
    begins or lasts); ``collapsed``: the weights fit an easy target (it is marked);
    ``worse``: back from below, the loss is :func:`~nansentinel.decide.spikes.above` the
    level the stretch went in at (``evidence.relative``, by the loss's spike ratio)."""
    spikes = evidence.spikes
    collapsed = spikes is not None and bool(spikes.collapsed)
    low = evidence.low or collapsed
    return low, collapsed, not low and above(evidence.relative,
                                             config.loss_spike_ratio or config.spike_ratio)


def _stretch(view: ClusterView, history: History, config: SentinelConfig, evidence: Evidence,
             overflow: bool) -> Decision | None:
    """A marked stretch (``collapse_action="rollback"``) judged at this step: its return came
    back :func:`reading` worse than the level it went in at (a rollback to the snapshot before
    it, its batches discarded by it), or it has lasted longer than a rollback may undo within
    ``max_lost_steps`` (the recovery ends: the run goes on from here). None: neither."""
    assert history.stretch is not None and evidence.snapshot_step is not None
    start, _, back = history.stretch
    target = evidence.snapshot_step
    if reading(evidence, config)[2]:
        return _rollback(history, config, Decision(
            SKIP, (), f"the loss came back from the degenerate stretch of steps {start}-"
            f"{view.step - back - 1} (dated from the step it left its band) at "
            f"{evidence.relative:.2f}x the level before it (the snapshot of step {target})",
            STRETCH, overflow), target)
    bound = config.max_lost_steps
    if bound and history.lost + history.undone(target) + 1 > bound:
        return _over(Decision(SKIP, (), "", STRETCH, overflow), config, (
            f"the degenerate stretch from step {start} has lasted longer than a rollback to "
            f"step {target} may undo (max_lost_steps={bound})"))
    return None


def _over(skip: Decision, config: SentinelConfig, why: str) -> Decision:
    """The recovery ends at this step: it applies (the steps go on from here, the references
    restart), or every rank aborts under ``policy="abort"``."""
    if config.policy == "abort":
        return dataclasses.replace(skip, action=ABORT, reason=f"{why}: aborting (policy is abort)")
    return dataclasses.replace(
        skip, action=OVERFLOW if skip.overflow else APPLY, cause=RECOVERY_OVER,
        reason=f"{why}: the recovery ends, this step and the next apply and the spike "
               "references restart from here")


def _bounded(history: History, config: SentinelConfig, skip: Decision, cost: int = 1
             ) -> Decision:
    """``skip`` (a step the recovery leaves unapplied, costing ``cost`` steps), unless that
    takes the recovery past ``max_lost_steps``: then it ends."""
    bound = config.max_lost_steps
    if bound and history.lost + cost > bound:
        return _over(skip, config, f"{skip.reason}; the recovery has left {history.lost} steps "
                     f"unapplied, and this would take it past max_lost_steps={bound}")
    return skip


def _most_severe(spikes: Spikes, config: SentinelConfig) -> str:
    actions = [
        config.loss_spike_action if s == "loss" else config.grad_spike_action
        for s in spikes.signals()
    ]
    return max(actions, key=_SEVERITY.__getitem__)


def _nonfinite(
    view: ClusterView, bad: tuple[RankHealth, ...], history: History, config: SentinelConfig,
    evidence: Evidence, overflow: bool,
) -> Decision:
    verdict = evidence.verdict
    provisional = Decision(SKIP, bad, cause=NONFINITE, overflow=overflow)
    excluding = _excluding(provisional, blamed_hosts(view, provisional, verdict), history,
                           config, view.step)
    if excluding is not None:
        return excluding
    if config.policy == "abort":
        return dataclasses.replace(provisional, action=ABORT, reason="policy is abort")
    if history.skip_batches > 0:  # discarded anyway: not one more rollback, nor a skip streak
        return dataclasses.replace(
            provisional, cause=AFTER_ROLLBACK,
            reason=f"in a batch discarded after a rollback ({history.skip_batches} left)")
    kept = dropping(view, bad, history, config, verdict=verdict, overflow=overflow)
    if kept is not None:  # applied: before the escalation of consecutive skips
        left_out = ", ".join(str(r) for r in provisional.bad_ranks)
        return dataclasses.replace(
            provisional, action=DROP, kept=kept, overflow=False,
            reason=f"rank(s) {left_out} left out of the reduction: the step applied from "
                   f"the other {kept} ranks' gradients")
    if history.consecutive_skips >= config.max_consecutive_skips:
        return dataclasses.replace(
            provisional,
            action=ABORT,
            reason=(
                f"{history.consecutive_skips} steps skipped in a row "
                f"(max_consecutive_skips={config.max_consecutive_skips})"
            ),
        )
    if config.policy == "rollback":
        return _rollback(history, config, dataclasses.replace(
            provisional, reason="policy is rollback"), evidence.snapshot_step)
    return provisional


def _excluding(provisional: Decision, hosts: list[str], history: History,
               config: SentinelConfig, step: int) -> Decision | None:
    """``provisional`` turned into the exclusion of every one of ``hosts`` that this step's
    strike brings to ``host_strikes`` (they leave together, with one rendezvous change), or
    None when none does."""
    leaving = [(host, n) for host in hosts
               if (n := history.strikes_within(host, step, config) + 1) >= config.host_strikes
               and host not in history.excluded]
    if not leaving:
        return None
    (host, strikes), *others = leaving
    return dataclasses.replace(
        provisional, action=EXCLUDE, exclude_host=host, strikes=strikes,
        also_exclude=tuple(others),
        reason="; ".join(exclusion_reason(h, n, config) for h, n in leaving))


def exclusion_reason(host: str, strikes: int, config: SentinelConfig) -> str:
    """Why ``host`` is excluded: its strikes within the window (each host's record says it)."""
    return f"host {host} blamed {strikes} times within {config.strike_window} steps"


def _unapplicable(view: ClusterView, history: History, config: SentinelConfig,
                  evidence: Evidence, overflow: bool) -> Decision:
    """A step no rank is blamed for that cannot apply: a non-finite optimizer hyperparameter
    (a schedule's NaN, the same on every rank: nobody's host), or floating buffers that only
    arrived non-finite. Skipped on every rank (the device gate skips it on the device), and
    like any skip, stopped after ``max_consecutive_skips`` in a row: a schedule that keeps
    returning NaN is the user's to fix."""
    totals = view.totals
    if totals.bad_hyper:
        what = evidence.hyper or f"on {totals.bad_hyper} of {view.world_size} rank(s)"
        reason, cause = (f"a non-finite optimizer hyperparameter ({what}): the step is skipped "
                         "on every rank, the hyperparameters are the schedule's to fix"), HYPER
    else:
        reason, cause = "floating buffers non-finite on arrival: the step is skipped", STATE
    skip = Decision(SKIP, (), reason, cause, overflow)
    if config.policy == "abort":
        return dataclasses.replace(skip, action=ABORT, reason=f"{reason}; policy is abort")
    if history.consecutive_skips >= config.max_consecutive_skips:
        return dataclasses.replace(skip, action=ABORT, reason=(
            f"{reason}; {history.consecutive_skips} steps skipped in a row "
            f"(max_consecutive_skips={config.max_consecutive_skips})"))
    return skip


def _poisoned_state(
    view: ClusterView, bad: tuple[RankHealth, ...], history: History, config: SentinelConfig,
    evidence: Evidence, overflow: bool,
) -> Decision:
    """A step at which some rank's weights, buffers or optimizer state held a non-finite value
    (``evidence.state``, the same on every rank). Where a finite replica holds every poisoned
    tensor, the state is repaired in place (step/judge.py) and the poisoned hosts struck: the
    step applies if its own numbers were finite (the state was found before a snapshot was
    kept), else it is skipped (or dropped) as any non-finite step. Where none does, the run
    rolls back to a snapshot (every snapshot kept was examined finite) not restored for a
    poisoned state before, or stops at once naming the tensors: no skip can end a poisoned
    state, so waiting ``max_consecutive_skips`` would only waste steps."""
    state = evidence.state
    assert state is not None
    what = f"the model's state is not finite: {state.describe()}"
    provisional = Decision(SKIP, bad, what, STATE, overflow)
    if config.policy == "abort":
        return dataclasses.replace(provisional, action=ABORT, reason=f"{what}; policy is abort")
    if state.repairable:
        # not the ranks it only reached (struck_hosts): the hosts that held it
        excluding = _excluding(provisional, state.bad_hosts, history, config, view.step)
        if excluding is not None:
            return dataclasses.replace(excluding, reason=f"{what}; {excluding.reason}")
        repaired = f"{what}; repaired from a finite replica"
        if not bad:
            return dataclasses.replace(provisional, action=OVERFLOW if overflow else APPLY,
                                       reason=f"{repaired}, then the step applied")
        nonfinite = _nonfinite(view, bad, history, config, evidence, overflow)
        if nonfinite.action == ROLLBACK:  # repaired: nothing to roll back to
            nonfinite = dataclasses.replace(nonfinite, action=SKIP, reason="")
        return dataclasses.replace(nonfinite, cause=STATE, reason=(
            f"{repaired}; {nonfinite.reason}" if nonfinite.reason else
            f"{repaired}; the step's own values were poisoned by it: skipped"))
    why = f" ({state.why})" if state.why else ""
    target = evidence.snapshot_step
    if target is not None and target not in history.failed and \
            target not in history.state_restored:
        done = history.rollbacks.get(target, 0)
        if done < config.max_rollbacks:
            return dataclasses.replace(provisional, action=ROLLBACK, reason=(
                f"{what}; no replica holds a finite copy{why}: restoring step {target}, whose "
                "whole state was finite"))
    kept = ("and the snapshot kept was restored for it before" if target is not None
            else "and no snapshot is kept")
    return dataclasses.replace(provisional, action=ABORT, reason=(
        f"{what}; no replica holds a finite copy{why} {kept}: restore another checkpoint"))


def max_dropped_ranks(world_size: int, fraction: float) -> int:
    """The most ranks one step may leave out under ``policy="drop"``: ``fraction`` of the
    world, rounded down, and at least one."""
    return max(1, math.floor(fraction * world_size + 1e-9))


def dropping(
    view: ClusterView, bad: tuple[RankHealth, ...], history: History, config: SentinelConfig,
    *, verdict: str | None, overflow: bool,
) -> int | None:
    """The ranks a ``policy="drop"`` step averages over, or None: skip it instead.

    A step is dropped when the ranks left out of its reduction (``totals.dropped``, each named
    by the detection) are every blamed rank, at most ``max_dropped`` of the world and not all
    of it, and the cause is not global (a ``divergence`` verdict). A blamed rank that was not
    left out had finite batch and loss: its NaN was made inside the backward, after some of its
    buckets were summed into everyone's gradients, so the step is skipped (drop.py). Batches to
    discard after a rollback are discarded. ``overflow``: non-finite gradients under GradScaler;
    if some came from a kept rank the reduced gradients overflowed, and the step is skipped."""
    n = view.totals.dropped
    if config.policy != "drop" or not n or verdict == "divergence" or history.skip_batches:
        return None
    left_out = [r for r in view.flagged if r.dropped]
    if len(left_out) != n or n >= view.world_size:
        return None
    if n > max_dropped_ranks(view.world_size, config.max_dropped):
        return None
    if any(not r.dropped for r in bad):
        return None
    if overflow and view.totals.bad_grad > sum("grad" in r.kinds for r in left_out):
        return None
    return view.world_size - n


def _rollback(history: History, config: SentinelConfig, skip: Decision,
              snapshot_step: int | None) -> Decision:
    """A rollback to the snapshot at ``snapshot_step``, in place of ``skip`` (the step's
    skip: its blamed ranks, reason, cause and overflow)."""
    finite = skip.cause in (SPIKE, STRETCH)  # the step's own numbers could apply
    if snapshot_step is None:
        return dataclasses.replace(skip, reason=f"{skip.reason}, but no snapshot yet: skipped")
    if snapshot_step in history.failed and not finite:
        return dataclasses.replace(skip, reason=f"{skip.reason}; the snapshot of step "
                                   f"{snapshot_step} did not help before: skipped")
    if snapshot_step in history.failed:
        return _over(skip, config, f"{skip.reason}; the last rollback to the snapshot of step "
                     f"{snapshot_step} did not bring the loss back within "
                     f"{config.rollback_check_steps} steps, and no older snapshot is kept")
    if finite:
        bounded = _bounded(history, config, skip, history.undone(snapshot_step) + 1)
        if bounded is not skip:
            return bounded
    bound, cost = config.max_lost_steps, history.undone(snapshot_step) + 1
    if not finite and bound and history.lost + cost > bound:
        # A non-finite step cannot apply: the recovery that would pass its bound stops.
        return dataclasses.replace(skip, action=ABORT, reason=(
            f"{skip.reason}; the recovery has left {history.lost} steps unapplied, and a "
            f"rollback to step {snapshot_step} would take it past max_lost_steps={bound}"))
    done = history.rollbacks.get(snapshot_step, 0)
    if done >= config.max_rollbacks:
        return dataclasses.replace(
            skip, action=ABORT,
            reason=f"{done} rollbacks to the snapshot of step {snapshot_step} did not help "
                   f"(max_rollbacks={config.max_rollbacks})")
    which = ("the oldest snapshot kept from before it" if skip.cause == STRETCH
             and history.returning() else "the newest snapshot kept")
    return dataclasses.replace(
        skip, action=ROLLBACK,
        reason=f"{skip.reason}: restoring step {snapshot_step} ({which}"
               + (f"; not restored: {', '.join(map(str, history.failed))}" if history.failed
                  else "") + ")")
