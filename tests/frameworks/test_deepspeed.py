"""A DeepSpeed script under ``nansentinel run``: the user's own loop on a ZeRO-3 engine, a
loss drill from the environment on rank 1, ``NANSENTINEL_POLICY=abort``: every rank raises
NonFiniteError at the same step naming rank 1 and its host, one report, exit code 3."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest

from tests.frameworks import runner

if importlib.util.find_spec("deepspeed") is None:  # tests/constraints.txt pins it; not imported
    pytest.skip("deepspeed is not installed (pip install -c tests/constraints.txt "
                "-r tests/requirements-main.txt)", allow_module_level=True)


@pytest.mark.timeout(200)
def test_deepspeed_zero3_abort_under_nansentinel_run_on_every_rank(tmp_path: Path) -> None:
    proc = runner.run(
        runner.nansentinel_run("deepspeed_worker.py", str(tmp_path), "--stage=3", "--steps=4"),
        tmp_path, timeout=180,
        env={"DS_ACCELERATOR": "cpu", "NANSENTINEL_POLICY": "abort",
             "NANSENTINEL_INJECT": "kind=loss,rank=1,step=1,value=nan"},
    )
    runner.assert_aborted_with_one_report(proc, tmp_path, 1, "loss")
    host = socket.gethostname()
    for rank in range(2):
        path = tmp_path / f"abort-rank{rank}.json"
        assert path.exists(), f"rank {rank} did not raise:\n{proc.stdout[-6000:]}"
        abort = json.loads(path.read_text())
        assert abort["type"] == "NonFiniteError" and abort["step"] == 1
        for words in ("step 1", "rank(s) 1", host, "loss"):
            assert words in abort["message"], abort["message"]
        # Step 0 applied through engine.step(); the aborted step's gradients discarded as
        # DeepSpeed discards an overflow (a skipped step to it), so that the engine is left
        # consistent for whatever the script does next (save a checkpoint, say).
        assert abort["applied_before"] == ["applied"]
        assert (abort["global_steps"], abort["skipped_steps"]) == (2, 1)
