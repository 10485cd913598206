"""Spike detection: warm-up, ratio and z-score together, the cluster mean, clean references,
each rank judging itself on the device and every rank reading the same verdicts."""

from __future__ import annotations

import math

import torch

from nansentinel.decide.spikes import CLUSTER, SpikeDetector, Spikes
from nansentinel.result import RankIdentity
from nansentinel.wire.schema import OwnRow, T, Totals, pack
from nansentinel.wire.view import ClusterView, RankHealth

KW = {"window": 20, "warmup": 10, "ratio": 10, "zscore": 6, "refresh": 1}


class Cluster:
    """``world`` ranks' detectors and the exchange between them, run as the sentinel runs
    them: each rank packs its own verdicts on the device, the vectors are summed, and the
    flagged ranks' rows are named (the detection) before every rank judges."""

    def __init__(self, world: int, **kw: float) -> None:
        self.detectors = [SpikeDetector(**{**KW, **kw}) for _ in range(world)]  # type: ignore[arg-type]

    def judge(self, loss: list[float], grad: list[float] | None = None, *,
              record: bool = False, batch: list[float] | None = None) -> Spikes:
        world = len(self.detectors)
        owns, vectors = [], []
        for r, d in enumerate(self.detectors):
            g = grad[r] if grad is not None else 0.0
            b = batch[r] if batch is not None else 0.0
            row = torch.tensor([b, loss[r], g, 0.0, 1.0, float(grad is not None), 0.0,
                                *[0.0] * 11])
            vector = pack(row, torch.tensor(d.thresholds()), r, amp=False)
            vectors.append(vector)
            owns.append(OwnRow.from_values(vector.tolist()))
        totals = Totals.from_values(torch.stack(vectors)[:, :T.size].sum(0).tolist())
        flagged = tuple(
            RankHealth.of(RankIdentity(r, 0, world, f"h{r}", "cpu"), own, d.ratios(own))
            for r, (own, d) in enumerate(zip(owns, self.detectors, strict=True)) if own.flagged
        )
        view = ClusterView(0, world, totals, flagged, flagged)
        verdicts = [d.judge(view) for d in self.detectors]
        assert all(v == verdicts[0] for v in verdicts)  # every rank reads the same
        if record:
            for own, d in zip(owns, self.detectors, strict=True):
                d.record(own, totals, verdicts[0])
        return verdicts[0]

    def feed(self, steps: int, loss: list[float], grad: list[float] | None = None,
             batch: list[float] | None = None) -> None:
        for _ in range(steps):
            self.judge(loss, grad, record=True, batch=batch)


def test_nothing_is_judged_during_warmup() -> None:
    c = Cluster(2)
    c.feed(5, [1.0, 1.0], [1.0, 1.0])
    assert not c.judge([1000.0, 1.0], [1.0, 1.0])


def test_one_rank_spiking_is_named_while_the_cluster_mean_stays_quiet() -> None:
    c = Cluster(4)
    c.feed(12, [1.0, 1.05, 0.95, 1.0], [0.5, 0.5, 0.5, 0.5])
    s = c.judge([1.0, 1.0, 20.0, 1.0], [0.5, 0.5, 0.5, 0.5])
    assert s.ranks == {"loss": [2]} and s.of_rank(2) == ["loss"]
    assert s.ratios["loss"][2] > 10 and not s.cluster_wide
    s = c.judge([30.0] * 4, [0.5] * 4)
    assert s.ranks["loss"] == [0, 1, 2, 3, CLUSTER] and s.cluster_wide


def test_a_spike_is_cluster_wide_when_the_rest_is_not_quiet_either() -> None:
    c = Cluster(2)
    c.feed(12, [1.0, 1.0], [1.0, 1.0])
    # Rank 1 crosses 10x; rank 0 is 6x its level: beyond half-way, so the cause is global.
    s = c.judge([1.0, 1.0], [6.0, 12.0])
    assert s.ranks == {"grad_norm": [1]} and s.cluster_wide
    # Rank 0 at its usual level: rank 1 alone.
    s = c.judge([1.0, 1.0], [1.0, 30.0])
    assert s.ranks["grad_norm"][0] == 1 and not s.cluster_wide


def test_ratio_and_zscore_must_both_hold() -> None:
    c = Cluster(1, window=40, warmup=20)
    # A noisy series: 12x its median is within its spread, so not a spike by z-score.
    for i in range(30):
        c.judge([1.0 if i % 2 else 30.0], record=True)
    assert not c.judge([35.0])
    # A quiet series: a 5x jump is far out by z-score but under the ratio.
    q = Cluster(1, window=40, warmup=20)
    q.feed(25, [2.0], [1.0])
    assert not q.judge([10.0], [1.0])
    assert q.judge([21.0], [1.0]).ranks == {"loss": [0, CLUSTER]}


def test_spikes_and_non_finite_values_never_enter_the_reference() -> None:
    c = Cluster(1, warmup=5)
    c.feed(6, [1.0], [1.0])
    for _ in range(10):  # a divergence cannot raise its own reference
        s = c.judge([50.0], [math.nan], record=True)
        assert s.ranks["loss"] == [0, CLUSTER]


def test_negative_median_is_judged_by_zscore_alone() -> None:
    c = Cluster(1, warmup=5)
    for i in range(10):
        c.judge([-5.0 + 0.01 * (i % 3)], record=True)
    assert c.judge([-4.0]).ranks == {"loss": [0, CLUSTER]}


