"""``policy="drop"`` in one process: its config, the pure decision, the wire's count, the
flag a rank is withheld by, the rescale, the refusals, and what reports and metrics call it.
(The reductions themselves run on gloo ranks: tests/distributed/test_drop.py.)"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

import nansentinel
from nansentinel.checks.health import LocalHealth
from nansentinel.config import ConfigError, SentinelConfig
from nansentinel.decide.policy import (
    DROP,
    EXCLUDE,
    SKIP,
    Evidence,
    History,
    decide,
    max_dropped_ranks,
)
from nansentinel.effects import drop
from nansentinel.effects.metrics import SentinelMetrics
from nansentinel.engines.ddp import DDPPath
from nansentinel.engines.deepspeed import DeepSpeedPath
from nansentinel.engines.fsdp import FSDPPath
from nansentinel.engines.local import LocalGradPath
from nansentinel.rare.incident import _NEXT
from nansentinel.reading.incidents import _OUTCOME_WORDS
from nansentinel.result import OUTCOMES, Outcome, RankIdentity, StepResult
from nansentinel.step.gate import device_gate_refusal
from nansentinel.wire.schema import OwnRow, T, Totals, pack
from nansentinel.wire.view import ClusterView, RankHealth

CPU = torch.device("cpu")
HOSTS = ["n0", "n0", "n1", "n1"]
DROP_HALF = SentinelConfig(policy="drop", max_dropped=0.5, host_strikes=99)


def view(bad: dict[int, tuple[str, ...]], *, dropped: set[int] | None = None,
         world: int = 4, bad_grad: int | None = None) -> ClusterView:
    """A detection's view; ``dropped``: the ranks whose gradients were withheld (default:
    those with a non-finite batch or loss, as the gradient path withholds them)."""
    if dropped is None:
        dropped = {r for r, kinds in bad.items() if {"batch", "loss"} & set(kinds)}
    rows = tuple(
        RankHealth(RankIdentity(r, r % 2, world, HOSTS[r % 4], "cpu"), bad[r], False, None,
                   None, dropped=r in dropped)
        for r in sorted(bad)
    )
    grads = sum("grad" in k for k in bad.values()) if bad_grad is None else bad_grad
    totals = Totals(bad_batch=sum("batch" in k for k in bad.values()),
                    bad_loss=sum("loss" in k for k in bad.values()), bad_grad=grads,
                    blamed=len(bad), flagged=len(bad), dropped=len(dropped))
    return ClusterView(3, world, totals, rows, rows)


def test_the_config_field_and_its_variable() -> None:
    assert SentinelConfig().max_dropped == 0.125
    cfg = SentinelConfig.from_env({"NANSENTINEL_POLICY": "drop",
                                   "NANSENTINEL_MAX_DROPPED": "0.25"})
    assert (cfg.policy, cfg.max_dropped) == ("drop", 0.25)
    for bad in (0, 1, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"^max_dropped=.*fraction"):
            SentinelConfig(max_dropped=bad)
    for bad, given in ((True, "a bool"), ("0.1", "a str")):  # the type, from the annotation
        with pytest.raises(ConfigError, match=rf"^max_dropped=.* is {given}, not a number"):
            SentinelConfig(max_dropped=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="NANSENTINEL_MAX_DROPPED"):
        SentinelConfig.from_env({"NANSENTINEL_MAX_DROPPED": "2"})
    with pytest.raises(ConfigError, match="drop"):  # the list of policies names it
        SentinelConfig(policy="drops")


@pytest.mark.parametrize(("world", "fraction", "most"), [
    (1, 0.125, 1), (4, 0.125, 1), (8, 0.125, 1), (16, 0.125, 2), (10, 0.3, 3),
    (4, 0.5, 2), (131_072, 0.125, 16_384),
])
def test_at_most_a_fraction_of_the_ranks_and_at_least_one(world: int, fraction: float,
                                                           most: int) -> None:
    assert max_dropped_ranks(world, fraction) == most


def test_a_batch_or_loss_fault_within_the_limit_is_dropped() -> None:
    d = decide(view({1: ("batch", "loss", "grad")}), History(), DROP_HALF)
    assert (d.action, d.kept, d.bad_ranks, d.bad_hosts) == (DROP, 3, [1], ["n0"])
    assert d.applies and d.outcome == Outcome.DROPPED and not d.stops
    assert "other 3 ranks' gradients" in d.reason
    two = decide(view({0: ("loss",), 3: ("batch", "loss")}), History(), DROP_HALF)
    assert (two.action, two.kept, two.bad_ranks) == (DROP, 2, [0, 3])


@pytest.mark.parametrize(("bad", "config", "verdict", "why"), [
    ({0: ("loss",), 1: ("loss",)}, SentinelConfig(policy="drop", host_strikes=99), None,
     "two of 4 ranks, above max_dropped=1/8 (one rank)"),
    ({r: ("loss",) for r in range(4)}, SentinelConfig(policy="drop", max_dropped=0.99,
                                                      host_strikes=99), None, "every rank"),
    ({1: ("loss",)}, DROP_HALF, "divergence", "a global cause"),
    ({1: ("grad",)}, DROP_HALF, None, "a NaN made inside the backward"),
    ({1: ("batch",), 2: ("grad",)}, DROP_HALF, None, "one dropped, one made in the backward"),
    ({1: ("loss",)}, SentinelConfig(host_strikes=99), None, "policy skip"),
])
def test_what_drop_skips(bad: dict[int, tuple[str, ...]], config: SentinelConfig,
                         verdict: str | None, why: str) -> None:
    d = decide(view(bad), History(), config, Evidence(verdict=verdict))
    assert d.action == SKIP and not d.applies, why
    assert d.bad_ranks == sorted(bad), why


def test_withheld_gradients_are_never_applied_unless_the_step_is_dropped() -> None:
    # A rank withheld but not named (its row did not come back): the count does not match.
    unnamed = view({1: ("loss",)}, dropped={1})
    unnamed = ClusterView(3, 4, Totals(bad_loss=1, blamed=1, flagged=1, dropped=2),
                          unnamed.flagged, unnamed.listed)
    assert decide(unnamed, History(), DROP_HALF).action == SKIP
    # Withheld with nobody blamed (can only be a quarantined or reached rank): never applied.
    nobody = ClusterView(3, 4, Totals(dropped=1))
    assert decide(nobody, History(), DROP_HALF).action == SKIP
    # Batches still to discard after a rollback are discarded.
    assert decide(view({1: ("loss",)}), History(skip_batches=2), DROP_HALF).action == SKIP


def test_under_amp_a_kept_ranks_overflow_skips() -> None:
    mine = view({1: ("loss", "grad")})
    d = decide(mine, History(), DROP_HALF, Evidence(amp=True))
    assert d.action == DROP and not d.overflow  # the withheld rank's own inf is not overflow
    kept_overflowed = view({1: ("loss", "grad")}, bad_grad=2)
    assert decide(kept_overflowed, History(), DROP_HALF, Evidence(amp=True)).action == SKIP


def test_a_dropped_step_is_applied_strikes_its_host_and_escalation_ignores_it() -> None:
    cfg = SentinelConfig(policy="drop", max_dropped=0.5, max_consecutive_skips=1,
                         host_strikes=3, strike_window=100)
    history = History(consecutive_skips=1)  # one more skip would abort
    d = decide(view({2: ("batch",)}), history, cfg)
    assert d.action == DROP
    history.record(view({2: ("batch",)}), d, cfg)
    assert history.consecutive_skips == 0 and history.strikes == {"n1": [3]}
    # A host that keeps poisoning the run is excluded, as under skip.
    history.strikes = {"n1": [1, 2]}
    assert decide(view({2: ("batch",)}), history, cfg).action == EXCLUDE


def test_the_count_travels_in_the_exchange_and_each_rank_sees_its_own() -> None:
    row = torch.tensor([1.0, math.nan, math.nan, 0.0, 1.0, 1.0, 0.0, *(0.0,) * 11])
    thresholds = torch.full((5,), math.inf)
    out = pack(row, thresholds, 2, amp=False, dropped=torch.tensor(True))
    kept = pack(row.nan_to_num(1.0), thresholds, 0, amp=False)  # not withheld: None
    summed = (out[:T.size] + kept[:T.size]).tolist()
    assert Totals.from_values(summed).dropped == 1
    assert OwnRow.from_values(out.tolist()).dropped
    assert not OwnRow.from_values(kept.tolist()).dropped
    health = RankHealth.of(RankIdentity(2, 0, 4, "h", "cpu"), OwnRow.from_values(out.tolist()),
                           {})
    # The flag travels with the named row (as a detection sends it), and only when set.
    assert RankHealth.from_wire(health.to_wire(), 4).dropped
    kept_row = RankHealth.of(RankIdentity(0, 0, 4, "h", "cpu"), OwnRow.from_values(kept.tolist()),
                             {})
    assert not RankHealth.from_wire(kept_row.to_wire(), 4).dropped


def test_the_flag_is_known_from_batch_and_loss_before_backward() -> None:
    health = LocalHealth(CPU)
    assert not health.poisoned()  # nothing checked: nothing to withhold
    health.add_batch(None, [torch.tensor(2.0)])
    health.add_loss(torch.tensor(0.5))
    assert not health.poisoned()
    health.add_loss(torch.tensor(math.inf))  # a second micro-batch's loss
    assert health.poisoned()
    bad_batch = LocalHealth(CPU)
    bad_batch.add_batch(None, [torch.tensor(1.0), torch.tensor(math.nan)])
    assert bad_batch.poisoned() and bad_batch.poisoned().dtype == torch.bool


def test_withhold_zeroes_only_a_flagged_contribution_and_rescale_divides() -> None:
    bucket = torch.tensor([1.0, math.nan, -math.inf])
    drop.withhold(bucket, torch.tensor(True))
    assert bucket.tolist() == [0.0, 0.0, 0.0]
    healthy = torch.tensor([0.1, -2.5, 3e-30])
    before = healthy.clone()
    drop.withhold(healthy, torch.tensor(False))
    assert torch.equal(healthy, before)  # bit for bit
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    a.grad = torch.tensor([0.75, 1.5])  # (g0 + g1 + g2) / 4, rank 3 withheld
    opt = torch.optim.SGD([a, b], lr=0.1)  # b has no gradient this step
    drop.rescale(opt, 4 / 3)
    assert torch.allclose(a.grad, torch.tensor([1.0, 2.0])) and b.grad is None
    # A sparse gradient (an embedding's: DDP's bucket of its own) withheld and rescaled.
    sparse = torch.sparse_coo_tensor([[1, 1]], [math.nan, 2.0], (4,))
    drop.withhold(sparse, torch.tensor(True))
    assert torch.equal(sparse.to_dense(), torch.zeros(4))
    emb = torch.nn.Parameter(torch.ones(4))
    emb.grad = torch.sparse_coo_tensor([[1, 1]], [0.75, 0.75], (4,))
    drop.rescale(torch.optim.SGD([emb], lr=0.1), 4 / 3)
    assert emb.grad.is_sparse and torch.allclose(emb.grad.to_dense(),
                                                 torch.tensor([0.0, 2.0, 0.0, 0.0]))


def _caps(path_class: Any, **fields: Any) -> Any:
    """A path's capabilities for this run, computed by the path itself on a bare instance."""
    path = path_class.__new__(path_class)
    for name, value in fields.items():
        setattr(path, name, value)
    return path._capabilities()


