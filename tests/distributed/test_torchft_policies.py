"""nansentinel on torchft (torchft_groups.py: a real lighthouse, replica groups as threads
over gloo): the policies across groups (abort, drop), gradients reduced by hand with
Manager.allreduce, and groups of two ranks."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

torchft = pytest.importorskip("torchft")

from torch.distributed import TCPStore  # noqa: E402

import nansentinel.torchft as nft  # noqa: E402
from nansentinel.config import ConfigError  # noqa: E402
from nansentinel.result import HostExcludedError, NonFiniteError, SentinelUsageError  # noqa: E402
from tests.distributed.torchft_groups import Group, join, lighthouse, run  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_gradients_reduced_by_hand_with_manager_allreduce(tmp_path: Path) -> None:
    """A plain module whose gradients the loop reduces with Manager.allreduce, after
    check_grads(): g1's gradient NaN at its step 2 is vetoed on both groups and named there;
    the weights stay finite and identical. A plain module without its manager is refused, and
    policy="drop" on gradients reduced by hand."""
    with pytest.raises(SentinelUsageError, match="without manager="):
        plain = torch.nn.Linear(4, 2)
        nft.Sentinel(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="reduced by hand"):
        nft.Sentinel(plain, torch.optim.SGD(plain.parameters(), lr=0.1), manager=object(),
                     policy="drop")
    with lighthouse() as house:
        groups = [Group(house, g, 0, tmp_path, manual=True,
                        inject="kind=grad,rank=0,steps=2-2" if g == 1 else None) for g in (0, 1)]
        join(run([(g, lambda g: g.manager.current_step() >= 4) for g in groups]))
    for g in groups:
        assert g.error is None and g.finite, g.error
        assert [(r.torchft_step, [(p.group, p.host) for p in r.poisoned])
                for r in g.results if not r.committed] == [(2, [("g1", "node1")])]
    assert all(torch.equal(a, b) for a, b in zip(*(g.weights() for g in groups), strict=True))


def test_a_nan_batch_under_policy_abort_stops_every_group_at_the_same_step(
        tmp_path: Path) -> None:
    """A NaN in g1's real batch at torchft step 2, policy="abort": both groups raise
    NonFiniteError at that step, naming g1 (batch, loss, grad), with finite weights."""
    with lighthouse() as house:
        groups = [Group(house, i, 0, tmp_path, policy="abort") for i in (0, 1)]

        def poison(g: Group) -> float:
            mine = g.kwargs["hostname"] == "node1" and g.manager.current_step() == 2
            return float("nan") if mine else 0.0

        threads = [threading.Thread(target=g.train, args=(lambda g: False, poison), daemon=True)
                   for g in groups]
        for t in threads:
            t.start()
        join(threads)
    for g in groups:
        assert isinstance(g.error, NonFiniteError) and not isinstance(g.error, HostExcludedError)
        last = g.results[-1]
        assert last.torchft_step == 2 and not last.committed and g.finite
        assert [(p.group, p.host, p.kinds) for p in last.poisoned] == [
            ("g1", "node1", ["batch", "loss", "grad"])]
        assert g.manager.current_step() == 2


def test_groups_of_two_ranks_veto_on_every_rank_of_every_group(tmp_path: Path) -> None:
    """Two replica groups of two ranks each: a NaN in group 1 rank 1's gradients reaches the
    rank 1 of every group through the health row, and should_commit() (agreed within each
    group) vetoes the step on all four ranks at once; the replicas stay identical."""
    with lighthouse() as house:
        stores = [TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
                  for _ in range(2)]
        ranks = [Group(house, g, 0, tmp_path, rank=(r, 2, stores[g]),
                       inject="kind=grad,rank=0,steps=2-2" if (g, r) == (1, 1) else None)
                 for g in (0, 1) for r in (0, 1)]
        join(run([(g, lambda g: g.manager.current_step() >= 5) for g in ranks]))
    for g in ranks:
        assert g.error is None and g.finite, g.error
        vetoed = [r for r in g.results if not r.committed]
        assert [r.torchft_step for r in vetoed] == [2]
    for r in ranks[1::2]:  # the ranks 1 name it: (group, rank, host)
        assert [(p.group, p.rank, p.host) for p in r.results[2].poisoned] == [
            ("g1", 1, "node1r1")]
    for a, b in ((ranks[0], ranks[2]), (ranks[1], ranks[3])):
        assert all(torch.equal(x, y) for x, y in zip(a.weights(), b.weights(), strict=True))


def test_policy_drop_keeps_the_step_without_the_poisoned_group(tmp_path: Path) -> None:
    """policy="drop", three groups: a NaN in g1's real batch at torchft step 2 leaves g1's
    gradients out (zeros) and every group applies the step from g0's and g2's, named on every
    group; a NaN made in g1's backward (a gradient drill, batch and loss finite) cannot be
    left out and is vetoed on every group. Weights stay finite and identical on all three."""
    with lighthouse() as house:
        groups = [Group(house, g, 0, tmp_path, policy="drop",
                        inject="kind=grad,rank=0,steps=4-4" if g == 1 else None)
                  for g in (0, 1, 2)]

        def poison(g: Group) -> float:
            mine = g.kwargs["hostname"] == "node1" and g.manager.current_step() == 2
            return float("nan") if mine else 0.0

        threads = [threading.Thread(target=g.train, args=(
            lambda g: g.manager.current_step() >= 6, poison), daemon=True) for g in groups]
        for t in threads:
            t.start()
        join(threads)
    for g in groups:
        assert g.error is None and g.finite, g.error
        named = [(r.torchft_step, r.outcome.value, r.committed, [p.group for p in r.poisoned])
                 for r in g.results if r.poisoned]
        assert named == [(2, "dropped", True, ["g1"]), (4, "skipped", False, ["g1"])], named
    for g in groups[1:]:
        assert all(torch.equal(a, b) for a, b in zip(groups[0].weights(), g.weights(),
                                                      strict=True))


def test_a_dropped_step_applies_the_kept_groups_mean(tmp_path: Path) -> None:
    """The arithmetic of a dropped step: with each group's batch fixed by (group, step), the
    weights g0 takes at the step g1's batch is NaN are the weights before it minus the learning
    rate times the mean of g0's and g2's gradients (to fp32 rounding)."""

    def batch(gid: int, step: int) -> torch.Tensor:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(gid * 100 + step))
        if (gid, step) == (1, 2):
            x[0, 0] = float("nan")
        return x

    seen: dict[str, Any] = {}

    def loop(g: Group, gid: int) -> None:
        sentinel = nft.Sentinel(g.model, g.opt, **g.kwargs)
        try:
            while (step := g.manager.current_step()) < 4:
                g.opt.zero_grad()
                g.manager.start_quorum()
                if (gid, step) == (0, 2):
                    seen["before"] = [p.detach().clone() for p in g.module.parameters()]
                x = sentinel.check_batch(batch(gid, step))
                loss = g.model(x).pow(2).mean()
                sentinel.check_loss(loss)
                loss.backward()
                result = sentinel.step()
                if (gid, step) == (0, 2):
                    seen["after"], seen["outcome"] = g.weights(), result.outcome.value
            sentinel.close()
        finally:
            g.manager.shutdown(wait=False)

    with lighthouse() as house:
        groups = [Group(house, g, 0, tmp_path, policy="drop") for g in (0, 1, 2)]
        threads = [threading.Thread(target=loop, args=(g, i), daemon=True)
                   for i, g in enumerate(groups)]
        for t in threads:
            t.start()
        join(threads)
    # A copy outside DDP: a backward through the watched module would reach its reducer.
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for p, w in zip(model.parameters(), seen["before"], strict=True):
            p.copy_(w)
    grads = []
    for gid in (0, 2):
        model.zero_grad()
        model(batch(gid, 2)).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert seen["outcome"] == "dropped"
    for w, a, b, after in zip(seen["before"], *grads, seen["after"], strict=True):
        torch.testing.assert_close(after, w - 0.05 * (a + b) / 2, rtol=0, atol=1e-6)
