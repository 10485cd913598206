"""What a framework's integration keeps of the sentinel it builds (lightning.py,
transformers.py, accelerate.py).

A framework steps the optimizer itself, so its callback builds the :class:`Sentinel` once it
can see the wrapped model, decides each step with ``step(optimizer_step=False)``, and keeps
the results for the user. The integrations share this part; what differs is where each
framework lets them in.

On a DeepSpeed engine the framework calls ``engine.step()`` itself (Accelerate from
``accelerator.backward`` at the accumulation boundary, Lightning after
``on_before_optimizer_step``), and that call must be the sentinel's, which applies the step or
forces DeepSpeed's own overflow skip on every rank (engines/deepspeed_step.py): :class:`EngineSteps`
makes it so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nansentinel import engines
from nansentinel.config import SentinelConfig
from nansentinel.result import SentinelUsageError, StepResult
from nansentinel.step.record import PendingResult
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
        self._engine_steps: EngineSteps | None = None

    def build(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
              scaler: Any, replay: Callable[[torch.nn.Module, Any], torch.Tensor] | None
              ) -> Sentinel:
        """The sentinel on the framework's wrapped model, with its replay function unless
        ``replay=False`` was asked for, or unless the model's gradient path cannot replay and
        the user did not ask for it (a DeepSpeed engine: ``replay=True`` there gets the
        engine's refusal). On an engine whose step the sentinel drives, the framework's own
        ``engine.step()`` calls become ``sentinel.step()`` (:class:`EngineSteps`)."""
        overrides = dict(self.overrides)
        asked = overrides.pop("replay", None)
        if asked is None:
            wanted = replay if replay is not None and engines.takes_replay(model) else False
        else:
            wanted = replay if asked and replay is not None else bool(asked)
        self.sentinel = Sentinel(model, optimizer, scaler=scaler, replay=wanted, **overrides)
        if self.sentinel.gradients.caps.steps_optimizer:  # the sentinel drives the engine
            self._engine_steps = EngineSteps(self.sentinel, self.decided)
        return self.sentinel

    @property
    def drives_engine(self) -> bool:
        """The sentinel decides inside the framework's own ``engine.step()`` (DeepSpeed), not
        in the framework's hook before the optimizer step."""
        return self._engine_steps is not None

    def release(self, *, abandon: bool = False) -> None:
        """Give the engine its own ``step`` back and close the sentinel (``abandon``: without a
        collective, after an exception that may be this rank's alone)."""
        if self._engine_steps is not None:
            self._engine_steps.release()
            self._engine_steps = None
        if self.sentinel is not None:
            if abandon:
                self.sentinel.abandon()
            else:
                self.sentinel.close()

    def require(self, what: str, builder: str) -> Sentinel:
        """The sentinel; a clear error when the framework ran ``what`` before the hook that
        builds it (``builder``)."""
        if self.sentinel is None:
            raise SentinelUsageError(
                f"nansentinel: SentinelCallback saw {what} before {builder} built the sentinel; "
                "is the callback passed to the trainer's callbacks?")
        return self.sentinel

    def decided(self, result: StepResult | PendingResult | None) -> StepResult | None:
        """Keep a step's result (``last``, and ``skipped`` when it was not applied); None (a
        micro-batch before DeepSpeed's accumulation boundary) keeps nothing. A device-gated
        result is resolved here: a framework reads it before its next sentinel call."""
        if result is None:
            return None
        if isinstance(result, PendingResult):
            result = result.resolve()
        self.last = result
        if not result.applied:
            self.skipped[result.step] = result
        return result


class EngineSteps:
    """A framework's own ``engine.step()`` calls, made the sentinel's.

    A Sentinel on a DeepSpeed engine steps the engine itself (``sentinel.step()`` in place of
    ``engine.step()``), while the frameworks call ``engine.step()`` from their own loops. The
    engine's ``step`` is shadowed on the instance: a call from the framework runs
    ``sentinel.step()`` (a micro-batch before the boundary is counted, the boundary decided on
    every rank), and the sentinel's own calls of ``engine.step()`` inside it (the apply, the
    forced overflow skip, a micro-batch's count) reach DeepSpeed's. Each decision goes to
    ``on_result``. :meth:`release` puts DeepSpeed's own ``step`` back.
    """

    def __init__(self, sentinel: Sentinel,
                 on_result: Callable[[StepResult | PendingResult], Any]) -> None:
        self.sentinel = sentinel
        self.engine = sentinel.model
        self.on_result = on_result
        self._inside = False
        self._own = self.engine.step  # DeepSpeed's, bound to the engine
        self.engine.step = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._inside:  # the sentinel's own call: DeepSpeed's step
            return self._own(*args, **kwargs)
        if args or kwargs:
            raise SentinelUsageError(
                f"nansentinel: engine.step({', '.join([*map(repr, args), *kwargs])}) on rank "
                f"{self.sentinel.rank}: arguments to the engine's step (lr_kwargs) are not "
                "supported while the sentinel drives it; call it without them")
        self._inside = True
        try:
            result = self.sentinel.step()
        finally:
            self._inside = False
        if result is not None:
            self.on_result(result)
        return None

    def release(self) -> None:
        if vars(self.engine).get("step") is self:
            del self.engine.step
