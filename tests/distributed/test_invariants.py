"""The invariants of DESIGN.md, in every combination users make, on every engine (issues 26, 36).

Engine (every gradient path of ``nansentinel.engines.registry()``: DDP, DeepSpeed, FSDP1, FSDP2,
local gradients reduced by hand) x policy (skip, rollback, abort, drop) x gate x optimizer x
GradScaler x BatchNorm x gradient accumulation x replay x replica fingerprints x rank 0 alone
reading results, crossed with faults of eight kinds (batch, loss, forward activation, backward;
and, issue 68, what the model holds: a weight, an optimizer-state tensor, a floating buffer, the
learning rate, by the NANSENTINEL_INJECT state drills) on one rank and on two, on 3 gloo
ranks. A CI run takes a random sample of the combinations,
a share per engine (:attr:`~tests.distributed.workers_invariants.Run.runs` and ``refusals``);
its seed is printed, and ``NANSENTINEL_MATRIX_SEED=S`` reruns the same sample.
``NANSENTINEL_MATRIX=N`` takes a sample of N (shared out in the same proportions),
``NANSENTINEL_MATRIX=all`` every combination (tens of thousands: days);
``NANSENTINEL_MATRIX_ENGINES=FSDPPath,LocalGradPath`` only those engines.

The engine dimension comes from the registry, and what each engine allows from its
capabilities, never from its name (:func:`allowance`): a new engine is in the matrix the day it
lands in ``registry()``, with a builder in ``workers_invariants.BUILDERS`` (how to build its
model, optimizer and loop on CPU gloo ranks; :func:`test_every_engine_has_a_builder` fails until
it has one). The capabilities judged are the run's: each set of ranks first builds every
engine of its combinations for the plain setup and reads ``sentinel.gradients.caps`` back (the
declared ``CAPS``, refined at construction: the local path refuses a drop on 3 ranks); the
declared ones only choose which combinations the sample takes.

A combination the capabilities refuse must be refused clearly: the Sentinel's construction
raises, on every rank, ``SentinelUsageError`` or ``ConfigError`` (whose ``.field`` names the
setting), with the capability's reason in its message and the rank named. Where the design
falls back instead (the host gate for the device gate, no replay, no replica fingerprints),
the combination runs and the fallback is asserted. After every other combination:
- every rank took the same decision, for the same reason, at every step, and the run ended on
  every rank alike (to the end, or ``NonFiniteError`` at the same step under
  ``policy="abort"``); under
  ``policy="drop"`` a batch, loss or forward fault on one rank is ``dropped`` (applied, that
  rank named), and the rank left out puts its floating buffers back;
- weights and optimizer state are finite and bit-identical across replicas (whole: FSDP2's
  shards and ZeRO's optimizer partitions gathered), floating buffers finite; and where the
  policy promises it (every faulty step skipped, or an abort), weights, buffers, optimizer
  state and the scale equal, bit for bit, a run that never saw the faulty steps;
- one valid report per incident, and the skip list holds the poisoned rows of batch faults;
- the optimizer and the scaler take one more step afterwards;
- a poisoned state is named with the verdict ``state`` (never ``divergence``) and the ranks
  holding it, and costs what its engine's capabilities allow (:func:`check_state`): repaired
  from a replica where one holds a finite copy (``caps.fingerprints is None``), else rolled back
  to a snapshot or stopped at once with ``NonFiniteStateError``; a non-finite learning rate
  skips its step on every rank, nobody blamed.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from nansentinel import engines
from nansentinel.engines import Capabilities
from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_invariants import (
    BUILDERS,
    COLLAPSE,
    DATA_BACK,
    FAULT_STEPS,
    JUMP_STEP,
    LONG,
    LOST_BOUND,
    PLAIN,
    RESPIKE,
    RETURN,
    ROWS,
    SPIKE,
    SPIKING,
    STATE_FAULTS,
    STEPS,
    STRETCH,
    drops,
    every_combo,
    faults_of,
    finite,
    run_combos,
    run_recovery_states,
    run_stretch_states,
    same,
    sample_id,
)

WORLD = 3
#: Combinations handed to one set of ranks (the rest go to the next set).
CHUNK = 48
#: The error types a refusal may raise (nansentinel.SentinelUsageError, nansentinel.ConfigError).
REFUSALS = ("SentinelUsageError", "ConfigError")
#: The setting each capability's refusal is about (``ConfigError.field``).
SETTING = {"device_gate": "gate", "replay": "replay", "drop": "policy", "rollback": "policy"}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One reason a combination is refused: the setting (``ConfigError.field`` when that is
    the error raised) and the words the message must hold (the capability's reason)."""

    setting: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Allowance:
    """What an engine does with a combination: refuses it at construction (any one of
    ``refusals`` may be the one raised), or runs it with the ``fallbacks`` its capabilities
    give (``device_gate``: the host gate; ``replay``: off; ``fingerprints``: none)."""

    refusals: tuple[Refusal, ...] = ()
    fallbacks: frozenset[str] = frozenset()


