"""The decision as a pure function of view, history and config."""

from __future__ import annotations

from nansentinel.checks.state import Poisoned, StateFindings
from nansentinel.config import SentinelConfig
from nansentinel.decide.policy import (
    ABORT,
    APPLY,
    DATA_BACK,
    EXCLUDE,
    OVERFLOW,
    RECOVERY_OVER,
    ROLLBACK,
    SKIP,
    STRETCH,
    Decision,
    Evidence,
    History,
    decide,
)
from nansentinel.decide.spikes import CLUSTER, Spikes
from nansentinel.result import RankIdentity
from nansentinel.wire.schema import Totals
from nansentinel.wire.view import ClusterView, RankHealth

HOSTS = ["n0", "n0", "n1", "n1"]


def view(step: int, bad: dict[int, tuple[str, ...]]) -> ClusterView:
    """The view a detection builds: the totals, and the bad ranks by name."""
    rows = tuple(
        RankHealth(RankIdentity(r, r % 2, 4, HOSTS[r], "cpu"), bad[r], False, 1.0, 1.0)
        for r in sorted(bad)
    )
    count = {k: sum(k in kinds for kinds in bad.values()) for k in ("batch", "loss", "grad")}
    totals = Totals(bad_batch=count["batch"], bad_loss=count["loss"], bad_grad=count["grad"],
                    blamed=len(bad), flagged=len(bad), flagged_rank=float(sum(bad)))
    every_host_bad = bool(bad) and {HOSTS[r] for r in bad} == set(HOSTS)
    return ClusterView(step, len(HOSTS), totals, rows, rows, every_host_bad=every_host_bad)


def test_healthy_applies_and_bad_skips_naming_rank_and_host() -> None:
    cfg = SentinelConfig(host_strikes=99)
    assert decide(view(0, {}), History(), cfg).action == APPLY
    d = decide(view(0, {2: ("grad",)}), History(), cfg)
    assert d.action == SKIP and d.bad_ranks == [2] and d.bad_hosts == ["n1"] and d.kinds == ["grad"]


def test_abort_policy_and_escalation() -> None:
    bad = view(3, {1: ("loss",)})
    assert decide(bad, History(), SentinelConfig(policy="abort", host_strikes=99)).action == ABORT
    cfg = SentinelConfig(max_consecutive_skips=2, host_strikes=99)
    h = History()
    actions = []
    for step in range(4):
        d = decide(view(step, {1: ("loss",)}), h, cfg)
        h.record(view(step, {1: ("loss",)}), d, cfg)
        actions.append(d.action)
    assert actions == [SKIP, SKIP, ABORT, ABORT]
    d = decide(view(9, {}), h, cfg)
    h.record(view(9, {}), d, cfg)
    assert h.consecutive_skips == 0


def test_amp_overflow_is_not_blamed_but_bad_loss_is() -> None:
    cfg = SentinelConfig()
    d = decide(view(0, {1: ("grad",)}), History(), cfg, Evidence(amp=True))
    assert d.action == OVERFLOW and d.overflow and d.bad_ranks == []
    d = decide(view(0, {1: ("loss", "grad")}), History(), cfg, Evidence(amp=True))
    assert d.action == SKIP and d.bad_ranks == [1] and d.kinds == ["loss", "grad"]


def test_strikes_within_window_exclude_a_host_but_never_the_only_one() -> None:
    cfg = SentinelConfig(host_strikes=2, strike_window=10)
    h = History()
    seq = []
    for step in (0, 20, 25):  # step 0 falls out of the window before step 20
        v = view(step, {3: ("batch",)})
        d = decide(v, h, cfg)
        h.record(v, d, cfg)
        seq.append(d.action)
    assert seq == [SKIP, SKIP, EXCLUDE] and h.excluded == ["n1"]
    # Every host bad: global divergence, nobody is struck.
    h2 = History()
    v = view(0, {0: ("loss",), 2: ("loss",)})
    d = decide(v, h2, cfg)
    h2.record(v, d, cfg)
    assert h2.strikes == {}


