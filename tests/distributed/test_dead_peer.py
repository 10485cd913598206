"""A dead peer seen first by a collective the sentinel does not wait on (issue 58, item 1):
two ranks started by hand (env://, no launcher), the model under FSDP2, rank 1 SIGKILLs
itself in the middle of step 5. Rank 0's gloo all-gather or reduce-scatter raises inside
``backward()``, the training script lets it escape, and the process still exits 5 with a
verdict naming rank 1, within the naming bound (before: exit 1, no verdict, ~33 s)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from nansentinel.common.exitcodes import EXIT_EXCHANGE_TIMEOUT
from nansentinel.wire.exchange import diagnosis_grace
from tests.distributed.harness import start_by_hand

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "e2e" / "workers" / "fault_worker.py"
TIMEOUT = 4.0


@pytest.mark.timeout(120)
def test_an_uncaught_fsdp_collective_failure_exits_5_with_a_verdict(tmp_path: Path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    procs = start_by_hand(WORKER, [str(out), "--steps=30", "--rank=1", "--die-at=5", "--fsdp"],
                          2, run_dir, NANSENTINEL_EXCHANGE_TIMEOUT=str(TIMEOUT))
    marker = out / f"at-{socket.gethostname()}-5"  # both ranks touch it; rank 1 dies in it
    began = None
    try:
        deadline = time.monotonic() + 100
        while procs[0].poll() is None and time.monotonic() < deadline:
            if began is None and marker.exists():
                began = time.monotonic()
            time.sleep(0.05)
        ended = time.monotonic()
        codes = [p.wait(timeout=10) for p in procs]
        output = procs[0].communicate()[0]
    finally:
        for p in procs:
            p.kill()
    assert codes == [EXIT_EXCHANGE_TIMEOUT, -9], output[-3000:]
    assert "Connection" in output  # gloo's own error, printed as the traceback it was
    verdict = json.loads((run_dir / "verdicts" / "rank-0.json").read_text())
    assert verdict["outcome"] == "exchange_timeout" and verdict["missing"] == [1], verdict
    assert "no answer from rank 1 (host1)" in verdict["message"]
    # Unarmed (FSDP's collectives are not the sentinel's): it waits the timeout and a grace
    # for check-ins, then lingers a grace as rank 0; 5 s for the process's own end.
    assert began is not None and ended - began < TIMEOUT + 2 * diagnosis_grace(TIMEOUT) + 5
