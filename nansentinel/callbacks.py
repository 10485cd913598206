"""What a framework's callback keeps of the sentinel it builds (lightning.py, transformers.py).

A framework steps the optimizer itself, so its callback builds the :class:`Sentinel` once it
can see the wrapped model, decides each step with ``step(optimizer_step=False)``, and keeps
the results for the user. Both callbacks share this part; what differs is where each
framework lets them in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nansentinel.config import SentinelConfig
from nansentinel.result import SentinelUsageError, StepResult
from nansentinel.step.sentinel import Sentinel


class SentinelState:
    """A callback's sentinel and its results.

    Args:
        **overrides: fields of :class:`~nansentinel.config.SentinelConfig` (keyword > env >
            default), checked at once, so that a typo fails before the job starts.
            ``replay=False`` turns the replay (through the framework's own step) off.

    Attributes:
        sentinel: the :class:`Sentinel`, once training has started.
        last: the :class:`StepResult` of the latest optimizer step.
        skipped: ``{step: result}`` of every step that was not applied (skip or rollback).
    """

    def __init__(self, **overrides: Any) -> None:
        SentinelConfig.from_env(None, **overrides)  # fail now, not on every rank at start
        self.overrides = overrides
        self.sentinel: Sentinel | None = None
        self.last: StepResult | None = None
        self.skipped: dict[int, StepResult] = {}

    def build(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, scaler: Any,
              replay: Callable[[torch.nn.Module, Any], torch.Tensor]) -> Sentinel:
        """The sentinel on the framework's wrapped model, with its replay function unless
        ``replay=False`` was asked for."""
        overrides = dict(self.overrides)
        wanted = replay if overrides.pop("replay", True) else False
        self.sentinel = Sentinel(model, optimizer, scaler=scaler, replay=wanted, **overrides)
        return self.sentinel

    def require(self, what: str, builder: str) -> Sentinel:
        """The sentinel; a clear error when the framework ran ``what`` before the hook that
        builds it (``builder``)."""
        if self.sentinel is None:
            raise SentinelUsageError(
                f"nansentinel: SentinelCallback saw {what} before {builder} built the sentinel; "
                "is the callback passed to the trainer's callbacks?")
        return self.sentinel

    def decided(self, result: StepResult) -> StepResult:
        """Keep a step's result (``last``, and ``skipped`` when it was not applied)."""
        self.last = result
        if not result.applied:
            self.skipped[result.step] = result
        return result
