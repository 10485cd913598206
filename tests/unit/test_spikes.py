"""Spike detection: warm-up, ratio and z-score together, the cluster mean, clean references."""

from __future__ import annotations

import math

from nansentinel.spikes import CLUSTER, SpikeDetector


def feed(d: SpikeDetector, steps: int, loss: list[float], grad: list[float]) -> None:
    for _ in range(steps):
        cur = {"loss": list(loss), "grad_norm": list(grad)}
        d.record(cur, d.judge(cur))


def test_nothing_is_judged_during_warmup() -> None:
    d = SpikeDetector(2, window=20, warmup=10, ratio=10, zscore=6, refresh=1)
    feed(d, 5, [1.0, 1.0], [1.0, 1.0])
    assert not d.judge({"loss": [1000.0, 1.0], "grad_norm": [1.0, 1.0]})


def test_one_rank_spiking_is_named_while_the_cluster_mean_stays_quiet() -> None:
    d = SpikeDetector(4, window=20, warmup=10, ratio=10, zscore=6, refresh=1)
    feed(d, 12, [1.0, 1.05, 0.95, 1.0], [0.5, 0.5, 0.5, 0.5])
    s = d.judge({"loss": [1.0, 1.0, 20.0, 1.0], "grad_norm": [0.5, 0.5, 0.5, 0.5]})
    assert s.ranks == {"loss": [2]} and s.of_rank(2) == ["loss"]
    assert s.ratios["loss"][2] > 10 and not s.everywhere(4)
    s = d.judge({"loss": [30.0] * 4, "grad_norm": [0.5] * 4})
    assert s.ranks["loss"] == [0, 1, 2, 3, CLUSTER] and s.everywhere(4)


def test_ratio_and_zscore_must_both_hold() -> None:
    d = SpikeDetector(1, window=40, warmup=20, ratio=10, zscore=6, refresh=1)
    # A noisy series: 12x its median is within its spread, so not a spike by z-score.
    for i in range(30):
        v = 1.0 if i % 2 else 30.0
        d.record({"loss": [v]}, d.judge({"loss": [v]}))
    assert not d.judge({"loss": [35.0]})
    # A quiet series: a 5x jump is far out by z-score but under the ratio.
    q = SpikeDetector(1, window=40, warmup=20, ratio=10, zscore=6, refresh=1)
    feed(q, 25, [2.0], [1.0])
    assert not q.judge({"loss": [10.0], "grad_norm": [1.0]})
    assert q.judge({"loss": [21.0], "grad_norm": [1.0]}).ranks == {"loss": [0, CLUSTER]}


def test_spikes_and_non_finite_values_never_enter_the_reference() -> None:
    d = SpikeDetector(1, window=20, warmup=5, ratio=10, zscore=6, refresh=1)
    feed(d, 6, [1.0], [1.0])
    for _ in range(10):  # a divergence cannot raise its own reference
        cur = {"loss": [50.0], "grad_norm": [math.nan]}
        s = d.judge(cur)
        assert s.ranks["loss"] == [0, CLUSTER]
        d.record(cur, s)


def test_negative_median_is_judged_by_zscore_alone() -> None:
    d = SpikeDetector(1, window=20, warmup=5, ratio=10, zscore=6, refresh=1)
    for i in range(10):
        v = -5.0 + 0.01 * (i % 3)
        d.record({"loss": [v]}, d.judge({"loss": [v]}))
    assert d.judge({"loss": [-4.0]}).ranks == {"loss": [0, CLUSTER]}


def test_state_roundtrip() -> None:
    d = SpikeDetector(2, window=20, warmup=5, ratio=10, zscore=6)
    feed(d, 10, [1.0, 2.0], [1.0, 1.0])
    e = SpikeDetector(2, window=20, warmup=5, ratio=10, zscore=6)
    e.load_state_dict(d.state_dict())
    cur = {"loss": [15.0, 2.0], "grad_norm": [1.0, 1.0]}
    assert e.judge(cur).ranks == d.judge(cur).ranks == {"loss": [0]}