def allowance(combo: dict[str, Any], caps: Capabilities) -> Allowance:
    """What the engine whose capabilities are ``caps`` allows of ``combo``, from those alone.

    A drop, and a rollback, that the capabilities give a reason against are refused (no
    fallback exists: the policy is the user's choice). The device gate and the replay are the
    sentinel's own: on a path that the sentinel steps, it keeps the host gate or turns the
    replay off (saying why in the log); a path that steps its own optimizer
    (``steps_optimizer``) is handed the step through its engine's adapter
    (``engines.deepspeed_step``), which refuses at construction what its capabilities rule out,
    since no step of the sentinel's is there to fall back on, and refuses a GradScaler given
    beside the engine, whose own loss scale is used. Replica fingerprints that the capabilities
    give a reason against are not measured (said once in the log).
    """
    refusals: list[Refusal] = []
    fallbacks: set[str] = set()
    for name in ("drop", "rollback"):
        why = getattr(caps, name)
        if combo["policy"] == name and why is not None:
            refusals.append(Refusal(SETTING[name], why))
    for name, asked in (("device_gate", combo["gate"] == "device"),
                        ("replay", combo["replay"])):
        why = getattr(caps, name)
        if asked and why is not None:
            if caps.steps_optimizer:
                refusals.append(Refusal(SETTING[name], why))
            else:
                fallbacks.add(name)
    if caps.steps_optimizer and combo["scaler"] != "none":
        refusals.append(Refusal("scaler", "scaler"))  # "scaler given beside the engine"
    if combo["fingerprint"] and caps.fingerprints is not None:
        fallbacks.add("fingerprints")
    return Allowance(tuple(refusals), frozenset(fallbacks))


def device_gated(combo: dict[str, Any], allowed: Allowance) -> bool:
    """Whether the device gate takes the combination's steps: asked for, not a fallback of
    the engine, and the setup's own conditions (step/gate.device_gate_refusal): a fused
    optimizer, no GradScaler, no drop."""
    return (combo["gate"] == "device" and "device_gate" not in allowed.fallbacks
            and combo["optimizer"] == "adamw_fused" and combo["scaler"] == "none"
            and combo["policy"] != "drop")


def _engines() -> tuple[list[type], list[str]]:
    """The engines the matrix runs here (``NANSENTINEL_MATRIX_ENGINES`` narrows them), and a
    note per engine left out (its package is not installed)."""
    only = {e for e in os.environ.get("NANSENTINEL_MATRIX_ENGINES", "").split(",") if e}
    chosen, notes = [], []
    for path in engines.registry():
        if only and path.__name__ not in only:
            continue
        if path.__name__ not in BUILDERS:
            pytest.fail(f"{path.__name__} has no matrix builder (test_every_engine_has_a_builder)")
        missing = BUILDERS[path.__name__].available()
        if missing:
            notes.append(f"{path.__name__} left out: {missing}")
        else:
            chosen.append(path)
    return chosen, notes


def _strata(paths: list[type]) -> dict[tuple[str, bool], list[dict[str, Any]]]:
    """Every combination of each engine, split by whether its declared ``CAPS`` refuse it."""
    strata: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for path in paths:
        for combo in every_combo(path.__name__):
            refused = bool(allowance(combo, path.CAPS).refusals)
            strata.setdefault((path.__name__, refused), []).append(combo)
    return strata


def _allocate(n: int, shares: dict[Any, int], sizes: dict[Any, int]) -> dict[Any, int]:
    """``n`` shared out in proportion to ``shares`` (largest remainders; none over its size)."""
    total = sum(shares.values())
    quotas = {k: n * s / total for k, s in shares.items()}
    counts = {k: min(int(q), sizes[k]) for k, q in quotas.items()}
    for k in sorted(quotas, key=lambda k: int(quotas[k]) - quotas[k]):  # stable on ties
        if sum(counts.values()) >= n:
            break
        if counts[k] < sizes[k]:
            counts[k] += 1
    return counts