def test_every_host_that_reaches_its_strikes_at_one_step_leaves_at_that_step() -> None:
    """Two of three hosts poisoned from the same step: both reach their strikes together and
    one decision excludes both (one rendezvous change), each with its own strikes."""
    hosts = ["a", "a", "b", "b", "c", "c"]
    cfg = SentinelConfig(host_strikes=2, strike_window=10)
    h = History()
    decisions = []
    for step in (5, 6):
        bad = (RankHealth(RankIdentity(r, r % 2, 2, hosts[r], "cpu"), ("grad",), False, 1.0,
                          1.0) for r in (0, 1, 2, 3))
        rows = tuple(bad)
        v = ClusterView(step, len(hosts), Totals(bad_grad=4, blamed=4, flagged=4,
                                                 flagged_rank=6.0), rows, rows)
        d = decide(v, h, cfg)
        h.record(v, d, cfg)
        decisions.append(d)
    assert [d.action for d in decisions] == [SKIP, EXCLUDE]
    d = decisions[-1]
    assert (d.exclude_host, d.strikes, d.also_exclude) == ("a", 2, (("b", 2),))
    assert d.exclusions == [("a", 2), ("b", 2)]
    assert d.reason == ("host a blamed 2 times within 10 steps; host b blamed 2 times within "
                        "10 steps")
    assert h.excluded == ["a", "b"]


def test_history_saves_its_own_state_under_the_checkpoint_keys() -> None:
    h = History(consecutive_skips=2, strikes={"node3": [4, 9]}, excluded=["node7"],
                rollbacks={10: 1}, skip_batches=3, spike_streak=1)
    state = h.state_dict()
    assert set(state) == {"consecutive_skips", "strikes", "excluded", "rollbacks",
                          "skip_batches", "spike_streak", "lost", "applied",
                          "snapshot_applied", "failed_snapshots", "watch", "retry",
                          "retry_stretch", "state_restored", "stretch", "window_spiked"}
    # JSON-style keys (a checkpoint written as JSON turns int keys into strings) load too.
    state["rollbacks"] = {"10": 1}
    assert History.from_state_dict(state) == h
    assert History.from_state_dict({}) == History()


def _spiking(history: History, cfg: SentinelConfig, steps: list[bool | str],
             snapshot_step: int | None = 0) -> list[str]:
    """Decide and record one step per entry (True: the cluster's loss spiked; "data": rank
    0's loss spiked with its batch), as the judge does; the actions taken."""
    actions = []
    for step, spiked in enumerate(steps, start=1):
        spikes = Spikes({"loss": [CLUSTER]}, {"loss": {CLUSTER: 2.0}}) if spiked else Spikes()
        if spiked == "data":
            spikes = Spikes({"loss": [0]}, {"loss": {0: 9.0}}, in_data=True)
        evidence = Evidence(spikes=spikes, snapshot_step=snapshot_step)
        d = decide(view(step, {}), history, cfg, evidence)
        history.record(view(step, {}), d, cfg, evidence)
        actions.append(d.action)
    return actions


def test_spike_patience_rolls_back_on_the_nth_spiking_step_in_a_row_only() -> None:
    """Issue 38: with spike_patience=2 one noisy step or bad batch is skipped; a second in a
    row rolls back; a quiet step in between starts the count again; patience 1 is today's."""
    cfg = SentinelConfig(loss_spike_action="rollback", spike_patience=2, max_rollbacks=99,
                         rollback_skip_batches=0)
    h = History()
    assert _spiking(h, cfg, [True, False, True, True, True, True]) == [
        SKIP, APPLY, SKIP, ROLLBACK, SKIP, ROLLBACK]
    assert h.spike_streak == 0
    h = History()
    assert _spiking(h, cfg, [True]) == [SKIP] and h.spike_streak == 1
    resumed = History.from_state_dict(h.state_dict())  # a checkpoint keeps the streak
    assert _spiking(resumed, cfg, [True]) == [ROLLBACK]
    once = SentinelConfig(loss_spike_action="skip", max_consecutive_skips=99, spike_patience=3)
    assert _spiking(History(), once, [True, True, False]) == [SKIP, SKIP, APPLY]
    warn = SentinelConfig(spike_patience=2)  # warn applies every spike
    assert _spiking(History(), warn, [True, True, True]) == [APPLY] * 3