def test_refusals_name_why() -> None:
    plain = _caps(DDPPath, model=torch.nn.Linear(2, 2), group=None)
    alone = LocalGradPath(torch.nn.Linear(2, 2), SimpleNamespace(world_size=1)).caps
    assert drop.refusal(plain, world_size=1) is None
    assert drop.refusal(alone, world_size=1) is None  # one rank
    by_hand = LocalGradPath(torch.nn.Linear(2, 2), SimpleNamespace(world_size=4)).caps
    refused = {
        "pipeline stages": drop.refusal(plain.staged(), world_size=1),
        "DeepSpeed": drop.refusal(DeepSpeedPath.CAPS, world_size=1),
        "reduced by hand": drop.refusal(by_hand, world_size=4),
        "mesh does not span": drop.refusal(_caps(FSDPPath, model=torch.nn.Linear(2, 2),
                                                 reduces=True, replica_groups=[object()]),
                                           world_size=1),
        "2 of the job's 1": drop.refusal(plain, world_size=2),
    }
    tp = torch.nn.Linear(2, 2)
    tp.weight.to_local = lambda: None  # type: ignore[attr-defined]  # a DTensor's duck type
    refused["DTensor parameters"] = drop.refusal(_caps(DDPPath, model=tp, group=None),
                                                 world_size=1)
    for words, why in refused.items():
        assert why is not None and words in why, (words, why)
    with pytest.raises(ConfigError, match="policy='drop' is refused on rank 3") as err:
        drop.refuse_unsupported(DeepSpeedPath.CAPS, world_size=1, rank=3)
    assert err.value.field == "policy"