def _sample() -> tuple[list[dict[str, Any]], int | None, list[str]]:
    paths, notes = _engines()
    strata = _strata(paths)
    wanted = os.environ.get("NANSENTINEL_MATRIX", "")
    if wanted == "all":
        return [c for combos in strata.values() for c in combos], None, notes
    seed = int(os.environ.get("NANSENTINEL_MATRIX_SEED") or random.SystemRandom().randrange(10**6))
    shares = {key: (BUILDERS[key[0]].refusals if key[1] else BUILDERS[key[0]].runs)
              for key in strata}
    shares = {k: s for k, s in shares.items() if s > 0}
    n = int(wanted) if wanted else sum(shares.values())
    counts = _allocate(n, shares, {k: len(strata[k]) for k in shares})
    rng = random.Random(seed)
    return [c for key in shares for c in rng.sample(strata[key], counts[key])], seed, notes


def check_refused(combo: dict[str, Any], allowed: Allowance, ranks: list[dict[str, Any]],
                  where: str) -> None:
    """Refused as the capabilities say, clearly: on every rank, a documented error naming the
    rank, with one of the reasons (and its setting, for a ``ConfigError``)."""
    first = ranks[0]["refused"]
    assert allowed.refusals, (
        f"{where}: refused, though the engine's capabilities allow it: {first}")
    reasons = [r.reason for r in allowed.refusals]
    for rank, out in enumerate(ranks):
        refused = out["refused"]
        assert refused is not None and refused["type"] in REFUSALS, (
            f"{where}: rank {rank} was not refused like the others: {refused}")
        said = [r for r in allowed.refusals if r.reason in refused["message"]]
        assert said, (f"{where}: rank {rank}'s refusal does not say why (one of {reasons}): "
                      f"{refused['message']}")
        if refused["type"] == "ConfigError":
            assert refused["field"] in {r.setting for r in said}, (
                f"{where}: ConfigError.field {refused['field']!r} for {refused['message']}")
        assert f"rank {rank}" in refused["message"], (
            f"{where}: the refusal does not name rank {rank}: {refused['message']}")


def steps_run(out: dict[str, Any]) -> list[int]:
    """The steps a run's ``planned_lrs`` (one per step it ran) belong to."""
    return [o["step"] for o in out["outcomes"]]