def test_a_spike_in_data_is_skipped_and_never_rolled_back_over() -> None:
    """A bad shard's batches spike the loss one after the other, like ruined weights; with
    their batch norm far off too they are skipped, however many in a row, and the weights'
    streak neither grows nor restarts over them."""
    cfg = SentinelConfig(loss_spike_action="rollback", spike_patience=2, max_rollbacks=99,
                         rollback_skip_batches=0)
    h = History()
    assert _spiking(h, cfg, ["data"] * 20) == [SKIP] * 20
    assert h.spike_streak == 0 and h.rollbacks == {}
    d = decide(view(1, {}), History(), cfg,
               Evidence(spikes=Spikes({"loss": [0]}, {"loss": {0: 9.0}}, in_data=True),
                        snapshot_step=0))
    assert d.cause == "spike" and "the data's, not the weights'" in d.reason
    assert _spiking(History(), cfg, [True, "data", True]) == [SKIP, SKIP, ROLLBACK]
    skip = SentinelConfig(loss_spike_action="skip", max_consecutive_skips=99)
    assert _spiking(History(), skip, ["data", True]) == [SKIP, SKIP]
    warn = SentinelConfig()  # warn: applied, as any spike
    assert _spiking(History(), warn, ["data"]) == [APPLY]


def test_after_a_rollback_its_discarded_batches_never_roll_back_again_and_the_window_widens(
) -> None:
    """Issue 38: a spike or a NaN in a batch the rollback discards anyway is skipped as one of
    them (not one more rollback, which counted towards max_rollbacks and aborted the run);
    each further rollback to the same snapshot discards twice as many batches."""
    cfg = SentinelConfig(loss_spike_action="rollback", policy="rollback",
                         rollback_skip_batches=2, max_rollbacks=3)
    h = History()
    assert _spiking(h, cfg, [True, True, True, True, True, True, True, True]) == [
        ROLLBACK, SKIP, SKIP, ROLLBACK, SKIP, SKIP, SKIP, SKIP]
    assert h.rollbacks == {0: 2} and h.skip_batches == 0
    v = view(20, {1: ("loss",)})
    h.skip_batches, skips = 3, h.consecutive_skips
    d = decide(v, h, cfg, Evidence(snapshot_step=0))
    assert d.action == SKIP and d.bad_ranks == [1] and "discarded after a rollback" in d.reason
    h.record(v, d, cfg, Evidence(snapshot_step=0))
    assert h.skip_batches == 2 and h.consecutive_skips == skips and h.rollbacks == {0: 2}


def test_a_stop_request_in_the_sums_names_one_signal_on_every_rank() -> None:
    """The decision to stop is a pure function of the summed slots: every rank reads the same
    sums, so every rank stops after the same step, for the same signal (SIGTERM first)."""
    import signal

    from nansentinel.decide.policy import requested_stop

    assert requested_stop(Totals()) == 0
    assert requested_stop(Totals(stop_term=1)) == signal.SIGTERM
    assert requested_stop(Totals(stop_int=2)) == signal.SIGINT
    assert requested_stop(Totals(stop_term=1, stop_int=3)) == signal.SIGTERM  # the scheduler's
    # A stop is not a fault: the step is decided as ever (applied here), the stop beside it.
    view = ClusterView(4, 3, Totals(stop_term=1))
    assert decide(view, History(), SentinelConfig()).action == "apply"


# --- what the model holds (issue 68) ------------------------------------------------------


def _state(ranks: dict[int, str], *, repairable: bool, why: str = "") -> StateFindings:
    """Findings: rank -> the tensor it holds non-finite."""
    return StateFindings(7, {r: [Poisoned(name, "weight", 1, 16)] for r, name in ranks.items()},
                         {r: HOSTS[r] for r in ranks}, repairable, why)


def test_a_repairable_state_is_repaired_and_struck_and_never_divergence() -> None:
    cfg = SentinelConfig(host_strikes=2)
    # Found before a snapshot (no value was poisoned yet): repaired, and the step applies.
    quiet = decide(view(7, {}), History(), cfg,
                   Evidence(state=_state({1: "fc.weight"}, repairable=True), verdict="state"))
    assert quiet.action == APPLY and quiet.cause == "state" and "repaired" in quiet.reason
    # Found on an incident: the step's own values were poisoned by it: skipped, repaired.
    h = History()
    for step in (7, 8):
        v = view(step, {1: ("loss", "grad")})
        ev = Evidence(state=_state({1: "fc.weight"}, repairable=True), verdict="state")
        d = decide(v, h, cfg, ev)
        h.record(v, d, cfg, ev)
        if step == 7:
            assert d.action == SKIP and d.cause == "state" and "fc.weight" in d.reason
            assert h.strikes == {"n0": [7]}
    assert d.action == EXCLUDE and d.exclude_host == "n0"  # the second strike excludes it
    # policy abort stops on it, as on any non-finite value.
    aborted = decide(view(7, {1: ("loss",)}), History(), SentinelConfig(policy="abort"),
                     Evidence(state=_state({1: "fc.weight"}, repairable=True)))
    assert aborted.action == ABORT and "not finite" in aborted.reason


