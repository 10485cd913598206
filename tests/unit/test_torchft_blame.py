"""The pure parts of the torchft replica groups' blame and ride-along row: which culprit a group
names (its agreed blame, not the naming rank's position), how the names become the step's
result, and the row that travels with the gradients (wire/group_rows.py)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any

import torch

from nansentinel.decide.groups import Decided, group_result
from nansentinel.result import Outcome, StepResult
from nansentinel.step.group_scope import ReplicaGroups
from nansentinel.wire.group_rows import carried, device_row, row_on_device
from nansentinel.wire.schema import GroupTotals, R


def _local(**kw: Any) -> StepResult:
    fields: dict[str, Any] = dict(
        step=3, applied=False, outcome=Outcome.SKIPPED, bad_ranks=[1], bad_hosts=["node1r1"],
        kinds=["grad"], local_kinds=[], local_loss=1.0, local_grad_norm=None,
        consecutive_skips=1)
    fields.update(kw)
    return StepResult(**fields)


def _groups(group_rank: int, hostname: str) -> ReplicaGroups:
    groups = ReplicaGroups(object(), group="g1", group_rank=group_rank, rollback="",
                           by_hand=False)
    groups._parts = SimpleNamespace(  # type: ignore[assignment]
        ctx=SimpleNamespace(identity=SimpleNamespace(hostname=hostname)))
    return groups


def test_a_group_rank_names_its_groups_culprit_not_its_own_position() -> None:
    """g1's rank 0 (healthy, node1r0) tells the other groups what g1 agreed: rank 1 on
    node1r1. A rank alone in its sentinel's process group blames itself; culprits on several
    hosts that cannot be paired with their ranks are named by host (rank -1)."""
    assert _groups(0, "node1r0")._culprits(_local(), world_size=2) == [(1, "node1r1")]
    assert _groups(1, "node1r1")._culprits(_local(bad_ranks=[0]), world_size=1) == [
        (1, "node1r1")]
    assert _groups(0, "a")._culprits(_local(bad_ranks=[0, 2], bad_hosts=["a", "b"]),
                                     world_size=4) == [(-1, "a"), (-1, "b")]
    assert _groups(0, "a")._culprits(_local(bad_ranks=[], bad_hosts=[]), world_size=2) == []


def test_strikes_are_counted_per_culprit_host_on_every_rank_of_the_group() -> None:
    """Every rank of the group counts the culprit host's strikes (only the culprit's own rank
    acts on them); a replay that blamed the data strikes no one."""
    from nansentinel.config import SentinelConfig

    config = SentinelConfig(strike_window=10)
    healthy = _groups(0, "node1r0")
    assert healthy._strike(3, {"node1r1"}, None, config) == {"node1r1": 1}
    assert healthy._strike(5, {"node1r1"}, None, config) == {"node1r1": 2}
    assert healthy._strike(20, {"node1r1"}, None, config) == {"node1r1": 1}  # out of window
    assert healthy._strike(21, {"node1r1"}, "data", config) == {}
    assert "node1r0" not in healthy.strikes


def test_the_names_become_one_poisoned_entry_per_culprit() -> None:
    names = [{"group": "g1", "step": 3, "kinds": ["grad"], "leaving": True,
              "culprits": [[1, "node1r1"]]},
             {"group": "g2", "step": 3, "kinds": [], "culprits": []}]
    result = group_result(_local(applied=True, outcome=Outcome.APPLIED, bad_ranks=[],
                                 bad_hosts=[]), names, Decided(3, False, False))
    assert [(p.group, p.rank, p.host, p.leaving) for p in result.poisoned] == [
        ("g1", 1, "node1r1", True), ("g2", -1, "", False)]
    assert result.bad_hosts == ["node1r1"] and result.excluded_hosts == ["node1r1"]
    assert "replica group g1 (rank 1, host node1r1)" in result.reason
    assert "replica group g2 (no culprit rank)" in result.reason
    assert not result.applied and result.outcome is Outcome.SKIPPED


def test_the_ride_along_row_flags_a_non_finite_or_quarantined_rank() -> None:
    """Zeros on a healthy rank (they add nothing to the gradients' all-reduce); a NaN loss or
    a quarantined batch flags the rank with its replica rank + 1; the counts come back from
    the averaged all-reduce times the participants."""
    row = torch.zeros(R.size)
    assert device_row(row, lambda: 2).tolist() == [0.0] * 6
    row[R.loss_value] = math.nan
    assert device_row(row, lambda: 2).tolist() == [1.0, 0.0, 1.0, 0.0, 3.0, 0.0]
    quarantined = torch.zeros(R.size)
    quarantined[R.quarantined] = 1.0
    assert device_row(quarantined, lambda: None).tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    averaged = (device_row(row, lambda: 2) + torch.zeros(6)) / 3  # three groups, one flagged
    totals = carried(averaged, lambda: 3)
    assert totals is not None and totals.bad == 1 and totals.loss == 1 and totals.single == 2
    assert carried(None, lambda: 3) is None
    asked: list[int] = []
    assert carried(torch.zeros(6), lambda: asked.append(1) or 3) == GroupTotals()
    assert not asked  # a healthy step's zeros need no count of the participants


def _giving(value: int | None) -> Any:
    return lambda: value


def test_the_ride_along_row_is_the_same_from_host_floats_and_on_the_device() -> None:
    """The CPU builds the row from the health row's floats (read from the packed vector, or
    the host row it was packed from), an accelerator with tensor operations: the same row for
    every kind of value, quarantine and replica rank."""
    specials = (0.0, 2.0, 3.0e38, math.inf, -math.inf, math.nan)
    for batch, loss, grad in itertools.product(specials, repeat=3):
        for quarantined, rank in itertools.product((0.0, 1.0), (None, 0, 7)):
            row = torch.zeros(R.size)
            row[R.batch_norm], row[R.loss_value], row[R.grad_norm_value] = batch, loss, grad
            row[R.quarantined] = quarantined
            host = device_row(row, _giving(rank))
            assert torch.equal(host, row_on_device(row, rank)), (row, rank)
            assert torch.equal(device_row(row.tolist(), _giving(rank)), host), (row, rank)


def test_the_row_rides_in_the_last_fsdp_all_reduce_hook_call() -> None:
    """Two FSDP parameter groups with torchft's hook: the first call goes to the user's hook
    as it is; the second (the step's last) goes with the row appended and comes back split:
    the shard averaged, the row in ``carried``."""
    import pytest

    pytest.importorskip("torchft")
    from nansentinel.engines.torchft import AllReduceHookRider

    seen: list[int] = []

    def average_over_two(out: torch.Tensor) -> None:  # as if a peer sent zeros
        seen.append(out.numel())
        out.div_(2)

    groups = [SimpleNamespace(_all_reduce_hook=average_over_two) for _ in range(2)]
    rider = AllReduceHookRider(groups)
    rider.install()
    launched: list[bool] = []
    rider.sink = SimpleNamespace(inferring=False, spent=lambda _: None,
                                 launch_exchange=lambda: launched.append(True))
    rider.rider = SimpleNamespace(row=lambda: torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 0.0]),
                                  carried=None)
    first, last = torch.full((2, 2), 4.0), torch.full((3,), 8.0)
    groups[0]._all_reduce_hook(first)
    groups[1]._all_reduce_hook(last)
    assert seen == [4, 3 + 6]
    assert launched == [True]  # the step's exchange left with the last call, once
    assert first.tolist() == [[2.0, 2.0], [2.0, 2.0]] and last.tolist() == [4.0, 4.0, 4.0]
    assert rider.rider.carried.tolist() == [0.5, 0.0, 0.0, 0.5, 1.0, 0.0]
    totals = carried(rider.rider.carried, lambda: 2)
    assert totals is not None and totals.bad == 1 and totals.single == 1
    # At close the user's own hooks are back, the same objects (a later sentinel wraps them).
    rider.release()
    assert all(g._all_reduce_hook is average_over_two for g in groups)