def check(combo: dict[str, Any], caps: Capabilities, ranks: list[dict[str, Any]],
          where: str) -> None:
    allowed = allowance(combo, caps)
    faulty = [r["faulty"] for r in ranks]
    if any(out["refused"] is not None for out in faulty):
        check_refused(combo, allowed, faulty, where)
        return
    assert not allowed.refusals, (
        f"{where}: the Sentinel took it, though the capabilities refuse it: {allowed.refusals}")
    reference = [r["reference"] for r in ranks]
    # The engine's fallbacks, and the features it keeps.
    for out in faulty:
        assert out["path"] == combo["engine"], f"{where}: taken by {out['path']}"
        gate = "device" if device_gated(combo, allowed) else "host"
        assert out["gate"] == gate, f"{where}: the {out['gate']} gate, expected the {gate} gate"
        assert out["replay"] == (combo["replay"] and "replay" not in allowed.fallbacks), (
            f"{where}: replay {'on' if out['replay'] else 'off'}")
        assert out["fingerprints"] == (
            combo["fingerprint"] and "fingerprints" not in allowed.fallbacks), (
            f"{where}: replica fingerprints {'on' if out['fingerprints'] else 'off'}")
    # Every rank decided the same at every step, and ended alike.
    first = faulty[0]
    for out in faulty[1:]:
        assert [o["outcome"] for o in out["outcomes"]] == [
            o["outcome"] for o in first["outcomes"]], f"{where}: decisions differ across ranks"
        assert [o.get("reason") for o in out["outcomes"]] == [
            o.get("reason") for o in first["outcomes"]], f"{where}: reasons differ across ranks"
        assert out["error"] == first["error"], f"{where}: ranks ended differently"
        # (The device gate plans a step's rates as it steps, before the decision: where a
        # rank's own rate was NaN (a hyperparameter fault), it plans that; the step is skipped
        # on every rank and the plan never counted. Every other step's plan is the same.)
        hyper = set(FAULT_STEPS) if combo["fault"] == "hyperparameter" else set()
        assert [p for i, p in enumerate(out["planned_lrs"]) if steps_run(out)[i] not in hyper] == [
            p for i, p in enumerate(first["planned_lrs"]) if steps_run(first)[i] not in hyper], (
            f"{where}: learning rates planned differently across ranks")
        assert [o.get("lr_held") for o in out["outcomes"]] == [
            o.get("lr_held") for o in first["outcomes"]], f"{where}: LR holds differ"
    faults = faults_of(combo, WORLD)
    outcomes = {o["step"]: o for o in first["outcomes"]}
    # Issue 52: the loop's x100 at a healthy step is held at the last applied rate (step 0's)
    # on every engine and gate, and no other step is held.
    held = [s for s, o in outcomes.items() if o.get("lr_held")]
    # A rollback for a poisoned state leaves the rate alone (no backoff, no cap), and the
    # device gate decides it at the next call, after the loop's schedule wrote that step's
    # rate: the snapshot's rate (written there as the gate kept it, one step late) is what
    # that step asks, and a jump from it is held.
    late = {s + 1 for s, o in outcomes.items() if o.get("state_action") == "rolled_back"
            and device_gated(combo, allowance(combo, caps))}
    assert [s for s in held if s not in late] == [JUMP_STEP], (
        f"{where}: learning rate held at steps {held}")
    assert outcomes[JUMP_STEP]["applied"], f"{where}: {outcomes[JUMP_STEP]}"
    jump_plan = first["planned_lrs"][JUMP_STEP]
    assert jump_plan == first["base_lrs"], f"{where}: step {JUMP_STEP} ran at {jump_plan}"
    # Under GradScaler, non-finite gradients alone are fp16 overflow: GradScaler's to skip.
    overflow = combo["scaler"] != "none" and combo["fault"] == "backward"
    aborts = combo["policy"] == "abort" and not overflow
    if overflow:
        assert all(outcomes[s]["outcome"] == "overflow" for s in faults), f"{where}: {outcomes}"
    if combo["fault"] in STATE_FAULTS:  # issue 68: what the model holds
        check_state(combo, caps, faulty, where)
    elif aborts:
        assert first["error"] and first["error"]["type"] == "NonFiniteError", where
        assert first["error"]["step"] == FAULT_STEPS[0], f"{where}: {first['error']}"
    else:
        assert first["error"] is None, f"{where}: {first['error']}"
        assert sorted(outcomes) == list(range(STEPS)), where
        # rollback_skip_batches=1: the batches after a rollback are discarded, one after the
        # first rollback to a snapshot, twice as many after each further one to it
        discarded: set[int] = set()
        to: dict[int | None, int] = {}
        for step, o in outcomes.items():
            if o["outcome"] == "rolled_back":
                to[o["rolled_back_to"]] = n = to.get(o["rolled_back_to"], 0) + 1
                discarded.update(range(step + 1, step + 1 + 2 ** (n - 1)))
        for step, o in outcomes.items():
            if step in faults and drops(combo):
                assert o["outcome"] == "dropped" and o["applied"], f"{where}: {o}"
                assert o["bad_ranks"] == faults[step], f"{where}: {o}"
            elif step in faults:
                assert o["outcome"] in ("skipped", "rolled_back", "overflow"), f"{where}: {o}"
                assert not o["applied"] or o["outcome"] == "overflow", f"{where}: {o}"
                if combo["fault"] == "hyperparameter":  # nobody's host: the schedule's
                    assert "hyperparameter" in o["kinds"] and not o["bad_ranks"], (
                        f"{where}: {o}")
            elif step in discarded:
                assert o["outcome"] == "skipped" and not o["bad_ranks"], f"{where}: {o}"
            else:
                assert o["applied"], f"{where}: healthy step {step} not applied: {o}"
    # Finite and identical across replicas (a run stopped on a poisoned state that nothing
    # could repair keeps it: check_state counted it).
    stopped_poisoned = combo["fault"] in STATE_FAULTS and first["error"] is not None
    for key in ("params", "optimizer"):
        tensors = [out["state"][key] for out in faulty]
        if not stopped_poisoned:
            assert all(finite(t) for t in tensors), f"{where}: {key} not finite"
            assert all(same(t, tensors[0]) for t in tensors), (
                f"{where}: {key} differ across ranks")
    if not stopped_poisoned:
        assert all(finite(out["state"]["buffers"]) for out in faulty), (
            f"{where}: buffers not finite")
    # Equal to the run that never saw the faulty steps, where the policy promises it.
    skipped = all(outcomes[s]["outcome"] == "skipped" for s in faults if s in outcomes)
    if combo["fault"] in STATE_FAULTS:  # a stop keeps the poison: not that run's state
        promised = skipped and first["error"] is None
    else:
        promised = aborts or skipped
    if promised:
        shared = BUILDERS[combo["engine"]].shares_buffers
        for rank, (mine, ref) in enumerate(zip(faulty, reference, strict=True)):
            # After an abort under DDP the last forward's buffer broadcast is what differs:
            # every replica holds rank 0's buffers from before the step, where the reference
            # kept its own.
            keys = ("params", "optimizer") if rank and aborts and shared else (
                "params", "buffers", "optimizer")
            if combo["fault"] == "buffer" and not shared and rank in faults[FAULT_STEPS[0]]:
                # repaired from another replica's buffers, which its own batches made
                keys = ("params", "optimizer")
            for key in keys:
                assert same(mine["state"][key], ref["state"][key]), (
                    f"{where}: {key} differ from the run without the faulty steps (rank {rank})")
            assert mine["state"]["scale"] == ref["state"]["scale"], f"{where}: scale differs"
    # Restored buffers are said so: every rank's on a skip, the left-out rank's on a drop.
    if combo["batchnorm"] and combo["policy"] in ("skip", "drop"):
        for step in (s for s in faults if s in outcomes):
            if outcomes[step]["outcome"] == "skipped":
                assert outcomes[step]["buffers_restored"] == 2, f"{where}: {outcomes[step]}"
            if outcomes[step]["outcome"] == "dropped":
                restored = [{o["step"]: o for o in out["outcomes"]}[step]["buffers_restored"]
                            for out in faulty]
                want = [2 if r in faults[step] else 0 for r in range(WORLD)]
                assert restored == want, f"{where}: step {step} restored {restored}"
    # One valid report per incident: a rank named, or a hyperparameter (nobody's).
    incidents = [o for o in first["outcomes"]
                 if o["bad_ranks"] or "hyperparameter" in o.get("kinds", ())]
    lr_reports = [r for r in first["reports"] if r["name"].endswith("-lr.json")]
    assert [(r["content"] or {}).get("step") for r in lr_reports
            if (r["content"] or {}).get("step") not in late] == [JUMP_STEP], (
        f"{where}: the held jump's reports: {lr_reports}")
    reports = [r for r in first["reports"] if r not in lr_reports]
    assert all(r["content"] is not None for r in reports), f"{where}: invalid report JSON"
    if first["error"] is not None:  # the stop is an incident too
        incidents.append(first["error"])
    assert len(reports) == len(incidents), f"{where}: {len(reports)} reports, {incidents}"
    assert [r["content"]["step"] for r in reports] == [o["step"] for o in incidents], where
    # The skip list: the poisoned rows of batch faults (row 0 of every micro-batch: the drill
    # writes into each), nothing else.
    listed = sorted(i for line in first["skip_list"] for i in line["ids"])
    if combo["fault"] == "batch":
        steps = FAULT_STEPS[:1] if aborts else list(faults)
        want = sorted(sample_id(r, s, m, 0) for s in steps for r in faults[s]
                      for m in range(combo["accumulate"]))
        assert listed == want, f"{where}: skip list {listed}, expected {want}"
    else:
        assert listed == [], f"{where}: skip list {listed}"
    # The optimizer and the scaler work the next step.
    if first["error"] is None:
        assert all(out["next"] for out in faulty), f"{where}: the next step did not apply"


