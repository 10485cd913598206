"""Never hang: a rank that dies or freezes mid-run is named by the others within the timeout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nansentinel.common.exitcodes import EXIT_EXCHANGE_TIMEOUT
from tests.distributed.harness import run_ranks, values
from tests.distributed.workers import stall

TIMEOUT = 4.0

#: DETAIL's own monitored barrier reports a dead peer before any collective of the sentinel's
#: can ("ProcessGroupWrapper: Monitored Barrier encountered error"), so what these tests check,
#: the sentinel's naming of the missing rank, runs without it.
NO_DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "OFF"}


@pytest.mark.timeout(120)
def test_killed_rank_is_named_by_the_others(tmp_path: Path) -> None:
    results = run_ranks(stall, 3, tmp_path, expect_all=False, victim=2, at_step=2, how="kill",
                        env=NO_DETAIL,
                        report_dir=str(tmp_path / "r"), run_dir=str(tmp_path / "run"),
                        exchange_timeout=TIMEOUT, timeout=90)
    assert results[2].get("missing") and results[2]["exitcode"] == -9
    for r in results[:2]:
        out = r["value"]
        assert out["error"] and "no answer from rank 2 (host2)" in out["error"], out
        assert "step 2" in out["error"]
        assert out["seconds"] < TIMEOUT + 15


@pytest.mark.timeout(120)
def test_frozen_rank_is_named_and_the_others_exit_within_the_timeout(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    results = run_ranks(stall, 3, tmp_path, expect_all=False, wait_for=[0, 2], victim=1,
                        env=NO_DETAIL,
                        at_step=2, how="stop",
                        report_dir=str(tmp_path / "r"), run_dir=str(run_dir),
                        exchange_timeout=TIMEOUT, timeout=60)
    # The live ranks were ended by the watchdog with the documented exit code...
    for rank in (0, 2):
        assert results[rank].get("missing") and results[rank]["exitcode"] == EXIT_EXCHANGE_TIMEOUT
        verdict = json.loads((run_dir / "verdicts" / f"rank-{rank}.json").read_text())
        # ...and left a verdict for the launcher naming the frozen rank.
        assert verdict["outcome"] == "exchange_timeout" and verdict["missing"] == [1]
        assert "no answer from rank 1 (host1)" in verdict["message"]
    assert not (run_dir / "verdicts" / "rank-1.json").exists()


@pytest.mark.timeout(120)
def test_slow_healthy_steps_never_talk_to_the_store(tmp_path: Path) -> None:
    """Two healthy steps 4 s slow on 2 ranks, with an 8 s exchange timeout: one slow inside
    the backward (the step armed, its exchange not yet launched), one between backward and
    step() (armed, collectives done). Before, a step armed 2.5 s checked every rank in at the
    store (set, add, delete_key), leaving keys behind; now nothing is asked of the store."""
    from tests.distributed.workers import slow_steps

    results = values(run_ranks(slow_steps, 2, tmp_path, exchange_timeout=8.0, pause=4.0,
                               report_dir=str(tmp_path / "r"), timeout=100))
    for r in results:
        assert r["outcomes"] == ["applied"] * 4, r
        assert r["requests"] == {}, r
        assert r["late_after"] == 8.0
        armed = r["armed_in_backward"]  # the pause in the backward came after the first bucket
        assert armed == [True], r