def test_drop_keeps_the_host_gate() -> None:
    fused = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], fused=True)
    cfg = SentinelConfig(gate="device", policy="drop")
    assert "policy drop" in str(device_gate_refusal(fused, scaler=None, config=cfg,
                                                    caps=DDPPath.CAPS))


def test_reports_metrics_and_the_reader_have_words_for_every_outcome() -> None:
    assert "dropped" in OUTCOMES
    assert set(_NEXT) == set(Outcome) and set(_OUTCOME_WORDS) == set(OUTCOMES)
    registry = CollectorRegistry()
    metrics = SentinelMetrics(RankIdentity(0, 0, 4, "n0", "cpu"), registry=registry)
    metrics.observe_step(StepResult(step=3, applied=True, outcome=Outcome.DROPPED,
                                    bad_ranks=[1], bad_hosts=["n0"], kinds=["loss"],
                                    local_kinds=[], local_loss=1.0, local_grad_norm=1.0,
                                    consecutive_skips=0), 0.001)
    value = registry.get_sample_value("nansentinel_steps_total", {"outcome": "dropped"})
    assert value == 1.0


def test_a_world_of_one_never_drops_its_only_rank(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={}, policy="drop",
                             metrics_port=0)
    x = torch.randn(8, 4)
    x[0, 0] = math.nan
    s.check_batch(x)
    loss = model(x).pow(2).mean()
    s.check_loss(loss)
    loss.backward()
    r = s.step()
    assert (r.outcome, r.applied, r.bad_ranks) == ("skipped", False, [0])
    assert torch.isfinite(model.weight).all()
    s.close()
