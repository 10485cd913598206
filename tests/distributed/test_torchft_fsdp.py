"""nansentinel on torchft replica groups of several ranks, every rank its own process
(torchft_hsdp.py): FSDP2 inside each group, torchft across the groups through the FSDP
all-reduce hook (torchtitan's layout), and nansentinel's torchft DDP with two ranks a group.
Group g1's rank 1 makes a NaN at torchft step 3: every rank of every group vetoes that step
and names g1's rank 1 and its host, and only that host is struck. Then g1 comes back, as a user
restarts it: refused on both ranks while one is on the struck-out host, let in on healthy
ones, healed from g0 rank by rank (FSDP2: shard by shard), and both groups train on with the
same finite weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torchft = pytest.importorskip("torchft")

from tests.distributed import torchft_hsdp  # noqa: E402

pytestmark = pytest.mark.timeout(420)

CULPRIT = [("g1", 1, "node1r1", True)]


def _check_sentinel_run(records: dict[Any, dict[str, Any]], excluded: Path) -> None:
    """The veto, the blame and the strike as the issue's contract says."""
    for key, rec in records.items():
        assert rec["finite"], (key, rec)
        assert all(finite for _, finite in rec["served"]), (key, rec["served"])
        if key[0] == "back":
            continue
        assert rec["riding"], "the health row took a round trip of its own"
        if "refusals" in rec:  # FSDP2: refused at construction on every rank, with the reason
            partial, drop = rec["refusals"]
            assert "FSDP module(s) 0 have no all-reduce hook" in partial, partial
            assert "policy='drop' is refused on torchft under FSDP2" in drop, drop
        vetoed = [(step, names) for step, committed, names in rec["steps"] if not committed]
        # Every rank of every group: step 3 vetoed, g1's rank 1 on node1r1 named, leaving.
        assert vetoed == [(3, CULPRIT)], (key, rec["steps"], rec["error"])
    for grank in (0, 1):  # g0 trains on without a restart after g1 left
        rec = records[(0, grank)]
        assert rec["error"] is None, (rec["error"], rec.get("trace"))
        committed = [s for s, ok, _ in rec["steps"] if ok]
        # one step vetoed, every other committed
        assert committed == list(range(max(len(committed), torchft_hsdp.STEPS - 1))), rec
    # Only the culprit's rank raises for its own host; the healthy rank of g1 stops with the
    # group (the core's HostExcludedError naming node1r1, not its own host).
    culprit, healthy = records[(1, 1)]["error"], records[(1, 0)]["error"]
    assert culprit[0] == "HostExcludedError" and "host node1r1" in culprit[1], culprit
    assert healthy[0] == "HostExcludedError" and "node1r1" in healthy[1], healthy
    assert "node1r0" not in healthy[1], healthy
    hosts = [json.loads(line)["host"] for line in excluded.read_text().splitlines()]
    assert hosts == ["node1r1"], hosts


def _check_rejoin(records: dict[Any, dict[str, Any]], refused: bool) -> None:
    """g1 came back: its start on the struck-out host was refused before it joined
    (``refused``: tried); on a healthy host it healed every rank's own shards (parameters)
    from g0's same rank at its first quorum (torchft's step, not 0, and g0's weights, not its
    own), then trained beside g0, every step committed on both, to the same finite weights."""
    if refused:  # on both ranks, the one on a healthy host too, naming node1r1
        for grank in (0, 1):
            why = records[("back", grank)].get("refused", "")
            assert "host node1r1 is excluded" in why, records[("back", grank)]
            assert "does not join the torchft quorum (rank 1 on node1r1" in why, why
            assert ("leaves with its group" in why) == (grank == 0), why
    for grank in (0, 1):
        back, peer = records[("back", grank)], records[(0, grank)]
        assert back["error"] is None, (back["error"], back.get("trace"))
        assert back["riding"], "the health row took a round trip of its own after the heal"
        steps = back["steps"]
        assert all(ok and not names for _, ok, names in steps), steps
        first = steps[0][0]  # healed to g0's step (step 3 was vetoed, so g0 is still there)
        assert first >= 3, f"rank {grank} of the group that came back began at step {first}"
        assert len(steps) == 1 + torchft_hsdp.AFTER_HEAL, steps
        # The same steps as g0's last ones, ending together.
        assert [s for s, _, _ in steps] == [s for s, _, _ in peer["steps"][-len(steps):]]
        assert (first, True) in peer["served"], peer["served"]  # g0 served the heal
        assert back["initial"] != peer["initial"], "the new group began with g0's weights"
        assert back["weights"] == peer["weights"], f"rank {grank}: weights apart after the heal"


def test_fsdp2_and_ddp_groups_of_two_ranks_blame_the_culprit_on_every_group(
        tmp_path: Path) -> None:
    """FSDP2 (shard degree 2) inside each of two replica groups and, beside it, nansentinel's
    torchft DDP with two ranks a group; host_strikes=1; the health rows ride with the last
    FSDP all-reduce hook call / the last DDP bucket. On both layouts every rank of both
    groups vetoes step 3 and names (g1, rank 1, node1r1); only node1r1 is excluded; g0 trains
    on alone. On both, g1 then comes back and heals (_check_rejoin). Without the sentinel
    (FSDP2, the same NaN batch), the NaN reaches the weights of every rank of every group."""
    arms: dict[str, tuple[str, dict[Any, Any] | None]] = {
        "fsdp2": ("fsdp2", {"all": {"host_strikes": 1,
                                    "exclusion_file": str(tmp_path / "fsdp2.jsonl")}}),
        "ddp": ("ddp", {"all": {"host_strikes": 1,
                                "exclusion_file": str(tmp_path / "ddp.jsonl")}}),
        "bare": ("fsdp2", None),
    }
    # One arm at a time: twelve ranks at once on a loaded 2-core machine miss torchft's
    # quorum and gloo timeouts.
    runs = {name: torchft_hsdp.run(tmp_path / name, layout, sentinel,
                                   rejoin=sentinel is not None, timeout=150)
            for name, (layout, sentinel) in arms.items()}
    _check_sentinel_run(runs["fsdp2"], tmp_path / "fsdp2.jsonl")
    assert all("refusals" in runs["fsdp2"][(g, r)] for g in (0, 1) for r in (0, 1))
    _check_rejoin(runs["fsdp2"], refused=True)
    _check_sentinel_run(runs["ddp"], tmp_path / "ddp.jsonl")
    _check_rejoin(runs["ddp"], refused=False)
    bare = runs["bare"]
    for key, rec in bare.items():
        assert rec["error"] is None, (key, rec)
        assert not rec["finite"], f"without the sentinel, rank {key} kept finite weights"
