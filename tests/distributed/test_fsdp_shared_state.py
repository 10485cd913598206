"""Modules sharded in one ``fully_shard([norm, lm_head])`` call (torchtitan's layout) share
one FSDP state: the sentinel checks that group once, names its poisoned parameter, and still
refuses a second Sentinel on the same model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_fsdp_shared import shared_state


@pytest.mark.timeout(120)
def test_modules_sharded_together_are_one_checked_group(tmp_path: Path) -> None:
    outs = values(run_ranks(shared_state, 2, tmp_path, report_dir=str(tmp_path / "r"),
                            timeout=100))
    for out in outs:
        assert [r["outcome"] for r in out["records"]] == ["applied", "skipped"]
        assert out["records"][1]["bad_ranks"] == [1]
        shared = [g for g in out["groups"] if g[0] == "embed+head"]
        assert shared == [("embed+head", ["embed.weight", "head.weight", "head.bias"])]
        assert "already watched by another Sentinel" in out["second"]
    # Checked before the reduce-scatter: the embedding alone, not what the reduction spread.
    assert outs[0]["records"][1]["parameters"] == {1: ["embed.weight"]}