def test_a_state_no_replica_holds_rolls_back_once_to_a_finite_snapshot_or_stops_at_once() -> None:
    cfg = SentinelConfig(policy="skip", host_strikes=99)
    every = _state({0: "fc.weight", 1: "fc.weight", 2: "fc.weight", 3: "fc.weight"},
                   repairable=False, why="every replica holds fc.weight non-finite")
    v = view(7, {r: ("loss", "grad") for r in range(4)})
    # No snapshot kept: stopped at once, not after max_consecutive_skips useless skips.
    d = decide(v, History(), cfg, Evidence(state=every, verdict="state"))
    assert d.action == ABORT and d.cause == "state" and "restore another checkpoint" in d.reason
    # A snapshot kept (every snapshot's state was read finite): rolled back, whatever the
    # policy; no batches discarded, no learning-rate backoff counted against it.
    h = History()
    ev = Evidence(state=every, verdict="state", snapshot_step=5)
    d = decide(v, h, cfg, ev)
    h.record(v, d, cfg, ev)
    assert d.action == ROLLBACK and h.skip_batches == 0 and h.state_restored == [5]
    assert h.strikes == {}  # every host at once: the checkpoint's or the numbers', no host's
    # The same poisoned state again: a rollback that led back into it is not repeated.
    again = decide(view(9, {r: ("loss",) for r in range(4)}), h, cfg, ev)
    assert again.action == ABORT and "restored for it before" in again.reason


def test_a_non_finite_hyperparameter_skips_every_rank_then_stops_naming_it() -> None:
    cfg = SentinelConfig(max_consecutive_skips=2)
    h = History()
    actions = []
    for step in range(4):
        v = ClusterView(step, 4, Totals(bad_hyper=4))
        ev = Evidence(hyper="param group 0's lr is nan")
        d = decide(v, h, cfg, ev)
        h.record(v, d, cfg, ev)
        actions.append(d.action)
        assert d.cause == "hyperparameter" and "param group 0's lr is nan" in d.reason
    assert actions == [SKIP, SKIP, ABORT, ABORT] and h.strikes == {}


def test_a_non_finite_rollback_is_bounded_by_max_lost_steps() -> None:
    cfg = SentinelConfig(policy="rollback", host_strikes=99, max_lost_steps=4)
    h = History(lost=3, applied=10, snapshot_applied={5: 9})
    d = decide(view(12, {1: ("loss",)}), h, cfg, Evidence(snapshot_step=5))
    assert d.action == ABORT and "max_lost_steps=4" in d.reason
    fresh = decide(view(12, {1: ("loss",)}), History(applied=10, snapshot_applied={5: 9}), cfg,
                   Evidence(snapshot_step=5))
    assert fresh.action == ROLLBACK


# --- a degenerate stretch judged at its end (issue 70) ------------------------------------

RECOVER = SentinelConfig.from_env({}, spikes="recover")  # ratio 1.5: clearly worse at 1.22x


def _stretch(history: History, cfg: SentinelConfig, steps: list[tuple[str, float]],
             snapshot: int = 3, first: int = 4) -> list[Decision]:
    """Decide and record one step per ``(kind, relative)``, as the judge does: ``in`` (the
    loss in its band), ``low`` (below it), ``collapse`` (collapsed), ``spike`` (the cluster's
    loss spiked); ``relative``: the loss over the level saved with ``snapshot``."""
    out = []
    for step, (kind, relative) in enumerate(steps, start=first):
        spikes = Spikes(collapsed={"loss": 0.1}) if kind == "collapse" else Spikes(
            {"loss": [CLUSTER]}, {"loss": {CLUSTER: 2.0}}) if kind == "spike" else Spikes()
        ev = Evidence(spikes=spikes, snapshot_step=snapshot, low=kind in ("low", "collapse"),
                      relative=relative, near=relative < 1.22 and kind == "in")
        d = decide(view(step, {}), history, cfg, ev)
        history.record(view(step, {}), d, cfg, ev)
        out.append(d)
    return out


