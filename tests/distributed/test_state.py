"""What the model holds (issue 68), on gloo ranks: a NaN in a weight, an optimizer-state tensor,
a floating buffer or a hyperparameter costs one step (two at most), named, never
``divergence`` (docs/recovery.md, "What the model holds").

Each fault is made by a ``NANSENTINEL_INJECT`` drill or by the test itself (what a bit flip, a
bad restore or a schedule leaves), on one rank or on every rank, under ``policy="skip"``,
``"rollback"`` and ``spikes="recover"``, on every engine whose path differs:

- DDP (2 ranks) and HSDP (replicate x shard, 4 ranks): a replica holds a finite copy, so one
  rank's poisoned state is repaired in place from it and its host struck (DDP's buffer
  broadcast names its source rank alone); every replica poisoned rolls back or stops;
- FSDP2 (4 ranks) and DeepSpeed ZeRO 1, 2, 3 (2 ranks): no replica holds the shard, so the run
  rolls back to a snapshot whose whole state was finite (FSDP2) or stops at once with
  ``NonFiniteStateError`` (no snapshot; DeepSpeed takes none);
- a NaN learning rate for one step is skipped and the next step applies; one that stays NaN
  stops after ``max_consecutive_skips`` with the hyperparameter named;
- a checkpoint restored with a NaN is refused at construction, and at ``check_state()`` and
  ``load_state_dict`` after a restore by hand.

Every check holds on every rank alike: the same decisions and reasons at every step; the
verdict ``state`` and the tensor and rank named (``poisoned_state``, ``bad_ranks``,
``state_action``); weights and optimizer state finite and identical across replicas afterwards
(floating buffers finite: BatchNorm updates them from each rank's own batch); the poisoned host
struck, and no other; one valid incident report per incident, naming the tensor; a stop is
``NonFiniteStateError`` on every rank at the same step, and ``nansentinel run`` would exit 6.

One process group per engine family runs all its cases (one fixture each); the whole file
takes ~17 s on the 2-core machine (at a load of 2.5; 50 s at a load of 9).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_state import run_cases

Case = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Expect:
    """What a case's state fault must come to."""

    at: int
    """The step the poisoned state is found and acted on."""
    ranks: tuple[int, ...]
    """The ranks ``poisoned_state`` names (those holding a non-finite tensor)."""
    tensor: str
    """A tensor every named rank's entry names."""
    action: str
    """``state_action`` at that step: ``repaired``, ``rolled_back`` or ``aborted``."""
    struck: tuple[str, ...] = ()
    """The hosts struck over the run (and no other)."""
    holders: tuple[int, ...] | None = None
    """The ranks whose entry names ``tensor`` (None: every rank of ``ranks``); the others
    hold what its update spread."""
    applied_poisoned: bool = False
    """The step before ``at`` applied with the fault in the state (an optimizer-state fault
    found at the next incident)."""
    bad_weights: int = 0
    """Where the run stops: the non-finite weight elements left (the fault's own, nothing an
    update spread)."""


def _written(step: int, what: str, ranks: list[int] | None) -> dict[int, dict[str, Any]]:
    return {step: {"what": what, "ranks": ranks}}


