"""See NaN coming and recover, on gloo ranks: blame by replay (data, host, transient),
spikes before NaN, rollback with a halved learning rate, and the order of the warnings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_recovery import blame, divergence, exploding, one_rank_spikes


@pytest.mark.timeout(150)
def test_nan_producing_batch_is_data_quarantined_and_training_goes_on(tmp_path: Path) -> None:
    outs = values(run_ranks(blame, 4, tmp_path, scenario="data", steps=9,
                            report_dir=str(tmp_path / "r"), timeout=120))
    for out in outs:
        recs = out["records"]
        assert recs[3]["bad_ranks"] == [1] and recs[3]["verdict"] == "data"
        assert recs[3]["kinds"] == ["loss", "grad"]  # the batch itself was finite
        # The same batch on another rank later: recognised, skipped, nobody blamed.
        assert recs[6]["quarantined"] and recs[6]["bad_ranks"] == [] and not recs[6]["applied"]
        assert [r["applied"] for i, r in enumerate(recs) if i not in (3, 6)] == [True] * 7
        assert out["strikes"] == {}  # data is not the host's fault
        assert len(out["quarantine"]) == 1
    w = [o["weights"] for o in outs]
    assert all(torch.equal(x, w[0]) for x in w) and torch.isfinite(w[0]).all()
    report = json.loads(Path(outs[0]["records"][3]["report_path"]).read_text())
    assert report["verdict"] == "data" and report["first_nonfinite_module"] == "inp"
    # The replay's peer is named beside the blamed rank, on another host.
    peer = next(r for r in report["ranks"].values() if "peer_replay" in r)
    assert peer["hostname"] != report["ranks"]["1"]["hostname"]
    assert peer["peer_replay"]["finite"] is False and peer["replayed_for"] == 1


@pytest.mark.timeout(150)
def test_replay_with_a_collective_in_the_forward_runs_in_lockstep(tmp_path: Path) -> None:
    """The forward all-reduces its token count: every rank replays, so the collectives pair
    up, the detection stays a skip (no crash, no hang), and anomaly mode is declined."""
    runs = run_ranks(blame, 4, tmp_path, scenario="data", steps=5, count_tokens=True,
                     replay_anomaly=True, report_dir=str(tmp_path / "r"), timeout=120)
    assert [r["exitcode"] for r in runs] == [0, 0, 0, 0]
    for out in values(runs):
        recs = out["records"]
        assert recs[3]["bad_ranks"] == [1] and recs[3]["verdict"] == "data"
        assert not recs[3]["applied"]
        assert [r["applied"] for i, r in enumerate(recs) if i != 3] == [True] * 4
    report = json.loads(Path(values(runs)[0]["records"][3]["report_path"]).read_text())
    own = report["ranks"]["1"]["replay"]
    assert own["finite"] is False and own["collectives"] >= 1
    assert "collectives" in own["anomaly_skipped"] and own["anomaly"] is None
    peer = next(r for r in report["ranks"].values() if "peer_replay" in r)
    assert peer["peer_replay"]["finite"] is False and peer["replayed_for"] == 1


@pytest.mark.timeout(150)
def test_faulty_device_is_host_and_injected_fault_is_transient(tmp_path: Path) -> None:
    outs = values(run_ranks(blame, 4, tmp_path, scenario="host", steps=7,
                            inject="kind=grad,rank=1,step=5", host_strikes=99,
                            report_dir=str(tmp_path / "r"), timeout=120))
    for out in outs:
        recs = out["records"]
        assert recs[3]["bad_ranks"] == [1] and recs[3]["verdict"] == "host"
        assert recs[5]["bad_ranks"] == [1] and recs[5]["verdict"] == "transient"
        assert out["strikes"] == {"host0": [3, 5]}  # both earn a strike: hardware suspect
    report = json.loads(Path(outs[0]["records"][3]["report_path"]).read_text())
    assert report["ranks"]["1"]["replay"]["finite"] is False
    peer = next(r for r in report["ranks"].values() if "peer_replay" in r)
    assert peer["hostname"] == "host1" and peer["peer_replay"]["finite"] is True  # fine there
    assert report["first_nonfinite_module"] == "out"  # the first module fed the bad values


@pytest.mark.timeout(150)
def test_exploding_gradient_is_seen_in_the_grad_norm_before_the_loss(tmp_path: Path) -> None:
    recs = values(run_ranks(exploding, 2, tmp_path, steps=30, boom=22,
                            report_dir=str(tmp_path / "r"), timeout=120))[0]
    grad_spikes = [r["step"] for r in recs if "grad_norm" in r["spikes"]]
    loss_spikes = [r["step"] for r in recs if "loss" in r["spikes"]]
    assert grad_spikes and loss_spikes, recs
    assert grad_spikes[0] == 22 and grad_spikes[0] < loss_spikes[0], (grad_spikes, loss_spikes)
    assert recs[22]["applied"]  # default action: warn
    assert recs[22]["verdict"] == "divergence"  # every rank at once


@pytest.mark.timeout(150)
def test_learning_rate_blowup_is_caught_rolled_back_and_then_converges(tmp_path: Path) -> None:
    outs = values(run_ranks(
        divergence, 2, tmp_path, steps=80, jump=30, report_dir=str(tmp_path / "r"),
        policy="rollback", loss_spike_action="rollback", grad_spike_action="rollback",
        snapshot_every=5, spike_warmup=10, spike_window=20, rollback_skip_batches=2,
        timeout=120,
    ))
    for out in outs:
        recs = out["records"]
        rollbacks = [r for r in recs if r["outcome"] == "rolled_back"]
        assert rollbacks, [(r["step"], r["outcome"], r["loss"]) for r in recs]
        first = rollbacks[0]
        assert first["spikes"] and first["verdict"] == "divergence"
        assert 25 <= first["rolled_back_to"] <= first["step"] and first["lr_factor"] == 0.5
        # Seen before NaN: nothing was ever non-finite.
        assert all(not r["kinds"] for r in recs) and all(math.isfinite(r["loss"]) for r in recs)
        # Two discarded batches after the rollback, then training with the halved LR.
        after = recs[first["step"] + 1 : first["step"] + 3]
        assert [r["reason"].startswith("discarding batches") for r in after] == [True, True]
        assert len(rollbacks) <= 2
        assert out["final_loss"] < 0.05 and out["final_loss"] < out["first_loss"] / 10
    assert torch.equal(outs[0]["weights"], outs[1]["weights"])
    first = next(r for r in outs[0]["records"] if r["outcome"] == "rolled_back")
    report = json.loads(Path(first["report_path"]).read_text())
    assert report["outcome"] == "rolled_back" and report["rolled_back_to"] is not None


@pytest.mark.timeout(150)
def test_spikes_recover_decides_alike_on_every_rank_when_one_ranks_loss_spikes(
        tmp_path: Path) -> None:
    """Issue 38: spikes="recover" on 2 gloo ranks, rank 1's loss spiking for two steps in a
    row (its batches' targets negated: the batch's norm as usual): the first is skipped
    (spike_patience=2), the second rolls back, on both ranks at the same step, naming rank 1;
    the weights stay finite and equal."""
    outs = values(run_ranks(one_rank_spikes, 2, tmp_path, steps=40, bad=[25, 26],
                            report_dir=str(tmp_path / "r"), timeout=120))
    decisions = [[(r["outcome"], r["rolled_back_to"], r["spikes"], r["lr_factor"])
                  for r in out["records"]] for out in outs]
    assert decisions[0] == decisions[1]
    recs = outs[0]["records"]
    assert recs[25]["outcome"] == "skipped" and 1 in recs[25]["spikes"]["loss"]
    assert 0 not in recs[25]["spikes"]["loss"] and "before a rollback" in recs[25]["reason"]
    assert recs[26]["outcome"] == "rolled_back" and recs[26]["rolled_back_to"] <= 25
    assert recs[26]["lr_factor"] == 0.5
    assert all(r["outcome"] == "applied" for r in recs[:25]), [r["outcome"] for r in recs]
    assert all(r["outcome"] == "skipped" for r in recs[27:37])  # the batches discarded
    assert all(r["outcome"] == "applied" for r in recs[37:])
    w = [o["weights"] for o in outs]
    assert torch.equal(w[0], w[1]) and torch.isfinite(w[0]).all()


@pytest.mark.timeout(150)
def test_one_ranks_bad_shard_is_skipped_on_every_rank_not_rolled_back(tmp_path: Path) -> None:
    """Rank 1's batches at steps 25-30 carry targets 30x too large: its loss spikes and so does
    its batch's norm against rank 1's own reference. Both ranks read the same totals and skip
    each of those steps as the data's, naming rank 1; nothing is rolled back."""
    bad = list(range(25, 31))
    outs = values(run_ranks(one_rank_spikes, 2, tmp_path, steps=36, bad=bad,
                            corrupt="scale", report_dir=str(tmp_path / "r"), timeout=120))
    decisions = [[(r["outcome"], r["spikes"], r["reason"]) for r in out["records"]]
                 for out in outs]
    assert decisions[0] == decisions[1]
    recs = outs[0]["records"]
    outcomes = [r["outcome"] for r in recs]
    assert [outcomes[s] for s in bad] == ["skipped"] * len(bad), outcomes
    for s in bad:
        assert 1 in recs[s]["spikes"]["loss"] and 0 not in recs[s]["spikes"]["loss"]
        assert "the data's, not the weights'" in recs[s]["reason"]
    assert all(o == "applied" for i, o in enumerate(outcomes) if i not in bad), outcomes
    report = json.loads(Path(recs[bad[0]]["report_path"]).read_text())
    assert report["cluster"]["spiking"]["with_their_batch"] == 1
    w = [o["weights"] for o in outs]
    assert torch.equal(w[0], w[1]) and torch.isfinite(w[0]).all()