def check_state(combo: dict[str, Any], caps: Capabilities, faulty: list[dict[str, Any]],
                where: str) -> None:
    """A NaN written into the model's own state (issue 68) as a fault step begins, on the
    faulty ranks: each fault is found at its step (an optimizer-state tensor: at the next,
    once the update it poisoned applied; or at its own, where a snapshot was due), with the
    verdict ``state`` and the ranks holding it named, never ``divergence``. Where a replica
    holds a finite copy (``caps.fingerprints is None``: DDP, local gradients) it is repaired
    from it, the step skipped (dropped under ``policy="drop"``) and the next applied; where
    none does (FSDP, ZeRO) the run rolls back to a snapshot (``policy="rollback"``) or stops
    at once with ``NonFiniteStateError``, as it does under ``policy="abort"``. Every step
    that is neither a fault's nor where one was found applies (a rollback for a poisoned state
    discards no batches). A stopped run keeps only the fault's own non-finite elements."""
    first = faulty[0]
    faults = faults_of(combo, WORLD)
    outcomes = {o["step"]: o for o in first["outcomes"]}
    error = first["error"]
    repairable = caps.fingerprints is None
    # The device gate decides a step at the next call, after the next step's drill was
    # written: what it reads then (the state on an incident, the replica fingerprints of
    # ``fingerprint_every=1``) may see the next fault a step early, and repair it with it.
    gated = device_gated(combo, allowance(combo, caps))
    found: dict[int, dict[str, Any]] = {}  # fault step -> where it was named
    for step, ranks in faults.items():
        if error is not None and error["step"] < step:
            break
        seen = [o for o in (outcomes.get(step - 1), outcomes.get(step), outcomes.get(step + 1),
                            error)
                if o is not None and step - gated <= o["step"] <= step + 1 and (
                    (o.get("poisoned") and o.get("state_action") != "not_kept")
                    or "replica" in o.get("kinds", ()))]
        fresh = [o for o in seen if not any(o is f for f in found.values())]
        assert seen, f"{where}: the fault at step {step} was never named: {first['outcomes']}"
        o = found[step] = (fresh or seen)[0]
        if not fresh:  # repaired with the fault before it, at the step before this one
            assert o["step"] == step - 1, f"{where}: {o}"
            continue
        if "replica" in o["kinds"]:
            assert combo["fingerprint"] and o["bad_ranks"] == ranks and o["applied"], (
                f"{where}: {o}")
            continue
        assert o["verdict"] == "state" and "state" in o["kinds"], f"{where}: {o}"
        assert set(ranks) <= set(o["poisoned"]) and set(o["poisoned"]) <= set(o["bad_ranks"]), (
            f"{where}: {ranks} poisoned at step {step}, named {o}")
        if repairable:  # a replica's copy of each (the rest of the world) is finite
            assert o["poisoned"] == ranks, f"{where}: {o}"
        if combo["fault"] != "optimizer_state":
            assert o["step"] == step, f"{where}: found at {o['step']}: {o}"
        if o is error:
            assert error["type"] == "NonFiniteStateError" and error["state_action"] == (
                "aborted"), f"{where}: {error}"
            assert not repairable or combo["policy"] == "abort", f"{where}: {error}"
            assert combo["policy"] == "rollback" or step == FAULT_STEPS[0], f"{where}: {error}"
        elif repairable:
            assert o["state_action"] == "repaired", f"{where}: {o}"
            assert o["outcome"] in ("skipped", "dropped", "applied"), f"{where}: {o}"
        else:
            assert o["state_action"] == "rolled_back" and combo["policy"] == "rollback", (
                f"{where}: {o}")
    for out in faulty:  # never a divergence, on any rank
        assert all(o.get("verdict") != "divergence" for o in out["outcomes"]), where
    if error is None:
        assert sorted(outcomes) == list(range(STEPS)), where
    else:  # only the fault's own elements (an optimizer state's: its update's too) are kept
        assert error in found.values(), f"{where}: stopped at {error}"
        assert combo["policy"] == "abort" or not repairable, f"{where}: {error}"
        n = combo["faulty_ranks"]
        for out in faulty:
            bad = {k: int((~torch.isfinite(out["state"][k])).sum()) for k in (
                "params", "optimizer", "buffers")}
            assert all(count <= n for count in bad.values()), f"{where}: {bad} non-finite"
    where_found = {o["step"] for o in found.values()}
    for step, o in outcomes.items():
        if o.get("outcome") == "aborted":  # the device gate's step that raised
            continue
        if step in where_found:
            assert not o["applied"] or o["outcome"] in ("dropped", "applied"), (
                f"{where}: {o}")
        elif step in faults:  # an optimizer state's fault applies: found at the next step
            early = step in found and found[step]["step"] < step  # by the fingerprints
            assert (combo["fault"] == "optimizer_state" or early) and o["applied"], (
                f"{where}: {o}")
        else:
            assert o["applied"], f"{where}: step {step} not applied: {o}"