#: DDP, 2 ranks: name -> (case, expectation).
DDP_CASES: dict[str, tuple[Case, Expect | None]] = {
    "weight drill, one rank, skip": (
        dict(inject="kind=weight,rank=1,step=3", steps=6),
        Expect(3, (1,), "weight inp.weight (1 of 128", "repaired", ("host1",))),
    "weight written, one rank, recover": (
        dict(write=_written(3, "weight", [1]), spikes="recover", steps=6),
        Expect(3, (1,), "weight inp.weight (1 of 128", "repaired", ("host1",))),
    "optimizer state drill before a snapshot, rollback": (
        dict(inject="kind=optimizer_state,rank=1,step=4", policy="rollback", steps=6),
        Expect(4, (1,), "optimizer state inp.weight.exp_avg (1 of 128", "repaired",
               ("host1",))),
    "optimizer state written, one rank, skip": (
        dict(write=_written(3, "optimizer_state", [1]), steps=6),
        Expect(4, (1,), "optimizer state inp.weight.exp_avg_sq (1 of 128", "repaired",
               ("host1",), applied_poisoned=True)),
    "buffer drill on the broadcast's source": (
        dict(inject="kind=buffer,rank=0,step=3", steps=6),
        Expect(3, (0,), "buffer norm.running_mean (1 of 16", "repaired", ("host0",))),
    "buffer written, one rank": (
        dict(write=_written(3, "buffer", [1]), steps=6),
        Expect(3, (1,), "buffer norm.running_var (1 of 16", "repaired", ("host1",))),
    "weight drill, every rank, skip": (
        dict(inject="kind=weight,step=3", steps=6),
        Expect(3, (0, 1), "weight inp.weight (1 of 128", "aborted", bad_weights=1)),
    "weight written, every rank, twice, rollback": (
        dict(write={**_written(3, "weight", None), **_written(4, "weight", None)},
             policy="rollback", config={"rollback_skip_batches": 1}, steps=7),
        None),
    "weight written, every rank, recover": (
        dict(write=_written(3, "weight", None), spikes="recover", steps=7),
        Expect(3, (0, 1), "weight inp.weight (1 of 128", "rolled_back")),
    "hyperparameter drill": (dict(inject="kind=hyperparameter,step=3", steps=6), None),
    "hyperparameter drill on rank 1, device gate": (
        dict(inject="kind=hyperparameter,rank=1,step=3", combo={"optimizer": "adamw_fused"},
             config={"gate": "device"}, steps=6), None),
    "lr NaN from step 3 on": (
        dict(lr_nan_from=3, config={"max_consecutive_skips": 3}, steps=9), None),
    "refused at construction": (dict(run="refuse", what="weight", ranks=[1]), None),
    "check_state and load_state_dict after a restore": (
        dict(run="restore", what="optimizer_state", ranks=None), None),
}

#: FSDP2 and HSDP, 4 ranks (HSDP's replicas: ranks 0 and 2, 1 and 3).
FSDP_CASES: dict[str, tuple[Case, Expect | None]] = {
    "FSDP2 weight drill, one rank, skip": (
        dict(engine="fsdp2", inject="kind=weight,rank=1,step=3", steps=6),
        Expect(3, (1,), "weight inp.weight (1 of 32", "aborted", bad_weights=1)),
    "FSDP2 optimizer state written, one rank, rollback": (
        dict(engine="fsdp2", write=_written(3, "optimizer_state", [2]), policy="rollback",
             steps=8),
        Expect(4, (2,), "optimizer state inp.weight.exp_avg_sq (1 of 32", "rolled_back",
               applied_poisoned=True)),
    "FSDP2 buffer drill, one rank, rollback": (
        dict(engine="fsdp2", inject="kind=buffer,rank=1,step=3", policy="rollback", steps=6),
        Expect(3, (1,), "buffer norm.running_mean (1 of 16", "rolled_back", ("host1",))),
    "HSDP weight drill, one rank, skip": (
        dict(engine="hsdp", inject="kind=weight,rank=1,step=3", steps=6),
        Expect(3, (1,), "weight inp.weight (1 of 64", "repaired", ("host1",))),
    "HSDP optimizer state written, one rank, recover": (
        dict(engine="hsdp", write=_written(3, "optimizer_state", [2]), spikes="recover",
             steps=6),
        Expect(4, (2,), "optimizer state inp.weight.exp_avg_sq (1 of 64", "repaired",
               ("host2",), applied_poisoned=True)),
    "HSDP weight written on both replicas of a shard, skip": (
        dict(engine="hsdp", write=_written(3, "weight", [1, 3]), steps=6),
        Expect(3, (1, 3), "weight inp.weight (1 of 64", "aborted", bad_weights=1)),
    "HSDP weight drill, every rank, rollback": (
        dict(engine="hsdp", inject="kind=weight,step=3", policy="rollback", steps=6),
        Expect(3, (0, 1, 2, 3), "weight inp.weight (1 of 64", "rolled_back")),
    # (test_fingerprints_let_a_finite_replica_win_over_a_nan_majority)
    "DDP on 4 ranks, optimizer state written on 3, fingerprints every step": (
        dict(engine="ddp", write=_written(3, "optimizer_state", [1, 2, 3]), steps=6,
             config={"fingerprint_every": 1}), None),
}

