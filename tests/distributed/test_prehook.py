"""Gradients reduced by the loop's own collectives, checked in process-group pre-hooks.

On torch >= 2.14 (engines/prehook.py) three hand-written loops on 2 gloo ranks, none of which
calls ``check_grads()`` (per-parameter ``all_reduce``, one flattened ``all_reduce``, a
``reduce_scatter_tensor`` then ``all_gather_into_tensor``), plus one that does: rank 1's
poisoned gradient is blamed on rank 1 alone with its parameter named, the step is skipped on
both ranks, the metrics count it on rank 1, and the second strike excludes its host; the
gradient norm of a healthy step is the norm of the gradients as they left (before the
average). Below 2.14 the three loops are refused at their first step with the feature, the
torch found and the minimum, and the ``check_grads()`` loop runs as before.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from nansentinel.common import torch_insides as insides
from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_prehook import (
    FAULTS,
    LOOPS,
    SHARDED_CLIP,
    forward_origin,
    refused,
    scenarios,
    sharded_clip,
)

HOOKS = insides.supported("collective_hooks")
MINIMUM = insides.FEATURES["collective_hooks"].minimum


def _expected(step: int) -> tuple[str, list[int]]:
    return ("skipped", [1]) if step in FAULTS else ("applied", [])


@pytest.mark.timeout(240)
@pytest.mark.skipif(not HOOKS, reason=f"collective pre-hooks need torch >= {MINIMUM}")
@pytest.mark.parametrize("loop", LOOPS)
def test_each_loop_blames_the_poisoned_rank_before_its_reduction(
        runs: tuple[Path, list[Any]], loop: str) -> None:
    tmp, every = runs
    outs = [out[loop] for out in every]
    excluded = (tmp / "r" / f"excluded-{loop}.jsonl").read_text()
    assert '"node1"' in excluded and '"node0"' not in excluded
    for rank, out in enumerate(outs):
        assert out["path"] == "collective pre-hooks"
        # The second strike (step FAULTS[1]) excludes rank 1's host, on every rank.
        assert out["error"] == {"type": "HostExcludedError", "step": FAULTS[1],
                                "excluded": ["node1"]}, out["error"]
        assert [r["step"] for r in out["records"]] == list(range(FAULTS[1]))
        for rec in out["records"]:
            outcome, bad = _expected(rec["step"])
            assert (rec["outcome"], rec["bad_ranks"]) == (outcome, bad), rec
            if bad:
                assert rec["kinds"] == ["grad"] and rec["bad_hosts"] == ["node1"], rec
                assert rec["parameters"] == {1: ["2.weight"]}, rec
            else:  # the norm of what left this rank, not of the average that came back
                assert math.isclose(rec["norm"], rec["local"], rel_tol=1e-5), rec
        assert out["skipped"] == 1.0
        assert out["blamed"] == out["grad_faults"] == (2.0 if rank == 1 else 0.0)
    weights = [out["weights"] for out in outs]
    assert torch.isfinite(weights[0]).all()
    assert torch.equal(weights[0], weights[1]), "the replicas diverged"


@pytest.mark.timeout(240)
@pytest.mark.skipif(not HOOKS, reason=f"collective pre-hooks need torch >= {MINIMUM}")
def test_the_first_poisoned_gradient_collective_names_the_origin(tmp_path: Path) -> None:
    """Issue 59: reduce-scatter, a norm all-reduce, all-gather. Rank 1's NaN lands in rank
    0's shard, so both ranks send a NaN in some gradient collective; the reduce-scatter came
    first and was non-finite on rank 1 alone: rank 1 is blamed and its host struck and
    excluded, rank 0 is named as reached, never blamed (it was both, verdict divergence)."""
    outs = values(run_ranks(sharded_clip, 2, tmp_path, report_dir=str(tmp_path / "r"),
                            timeout=200))
    excluded = (tmp_path / "r" / f"excluded-{SHARDED_CLIP}.jsonl").read_text()
    assert '"node1"' in excluded and '"node0"' not in excluded
    for rank, out in enumerate(outs):
        assert out["error"] == {"type": "HostExcludedError", "step": FAULTS[1],
                                "excluded": ["node1"]}, (rank, out["error"])
        for rec in out["records"]:
            outcome, bad = _expected(rec["step"])
            assert (rec["outcome"], rec["bad_ranks"], rec["bad_hosts"]) == (
                outcome, bad, [f"node{b}" for b in bad]), rec
        assert out["blamed"] == (2.0 if rank == 1 else 0.0)
    report = json.loads(next((tmp_path / "r").glob(f"incident-*-step{FAULTS[0]:08d}.json"))
                        .read_text())
    assert report["bad_ranks"] == [1] and report.get("verdict") != "divergence", report
    trace = report["origin_trace"]
    assert trace["origins"] == [1] and trace["collective"] == 1, trace
    assert trace["op"].startswith("reduce_scatter_tensor on group"), trace
    assert report["ranks"]["0"]["reached"] is True, report["ranks"]


@pytest.mark.timeout(240)
@pytest.mark.skipif(HOOKS, reason=f"torch >= {MINIMUM} checks these loops (test above)")
def test_below_the_minimum_a_loop_that_reduced_first_is_refused(tmp_path) -> None:
    outs = values(run_ranks(refused, 2, tmp_path, report_dir=str(tmp_path / "r"), timeout=200))
    for out in outs:
        for loop in LOOPS:
            if loop == "checked":  # check_grads() before its all-reduce: as before
                assert out[loop]["path"] == "local gradients"
                assert out[loop]["error"]["type"] == "HostExcludedError"
                continue
            message = out[loop].get("message", "")
            assert out[loop].get("refused") == "TorchTooOld", out[loop]
            assert f"needs torch >= {MINIMUM}" in message
            assert f"this is torch {torch.__version__}" in message
            assert "register_pre_hook" in message and "step 0" in message
            assert "check_grads()" in message


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    tmp = tmp_path_factory.mktemp("prehook")
    return tmp, values(run_ranks(scenarios, 2, tmp, report_dir=str(tmp / "r"), timeout=220))


def _trace(rec: dict[str, Any]) -> dict[str, Any]:
    return json.loads(Path(rec["report"]).read_text())["origin_trace"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("persistent", [False, True], ids=["transient", "faulty-device"])
def test_the_first_non_finite_forward_send_names_the_origin(tmp_path: Path,
                                                           persistent: bool) -> None:
    """Rank 1 writes a NaN into its activations before a forward all-reduce (row-parallel),
    so every rank's loss is non-finite. On torch >= 2.14 the step's own send buffers name
    rank 1 (collective #1), transient or not, with or without a replay function; below it,
    the replay's trace agrees where the fault reproduces, and a transient fault without a
    replay function cannot be traced (every rank is named)."""
    outs = values(run_ranks(forward_origin, 2, tmp_path, report_dir=str(tmp_path / "r"),
                            persistent=persistent, timeout=180))
    exact = HOOKS or persistent
    for out in outs:
        assert out["path"] == ("collective pre-hooks" if HOOKS else "local gradients")
        recs = out["records"]
        faulty = [1, 2] if persistent else [1]
        assert [r["outcome"] for r in recs] == [
            "skipped" if r["step"] in faulty else "applied" for r in recs]
        for rec in (recs[i] for i in faulty):
            if exact:
                assert rec["bad_ranks"] == [1] and rec["reached"] == [0], rec
                assert "activation" in rec["kinds"], rec
            else:
                assert rec["bad_ranks"] == [0, 1] and rec["reached"] == [], rec
        assert torch.isfinite(out["weights"]).all()
    trace = _trace(outs[0]["records"][1])
    if exact:
        assert trace["origins"] == [1] and trace["collective"] == 1, trace
        assert trace["op"].endswith("on group 0") and "all" in trace["op"], trace
    else:
        assert trace["origins"] == [] and "no replay function" in trace["reason"], trace
