"""Spike detection: see NaN coming.

A NaN is usually announced: the gradient norm jumps tens of times, then the loss jumps ~10x
over its running level, then NaN. Every rank's local loss and gradient norm are already in the
cluster view, so each rank judges every rank (and the cluster mean) against a robust running
reference with the same numbers — the verdicts are identical without another collective.

A value spikes when it is at least ``ratio`` times the rolling median *and* its robust z-score
(distance from the median in units of 1.4826 x MAD) is at least ``zscore``: the ratio alone
fires on a quiet series that doubles, the z-score alone on a noisy one. A negative or zero
median (e.g. a log-likelihood) is judged by the z-score alone. Nothing is judged before
``warmup`` values are in the window, and spikes and non-finite values never enter it, so a
divergence cannot raise its own reference.

The windows are one ``[world, window]`` CPU tensor per signal; a median over all ranks is one
vectorised call, so a 512-rank job pays microseconds, not a Python loop per rank.
"""

from __future__ import annotations

import dataclasses
import math

import torch

SIGNALS = ("loss", "grad_norm")
CLUSTER = -1
"""Pseudo-rank of the cluster mean in :class:`Spikes`."""


@dataclasses.dataclass(frozen=True, slots=True)
class Spikes:
    """Which ranks spiked on which signal at one step (``CLUSTER`` = the cluster mean)."""

    ranks: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    ratios: dict[str, dict[int, float]] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return any(self.ranks.values())

    def signals(self) -> list[str]:
        return [s for s in SIGNALS if self.ranks.get(s)]

    def of_rank(self, rank: int) -> list[str]:
        return [s for s in SIGNALS if rank in self.ranks.get(s, ())]

    def everywhere(self, world_size: int) -> bool:
        """Every rank spiked on some signal (or the cluster mean did while all are in it):
        a global divergence, not one bad rank."""
        spiking = {r for s in SIGNALS for r in self.ranks.get(s, ()) if r != CLUSTER}
        return len(spiking) == world_size

    def to_json(self) -> dict[str, object]:
        return {
            s: {str(r): round(self.ratios[s][r], 3) for r in self.ranks[s]}
            for s in SIGNALS
            if self.ranks.get(s)
        }


class SpikeDetector:
    """Rolling robust reference per rank and for the cluster mean, per signal.

    Args:
        world_size: ranks in the view.
        window: values kept per rank and signal.
        warmup: values needed before a series is judged.
        ratio: spike when value >= ratio x median (with a positive median) ...
        zscore: ... and robust z-score >= zscore.
    """

    def __init__(
        self, world_size: int, *, window: int, warmup: int, ratio: float, zscore: float
    ) -> None:
        self.world_size = world_size
        self.window, self.warmup, self.ratio, self.zscore = window, warmup, ratio, zscore
        rows = world_size + 1  # the last row is the cluster mean
        self._values = {
            s: torch.full((rows, window), math.nan, dtype=torch.float64) for s in SIGNALS
        }
        self._next = {s: torch.zeros(rows, dtype=torch.long) for s in SIGNALS}

    def judge(self, current: dict[str, list[float | None]]) -> Spikes:
        """Spikes among ``current[signal][rank]`` (None: the rank has no value this step)."""
        ranks: dict[str, list[int]] = {}
        ratios: dict[str, dict[int, float]] = {}
        for signal in SIGNALS:
            x = _with_mean(current.get(signal, []), self.world_size)
            values = self._values[signal]
            count = (~values.isnan()).sum(dim=1)
            median = values.nanmedian(dim=1).values
            mad = (values - median[:, None]).abs().nanmedian(dim=1).values
            scale = 1.4826 * mad + 1e-12 + 1e-6 * median.abs()
            z = (x - median) / scale
            # A non-positive median (e.g. a log-likelihood) is judged by the z-score alone.
            by_ratio = (median <= 0) | (x >= self.ratio * median)
            hit = (count >= self.warmup) & x.isfinite() & by_ratio & (z >= self.zscore)
            idx = hit.nonzero().flatten().tolist()
            if idx:
                rows = [CLUSTER if i == self.world_size else i for i in idx]
                ranks[signal] = rows
                ratios[signal] = {
                    r: float(x[i] / median[i]) if median[i] > 0 else math.inf
                    for r, i in zip(rows, idx, strict=True)
                }
        return Spikes(ranks, ratios)

    def record(self, current: dict[str, list[float | None]], spikes: Spikes) -> None:
        """Add this step's finite, non-spiking values to the reference windows."""
        for signal in SIGNALS:
            x = _with_mean(current.get(signal, []), self.world_size)
            keep = x.isfinite()
            for r in spikes.ranks.get(signal, ()):
                keep[self.world_size if r == CLUSTER else r] = False
            rows = keep.nonzero().flatten()
            if rows.numel() == 0:
                continue
            slot = self._next[signal][rows] % self.window
            self._values[signal][rows, slot] = x[rows]
            self._next[signal][rows] += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{k}/values": v.clone() for k, v in self._values.items()} | {
            f"{k}/next": v.clone() for k, v in self._next.items()
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for s in SIGNALS:
            if state[f"{s}/values"].shape == self._values[s].shape:
                self._values[s] = state[f"{s}/values"].clone()
                self._next[s] = state[f"{s}/next"].clone()


def _with_mean(values: list[float | None], world_size: int) -> torch.Tensor:
    """Per-rank values plus the mean of the finite ones (NaN where missing)."""
    x = torch.full((world_size + 1,), math.nan, dtype=torch.float64)
    present = [(r, v) for r, v in enumerate(values[:world_size]) if v is not None]
    if present:
        x[[r for r, _ in present]] = torch.tensor([v for _, v in present], dtype=torch.float64)
    finite = x[:world_size][x[:world_size].isfinite()]
    if finite.numel():
        x[world_size] = finite.mean()
    return x