#: DeepSpeed, 2 ranks: no snapshot (rollbacks are refused), no replica of a partition.
ZERO_CASES: dict[str, tuple[Case, Expect | None]] = {
    "ZeRO-1 weight drill, one rank": (
        dict(engine="zero1", inject="kind=weight,rank=1,step=2", steps=4),
        Expect(2, (1,), "weight inp.weight (1 of 128", "aborted", ("host1",), bad_weights=1)),
    "ZeRO-2 optimizer state drill, one rank": (
        dict(engine="zero2", inject="kind=optimizer_state,rank=1,step=2", steps=4),
        Expect(3, (0, 1), "optimizer state optimizer.0.exp_avg (1 of", "aborted",
               holders=(1,), applied_poisoned=True, bad_weights=1)),
    "ZeRO-2 buffer drill, every rank": (
        dict(engine="zero2", inject="kind=buffer,step=2", steps=4),
        Expect(2, (0, 1), "buffer norm.running_mean (1 of 16", "aborted")),
    "ZeRO-3 weight written in a partition, one rank": (
        dict(engine="zero3", write=_written(2, "weight", [1]), steps=4),
        Expect(2, (1,), "weight inp.weight (1 of 64", "aborted", bad_weights=1)),
    "ZeRO-3 hyperparameter drill": (
        dict(engine="zero3", inject="kind=hyperparameter,step=2", steps=4), None),
    "ZeRO-1 refused at construction": (
        dict(engine="zero1", run="refuse", what="weight", ranks=None), None),
}

#: What every rank must decide alike at every step.
SAME = ("step", "outcome", "applied", "bad_ranks", "bad_hosts", "kinds", "verdict",
        "poisoned_state", "state_action", "reason", "rolled_back_to", "excluded_hosts")


def _run(world: int, tmp: Path, cases: dict[str, tuple[Case, Expect | None]], engine: str,
         timeout: float) -> dict[str, list[dict[str, Any]]]:
    """Every case on ``world`` ranks in one process group: name -> each rank's outcome."""
    listed = [{"engine": engine, **case} for case, _ in cases.values()]
    outs = values(run_ranks(run_cases, world, tmp, cases=listed, report_dir=str(tmp / "r"),
                            run_dir=str(tmp / "v"), env={"DS_ACCELERATOR": "cpu"},
                            timeout=timeout))
    return {name: [out[i] for out in outs] for i, name in enumerate(cases)}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _run(2, tmp_path_factory.mktemp("state-ddp"), DDP_CASES, "ddp", timeout=120)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _run(4, tmp_path_factory.mktemp("state-fsdp"), FSDP_CASES, "fsdp2", timeout=150)


@pytest.fixture(scope="module")
def zero(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install -e '.[test]')")
    return _run(2, tmp_path_factory.mktemp("state-zero"), ZERO_CASES, "zero1", timeout=200)


# --- the checks every case takes -----------------------------------------------------------


def _nonfinite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum())


