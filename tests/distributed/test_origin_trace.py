"""A faulty device behind a collective in the forward (issue 31), on 4 gloo ranks, one host
each: the rank where it began is named alone, on every rank, and its host struck.

One start of the ranks runs every case in turn (suite in workers_origin.py): DDP with a
forward that centres a layer's output on its mean over every rank's batch (an all-reduce of
values, as SyncBatchNorm's statistics) — a persistent device fault on rank 1 from step 3, a
NaN batch on rank 1, a fault that is gone by the replay — and an MoE layer (top-1 routing,
one expert per rank, ``all_to_all_single`` dispatch and combine) whose rank-1 expert is
faulty. On main the first and the last named every rank and called it a divergence (nobody
struck), or named the three healthy ranks and called the faulty one reached.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_origin import suite


@pytest.fixture(scope="module")
def outs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("origin")
    runs = run_ranks(suite, 4, tmp, report_dir=str(tmp / "r"), timeout=170)
    assert [r["exitcode"] for r in runs] == [0, 0, 0, 0]
    return values(runs)


def _report(rec: dict[str, Any]) -> dict[str, Any]:
    return json.loads(Path(rec["report"]).read_text())


@pytest.mark.timeout(200)
def test_a_faulty_device_before_an_all_reduce_of_values_is_named_struck_and_excluded(
    outs: list[dict[str, Any]],
) -> None:
    """The issue's case: from step 3 rank 1's first layer writes NaN into its output every time
    it runs. Rank 1 alone is blamed, the others reached, verdict host; node1 is struck at
    steps 3 and 4 and excluded at its third strike, step 5: HostExcludedError on every rank,
    the documented end of a run whose host is excluded (``nansentinel run`` then restarts
    without it). The steps before the fault train normally; the weights stay finite and
    identical on every rank."""
    for out in (o["device"] for o in outs):
        recs = out["records"]
        assert [r["applied"] for r in recs] == [True, True, True, False, False]
        for rec in recs[3:]:
            assert rec["bad_ranks"] == [1] and rec["bad_hosts"] == ["node1"], rec
            assert rec["reached"] == [0, 2, 3] and rec["verdict"] == "host", rec
            assert "activation" in rec["kinds"], rec
        assert out["error"]["type"] == "HostExcludedError" and out["error"]["step"] == 5
        assert "excluding host node1 at step 5" in out["error"]["message"]
        assert "host node1 blamed 3 times" in out["error"]["message"]
        assert out["strikes"] == {"node1": [3, 4, 5]}  # nobody else
    weights = [torch.cat([w.reshape(-1) for w in o["device"]["weights"]]) for o in outs]
    assert all(torch.equal(w, weights[0]) for w in weights) and torch.isfinite(weights[0]).all()
    report = _report(outs[0]["device"]["records"][3])
    assert report["origin_trace"] == {"origins": [1], "collective": 1,
                                      "op": "allreduce on group 0", "reason": ""}
    assert report["ranks"]["1"]["replay"]["first_collective"] == 1
    # The peer replayed rank 1's batch on a healthy device: its own input to the all-reduce
    # was finite; what went non-finite later came from rank 1 through it.
    peer = next(r for r in report["ranks"].values() if "peer_replay" in r)
    assert peer["replayed_for"] == 1 and peer["hostname"] != "node1"
    assert peer["peer_replay"]["first_collective"] is None
    assert "after rank 1's forward" in report["ranks"]["0"]["boundary"][-1]


@pytest.mark.timeout(200)
def test_an_moe_experts_faulty_device_is_named_behind_its_all_to_all(
    outs: list[dict[str, Any]],
) -> None:
    """Rank 1's expert writes NaN into its output from step 1: the tokens every rank routed
    to it come back non-finite by the combine all-to-all. At step 2 rank 1 routed none of
    its own tokens to itself: its loss is finite, only its expert's gradients are not — after
    every other rank's loss, so the order of points alone called it reached."""
    for out in (o["moe"] for o in outs):
        recs = out["records"]
        assert [r["applied"] for r in recs] == [True, False, False]
        for rec in recs[1:]:
            assert rec["bad_ranks"] == [1] and rec["reached"] == [0, 2, 3], rec
            assert rec["verdict"] == "host" and "activation" in rec["kinds"], rec
        assert "loss" in recs[1]["kinds"] and "loss" not in recs[2]["kinds"]
        assert out["strikes"] == {"node1": [1, 2]} and out["error"] is None
        assert all(torch.isfinite(w).all() for w in out["weights"])
    group = outs[0]["moe"]["group"]
    trace = _report(outs[0]["moe"]["records"][2])["origin_trace"]
    # #1 the token counts (integers), #2 the dispatch (finite everywhere), #3 the combine.
    assert trace["origins"] == [1] and trace["collective"] == 3, trace
    assert trace["op"] == f"all_to_all_single on group {group}", trace


@pytest.mark.timeout(200)
def test_a_nan_batch_behind_the_same_collective_still_names_the_batchs_rank(
    outs: list[dict[str, Any]],
) -> None:
    """The batch is checked where it enters: no trace is needed, the verdict is data (the
    batch quarantined), no host is struck."""
    for out in (o["batch"] for o in outs):
        rec = out["records"][1]
        assert rec["bad_ranks"] == [1] and rec["reached"] == [0, 2, 3], rec
        assert "batch" in rec["kinds"] and rec["verdict"] == "data", rec
        assert [r["applied"] for r in out["records"]] == [True, False, True]
        assert out["strikes"] == {}
    assert _report(outs[0]["batch"]["records"][1])["origin_trace"] is None


@pytest.mark.timeout(200)
def test_a_fault_that_does_not_come_back_keeps_divergence_and_says_why(
    outs: list[dict[str, Any]],
) -> None:
    """Rank 1's layer is faulty in the step's forward only: the trace finds no non-finite
    collective input, every rank stays named, the verdict is today's (divergence: every
    host bad, nobody struck) and the report says why the origin could not be told."""
    for out in (o["transient"] for o in outs):
        rec = out["records"][1]
        assert rec["bad_ranks"] == [0, 1, 2, 3] and rec["verdict"] == "divergence", rec
        assert [r["applied"] for r in out["records"]] == [True, False, True]
        assert out["strikes"] == {}
    trace = _report(outs[0]["transient"]["records"][1])["origin_trace"]
    assert trace["origins"] == [] and "did not reproduce" in trace["reason"], trace