def test_every_engine_has_a_builder() -> None:
    """Every gradient path of the registry is in the matrix: a new engine without a builder
    (workers_invariants.BUILDERS) fails here, not silently outside the matrix."""
    names = [path.__name__ for path in engines.registry()]
    missing = [name for name in names if name not in BUILDERS]
    assert not missing, (f"no matrix builder for {missing}: add a Run subclass with "
                         "engine = <the path> to tests/distributed/workers_invariants.BUILDERS")
    assert sorted(BUILDERS) == sorted(names), f"builders of no registered engine: {BUILDERS}"
    for name, builder in BUILDERS.items():
        assert builder.engine.__name__ == name
        # The plain setup (the probe's) is every engine's: nothing its capabilities refuse.
        assert not allowance(dict(PLAIN, engine=name), builder.engine.CAPS).refusals, name


@pytest.mark.timeout(900)
def test_every_invariant_in_every_combination(tmp_path: Path, capsys: Any) -> None:
    combos, seed, notes = _sample()
    per_engine = {e: sum(c["engine"] == e for c in combos)
                  for e in dict.fromkeys(c["engine"] for c in combos)}
    only = os.environ.get("NANSENTINEL_MATRIX_ENGINES")
    with capsys.disabled():
        print(f"\ninvariant matrix: {len(combos)} combination(s) "
              f"({', '.join(f'{e} {n}' for e, n in per_engine.items())}), seed "
              f"{seed if seed is not None else '(all)'} "
              f"(rerun: NANSENTINEL_MATRIX_SEED={seed} "
              f"NANSENTINEL_MATRIX={os.environ.get('NANSENTINEL_MATRIX') or len(combos)}"
              f"{f' NANSENTINEL_MATRIX_ENGINES={only}' if only else ''})"
              + "".join(f"; {note}" for note in notes))
    started = time.monotonic()
    for start in range(0, len(combos), CHUNK):
        chunk = combos[start:start + CHUNK]
        outs = values(run_ranks(
            run_combos, WORLD,
            tmp_path, combos=chunk, report_dir=str(tmp_path / f"r{start}"),
            env={"DS_ACCELERATOR": "cpu"}, timeout=90 + 20 * len(chunk),
        ))
        probes = outs[0]["probes"]
        for engine, probe in probes.items():
            assert probe["path"] == engine, f"{engine}'s builder made a model {probe['path']} took"
            assert all(out["probes"][engine] == probe for out in outs), (
                f"{engine}: capabilities differ across ranks")
        for i, combo in enumerate(chunk):
            where = f"seed {seed}, combination {start + i}: {combo}"
            caps = Capabilities(**probes[combo["engine"]]["caps"])
            check(combo, caps, [outs[r]["outs"][i] for r in range(WORLD)], where)
    with capsys.disabled():
        print(f"invariant matrix: {len(combos)} combination(s) in "
              f"{time.monotonic() - started:.1f} s")


