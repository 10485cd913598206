"""The last steps' curves, for the incident page: this rank's loss and gradient norm, and the
cluster's mean and spread, as every rank already knows them after each step.

A healthy step appends one tuple of numbers the step has read anyway (its own row and the
exchange's totals): no collective, no device work. A detection hands the blamed ranks' own
curves to the report (they speak in the detection's gather already) and rank 0 writes the
cluster's beside them, so the report can draw the bad rank against the rest.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from nansentinel.common.report import json_float
from nansentinel.wire.schema import SIGNALS, OwnRow, Totals

STEPS = 200
"""How many judged steps the curves keep."""


class Curves:
    """A ring of the last ``size`` judged steps."""

    def __init__(self, size: int = STEPS) -> None:
        # (step, own loss, own grad norm, loss mean, loss std, grad mean, grad std)
        self._rows: deque[tuple[float | None, ...]] = deque(maxlen=size)

    def add(self, step: int, own: OwnRow, totals: Totals) -> None:
        self._rows.append((
            step, own.loss, own.grad_norm,
            *(x for s in SIGNALS for x in (totals.mean(s), totals.std(s))),
        ))

    def own(self) -> dict[str, Any]:
        """This rank's curves: ``steps`` and, per signal, its values (JSON-able)."""
        return {
            "steps": [r[0] for r in self._rows],
            **{s: [json_float(r[1 + i]) for r in self._rows] for i, s in enumerate(SIGNALS)},
        }

    def cluster(self) -> dict[str, Any]:
        """The cluster's curves: ``steps`` and, per signal, the mean and the spread (std over
        the ranks with a finite value; None where no rank had one)."""
        return {
            "steps": [r[0] for r in self._rows],
            **{s: {"mean": [json_float(r[3 + 2 * i]) for r in self._rows],
                   "std": [json_float(r[4 + 2 * i]) for r in self._rows]}
               for i, s in enumerate(SIGNALS)},
        }