def _alike(name: str, ranks: list[dict[str, Any]]) -> None:
    """Every rank decided the same at every step, and ended alike."""
    first = ranks[0]
    for r, out in enumerate(ranks[1:], 1):
        assert [{k: rec[k] for k in SAME} for rec in out["records"]] == [
            {k: rec[k] for k in SAME} for rec in first["records"]], f"{name}: rank {r} differs"
        mine, theirs = out["error"], first["error"]
        assert (mine is None) == (theirs is None), f"{name}: rank {r} ended differently"
        if mine is not None:
            assert {k: mine[k] for k in ("type", *SAME)} == {
                k: theirs[k] for k in ("type", *SAME)}, f"{name}: rank {r} stopped differently"
        assert out.get("strikes") == first.get("strikes"), f"{name}: strikes differ"


def _incidents(out: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps (and the stop) that were incidents: something named, or not applied."""
    steps = [rec for rec in out["records"] if rec["kinds"] or not rec["applied"]]
    return steps + ([out["error"]] if out["error"] is not None else [])


def _reports(name: str, ranks: list[dict[str, Any]]) -> None:
    """One valid report per incident (rank 0 writes them), with its verdict and reason."""
    first = ranks[0]
    reports = first["reports"]
    assert all(r is not None for r in reports), f"{name}: a report is not valid JSON"
    incidents = _incidents(first)
    assert [r["step"] for r in reports] == [i["step"] for i in incidents], (
        f"{name}: reports of steps {[r['step'] for r in reports]}")
    for report, incident in zip(reports, incidents, strict=True):
        assert report["verdict"] == incident["verdict"], (name, report["verdict"])
        assert report["reason"] == incident["reason"], (name, report["reason"])
        assert report["bad_ranks"] == incident["bad_ranks"], name


def check_state_fault(name: str, ranks: list[dict[str, Any]], expect: Expect) -> None:
    """A state fault, as :class:`Expect` says; on every rank (see the module docstring)."""
    _alike(name, ranks)
    first = ranks[0]
    steps = {rec["step"]: rec for rec in first["records"]}
    found = first["error"] if expect.action == "aborted" else steps[expect.at]
    assert found is not None and found["step"] == expect.at, (name, found)
    # Named: the verdict, the tensor, the ranks holding it, what was done.
    assert found["verdict"] == "state" and "state" in found["kinds"], (name, found)
    assert sorted(found["poisoned_state"]) == list(expect.ranks), (name, found)
    holders = expect.ranks if expect.holders is None else expect.holders
    for rank, tensors in found["poisoned_state"].items():
        assert any(expect.tensor in t for t in tensors) == (rank in holders), (name, tensors)
        assert rank in found["bad_ranks"] and f"host{rank}" in found["bad_hosts"], (name, found)
    # Blamed: the ranks holding it, not those its shard only reached through an all-gather.
    assert found["bad_ranks"] == list(expect.ranks), (name, found["bad_ranks"])
    assert found["state_action"] == expect.action, (name, found)
    assert expect.tensor in found["reason"], (name, found["reason"])
    # Never a divergence, and only that step named the state.
    for out in ranks:
        assert all(rec["verdict"] != "divergence" for rec in out["records"]), name
        assert [rec["step"] for rec in out["records"] if rec["poisoned_state"]] == (
            [] if expect.action == "aborted" else [expect.at]), name
    # The hosts struck: those whose memory held it alone, and only where it was repaired
    # or one rank alone held it.
    assert sorted(first["strikes"]) == sorted(expect.struck), (name, first["strikes"])
    _reports(name, ranks)
    before = [rec for rec in first["records"] if rec["step"] < expect.at]
    assert all(rec["applied"] for rec in before), (name, before)
    if expect.action == "aborted":
        for r, out in enumerate(ranks):
            err = out["error"]
            assert err["type"] == "NonFiniteStateError" and err["outcome"] == "aborted", (
                name, r, err)
            assert out["exit_code"] == 6, (name, r, out["exit_code"])
        # Stopped at once: nothing applied from the poisoned state (the fault's own
        # elements are all that is non-finite).
        assert max(_nonfinite(out["state"]["params"]) for out in ranks) == (
            expect.bad_weights), name
        return
    for r, out in enumerate(ranks):
        assert out["error"] is None, (name, r, out["error"])
    # The steps it cost: the one it was found at, and (an optimizer-state fault found at
    # the next incident) the poisoned step before it, applied; then every step applies
    # (after a rollback, the batches it discards).
    # (A rollback for a poisoned state discards no batches: they were not its cause.)
    after = [rec for rec in first["records"] if rec["step"] > expect.at]
    assert after and all(rec["applied"] for rec in after), (name, after)
    if expect.action == "repaired":
        unapplied = [rec["step"] for rec in first["records"] if not rec["applied"]]
        assert len(unapplied) + expect.applied_poisoned <= 2, (name, unapplied)
    else:
        assert steps[expect.at]["rolled_back_to"] is not None, name
    if expect.applied_poisoned:
        assert steps[expect.at - 1]["applied"], name
    # Finite, and identical across replicas (gathered whole).
    for key in ("params", "optimizer"):
        tensors = [out["state"][key] for out in ranks]
        assert all(_nonfinite(t) == 0 for t in tensors), f"{name}: {key} not finite"
        assert all(torch.equal(t, tensors[0]) for t in tensors), f"{name}: {key} differ"
    assert all(_nonfinite(out["state"]["buffers"]) == 0 for out in ranks), name


def _check_all(outs: dict[str, list[dict[str, Any]]],
               cases: dict[str, tuple[Case, Expect | None]]) -> None:
    for name, (_, expect) in cases.items():
        if expect is not None:
            check_state_fault(name, outs[name], expect)


# --- the tests -----------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_ddp_repairs_one_rank_from_a_replica_and_stops_or_rolls_back_for_all(
    ddp: dict[str, list[dict[str, Any]]],
) -> None:
    """DDP, 2 ranks: a weight, optimizer-state or buffer fault on one rank (drill or written)
    is repaired from the other replica and its host struck, at a cost of one step (an
    optimizer-state fault found before a snapshot: none); every rank poisoned stops at once
    under skip and rolls back under recover."""
    _check_all(ddp, DDP_CASES)
    found_early = ddp["optimizer state drill before a snapshot, rollback"][0]["records"][4]
    assert found_early["applied"], found_early  # repaired before its own optimizer step


@pytest.mark.timeout(180)
def test_ddp_buffer_broadcast_names_its_source_alone(
    ddp: dict[str, list[dict[str, Any]]],
) -> None:
    """The buffer drill on rank 0, DDP's broadcast source: rank 1 received the NaN with the
    broadcast and is not named; both put back their own buffers, rank 0's repaired."""
    for out in ddp["buffer drill on the broadcast's source"]:
        rec = out["records"][3]
        assert rec["bad_ranks"] == [0] and rec["bad_hosts"] == ["host0"], rec
        assert rec["kinds"] == ["buffer", "state"] and rec["buffers_restored"] == 2, rec


@pytest.mark.timeout(180)
def test_a_poisoned_state_rolls_back_once_to_the_same_snapshot(
    ddp: dict[str, list[dict[str, Any]]],
) -> None:
    """Every rank's weight poisoned at step 3 and again at step 4, policy rollback: step 3
    rolls back to step 2's snapshot (its whole state finite); step 4 would lead back into the
    same restore, so the run stops there instead of cycling."""
    ranks = ddp["weight written, every rank, twice, rollback"]
    _alike("twice", ranks)
    first = ranks[0]
    rec = first["records"][3]
    assert (rec["outcome"], rec["rolled_back_to"], rec["state_action"]) == (
        "rolled_back", 2, "rolled_back"), rec
    assert sorted(rec["poisoned_state"]) == [0, 1] and rec["verdict"] == "state", rec
    for out in ranks:
        err = out["error"]
        assert err["type"] == "NonFiniteStateError" and err["step"] == 4, err
        assert "the snapshot kept was restored for it before" in err["reason"], err
        assert out["exit_code"] == 6
    _reports("twice", ranks)


@pytest.mark.timeout(180)
def test_a_nan_learning_rate_is_skipped_then_applied_or_stops_named(
    ddp: dict[str, list[dict[str, Any]]], zero: dict[str, list[dict[str, Any]]],
) -> None:
    """The hyperparameter drill (one step, every rank; DDP and ZeRO-3's engine step; and on
    rank 1 alone under DDP's device gate, which decides at the next call) skips that step on
    every rank with the param group and the hyperparameter named alike (rank 0's report too),
    puts the schedule's rate back and applies the next; a schedule that keeps returning NaN
    stops after max_consecutive_skips (3) with the same words: exit 3, the schedule's to fix."""
    for name, ranks, at in (("DDP", ddp["hyperparameter drill"], 3),
                            ("DDP, rank 1, device gate",
                             ddp["hyperparameter drill on rank 1, device gate"], 3),
                            ("ZeRO-3", zero["ZeRO-3 hyperparameter drill"], 2)):
        _alike(name, ranks)
        assert [out["gate"] for out in ranks] == ["device" if "gate" in name else "host"] * len(
            ranks), name
        for out in ranks:
            assert out["error"] is None, (name, out["error"])
            for rec in out["records"]:
                if rec["step"] == at:
                    assert (rec["outcome"], rec["kinds"], rec["bad_ranks"]) == (
                        "skipped", ["hyperparameter"], []), (name, rec)
                    assert "param group 0's lr is nan" in rec["reason"], (name, rec)
                    assert rec["injected"], (name, rec)
                else:
                    assert rec["applied"] and not rec["kinds"], (name, rec)
            assert out["lr"] == [out["base_lr"]], (name, out["lr"])  # the drill's put back
            assert all(_nonfinite(out["state"][k]) == 0 for k in ("params", "optimizer"))
        _reports(name, ranks)
    ranks = ddp["lr NaN from step 3 on"]
    _alike("NaN forever", ranks)
    for out in ranks:
        assert [rec["outcome"] for rec in out["records"]] == ["applied"] * 3 + ["skipped"] * 3
        err = out["error"]
        assert err["type"] == "NonFiniteError" and err["step"] == 6, err
        assert "param group 0's lr is nan" in err["reason"], err
        assert "max_consecutive_skips=3" in err["reason"] and err["kinds"] == [
            "hyperparameter"], err
        assert out["exit_code"] == 3
        assert all(_nonfinite(out["state"][k]) == 0 for k in ("params", "optimizer"))
    _reports("NaN forever", ranks)


def _refused(name: str, ranks: list[dict[str, Any]], said: list[dict[str, Any]], *,
             holders: list[int], tensor: str, when: str) -> None:
    """Refused on every rank alike, naming the tensor, each rank holding it and its host,
    and the element count; nothing applied; exit 6."""
    assert all(err is not None for err in said), (name, said)
    for r, err in enumerate(said):
        assert err["type"] == "NonFiniteStateError" and err["verdict"] == "state", (name, err)
        assert err["message"] == said[0]["message"], f"{name}: rank {r} says otherwise"
        assert when in err["message"] and tensor in err["message"], (name, err["message"])
        assert err["bad_ranks"] == holders and sorted(err["poisoned_state"]) == holders, err
        assert err["bad_hosts"] == [f"host{h}" for h in holders], err
        assert not err["applied"] and err["state_action"] == "aborted", err
        assert err.get("exit_code", ranks[r]["exit_code"]) == 6, (name, r)


@pytest.mark.timeout(240)
def test_a_checkpoint_with_a_nan_is_refused_before_any_step(
    ddp: dict[str, list[dict[str, Any]]], zero: dict[str, list[dict[str, Any]]],
) -> None:
    """A NaN restored with the model: refused at construction (DDP: one rank's weight;
    ZeRO-1: every rank's); after a restore by hand (DDP, Adam's exp_avg_sq on every rank),
    ``check_state()`` and ``load_state_dict`` refuse it on every rank, and the clean
    checkpoint restored after it is taken and trains on."""
    ranks = ddp["refused at construction"]
    _refused("DDP construction", ranks, [out["error"] for out in ranks], holders=[1],
             tensor="weight inp.weight (1 of 128 elements non-finite)", when="at construction")
    assert "(host host1)" in ranks[0]["error"]["message"]
    ranks = zero["ZeRO-1 refused at construction"]
    _refused("ZeRO-1 construction", ranks, [out["error"] for out in ranks], holders=[0, 1],
             tensor="weight inp.weight (1 of 128 elements non-finite)", when="at construction")
    ranks = ddp["check_state and load_state_dict after a restore"]
    for how in ("check_state", "load_state_dict"):
        _refused(how, ranks, [out["said"][how] for out in ranks], holders=[0, 1],
                 tensor="optimizer state inp.weight.exp_avg_sq (1 of 128 elements non-finite)",
                 when="after a restore")
    for out in ranks:  # the clean checkpoint: taken, and its next step applies
        assert [rec["applied"] for rec in out["records"]] == [True] * 4, out["records"]
        assert out["records"][-1]["step"] == 2 and out["step_after"] == 3
        assert all(_nonfinite(out["state"][k]) == 0 for k in ("params", "optimizer"))


@pytest.mark.timeout(240)
def test_fsdp2_rolls_back_or_stops_and_hsdp_repairs_within_its_replica_group(
    fsdp: dict[str, list[dict[str, Any]]],
) -> None:
    """FSDP2 (no replica of a shard): one rank's poisoned weight stops at once without a
    snapshot, its poisoned optimizer state or buffer rolls back to a finite snapshot. HSDP:
    one rank's poisoned weight or optimizer state is repaired from its replica (the other
    member of its replicate group), and its shard group's ranks, which the all-gather only
    reached, are not struck; both replicas of a shard poisoned stop; every rank poisoned rolls
    back."""
    _check_all(fsdp, FSDP_CASES)


@pytest.mark.timeout(240)
def test_fingerprints_let_a_finite_replica_win_over_a_nan_majority(
    fsdp: dict[str, list[dict[str, Any]]],
) -> None:
    """DDP on 4 ranks, fingerprints every step, Adam's exp_avg_sq poisoned on ranks 1-3: the
    step applies and their weights turn NaN, where the fingerprint pass reads them first.
    Non-finite loses to finite: ranks 1-3 are repaired from rank 0 and their hosts struck, and
    the run goes on with every replica finite and identical."""
    ranks = fsdp["DDP on 4 ranks, optimizer state written on 3, fingerprints every step"]
    _alike("a NaN majority", ranks)
    for out in ranks:
        assert out["error"] is None, out["error"]
        assert sorted(out["strikes"]) == ["host1", "host2", "host3"], out["strikes"]
    for key in ("params", "optimizer"):
        tensors = [out["state"][key] for out in ranks]
        assert all(_nonfinite(t) == 0 for t in tensors), key
        assert all(torch.equal(t, tensors[0]) for t in tensors), key


@pytest.mark.timeout(300)
def test_deepspeed_zero_stops_at_once_naming_the_partition(
    zero: dict[str, list[dict[str, Any]]],
) -> None:
    """ZeRO 1, 2, 3 (no replica of a partition, no snapshot): a poisoned weight (ZeRO-3: in
    a parameter's partition), optimizer-state tensor (ZeRO's flat partition, whose update
    poisoned the weights one step before it was found) or buffer stops every rank at once
    with ``NonFiniteStateError`` naming it, exit 6."""
    _check_all(zero, ZERO_CASES)