def _recovery_runs() -> list[tuple[str, str]]:
    """Every engine that can roll back and runs here (``NANSENTINEL_MATRIX_ENGINES`` narrows
    them, as for the matrix: a torch lane runs only its own release's seam), under
    ``policy="skip"`` (the recovery ends by applying), and the first of them once more under
    ``policy="abort"``."""
    only = {e for e in os.environ.get("NANSENTINEL_MATRIX_ENGINES", "").split(",") if e}
    names = [name for name, run in BUILDERS.items()
             if run.engine.CAPS.rollback is None and run.available() is None
             and (not only or name in only)]
    if not names:
        pytest.skip(f"no engine of NANSENTINEL_MATRIX_ENGINES={','.join(sorted(only))} rolls "
                    "back here")
    return [(name, "skip") for name in names] + [(names[0], "abort")]


@pytest.mark.timeout(600)
def test_the_recovery_states_on_every_engine(tmp_path: Path) -> None:
    """Issue 60's states on every engine that rolls back, 3 gloo ranks: a collapse (every rank
    reports it, applies the step, keeps no snapshot), a rollback re-anchored to the snapshot's
    references, a rollback that did not help followed by one to the older snapshot, and the
    recovery's end (the steps apply from there, or every rank aborts under policy abort);
    every rank decides alike and the replicas' weights stay identical."""
    runs = _recovery_runs()
    outs = values(run_ranks(run_recovery_states, WORLD, tmp_path, runs=runs,
                            report_dir=str(tmp_path / "reports"),
                            env={"DS_ACCELERATOR": "cpu"}, timeout=120 + 40 * len(runs)))
    for i, (engine, policy) in enumerate(runs):
        where = f"{engine}, policy {policy}"
        ranks = [outs[r][i] for r in range(WORLD)]
        first = ranks[0]
        for out in ranks[1:]:  # the same decisions, account and references on every rank
            assert out["steps"] == first["steps"], where
            assert out["error"] == first["error"], where
            assert same(out["params"], first["params"]), f"{where}: replicas differ"
        steps = {s["step"]: s for s in first["steps"]}
        trail = [(s["step"], s["outcome"], s["reason"]) for s in first["steps"][SPIKE - 1:]]
        for s in COLLAPSE:  # reported, applied
            assert steps[s]["collapsed"] == ["loss"] or "loss" in steps[s]["collapsed"], (
                where, steps[s])
            assert steps[s]["applied"], (where, steps[s])
        rolled = [s for s in first["steps"] if s["outcome"] == "rolled_back"]
        assert len(rolled) == 2, (where, trail)
        one, two = rolled
        assert one["step"] == SPIKE + 1 and two["step"] < RESPIKE, (where, trail)
        assert one["rolled_back_to"] < COLLAPSE[0], (where, one)  # no snapshot in the collapse
        assert one["reference"] == steps[one["rolled_back_to"]]["reference"], (
            f"{where}: not re-anchored")
        assert two["rolled_back_to"] < one["rolled_back_to"], (where, trail)
        assert f"rollback to step {one['rolled_back_to']} did not bring the loss back" in (
            two["reason"]), where
        assert two["recovery"]["failed_snapshots"] == [one["rolled_back_to"]], where
        if policy == "abort":
            assert first["error"] is not None and "aborting (policy is abort)" in (
                first["error"]["reason"]), (where, trail)
            continue
        assert first["error"] is None, where
        end = next(s for s in first["steps"] if "the recovery ends" in s["reason"])
        assert end["applied"], where
        assert all(s["applied"] for s in first["steps"] if s["step"] > end["step"]), (
            where, trail)
        unapplied = [s for s in first["steps"] if not s["applied"]]
        assert len(unapplied) <= 60, where
        reports = [r["content"] for r in first["reports"]]
        assert any("collapse" in (c or {}).get("spikes", {}) for c in reports), where
        assert any((c or {}).get("recovery", {}).get("failed_snapshots") for c in reports), where


