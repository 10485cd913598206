"""nansentinel on torchft replica groups of several ranks, every rank its own process
(torchft_hsdp.py): FSDP2 inside each group, torchft across the groups through the FSDP
all-reduce hook (torchtitan's layout), and nansentinel's torchft DDP with two ranks a group.
Group g1's rank 1 makes a NaN at torchft step 3: every rank of every group vetoes that step
and names g1's rank 1 and its host, and only that host is struck."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torchft = pytest.importorskip("torchft")

from tests.distributed import torchft_hsdp  # noqa: E402

pytestmark = pytest.mark.timeout(420)

CULPRIT = [("g1", 1, "node1r1", True)]


def _check_sentinel_run(records: dict[tuple[int, int], dict[str, Any]], excluded: Path) -> None:
    """The veto, the blame and the strike as the issue's contract says."""
    for (gid, grank), rec in records.items():
        assert rec["finite"], (gid, grank, rec)
        assert rec["riding"], "the health row took a round trip of its own"
        vetoed = [(step, names) for step, committed, names in rec["steps"] if not committed]
        # Every rank of every group: step 3 vetoed, g1's rank 1 on node1r1 named, leaving.
        assert vetoed == [(3, CULPRIT)], ((gid, grank), rec["steps"], rec["error"])
    for grank in (0, 1):  # g0 trains on without a restart after g1 left
        rec = records[(0, grank)]
        assert rec["error"] is None, rec
        committed = [s for s, ok, _ in rec["steps"] if ok]
        assert committed == list(range(torchft_hsdp.STEPS - 1)), rec  # one step vetoed
    # Only the culprit's rank raises for its own host; the healthy rank of g1 stops with the
    # group (the core's HostExcludedError naming node1r1, not its own host).
    culprit, healthy = records[(1, 1)]["error"], records[(1, 0)]["error"]
    assert culprit[0] == "HostExcludedError" and "host node1r1" in culprit[1], culprit
    assert healthy[0] == "HostExcludedError" and "node1r1" in healthy[1], healthy
    assert "node1r0" not in healthy[1], healthy
    hosts = [json.loads(line)["host"] for line in excluded.read_text().splitlines()]
    assert hosts == ["node1r1"], hosts


def test_fsdp2_and_ddp_groups_of_two_ranks_blame_the_culprit_on_every_group(
        tmp_path: Path) -> None:
    """FSDP2 (shard degree 2) inside each of two replica groups and, beside it, nansentinel's
    torchft DDP with two ranks a group; host_strikes=1; the health rows ride with the last
    FSDP all-reduce hook call / the last DDP bucket. On both layouts every rank of both
    groups vetoes step 3 and names (g1, rank 1, node1r1); only node1r1 is excluded; g0 trains
    on alone. Without the sentinel (FSDP2, the same NaN batch), the NaN reaches the weights
    of every rank of every group."""
    arms: dict[str, tuple[str, dict[Any, Any] | None]] = {
        "fsdp2": ("fsdp2", {"all": {"host_strikes": 1,
                                    "exclusion_file": str(tmp_path / "fsdp2.jsonl")}}),
        "ddp": ("ddp", {"all": {"host_strikes": 1,
                                "exclusion_file": str(tmp_path / "ddp.jsonl")}}),
        "bare": ("fsdp2", None),
    }
    # One arm at a time: twelve ranks at once on a loaded 2-core machine miss torchft's
    # quorum and gloo timeouts.
    runs = {name: torchft_hsdp.run(tmp_path / name, layout, sentinel)
            for name, (layout, sentinel) in arms.items()}
    _check_sentinel_run(runs["fsdp2"], tmp_path / "fsdp2.jsonl")
    _check_sentinel_run(runs["ddp"], tmp_path / "ddp.jsonl")
    bare = runs["bare"]
    for key, rec in bare.items():
        assert rec["error"] is None, (key, rec)
        assert not rec["finite"], f"without the sentinel, rank {key} kept finite weights"
