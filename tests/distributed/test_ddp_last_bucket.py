"""The DDP hook checks the local gradients at the last bucket (issue 46): DDP copies each
gradient into its bucket and leaves ``.grad`` local until the end of backward, so a NaN that
only one rank's backward made is blamed on that rank alone, on every rank, and named. Held on
2 gloo ranks, under both gates, with a poison no drill makes (the drill keeps the per-bucket
check), on the comm hook and on NCCL's seam (no comm hook, a callback at the end of backward,
forced on gloo): a torch whose DDP wrote reduced values into ``.grad`` earlier, or ran its
end-of-backward copy before the sentinel's callback, would blame both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_ddp_hook import every_gate


@pytest.mark.timeout(120)
def test_a_backward_only_nan_on_one_rank_is_blamed_on_it_alone(tmp_path: Path) -> None:
    outs = values(run_ranks(every_gate, 2, tmp_path, report_dir=str(tmp_path / "r"),
                            timeout=100))
    for gate in outs[0]:
        for out in outs:
            records = out[gate]["records"]
            assert [r["applied"] for r in records] == [True, False, True], (gate, records)
            assert records[1]["bad_ranks"] == [1] and records[1]["kinds"] == ["grad"]
            assert records[1]["parameters"] == {1: ["3.weight"]}, (gate, records[1])
            before, after = out[gate]["weights"][1], out[gate]["weights"][2]
            assert torch.equal(before, after)  # the poisoned step was skipped
        assert torch.equal(outs[0][gate]["weights"][-1], outs[1][gate]["weights"][-1])
