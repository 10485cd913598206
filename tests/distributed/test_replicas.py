"""Replica fingerprints on gloo: a silently flipped bit on one replica is found within
``fingerprint_every`` steps, named identically on every rank, and repaired in place (DDP, and
HSDP within the replica group); two replicas without a majority are named, not repaired; 300
healthy steps with skips and rollbacks (a fingerprint every step) raise no false alarm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_replicas import ddp_scenarios, pair_scenarios, run


def _flagged(out: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in out["records"] if "replica" in r["kinds"]]


def _identical(outs: list[dict[str, Any]]) -> None:
    """Weights and optimizer state bit-identical across these replicas."""
    first = outs[0]["state"]
    assert first and any(".exp_avg" in name for name in first)
    for out in outs[1:]:
        assert out["state"].keys() == first.keys()
        for name, t in first.items():
            assert torch.equal(out["state"][name], t), f"{name} differs after the repair"


def _found_and_repaired(outs: list[dict[str, Any]], *, step: int, bad: list[int],
                        group: list[int]) -> None:
    for out in outs:
        assert out["error"] is None, out["error"]
        flagged = _flagged(out)
        assert [r["step"] for r in flagged] == [step], flagged  # found once, nothing else
        rec = flagged[0]
        assert rec["bad_ranks"] == bad and rec["verdict"] == "sdc"
        assert rec["kinds"] == ["replica"] and rec["outcome"] == "applied"
        assert rec["parameters"] == {bad[0]: ["0.weight"]}
        assert f"replica group {group}" in rec["reason"] and "repaired" in rec["reason"]
        assert all(r["bad_ranks"] == [] for r in out["records"] if r is not rec)
    assert [o["divergences"] for o in outs] == [1.0 if r in bad else 0.0
                                                for r in range(len(outs))]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("replicas")
    return values(run_ranks(ddp_scenarios, 4, tmp, report_dir=str(tmp / "reports"),
                            timeout=120))


@pytest.mark.timeout(150)
def test_ddp_flip_is_found_named_and_repaired(ddp: list[dict[str, Any]]) -> None:
    outs = [r["flip"] for r in ddp]
    # Flipped after rank 2's step 5; checks run after steps 1, 3, 5, 7, 9: found at 7.
    _found_and_repaired(outs, step=7, bad=[2], group=[0, 1, 2, 3])
    assert "ranks [0, 1, 3] (which agreed)" in _flagged(outs[0])[0]["reason"]
    assert "within the last 2 step(s)" in _flagged(outs[0])[0]["reason"]
    _identical(outs)
    report = json.loads(Path(_flagged(outs[0])[0]["report_path"]).read_text())
    assert report["bad_ranks"] == [2] and report["verdict"] == "sdc"
    assert report["lasted_steps"] == 2 and report["action"] == "repair"
    assert report["groups"][0]["agreed"] == [0, 1, 3]
    assert report["strikes"] == {_flagged(outs[0])[0]["bad_hosts"][0]: 1}  # one strike


@pytest.mark.timeout(150)
def test_bitflip_drill_end_to_end(ddp: list[dict[str, Any]]) -> None:
    outs = [r["drill"] for r in ddp]
    # Flipped at step 2, between checks (after steps 1, 3, 5): the next check finds it.
    _found_and_repaired(outs, step=3, bad=[1], group=[0, 1, 2, 3])
    _identical(outs)


@pytest.mark.timeout(150)
def test_hsdp_flip_is_repaired_within_its_replica_group(tmp_path: Path) -> None:
    outs = values(run_ranks(run, 6, tmp_path, mesh="hsdp", replicate=3, steps=10,
                            flip=(2, 5), fingerprint_every=2,
                            report_dir=str(tmp_path / "reports"), timeout=120))
    # Mesh rows [0, 1], [2, 3], [4, 5]: rank 2's replicas are ranks 0 and 4.
    _found_and_repaired(outs, step=7, bad=[2], group=[0, 2, 4])
    for group in ([0, 2, 4], [1, 3, 5]):
        _identical([outs[r] for r in group])
    assert outs[0]["found"][0][1][0]["agreed"] == [0, 4]


@pytest.mark.timeout(150)
def test_two_replicas_without_a_majority_are_both_named(tmp_path: Path) -> None:
    outs = values(run_ranks(pair_scenarios, 2, tmp_path, report_dir=str(tmp_path / "r"),
                            timeout=120))
    for out in (o["repair"] for o in outs):
        assert out["error"] is not None and out["error"]["step"] == 3, out["error"]
        assert out["error"]["bad_ranks"] == [0, 1]
        message = out["error"]["message"]
        assert "no majority" in message and "rank 0 (host" in message
        assert "rank 1 (host" in message and "aborting" in message
    for out in (o["warn"] for o in outs):
        assert out["error"] is None
        flagged = _flagged(out)
        assert [r["step"] for r in flagged] == [3, 4, 5]  # never repaired: found each check
        assert all(r["bad_ranks"] == [0, 1] and "no majority" in r["reason"] for r in flagged)
    assert not torch.equal(outs[0]["warn"]["state"]["0.weight"],
                           outs[1]["warn"]["state"]["0.weight"])
    # A NaN no loss reads (a frozen, unused parameter), on one of two replicas: the check after
    # step 3 finds it (fingerprints every 2 steps), step 4 reads the state, names it, repairs
    # it from the finite replica (no vote) and strikes its host; nothing is lost.
    for out in (o["nan_one"] for o in outs):
        assert out["error"] is None, out["error"]
        assert [r["outcome"] for r in out["records"]] == ["applied"] * 6
        rec = out["records"][4]
        assert rec["verdict"] == "state" and rec["state_action"] == "repaired", rec
        assert rec["poisoned_state"] == {1: ["weight frozen (1 of 4 elements non-finite)"]}
        assert rec["bad_hosts"] == ["host1"] and all(
            r["poisoned_state"] == {} for r in out["records"] if r is not rec)
    _identical([o["nan_one"] for o in outs])
    assert all(torch.isfinite(o["nan_one"]["state"]["frozen"]).all() for o in outs)
    # On both: no finite copy, no snapshot kept: the run stops at once at step 4, naming it.
    for out in (o["nan_both"] for o in outs):
        error = out["error"]
        assert error is not None and error["type"] == "NonFiniteStateError", error
        assert error["step"] == 4 and error["verdict"] == "state", error
        assert "weight frozen (1 of 4 elements non-finite)" in error["message"]
        assert "restore another checkpoint" in error["message"]


#: 300 steps, a fingerprint every step, three rollbacks (each discarding 3 batches) spread
#: over it, the last 50 steps after the last one (500 steps until 2026-12-06: CI time).
HEALTHY = dict(steps=300, fingerprint_every=1, policy="rollback", snapshot_every=20,
               rollback_skip_batches=3, inject="kind=loss,rank=1,step=60;kind=grad,rank=0,"
               "step=170;kind=batch,rank=1,step=250")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mesh", ["ddp", "hsdp"])
def test_no_false_alarm_in_300_steps(tmp_path: Path, mesh: str) -> None:
    outs = values(run_ranks(run, 4, tmp_path, mesh=mesh, replicate=2,
                            report_dir=str(tmp_path / "r"), timeout=110, **HEALTHY))
    for out in outs:
        assert out["error"] is None, out["error"]
        assert len(out["records"]) == 300 and not _flagged(out) and not out["found"]
        outcomes = [r["outcome"] for r in out["records"]]
        assert outcomes.count("rolled_back") == 3, outcomes
        assert outcomes.count("skipped") == 9  # after each rollback: 3 batches discarded
        assert out["divergences"] == 0.0
    groups = [[0, 1, 2, 3]] if mesh == "ddp" else [[0, 2], [1, 3]]
    for group in groups:
        _identical([outs[r] for r in group])


@pytest.mark.timeout(150)
def test_a_diverged_replica_strikes_its_host_and_the_strikes_exclude_it(tmp_path: Path) -> None:
    """The strike goes the existing way: at ``host_strikes`` the host is excluded (the record
    the launcher reads is written, HostExcludedError on every rank)."""
    excl = tmp_path / "excluded.jsonl"
    outs = values(run_ranks(run, 3, tmp_path, mesh="ddp", steps=6, one_host_each=True,
                            report_dir=str(tmp_path / "r"), fingerprint_every=1, host_strikes=1,
                            inject="kind=bitflip,rank=1,step=3", exclusion_file=str(excl),
                            timeout=120))
    for out in outs:
        assert out["error"] is not None and out["error"]["type"] == "HostExcludedError", out
        assert out["error"]["step"] == 3 and out["error"]["bad_ranks"] == [1]
    records = [json.loads(line) for line in excl.read_text().splitlines()]
    assert [r["host"] for r in records] == ["host1"]
