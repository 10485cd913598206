"""A SIGTERM to one rank stops every rank after the same step (issue 62, item 6): three ranks
started by hand (env://, no launcher), rank 1 sends itself SIGTERM in the middle of step 4 (as
a scheduler's signal reaches one process first). Its stop request travels in the health row's
summed slot, so every rank reads it from the same sums: every rank's step result says so after
the same step, every rank saves a whole checkpoint of that step, and every process exits 143
(128 + SIGTERM) with a ``stopped`` verdict naming the step and the signal."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from nansentinel.common.exitcodes import EXIT_SIGTERM
from tests.distributed.harness import start_by_hand

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "e2e" / "workers" / "fault_worker.py"
WORLD, TERM_AT = 3, 4


@pytest.mark.timeout(120)
def test_one_rank_sigtermed_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    procs = start_by_hand(WORKER, [str(out), "--steps=200", "--rank=1", f"--term-at={TERM_AT}",
                                   "--step-sleep=0.02"], WORLD, run_dir)
    try:
        codes = [p.wait(timeout=100) for p in procs]
        outputs = [p.communicate()[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert codes == [EXIT_SIGTERM] * WORLD, outputs
    assert all("Traceback" not in o for o in outputs), outputs
    stopped = [json.loads((out / f"stopped-{r}.json").read_text()) for r in range(WORLD)]
    steps = {s["step"] for s in stopped}
    # The signal came before rank 1 packed its row of step 4: that row carries it.
    assert steps == {TERM_AT}, stopped
    assert {s["signal"] for s in stopped} == {signal.SIGTERM}
    assert not list(out.glob(".ckpt-*"))  # no torn checkpoint left beside the whole ones
    states = [torch.load(out / f"ckpt-{r}.pt") for r in range(WORLD)]
    assert {s["step"] for s in states} == {TERM_AT}
    assert {s["sentinel"]["step"] for s in states} == {TERM_AT + 1}
    # DDP: the weights every rank saved are the same weights.
    for name, value in states[0]["model"].items():
        assert all(torch.equal(value, s["model"][name]) for s in states[1:]), name
    verdicts = [json.loads((run_dir / "verdicts" / f"rank-{r}.json").read_text())
                for r in range(WORLD)]
    assert [(v["outcome"], v["step"], v["signal"]) for v in verdicts] == [
        ("stopped", TERM_AT, signal.SIGTERM)] * WORLD, verdicts
    assert not list(out.glob(f"at-*-{TERM_AT + 1}"))  # nobody began another step after it