def test_a_stretch_is_dated_from_the_band_and_rolled_back_over_when_it_returns_worse() -> None:
    """The stretch opens when the loss leaves its band (step 4), not when it collapses (6);
    its return (8) at 1.5x the level saved before it rolls back to that snapshot, with no
    batch discarded after it (the rollback discarded the stretch's) and its check armed."""
    h = History(applied=3, snapshot_applied={3: 3})
    decisions = _stretch(h, RECOVER, [("low", 0.8), ("low", 0.7), ("collapse", 0.1),
                                      ("collapse", 0.05)])
    assert [d.action for d in decisions] == [APPLY] * 4  # marked, not acted on
    assert h.stretch == [4, 1, 0]
    (back,) = _stretch(h, RECOVER, [("in", 1.5)], first=8)
    assert back.action == ROLLBACK and back.cause == STRETCH, back
    assert "stretch of steps 4-7" in back.reason and "1.50x the level" in back.reason
    assert "the oldest snapshot kept from before it" in back.reason
    assert h.stretch is None and h.skip_batches == 0 and h.rollbacks == {3: 1}
    assert h.watch == [3, RECOVER.rollback_check_steps, 1]
    assert h.lost == 4 + 1  # the stretch's four applied steps undone, and the return's own


def test_a_stretch_that_comes_back_no_worse_is_judged_on_its_first_steps_then_closes() -> None:
    h = History(applied=3, snapshot_applied={3: 3})
    _stretch(h, RECOVER, [("low", 0.8), ("collapse", 0.1)])
    # Back at the level (a shard of padding: nothing learned that real data contradicts).
    ok = _stretch(h, RECOVER, [("in", 1.0)] * 4, first=6)
    assert [d.action for d in ok] == [APPLY] * 4 and h.stretch == [4, 1, 4]
    # A return that worsens within rollback_check_steps is still the stretch's.
    (late,) = _stretch(h, RECOVER, [("in", 1.3)], first=10)
    assert late.action == ROLLBACK and "stretch of steps 4-5" in late.reason
    # After rollback_check_steps calm steps the stretch is over: the next rise is a spike's.
    h = History(applied=3, snapshot_applied={3: 3})
    _stretch(h, RECOVER, [("collapse", 0.1)] + [("in", 1.0)] * 5)
    assert h.stretch is None
    assert _stretch(h, RECOVER, [("in", 1.3)], first=10)[0].action == APPLY


def test_an_unmarked_dip_closes_at_once_and_a_warn_collapse_tracks_nothing() -> None:
    """A fast descent dips below its band without collapsing: nothing is judged, the stretch
    closes at the first step back (a snapshot may be kept again)."""
    h = History()
    assert [d.action for d in _stretch(h, RECOVER, [("low", 0.8), ("in", 1.4)])] == [APPLY] * 2
    assert h.stretch is None
    warn = SentinelConfig.from_env({}, spikes="recover", collapse_action="warn")
    h = History()
    decisions = _stretch(h, warn, [("collapse", 0.1), ("in", 2.0)])
    assert [d.action for d in decisions] == [APPLY] * 2 and h.stretch is None


def test_a_stretch_past_max_lost_steps_ends_the_recovery_instead_of_a_rollback() -> None:
    """A stretch that has lasted longer than a rollback may undo is the run's new level: the
    recovery ends there (the step applies, the references restart; policy abort: abort), and
    its return is not rolled back over."""
    cfg = SentinelConfig.from_env({}, spikes="recover", max_lost_steps=6)
    h = History(applied=3, snapshot_applied={3: 3})
    decisions = _stretch(h, cfg, [("low", 0.8)] + [("collapse", 0.1)] * 6)
    over = decisions[-1]
    assert [d.action for d in decisions] == [APPLY] * 7
    assert over.cause == RECOVERY_OVER and "has lasted longer than a rollback to step 3" in (
        over.reason) and "max_lost_steps=6" in over.reason
    assert h.stretch is None
    aborting = SentinelConfig.from_env({}, spikes="recover", max_lost_steps=6, policy="abort")
    h = History(applied=3, snapshot_applied={3: 3})
    assert _stretch(h, aborting, [("collapse", 0.1)] * 7)[-1].action == ABORT
    # The same return within the bound rolls back.
    h = History(applied=3, snapshot_applied={3: 3})
    assert _stretch(h, cfg, [("collapse", 0.1)] * 4 + [("in", 2.0)])[-1].action == ROLLBACK


