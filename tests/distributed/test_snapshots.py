"""Rollback snapshots sharded across DDP replicas, on gloo ranks: each rank holds 1/W of the
replicated state and a rollback gathers it back exactly; a snapshot that does not fit on one
rank is refused on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_snapshots import HIDDEN, IN, buffers_and_refusal, rollback


@pytest.mark.timeout(150)
def test_ddp_ranks_roll_back_through_a_sharded_snapshot_to_the_full_state(tmp_path: Path
                                                                          ) -> None:
    world = 3
    outs = values(run_ranks(rollback, world, tmp_path, steps=8, bad_step=5,
                            report_dir=str(tmp_path / "r"), timeout=120))
    for out in outs:
        assert out["rolled"] == [(5, 3)]  # snapshots at 0 and 3; steps 3, 4 moved the weights on
        assert not torch.equal(out["after"][4], out["before"][3])
        # The gathered state is the whole state step 3 was computed from (taken before its
        # update: a quiet step's own update may be the one that ruins it), as this rank had it.
        assert torch.equal(out["final"], out["before"][3])
        # 1/W of the three large tensors (the weight and its two moments), the rest whole.
        large = IN * HIDDEN * 4 * 3
        small = out["unsharded_bytes"] - large
        assert out["bytes"] == -(-IN * HIDDEN // world) * 4 * 3 + small
        assert out["bytes"] < out["unsharded_bytes"] / world + small
    # The replicas agree on what DDP keeps identical (their BatchNorm statistics differ).
    assert all(torch.equal(o["replicated"], outs[0]["replicated"]) for o in outs)


@pytest.mark.timeout(150)
def test_per_rank_buffers_come_back_as_their_own_and_a_refusal_stops_every_rank(
        tmp_path: Path) -> None:
    outs = values(run_ranks(buffers_and_refusal, 2, tmp_path, timeout=120))
    for out in outs:
        assert out["changed"] and out["restored"]
        assert out["tight_bytes"] == 0  # refused before anything was allocated
    # BatchNorm's statistics saw each rank's own batches: kept whole, restored per rank.
    assert not torch.equal(outs[0]["running_mean"], outs[1]["running_mean"])
    short, fine = outs[1]["refusal"], outs[0]["refusal"]
    assert short is not None and "rank 1 (host host1) at step 7" in short
    assert "and 0 bytes (0.00 GiB) are available" in short
    assert fine is not None and "on rank 1 at step 7" in fine and "host0" in fine