@pytest.mark.timeout(600)
def test_a_degenerate_stretch_is_judged_at_its_end_on_every_engine(tmp_path: Path) -> None:
    """Issue 70's states on every engine that rolls back, 3 gloo ranks: a stretch dated from
    the step its loss left the band (before it collapsed), judged when real data returns
    twice as high (rolled back over to the snapshot before it, with no batch discarded and no
    learning-rate backoff after it, each rank's ids of its batches in the skip list), and a
    stretch that runs past max_lost_steps (the recovery ends there and nothing is rolled
    back; policy abort: every rank aborts); every rank decides alike, the replicas' weights
    stay identical."""
    runs = _recovery_runs()
    outs = values(run_ranks(run_stretch_states, WORLD, tmp_path, runs=runs,
                            report_dir=str(tmp_path / "reports"),
                            env={"DS_ACCELERATOR": "cpu"}, timeout=120 + 40 * len(runs)))
    for i, (engine, policy) in enumerate(runs):
        where = f"{engine}, policy {policy}"
        ranks = [outs[r][i] for r in range(WORLD)]
        first = ranks[0]
        for out in ranks[1:]:
            assert out["steps"] == first["steps"], where
            assert out["error"] == first["error"], where
            assert out["skipped"] == first["skipped"], where  # one skip list, every rank's
            assert same(out["params"], first["params"]), f"{where}: replicas differ"
        steps = {s["step"]: s for s in first["steps"]}
        trail = [(s["step"], s["outcome"], s["reason"]) for s in first["steps"][STRETCH[0]:]]
        assert not steps[STRETCH[0]]["collapsed"] and steps[STRETCH[1]]["collapsed"], where
        rolled = [s for s in first["steps"] if s["outcome"] == "rolled_back"]
        assert [s["step"] for s in rolled] == [RETURN, SPIKING[1]], (where, trail)
        back = rolled[0]
        assert back["rolled_back_to"] < STRETCH[0], (where, back)
        assert f"degenerate stretch of steps {STRETCH[0]}-{STRETCH[-1]}" in back["reason"], (
            where, back["reason"])
        assert back["lr_factor"] == 1.0 and steps[RETURN + 1]["applied"], (where, trail)
        assert back["recovery"]["lost_steps"] == RETURN - back["rolled_back_to"] + 1, where
        expected = {sample_id(r, s, 0, row) for r in range(WORLD) for s in STRETCH
                    for row in range(ROWS)}
        assert set(first["skipped"]) == expected, where
        # Batches that spike against the restored state are the data's: the first back at
        # its level ends the window discarded after the rollback (not its 10 batches), and
        # the learning-rate backoff with it.
        assert not any(steps[s]["applied"] for s in SPIKING), (where, trail)
        spiked = steps[SPIKING[-1]]
        assert "discarding batches after a rollback" in spiked["reason"] or (
            "discarded after a rollback" in spiked["reason"]), (where, trail)
        assert spiked["lr_factor"] < 1.0, (where, spiked)
        data_back = steps[DATA_BACK]
        assert data_back["applied"] and "the data that led in has ended" in (
            data_back["reason"]), (where, trail)
        assert data_back["lr_factor"] == 1.0, (where, data_back)
        if policy == "abort":
            assert first["error"] is not None and "aborting (policy is abort)" in (
                first["error"]["reason"]), (where, trail)
            assert "has lasted longer than a rollback" in first["error"]["reason"], where
            continue
        assert first["error"] is None, where
        over = [s for s in first["steps"] if "has lasted longer than a rollback" in s["reason"]]
        assert over and over[0]["applied"] and over[0]["step"] in LONG, (where, trail)
        assert f"max_lost_steps={LOST_BOUND}" in over[0]["reason"], where
        assert all(s["applied"] for s in first["steps"]
                   if s["step"] > RETURN and s["step"] not in SPIKING), (where, trail)
        reports = [r["content"] or {} for r in first["reports"]]
        assert any(c.get("outcome") == "rolled_back" and c.get("skip_list") for c in reports), (
            where)