def test_quiet_needs_every_rank_and_the_mean_below_half_way() -> None:
    c = Cluster(2, warmup=5)
    c.feed(6, [1.0, 1.0], [1.0, 1.0])
    d = c.detectors[0]
    calm = Totals.from_values(pack(torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, *[0.0] * 11]),
                                   torch.tensor(d.thresholds()), 0, amp=False).tolist())
    assert d.quiet(calm)
    uneasy = pack(torch.tensor([0.0, 4.0, 1.0, 0.0, 1.0, 1.0, 0.0, *[0.0] * 11]),
                  torch.tensor(d.thresholds()), 0, amp=False)
    assert not d.quiet(Totals.from_values(uneasy.tolist()))  # 4x > sqrt(10)x its median


def test_state_roundtrip_and_a_checkpoint_from_before_the_fixed_exchange() -> None:
    c = Cluster(2, warmup=5, refresh=None)  # type: ignore[arg-type]
    c.feed(10, [1.0, 2.0], [1.0, 1.0])
    e = Cluster(2, warmup=5, refresh=None)  # type: ignore[arg-type]
    for mine, theirs in zip(e.detectors, c.detectors, strict=True):
        mine.load_state_dict(theirs.state_dict())
    assert e.judge([15.0, 2.0], [1.0, 1.0]).ranks == c.judge(
        [15.0, 2.0], [1.0, 1.0]).ranks == {"loss": [0]}
    # 0.1 saved one window per rank and one for the cluster mean; each rank takes its own.
    legacy = {"values": {"loss": [[1.0] * 10, [2.0] * 10, [1.5] * 10],
                         "grad_norm": [[1.0] * 10] * 3}, "recorded": 10}
    old = SpikeDetector(**{**KW, "warmup": 5})  # type: ignore[arg-type]
    old.load_state_dict(legacy, rank=1)
    assert old.own["loss"].values == [2.0] * 10 and old.cluster["loss"].values == [1.5] * 10
    assert old.thresholds()[0] == 20.0  # 10x rank 1's median


def test_the_loss_has_its_own_ratio() -> None:
    """Issue 38: a language model's loss cannot jump 10x (it starts near ln V); with a loss
    ratio of 1.5 a 2x loss spikes while the gradient norm keeps the ratio of 10."""
    d = SpikeDetector(window=20, warmup=10, ratio={"loss": 1.5, "grad_norm": 10.0}, zscore=6,
                      refresh=1)
    for i in range(12):
        d.own["loss"].add(2.0 + 0.01 * (i % 3))
        d.own["grad_norm"].add(1.0 + 0.01 * (i % 3))
    d._recompute()
    assert d.own["loss"].spikes(4.0) and not d.own["loss"].spikes(2.5)
    assert not d.own["grad_norm"].spikes(4.0) and d.own["grad_norm"].spikes(11.0)
    one = SpikeDetector(window=20, warmup=1, ratio=10, zscore=6, refresh=1)
    one.own["loss"].add(2.0)
    one._recompute()  # judged from the first value on (spike_warmup may be 1)
    assert one.own["loss"].spikes(25.0) and not one.own["loss"].spikes(4.0)


def test_a_spike_whose_batch_spiked_too_is_the_datas() -> None:
    """Each rank keeps its batch norm's reference: a loss spike in a step whose batch is far
    above it (an unnormalised shard) is the data's; with a usual batch it is the weights'.
    Every rank that spiked must have had such a batch, or the step is not the data's."""
    c = Cluster(2)
    c.feed(12, [2.0, 2.0], [1.0, 1.0], batch=[40.0, 41.0])
    assert c.detectors[0].thresholds()[4] == 3 * 40.0  # DATA_RATIO x its median
    data = c.judge([30.0, 2.0], [1.0, 1.0], batch=[4000.0, 41.0])
    assert data.ranks == {"loss": [0]} and data.in_data
    weights = c.judge([30.0, 2.0], [1.0, 1.0], batch=[40.0, 41.0])
    assert weights.ranks == {"loss": [0]} and not weights.in_data
    # Rank 1 spiked with a usual batch: not every spike is the data's.
    mixed = c.judge([30.0, 30.0], [1.0, 1.0], batch=[4000.0, 41.0])
    assert mixed.ranks["loss"][:2] == [0, 1] and not mixed.in_data
    # A batch far off with no spike of the loss or the gradient norm is nothing to act on.
    assert not c.judge([2.0, 2.0], [1.0, 1.0], batch=[4000.0, 41.0])
    # A non-finite batch is the non-finite path's, never a data spike.
    assert not c.judge([30.0, 2.0], [1.0, 1.0], batch=[math.inf, 41.0]).in_data


def test_the_batch_reference_keeps_out_its_own_spikes_and_survives_a_checkpoint() -> None:
    c = Cluster(1)
    c.feed(12, [2.0], [1.0], batch=[10.0])
    for _ in range(12):  # a long bad shard does not become the reference
        c.judge([2.0], [1.0], batch=[5000.0], record=True)
    d = c.detectors[0]
    assert d.thresholds()[4] == 30.0
    restored = SpikeDetector(**KW)  # type: ignore[arg-type]
    restored.load_state_dict(d.state_dict())
    assert restored.thresholds() == d.thresholds()
    older = {k: v for k, v in d.state_dict().items() if k != "batch"}
    fresh = SpikeDetector(**KW)  # type: ignore[arg-type]
    fresh.load_state_dict(older)  # a checkpoint from before the batch reference: warming up
    assert fresh.thresholds()[4] == math.inf
