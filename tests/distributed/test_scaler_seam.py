"""The framework's GradScaler after a skip (issue 20, item 2): with
``step(optimizer_step=False)`` a skip leaves no gradient, and the caller's ``scaler.step`` /
``scaler.update`` used to raise "No inf checks were recorded" (in ``update`` with a fused
optimizer, in ``step`` without). Now the step is skipped and the scale backs off as after an
fp16 overflow, on every rank alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_scaler import callers_scaler


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("fused", "unscale_first"), [
    (True, False), (False, False), (False, True),
], ids=["fused", "plain", "plain-unscaled-first"])
def test_callers_scaler_skips_and_backs_off_after_a_skip(
    tmp_path: Path, fused: bool, unscale_first: bool
) -> None:
    outs = values(run_ranks(callers_scaler, 2, tmp_path, fused=fused,
                            unscale_first=unscale_first, steps=6, bad=3,
                            report_dir=str(tmp_path / "r"), timeout=120))
    for out in outs:
        recs = out["records"]
        assert [r["applied"] for r in recs] == [True, True, True, False, True, True]
        bad = recs[3]
        assert bad["unchanged"], "weights or optimizer state moved on the skipped step"
        assert bad["scale_after"] == bad["scale_before"] * 0.5  # as after an overflow
        assert all(not r["unchanged"] for i, r in enumerate(recs) if i != 3)
        assert all(r["scale_after"] == r["scale_before"] for i, r in enumerate(recs) if i != 3)
    assert torch.equal(outs[0]["weights"], outs[1]["weights"])
    assert torch.isfinite(outs[0]["weights"]).all()
    assert outs[0]["scale"] == outs[1]["scale"]