def test_a_rollback_check_waits_while_the_restored_state_meets_spiking_batches() -> None:
    """After a rollback the check counts the steps whose loss is out of its band but not
    spiking: a spike on the batches after a known-good snapshot is the data's (degenerate
    data that outlasts the discarded batches), not the snapshot's. A stretch's failed check
    goes on to the older snapshot as a stretch's rollback: nothing discarded after it."""
    h = History(applied=3, snapshot_applied={3: 3})
    _stretch(h, RECOVER, [("collapse", 0.1), ("in", 2.0)])
    assert h.watch == [3, 5, 1]
    assert _stretch(h, RECOVER, [("spike", 3.0)], first=6)[0].action == SKIP
    assert h.watch == [3, 5, 1] and h.failed == []  # spiking: the snapshot is not blamed
    _stretch(h, RECOVER, [("in", 1.3)] * 5, first=7)  # not back, not spiking: it counts
    assert h.watch is None and h.failed == [3] and h.retry and h.retry_stretch
    retry = decide(view(12, {}), h, RECOVER, Evidence(snapshot_step=1, relative=1.3))
    assert retry.action == ROLLBACK and retry.cause == STRETCH
    assert "rollback to step 3 did not bring the loss back" in retry.reason
    h.record(view(12, {}), retry, RECOVER, Evidence(snapshot_step=1, relative=1.3))
    assert h.skip_batches == 0 and h.watch == [1, 5, 1]
    # A spike rollback's check waits too, through the batches discarded after it.
    h = History(applied=3, snapshot_applied={3: 3})
    assert [d.action for d in _stretch(h, RECOVER, [("spike", 3.0)] * 12)] == [
        SKIP, ROLLBACK] + [SKIP] * 10
    assert h.watch == [3, 5, 0] and h.failed == [] and h.skip_batches == 0


def test_a_window_whose_batches_spiked_against_the_restored_state_ends_when_the_data_is_back(
) -> None:
    """Degenerate data that outlasts a rollback spikes against the restored, known-good state:
    the batches discarded then are the data's. The first batch of the window back near the
    restored level and quiet on every signal applies and ends the window (``data_back``): the
    rest of it is real data, which discarding cost seed 1 of the bench's constant and copied
    cases 12 steps past the stretch (+2.1%). A window whose batches never spiked (the weights
    or the schedule led in) runs its length, near or not."""
    h = History(applied=3, snapshot_applied={3: 3})
    decisions = _stretch(h, RECOVER, [("spike", 3.0)] * 2 + [("spike", 3.0)] * 3)
    assert [d.action for d in decisions] == [SKIP, ROLLBACK, SKIP, SKIP, SKIP]
    assert h.window_spiked and h.skip_batches == RECOVER.rollback_skip_batches - 3
    (back,) = _stretch(h, RECOVER, [("in", 1.0)], first=9)
    assert back.action == APPLY and back.cause == DATA_BACK, back
    assert "the data that led in has ended" in back.reason
    assert h.skip_batches == 0 and not h.window_spiked
    # Saved and restored with a checkpoint.
    h = History(applied=3, snapshot_applied={3: 3})
    _stretch(h, RECOVER, [("spike", 3.0)] * 3)
    resumed = History.from_state_dict(h.state_dict())
    assert resumed.window_spiked and resumed == h
    assert _stretch(resumed, RECOVER, [("in", 1.0)], first=7)[0].cause == DATA_BACK
    # Back in band but above the restored level (the weights' doing): still discarded.
    h = History(applied=3, snapshot_applied={3: 3})
    _stretch(h, RECOVER, [("spike", 3.0)] * 3)
    assert _stretch(h, RECOVER, [("in", 1.3)], first=7)[0].action == SKIP
    # Near on the loss, but some signal half-way to a spike (a degenerate batch just under
    # the ratio: its gradient norm 9.9x under the default 10x): not back, still discarded.
    loud = Evidence(spikes=Spikes(), snapshot_step=3, near=True, quiet=False, relative=1.0)
    d = decide(view(8, {}), h, RECOVER, loud)
    assert d.action == SKIP and "discarding batches after a rollback" in d.reason
    # Nothing spiked in the window (a learning-rate spike: the restored state is fine on
    # real data): the whole window is discarded.
    h = History(applied=3, snapshot_applied={3: 3})
    _stretch(h, RECOVER, [("spike", 3.0)] * 2)
    window = _stretch(h, RECOVER, [("in", 1.0)] * RECOVER.rollback_skip_batches, first=6)
    assert [d.action for d in window] == [SKIP] * RECOVER.rollback_skip_batches
    assert h.skip_batches == 0 and not h.window_spiked
    assert _stretch(h, RECOVER, [("in", 1.0)], first=99)[0].action == APPLY
