"""Spike detection: see NaN coming.

A NaN is usually announced: the gradient norm jumps tens of times, then the loss jumps ~10x
over its running level, then NaN. Each rank judges its own loss and gradient norm against its
own running reference, where the values are, and every rank judges the cluster mean (from the
exchange's sums) against one more: four references per rank at any world size. A rank's own
verdict is taken on the device, against thresholds this module hands it (:meth:`thresholds`),
and travels as a flag in the exchange, so every rank learns how many ranks spiked, and which
(after a detection), from the same numbers.

A value spikes when it is at least ``ratio`` times the rolling median *and* its robust z-score
(distance from the median in units of 1.4826 x MAD) is at least ``zscore``: the ratio alone
fires on a quiet series that doubles, the z-score alone on a noisy one. A negative or zero
median (e.g. a log-likelihood) is judged by the z-score alone. Nothing is judged before
``warmup`` values are in the window, and spikes and non-finite values never enter it, so a
divergence cannot raise its own reference.

A spike is *cluster-wide* (a divergence: learning rate or model) when every rank spiked, or
when the cluster mean without the spiking ranks is not quiet either: one node's loss can spike
while the rest looks fine, and then it is that node's.

A spike in a step whose batch spiked too is the *data's* (:attr:`Spikes.in_data`): each rank
also keeps a reference of its batch's norm (the floating tensors ``check_batch`` saw), and a
batch ``DATA_RATIO`` times its median (and ``zscore`` out) says the input changed, a shard
preprocessed without its scaler, not that the weights were ruined. The policy skips such a step
rather than rolling back: a rollback cannot tell twenty bad batches in a row from ruined
weights, and it would discard good steps for them. A batch of integer tokens alone has no norm
(0): its steps are never the data's by this rule.

A value can also fall far below its level: a *collapse* (issue 60). Degenerate data (every
label the same token, a shard of padding, the inputs copied into the labels) is easy to fit,
and the loss drops from its level to near zero within a few steps; the weights learn the
degenerate target, and a snapshot taken then is not a good state. The cluster mean's loss and
gradient norm are judged for it from the totals (the same on every rank): at most
``1 / ratio`` times the median *and* half ``zscore`` robust deviations below it (a loss
falls towards 0, and while it still descends its spread is wide). A collapsed value
does not enter the references (neither the cluster's nor the rank's own), so the level the
data returns to is judged against the level before the collapse; :meth:`SpikeDetector.quiet`
is false while the cluster mean is below its normal band (``1 / sqrt(ratio)`` and a quarter of
the z-score), so no snapshot is kept then. A collapse that lasts ``window // 2`` steps in a row is
the run's new level (a phase change, a new curriculum stage): the references restart from the
collapsed values, and the collapse ends.

A stretch of degenerate data begins before it collapses (issue 70): :meth:`SpikeDetector.low`
says when the cluster's loss left its band below, :meth:`SpikeDetector.level` where the loss
stood when a snapshot was kept (the median of its recent values), and :func:`above` when a
loss is clearly above such a level; the policy dates, judges and undoes the stretch from
them (policy.py).

The reference (median and MAD) is recomputed every tenth of a window, not every step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import deque

from nansentinel.wire.schema import SIGNALS, OwnRow, Totals
from nansentinel.wire.view import ClusterView

CLUSTER = -1
"""Pseudo-rank of the cluster mean in :class:`Spikes`."""

DATA_RATIO = 3.0
"""A batch whose norm is this many times its running median (and ``zscore`` robust deviations
out) is itself anomalous. A normalised input pipeline moves its batch norm by a few percent
from batch to batch; an unnormalised column moves it by orders of magnitude."""

__all__ = ["CLUSTER", "SIGNALS", "Series", "SpikeDetector", "Spikes", "above"]


def above(relative: float | None, ratio: float) -> bool:
    """A value ``relative`` times a level it is judged against is clearly above it: at least
    ``sqrt(ratio)`` times it, half-way (geometrically) to a spike over it. The bar a rollback
    must bring the loss under (the level saved with its snapshot, issue 60), and the one a
    degenerate stretch's return is judged by against the level it went in at (issue 70): on
    the bench, runs whose weights learned a stretch came back at 1.29-5.7 times that level,
    runs whose weights did not at 0.85-1.11 times (at most 1.17 within five steps)
    (docs/recovery.md)."""
    return relative is not None and relative >= math.sqrt(ratio)


@dataclasses.dataclass(frozen=True, slots=True)
class Spikes:
    """Which ranks spiked on which signal at one step (``CLUSTER`` = the cluster mean)."""

    ranks: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    ratios: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)
    cluster_wide: bool = False
    """Every rank spiked, or the ranks that did not are not quiet either: a divergence."""
    in_data: bool = False
    """Every rank that spiked had a batch that spiked too (``Totals.data_spike``): the data
    changed, not the weights."""
    collapsed: dict[str, float] = dataclasses.field(default_factory=dict)
    """Signal -> the cluster mean over its running median, for the signals whose cluster mean
    collapsed (far below its level). Not a rise: ``bool(spikes)`` ignores it."""

    def __bool__(self) -> bool:
        return any(self.ranks.values())

    def signals(self) -> list[str]:
        return [s for s in SIGNALS if self.ranks.get(s)]

    def of_rank(self, rank: int) -> list[str]:
        return [s for s in SIGNALS if rank in self.ranks.get(s, ())]

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            s: {str(r): round(self.ratios[s][r], 3) for r in self.ranks[s]}
            for s in SIGNALS
            if self.ranks.get(s)
        }
        if self.collapsed:
            out["collapse"] = {s: round(x, 4) for s, x in self.collapsed.items()}
        return out


class Series:
    """One rolling robust reference (median, spike and quiet thresholds) over a window."""

    __slots__ = ("_values", "ratio", "ref", "warmup", "zscore")

    def __init__(self, *, window: int, warmup: int, ratio: float, zscore: float) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self.warmup, self.ratio, self.zscore = warmup, ratio, zscore
        #: (median, spike threshold, quiet threshold, collapse threshold, low end of the
        #: normal band), or None while warming up.
        self.ref: tuple[float, float, float, float, float] | None = None

    def spikes(self, x: float | None) -> bool:
        ref = self.ref
        return ref is not None and x is not None and math.isfinite(x) and x >= ref[1]

    def quiet(self, x: float | None) -> bool:
        """Not even half-way (geometrically) to a spike: below sqrt(ratio) x the median and
        half the z-score; a non-finite value is never quiet."""
        if x is None:
            return True
        if not math.isfinite(x):
            return False
        return self.ref is None or x < self.ref[2]

    def collapses(self, x: float | None) -> bool:
        """Far below the median: at most ``1 / ratio`` times it (a positive median) and
        half ``zscore`` robust deviations under it."""
        ref = self.ref
        return ref is not None and x is not None and math.isfinite(x) and x <= ref[3]

    def in_band(self, x: float | None) -> bool:
        """Not even half-way (geometrically) down to a collapse: above the normal band's low
        end (``1 / sqrt(ratio)`` x the median and a quarter of the z-score under it)."""
        ref = self.ref
        return ref is None or x is None or not math.isfinite(x) or x > ref[4]

    def level(self, n: int) -> float | None:
        """The median of the last ``n`` values (None: none yet): where the series stands now,
        robust to one batch's noise, and not lagging as the whole window's median does while
        the value descends."""
        recent = sorted(list(self._values)[-n:])
        return recent[len(recent) // 2] if recent else None

    def ratio_of(self, x: float) -> float:
        """``x`` over the running median (inf for a non-positive median)."""
        median = self.ref[0] if self.ref is not None else 0.0
        return x / median if median > 0 else math.inf

    def add(self, x: float | None) -> None:
        if x is not None and math.isfinite(x):
            self._values.append(x)

    def recompute(self) -> None:
        if len(self._values) < self.warmup:
            self.ref = None
            return
        ordered = sorted(self._values)
        median = ordered[len(ordered) // 2]
        mad = sorted(abs(v - median) for v in ordered)[len(ordered) // 2]
        scale = 1.4826 * mad + 1e-12 + 1e-6 * abs(median)
        threshold = median + self.zscore * scale
        quiet = median + self.zscore / 2 * scale
        # A loss falls towards 0, not symmetrically: half the z-score below (and 1/ratio).
        collapse = median - self.zscore / 2 * scale
        low = median - self.zscore / 4 * scale
        if median > 0:  # a non-positive median (a log-likelihood): z-score alone
            threshold = max(threshold, self.ratio * median)
            quiet = max(quiet, math.sqrt(self.ratio) * median)
            collapse = min(collapse, median / self.ratio)
            low = min(low, median / math.sqrt(self.ratio))
        self.ref = (median, threshold, quiet, collapse, low)

    @property
    def values(self) -> list[float]:
        return list(self._values)

    def load(self, values: list[float]) -> None:
        self._values.clear()
        self._values.extend(float(v) for v in values)

    def rebase(self, values: list[float]) -> None:
        """Start again from ``values`` (a collapse that became the level), judged at once."""
        self.load(values)
        self.recompute()


class SpikeDetector:
    """This rank's own references and the cluster mean's, per signal.

    Args:
        window: values kept per series.
        warmup: values needed before a series is judged.
        ratio: spike when value >= ratio x median (with a positive median) ...; one ratio
            for every signal, or one per signal (a language model's loss wants a lower one
            than its gradient norm).
        zscore: ... and robust z-score >= zscore.
        refresh: steps between recomputations of the references (default window // 10).
    """

    def __init__(
        self, *, window: int, warmup: int, ratio: float | dict[str, float], zscore: float,
        refresh: int | None = None,
    ) -> None:
        self.refresh = refresh or max(1, window // 10)
        ratios = ratio if isinstance(ratio, dict) else dict.fromkeys(SIGNALS, ratio)
        series = functools.partial(Series, window=window, warmup=warmup, zscore=zscore)
        self.own = {s: series(ratio=ratios[s]) for s in SIGNALS}
        self.cluster = {s: series(ratio=ratios[s]) for s in SIGNALS}
        #: This rank's batch norm (own only: a rank's data is its own).
        self.batch = series(ratio=DATA_RATIO)
        self._recorded = 0
        #: Bumped whenever the references change, so the device thresholds are re-sent.
        self.version = 0
        #: Signal -> the cluster means of the collapse in progress (kept out of the
        #: references; they become the references when it lasts ``window // 2`` steps).
        self._collapse: dict[str, list[float]] = {}
        self._window = window

    def thresholds(self) -> list[float]:
        """``[spike loss, spike grad, quiet loss, quiet grad, spike batch]`` of this rank's own
        series, for the judgement on the device (``inf``: not judged yet)."""
        refs = [self.own[s].ref for s in SIGNALS]
        batch = self.batch.ref
        return ([r[1] if r else math.inf for r in refs] + [r[2] if r else math.inf for r in refs]
                + [batch[1] if batch else math.inf])

    def judge(self, view: ClusterView) -> Spikes:
        """The spikes of this step: the named ranks' own verdicts (gathered with their rows)
        and the cluster mean's, judged here from the totals."""
        ranks: dict[str, list[int]] = {}
        ratios: dict[str, dict[int, float]] = {}
        for r in view.flagged:
            for signal, ratio in r.spikes.items():
                ranks.setdefault(signal, []).append(r.rank)
                ratios.setdefault(signal, {})[r.rank] = ratio
        totals = view.totals
        wide = view.world_size > 0 and totals.spike_any >= view.world_size
        for signal in SIGNALS:
            series = self.cluster[signal]
            mean = totals.mean(signal)
            if series.spikes(mean):
                assert mean is not None
                ranks.setdefault(signal, []).append(CLUSTER)
                ratios.setdefault(signal, {})[CLUSTER] = series.ratio_of(mean)
            if ranks.get(signal) and not wide:
                spiking = [v for r in view.flagged if signal in r.spikes
                           and (v := r.value(signal)) is not None]
                rest = totals.without(signal, spiking)
                wide = rest is not None and series.ref is not None and not series.quiet(rest)
        in_data = 0 < totals.spike_any <= totals.data_spike
        return Spikes(ranks, ratios, cluster_wide=bool(ranks) and wide,
                      in_data=bool(ranks) and in_data, collapsed=self.collapses(totals))

    def collapses(self, totals: Totals) -> dict[str, float]:
        """Signal -> the cluster mean over its median, for the signals that collapsed."""
        out = {}
        for signal in SIGNALS:
            series, mean = self.cluster[signal], totals.mean(signal)
            if series.collapses(mean):
                assert mean is not None and series.ref is not None
                out[signal] = mean / series.ref[0] if series.ref[0] > 0 else -math.inf
        return out

    @property
    def collapsing(self) -> list[str]:
        """The signals whose collapse is in progress (the last step recorded collapsed)."""
        return [s for s in SIGNALS if self._collapse.get(s)]

    def cluster_spikes(self, totals: Totals) -> bool:
        """The cluster mean spiked on some signal (a detection even if no rank did)."""
        return any(self.cluster[s].spikes(totals.mean(s)) for s in SIGNALS)

    def quiet(self, totals: Totals) -> bool:
        """No rank (by its own flag) and not the cluster mean is even half-way to a spike. A
        rollback target must be quiet, or restoring it brings the spike straight back (the
        gradient norm rises for steps before it crosses the threshold)."""
        return totals.not_quiet == 0 and all(
            self.cluster[s].quiet(totals.mean(s)) and self.cluster[s].in_band(totals.mean(s))
            for s in SIGNALS
        )

    def near(self, totals: Totals, level: float | None = None) -> bool:
        """The cluster mean's loss is in its normal band, neither half-way up to a spike nor
        down to a collapse, and (given the ``level`` saved with the snapshot restored) not
        :func:`above` that level either: after a rollback, the restored state does what it
        was known to."""
        series, mean = self.cluster["loss"], totals.mean("loss")
        if mean is None:
            return True
        if level is not None and level > 0 and above(mean / level, series.ratio):
            return False
        return series.quiet(mean) and series.in_band(mean)

    def level(self) -> float | None:
        """Where the cluster's loss stands now: the median of its last ``refresh`` values in
        the reference (a step's own loss is one batch's, as noisy as the batches are)."""
        return self.cluster["loss"].level(self.refresh)

    def low(self, totals: Totals) -> bool:
        """The cluster mean's loss is below its normal band (half-way down to a collapse, or
        further): where a degenerate stretch begins, before it collapses (a loader serving
        one batch again: the loss sinks as the weights learn it)."""
        return not self.cluster["loss"].in_band(totals.mean("loss"))

    def ratios(self, own: OwnRow) -> dict[str, float]:
        """Signal -> this rank's value over its running median, for the signals it spiked on."""
        out = {}
        for signal in own.spiked():
            x = own.value(signal)
            if x is not None:
                out[signal] = self.own[signal].ratio_of(x)
        return out

    def record(self, own: OwnRow, totals: Totals, spikes: Spikes) -> None:
        """Add this step's finite, non-spiking, non-collapsed values to the references."""
        mine = set(own.spiked())
        for signal in SIGNALS:
            if signal in spikes.collapsed:  # kept out, unless it lasts (the new level)
                held = self._collapse.setdefault(signal, [])
                held.append(totals.mean(signal))  # type: ignore[arg-type]
                if len(held) >= max(1, self._window // 2):
                    self.cluster[signal].rebase(held)
                    self.own[signal].rebase([])  # this rank's own: warms up again
                    self._collapse.pop(signal)
                    self.version += 1
                continue
            self._collapse.pop(signal, None)
            if signal not in mine:
                self.own[signal].add(own.value(signal))
            if CLUSTER not in spikes.ranks.get(signal, ()):
                self.cluster[signal].add(totals.mean(signal))
        if not own.spike_batch:
            self.batch.add(own.batch_norm)
        self._recorded += 1
        if self._recorded % self.refresh == 0:
            self._recompute()

    def _recompute(self) -> None:
        for series in (*self.own.values(), *self.cluster.values(), self.batch):
            series.recompute()
        self.version += 1

    def state_dict(self) -> dict[str, object]:
        return {
            "own": {s: self.own[s].values for s in SIGNALS},
            "cluster": {s: self.cluster[s].values for s in SIGNALS},
            "batch": self.batch.values,
            "recorded": self._recorded,
            "collapse": {s: list(v) for s, v in self._collapse.items()},
        }

    def reset(self) -> None:
        """Forget every reference (each warms up again from the values that come): the run
        goes on from a level no snapshot knew, after a recovery that did not help."""
        for series in (*self.own.values(), *self.cluster.values(), self.batch):
            series.rebase([])
        self._collapse.clear()
        self.version += 1

    def load_state_dict(self, state: dict[str, object], rank: int = 0) -> None:
        """Restore :meth:`state_dict`; a checkpoint from before 0.2 (one window per rank and
        one for the cluster mean, ``values``) gives this rank's window and the last one."""
        own, cluster = state.get("own"), state.get("cluster")
        if own is None and isinstance(state.get("values"), dict):
            legacy: dict[str, list[list[float]]] = state["values"]  # type: ignore[assignment]
            own = {s: rows[rank] for s, rows in legacy.items() if rank < len(rows) - 1}
            cluster = {s: rows[-1] for s, rows in legacy.items() if rows}
        for target, saved in ((self.own, own), (self.cluster, cluster)):
            if isinstance(saved, dict):
                for s in SIGNALS:
                    if s in saved:
                        target[s].load(saved[s])
        batch = state.get("batch")
        if isinstance(batch, list):  # absent in older checkpoints: it starts afresh
            self.batch.load(batch)
        self._recorded = int(state.get("recorded", 0))  # type: ignore[call-overload]
        collapse = state.get("collapse")
        self._collapse = ({s: [float(x) for x in v] for s, v in collapse.items()}
                          if isinstance(collapse, dict) else {})
        self._recompute()
