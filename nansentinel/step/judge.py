"""The host side of a step: from its exchanged vector to a decision, and the decision's acts.

::

    totals ─[flagged or spiking: detection.view]─ view ─ spikes ─ evidence (naming, replay)
          └─ policy.decide (pure) ─ history ─ act: optimizer step | discard + buffers + scaler
             | rollback | drop: rescale, then step ─ incident ─ tail: snapshot, replica check,
             metrics

A healthy step reads the totals and acts: one decision, one optimizer step, a few counters.
What only a detection needs lives in detection.py; what the decision is, in policy.py.
:meth:`StepJudge.decide` takes a step's record to ``DECIDED`` and :meth:`StepJudge.finish` to
``DONE`` (step/record.py): apart, because on the device gate a step decided by a read of its
result on one rank must leave its collectives (the replica check, a snapshot) for the next
sentinel call, where every rank runs them (gate.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from nansentinel.checks.buffers import FloatingBuffers
from nansentinel.checks.health import LocalHealth
from nansentinel.checks.state import (
    StateFindings,
    describe_hyperparameters,
    poisoned_hyperparameters,
)
from nansentinel.decide.policy import (
    DATA_BACK,
    DROP,
    HYPER,
    RECOVERY_OVER,
    ROLLBACK,
    STATE,
    STRETCH,
    Decision,
    Evidence,
    History,
    blamed,
    decide,
    reading,
    requested_stop,
)
from nansentinel.decide.spikes import SpikeDetector, Spikes
from nansentinel.effects import drop, scaling
from nansentinel.effects.learning_rate import LearningRates, Saved
from nansentinel.effects.recovery import SnapshotRing, SnapshotStore
from nansentinel.rare import samples as skip_list
from nansentinel.rare.detection import Detector
from nansentinel.rare.incident import Case
from nansentinel.rare.replicas import ReplicaCheck
from nansentinel.rare.state import StateCheck
from nansentinel.result import BUFFER, StepResult
from nansentinel.step.record import Stage, StepRecord
from nansentinel.wire.context import Context
from nansentinel.wire.schema import OwnRow, Totals
from nansentinel.wire.view import ClusterView

log = logging.getLogger("nansentinel")

@dataclasses.dataclass(frozen=True, slots=True)
class Stepping:
    """What a decided step acts on.

    Args:
        optimizer: stepped when a step applies (DeepSpeed: the engine's step).
        scaler: a GradScaler (or DeepSpeed's loss scale), stepped and updated with it.
        buffers: the floating buffers, put back when a step is not applied.
        snapshots: the last good state, for rollbacks (None: none kept).
        replicas: the replica fingerprint check, after the optimizer step (None: none).
        state: reads the model's whole state on an incident and before a snapshot is kept,
            and repairs it from a finite replica (rare/state.py; None: never read).
    """

    optimizer: torch.optim.Optimizer
    scaler: Any
    buffers: FloatingBuffers
    snapshots: SnapshotStore | None = None
    replicas: ReplicaCheck | None = None
    state: StateCheck | None = None


class StepJudge:
    """Decides each step on this rank, from the same numbers as every other rank, and acts.

    Owns what the decision remembers and saves with the checkpoint (the policy history, the
    spike references, the rollback cooldown; the quarantine is the detector's).

    Args:
        ctx: the run. stepping: what a decided step acts on. detector: the rare path.
        spikes: the spike references (the step in progress reads their thresholds too).
    """

    def __init__(self, ctx: Context, stepping: Stepping, detector: Detector,
                 spikes: SpikeDetector) -> None:
        self.ctx, self.config = ctx, ctx.config
        self.world_size, self.rank = ctx.world_size, ctx.rank
        self.optimizer, self.scaler = stepping.optimizer, stepping.scaler
        self.buffers, self.snapshots = stepping.buffers, stepping.snapshots
        self.replicas, self.state = stepping.replicas, stepping.state
        self.detector, self.spikes = detector, spikes
        self.quarantine, self.curves = detector.quarantine, detector.curves
        self.guarded = ctx.guarded
        self.history = History()
        #: The learning rate each group steps at: the rollback's backoff and the rules that
        #: keep an untried rate off the weights (effects/learning_rate.py).
        self.lr = LearningRates(stepping.optimizer, self.config, spikes, rank=self.rank,
                                report=self._lr_report)
        self.cooldown = self.lr.cooldown
        self.metrics: Any = None
        self._after_step: tuple[Saved | None, ClusterView] | None = None
        self._post_hook: Any = None
        #: The spike references as they were when the snapshot was kept: a rollback puts them
        #: back, so the steps after it are judged against what that state was known to do.
        self._anchors: dict[int, dict[str, Any]] = {}
        #: The cluster's loss at the snapshot last restored (its level, for the check).
        self._level: float | None = None
        #: The step whose whole state was last read finite (or repaired): its snapshot needs
        #: no second read.
        self._finite_at: int | None = None
        #: The replica fingerprints found a non-finite value: the next step reads the state.
        self._read_state = False
        #: This rank's sample ids of the stretch of low loss in progress (issue 70).
        self._stretch: list[Any] = []

    @property
    def amp(self) -> bool:
        return self.ctx.amp

    def needs_detection(self, totals: Totals) -> bool:
        """The step flagged a rank or the cluster mean spiked: naming it takes collectives."""
        return totals.flagged > 0 or self.spikes.cluster_spikes(totals)

    def decide(self, record: StepRecord, *, optimizer_step: bool = True) -> None:
        """Decide one step and act on it (optimizer, buffers, scaler, rollback, report):
        ``LAUNCHED``/``READ`` -> ``DECIDED``, with the record's view, decision and result.
        On the device gate (``record.gated``) the optimizer step already ran on the device."""
        started = time.perf_counter()
        local, values = record.local, record.read()
        if record.stage is Stage.LAUNCHED:
            record.to(Stage.READ)
        totals, own = Totals.from_values(values), OwnRow.from_values(values)
        view = ClusterView(record.index, self.world_size, totals)
        if self.needs_detection(totals):
            with self.guarded():
                view = self.detector.view(record.index, totals, own, self.spikes.ratios(own),
                                          local.forward_groups, batch=local.batch)
        spikes = self.spikes.judge(view)
        self.spikes.record(own, totals, spikes)
        self.curves.add(record.index, own, totals)
        bad = blamed(view, amp=self.amp)
        state = record.state = self._examine(view, own, bad, record)
        verdict, detail = (STATE, self.detector.naming(bad, record.kept)) if state else \
            self.detector.evidence(
                view, bad, spikes, batch=local.batch, kept=record.kept,
                discard=None if record.gated else self._discard_before_replay,
            ) if bad or spikes else (None, {})
        snapshot_step = self._snapshot_choice()
        evidence = Evidence(self.amp, spikes, verdict, snapshot_step,
                            near=self.spikes.near(totals, self._level),
                            # read only inside a window whose batches spiked (data_back):
                            # no pass over the signals on the other steps
                            quiet=not self.history.window_spiked or self.spikes.quiet(totals),
                            low=self.spikes.low(totals),
                            relative=self._relative(totals, snapshot_step),
                            state=state, hyper=self._hyper(totals, local))
        decision = decide(view, self.history, self.config, evidence)
        self.history.record(view, decision, self.config, evidence)
        discarded = self._stretch_ids(decision, evidence, local.ids)
        rolled_back_to, restored, not_ours = self._act(decision, view, own, record,
                                                       optimizer_step, snapshot_step)
        result = self._result(view, own, decision, evidence, (rolled_back_to, restored))
        if (decision.bad or spikes or spikes.collapsed or decision.action == ROLLBACK
                or decision.cause in (RECOVERY_OVER, STATE, HYPER)):
            result = self.detector.record(Case(view, decision, result, spikes, detail,
                                               local.batch, local.ids, discarded))
        record.view, record.decision, record.result = view, decision, result
        record.spent = local.seconds + time.perf_counter() - started - not_ours
        # The device gate stepped before the decision: its snapshot comes after the update.
        record.snapshot = decision.applies and optimizer_step and record.gated
        record.to(Stage.DECIDED)

    def finish(self, record: StepRecord, *, observe: bool = True) -> None:
        """What a decided step owes every rank together: the snapshot and the replica check
        (collectives, both), then its metrics (``DECIDED`` -> ``DONE``). The replica check may
        change the result and the decision (a divergence). ``observe=False``: a wider scope
        decides the step after the ranks, and observes it once, as decided there."""
        started = time.perf_counter()
        view, result, decision = record.view, record.result, record.decision
        assert view is not None and result is not None and decision is not None
        if record.snapshot:
            # The device gate stepped before the decision: the state it would keep is read
            # now, and a poisoned one is not kept (the next step finds it, as an incident).
            found = self.maybe_snapshot(view, applied_after=0)
            if found is not None:
                result = dataclasses.replace(result, poisoned_state=found.named(),
                                             state_action="not_kept")
        if self.replicas is not None and not decision.stops:  # after the optimizer step
            result, decision = self.replicas.check(view.step, result, decision, self.history)
            self._read_state = self.replicas.nonfinite  # the next step reads the state
        if observe and self.metrics is not None:
            self.metrics.observe_step(result, record.spent + time.perf_counter() - started)
        record.result, record.decision = result, decision
        record.to(Stage.DONE)

    def _examine(self, view: ClusterView, own: OwnRow, bad: tuple[Any, ...],
                 record: StepRecord) -> StateFindings | None:
        """The model's whole state, read on every rank where a NaN may have entered it (a
        rank blamed for a non-finite value, a non-finite floating buffer) or before a snapshot
        is kept (only a finite state is known-good; the device gate reads it after its update,
        in :meth:`finish`): the same condition on every rank, from the same view. A rank whose
        own buffers were non-finite puts back its copy first (what a skip would), so that what
        is read is what the step leaves. None: nothing non-finite, or nothing read."""
        if self.state is None:
            return None
        due = not record.gated and self._snapshot_due(view)
        asked, self._read_state = self._read_state, False
        if not (due or asked or bad or view.totals.bad_buffer):
            return None
        if not record.gated and BUFFER in own.kinds:
            self.buffers.restore()
        found = self.state.examine(view.step)
        if found is None or found.repairable:  # finite, or finite once repaired (_act)
            self._finite_at = view.step
        return found

    def _stretch_ids(self, decision: Decision, evidence: Evidence, ids: list[Any]
                     ) -> list[Any] | None:
        """This rank's sample ids of the stretch of low loss in progress (each of its steps'
        batches checked with ids, at most ``MAX_STRETCH_IDS``): kept while it lasts, handed
        to the skip list when a rollback undoes it (returned then), forgotten when it ends."""
        if decision.action == ROLLBACK and decision.cause == STRETCH:
            kept, self._stretch = self._stretch, []
            return kept
        if self.history.stretch is None:
            self._stretch = []
        elif reading(evidence, self.config)[0] and len(self._stretch) < skip_list.MAX_STRETCH_IDS:
            for _, batch_ids in ids:
                self._stretch.extend(skip_list.as_ids(batch_ids))
            del self._stretch[skip_list.MAX_STRETCH_IDS:]
        return None

    def _hyper(self, totals: Totals, local: LocalHealth) -> str:
        """The non-finite hyperparameters in words, where some rank had one: the first such
        rank's as its row left (the device gate decides at the next call, after the schedule
        wrote the next rate), on every rank (a rare path's two small collectives, every rank
        alike: the reason and rank 0's report name them where rank 0's own were finite)."""
        if not totals.bad_hyper:
            return ""
        mine, peers = local.hyper, self.ctx.peers
        if not mine and local.hyper_flag is not None and float(local.hyper_flag):
            # A tensor on the accelerator was read on the device only: named now (the rare
            # path's one read), as it stands now.
            mine = describe_hyperparameters(poisoned_hyperparameters(self.optimizer))
        with self.guarded():
            first = peers.min_ints([peers.rank if mine else peers.world_size])[0]
            if first == peers.world_size:
                return ""
            return str(peers.gather_from([first], mine).get(first, mine))

    def _snapshot_choice(self) -> int | None:
        """The snapshot a rollback would restore: the newest kept that a rollback has not
        already failed to bring the loss back from (``History.failed``); when every one has,
        the newest (the policy then ends the recovery); after a rollback that failed, only an
        older one. While a stretch of low loss lasts, only those from before it, and once it
        is marked the oldest of them (``History.stretch``, issue 70): the weights begin to
        learn degenerate rows before the loss leaves its band (a shard's rows mixed in, a
        batch memorised), so the newest snapshot before it can hold part of the damage."""
        snaps = self.snapshots
        if snaps is None:
            return None
        kept = snaps.steps if isinstance(snaps, SnapshotRing) else (
            [snaps.step] if snaps.step is not None else [])
        history = self.history
        if history.stretch is not None:
            kept = [s for s in kept if s < history.stretch[0]]
        if history.retry and history.failed:
            kept = [s for s in kept if s < history.failed[-1]]
        fresh = [s for s in kept if s not in history.failed]
        if history.returning() and fresh:
            return fresh[-1]
        return fresh[0] if fresh else (kept[0] if kept else None)

    def _relative(self, totals: Totals, snapshot_step: int | None) -> float | None:
        """The cluster's loss over the level saved with ``snapshot_step`` (the one a rollback
        would restore: from before the stretch in progress), or None."""
        anchor = self._anchors.get(snapshot_step) if snapshot_step is not None else None
        mean = totals.mean("loss")
        level = anchor["level"] if anchor is not None else None
        return mean / level if mean is not None and level else None

    def _act(self, decision: Decision, view: ClusterView, own: OwnRow, record: StepRecord,
             optimizer_step: bool, target: int | None = None
             ) -> tuple[int | None, int, float]:
        """The decision's acts: ``(rolled back to, buffers restored, optimizer seconds)``;
        ``target``: the snapshot a rollback restores. A poisoned state (``record.state``) is
        repaired from a finite replica where one holds every tensor of it."""
        state = record.state
        repair = state is not None and state.repairable and not decision.stops
        if repair and decision.applies:  # before the optimizer step reads it
            assert self.state is not None and state is not None
            self.state.repair(state)
        left_out = self._leave_out(decision, view, own)
        if decision.cause == RECOVERY_OVER:  # the run goes on from a level no snapshot knew
            self.spikes.reset()
        if decision.cause == DATA_BACK:  # the data led in, not the rate: no backoff for it
            if self.rank == 0:
                log.info("nansentinel: step %d: %s", view.step, decision.reason)
            self.lr.end_backoff(view.step, "the rollback was the data's doing (its batches "
                                "spiked against the restored state, and have ended)")
        if decision.applies and not optimizer_step:
            # The caller steps the optimizer right after: the snapshot is taken now, before
            # its update, and the cooldown undone from the optimizer's post-hook.
            self.maybe_snapshot(view)
            self._after_step = (self.lr.apply(view.step), view)
            if self._post_hook is None:  # once: a hook cannot remove itself while it runs
                self._post_hook = self.optimizer.register_step_post_hook(self._callers_step)
            return None, left_out, 0.0
        if decision.applies:
            if record.gated:  # the device gate has stepped already
                self.lr.count(view)
                return None, left_out, 0.0
            self.maybe_snapshot(view)
            started = time.perf_counter()
            with self.lr.stepping(view):
                if self.scaler is not None:
                    self.scaler.step(self.optimizer)
                    self.scaler.update()
                else:
                    self.optimizer.step()
            return None, left_out, time.perf_counter() - started
        restored = record.buffers if record.gated else self._discard(optimizer_step)
        if repair:  # after the buffers came back: a repaired buffer stays repaired
            assert self.state is not None and state is not None
            self.state.repair(state)
        rolled_back_to = None
        if decision.action == ROLLBACK and self.snapshots is not None:
            snaps = self.snapshots
            rolled_back_to = (snaps.load(target) if isinstance(snaps, SnapshotRing)
                              else snaps.load())
            if decision.cause not in (STATE, STRETCH):  # nor was the data the rate's doing
                self.lr.rolled_back()
            anchor = self._anchors.get(rolled_back_to)
            if anchor is not None:  # re-anchored: judged against what that state did
                self.spikes.load_state_dict(anchor["spikes"], self.rank)
                self._level = anchor["level"]
        return rolled_back_to, restored, 0.0

    def _leave_out(self, decision: Decision, view: ClusterView, own: OwnRow) -> int:
        """A dropped step, before the optimizer steps: the reduced gradients (the kept ranks'
        sum over the world) become their mean over the kept ranks, on every rank (drop.py);
        a rank left out puts back the floating buffers its own forward took the poisoned batch
        into. Returns the buffers restored (0 on any other step)."""
        if decision.action != DROP:
            return 0
        drop.rescale(self.optimizer, view.world_size / decision.kept)
        return self.buffers.restore() if own.dropped else 0

    def _discard_before_replay(self) -> None:
        """Free a blamed step's gradients before its replay, unless ``policy="drop"`` may
        still apply them: the replay then holds one more set of gradients."""
        if self.config.policy != "drop":
            self._discard_grads()

    def _discard(self, optimizer_step: bool) -> int:
        """A step not applied, on the host gate: the poisoned gradients go on every rank
        (weights never take them), the buffers come back, the scaler is settled; returns the
        buffers restored. (The device gate skipped on the device already.)"""
        self._discard_grads()
        restored = self.buffers.restore()
        if self.scaler is not None and not optimizer_step:
            scaling.record_skip(self.scaler, self.optimizer)  # the caller's scaler.step
        elif self.scaler is not None:
            scaling.settle(self.scaler)  # the next step's unscale_ must work
        return restored

    def _discard_grads(self) -> None:
        """Free the gradients of a step no policy applies (before its replay, too)."""
        self.optimizer.zero_grad(set_to_none=True)

    def caller_did_not_step(self) -> None:
        """``step(optimizer_step=False)`` came round again without the caller's optimizer
        step (its GradScaler skipped): undo the cooldown applied for it."""
        if self._after_step is not None:
            self.lr.undo(self._after_step[0], None)
            self._after_step = None

    def _callers_step(self, *_: Any) -> None:
        """Optimizer step post-hook for ``step(optimizer_step=False)``: undo the cooldown."""
        pending, self._after_step = self._after_step, None
        if pending is not None:
            self.lr.undo(pending[0], pending[1])

    def _snapshot_due(self, view: ClusterView) -> bool:
        """Whether a step that applies would keep its state as the last good one now: every
        ``snapshot_every`` steps, with snapshots kept, after a healthy, quiet step; not while
        batches are discarded after a rollback, nor while a collapse lasts (degenerate data:
        the weights learn an easy target) or the stretch of low loss around it is judged, nor
        while a rollback's effect is checked, nor just after a rollback before a clean step
        (the learning-rate rules)."""
        snaps, history = self.snapshots, self.history
        if snaps is None or history.skip_batches > 0 or history.stretch is not None or \
                history.watch is not None or not self.spikes.quiet(view.totals):
            return False
        if self.spikes.collapsing or not self.lr.may_snapshot():
            return False
        return snaps.step is None or view.step - snaps.step >= self.config.snapshot_every

    def maybe_snapshot(self, view: ClusterView, applied_after: int = 1
                       ) -> StateFindings | None:
        """Keep the state a healthy, quiet step was computed from as the last good one, when
        :meth:`_snapshot_due`: taken before the step's update (on the device gate, which steps
        before the decision, after it). A quiet step's own update can be the one that ruins the
        weights (a learning rate 100x too high from this step on: its loss and gradient norm
        were computed before it), so a snapshot after it would bring the spike straight back.
        The spike references go with it, for a rollback to put back. Its whole state was read
        finite just before (:meth:`_examine`, or here): a snapshot holding a non-finite tensor
        is never kept; what was found is returned then (None: kept, or not due)."""
        snaps = self.snapshots
        if snaps is None or not self._snapshot_due(view):
            return None
        if self.state is not None and self._finite_at != view.step:
            found = self.state.examine(view.step)
            if found is not None:
                if self.rank == 0:
                    log.error("nansentinel: step %d's snapshot not kept: the model's state is "
                              "not finite: %s", view.step, found.describe())
                return found
        if isinstance(snaps, SnapshotRing):
            snaps.save(view.step, stale=self.history.failed)
        else:
            snaps.save(view.step)
        self.lr.snapshot_taken()
        self.history.snapshot_kept(view.step, applied_after, self.config.snapshot_keep)
        self._anchors[view.step] = {"spikes": self.spikes.state_dict(),
                                    "level": self.spikes.level()}
        kept = set(snaps.steps if isinstance(snaps, SnapshotRing) else [view.step])
        self._anchors = {s: a for s, a in self._anchors.items() if s in kept}
        return None

    def _result(
        self, view: ClusterView, mine: OwnRow, decision: Decision, evidence: Evidence,
        acted: tuple[int | None, int],
    ) -> StepResult:
        """The step's result: ``acted`` is (the step rolled back to, buffers restored)."""
        (rolled_back_to, buffers_restored), verdict = acted, evidence.verdict
        spikes = evidence.spikes if evidence.spikes is not None else Spikes()
        state, kinds = evidence.state, decision.kinds
        bad_ranks, bad_hosts = decision.bad_ranks, decision.bad_hosts
        if state is not None:
            # Blame goes to the ranks that held the poisoned state: a NaN in one rank's FSDP
            # shard reaches every rank's loss through the all-gather, and only its holder is
            # at fault. A rank whose own batch was non-finite beside it keeps its blame.
            batch = [r for r in decision.bad if "batch" in r.kinds]
            bad_ranks = sorted({*state.ranks, *(r.rank for r in batch)})
            bad_hosts = sorted({*state.bad_hosts, *(r.identity.hostname for r in batch)})
            kinds = [*kinds, STATE]
        if view.totals.bad_hyper:
            kinds = [*kinds, HYPER]
        return StepResult(
            step=view.step, applied=decision.applies, outcome=decision.outcome,
            bad_ranks=bad_ranks, bad_hosts=bad_hosts, kinds=kinds,
            local_kinds=_local_kinds(mine, state, self.rank), local_loss=mine.loss,
            local_grad_norm=mine.grad_norm,
            consecutive_skips=self.history.consecutive_skips, injected=view.injected,
            overflow=decision.overflow, excluded_hosts=list(self.history.excluded),
            verdict=verdict, spikes={k: list(v) for k, v in spikes.ranks.items()},
            local_spikes=[*spikes.of_rank(self.rank), *(["batch"] if mine.spike_batch else [])],
            quarantined=view.quarantined,
            rolled_back_to=rolled_back_to, lr_factor=self.cooldown.lr_factor,
            lr_held=self.lr.held_at(view.step),
            reason=decision.reason, reached=view.reached, buffers_restored=buffers_restored,
            collapsed=dict(spikes.collapsed),
            recovery=(self.history.recovery(self.config) if self.history.lost
                      or self.history.failed or not decision.applies
                      or decision.cause == RECOVERY_OVER else {}),
            stop_signal=requested_stop(view.totals),
            poisoned_state=state.named() if state is not None else {},
            state_action=_state_action(state, decision),
        )

    # --- what the checkpoint keeps -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.history.state_dict(),
            "spikes": self.spikes.state_dict(),
            "cooldown": self.cooldown.state_dict(),
            "lr_guard": self.lr.state_dict(),
            "quarantine": self.quarantine.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        self.history = History.from_state_dict(state)
        if "spikes" in state:
            self.spikes.load_state_dict(state["spikes"], self.rank)
        if "cooldown" in state:
            self.cooldown.load_state_dict(state["cooldown"])
        if "lr_guard" in state:
            self.lr.load_state_dict(state["lr_guard"])
        self.quarantine.load_state_dict(state.get("quarantine", []), step)

    def _lr_report(self, step: int, content: dict[str, Any]) -> str | None:
        """A held learning-rate jump's incident report (rank 0), where reports go."""
        path = self.detector.incidents.write_report(step, "-lr", content)
        return str(path) if path is not None else None


def _local_kinds(mine: OwnRow, state: StateFindings | None, rank: int) -> list[str]:
    """This rank's kinds: its row's, and the kinds of its own state found non-finite."""
    kinds = list(mine.kinds)
    for p in state.poisoned.get(rank, []) if state is not None else []:
        if p.kind not in kinds:
            kinds.append(p.kind)
    return kinds


def _state_action(state: StateFindings | None, decision: Decision) -> str:
    """What became of a poisoned state at this step (``StepResult.state_action``)."""
    if state is None:
        return ""
    if decision.stops:
        return str(decision.outcome)
    if state.repairable:
        return "repaired"
    return "rolled_back" if decision.action == ROLLBACK else "not_repaired"
