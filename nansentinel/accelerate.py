"""Accelerate: your own training loop on ``accelerate.Accelerator``, watched.

::

    from accelerate import Accelerator
    from nansentinel.accelerate import AcceleratedSentinel

    accelerator = Accelerator(gradient_accumulation_steps=4, mixed_precision="bf16")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    sentinel = AcceleratedSentinel(accelerator, model, optimizer)   # SentinelConfig keywords

    for batch in loader:
        with accelerator.accumulate(model):
            sentinel.check_batch(batch)
            loss = model(**batch).loss
            sentinel.check_loss(loss)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            sentinel.step()            # in place of optimizer.step()
            scheduler.step()           # Accelerate's: does not advance on a skipped step
            optimizer.zero_grad()
    sentinel.close()

Why a helper and not ``Sentinel(model, optimizer)`` alone: Accelerate decides three things the
sentinel must agree with.

- **When a step ends.** Under ``accelerator.accumulate`` every micro-batch calls
  ``optimizer.step()``, and Accelerate's optimizer steps only where ``accelerator.sync_gradients``
  holds. :meth:`AcceleratedSentinel.step` decides there and only there, once per optimizer step,
  on every rank alike (the micro-batches before it are checked and counted into that step; DDP's
  comm hook checks the last one's bucket, which carries the accumulated gradient).
- **Whether the scheduler moves.** Accelerate's ``AcceleratedScheduler.step`` does nothing when
  ``optimizer.step_was_skipped``, which Accelerate sets only from its own GradScaler (fp16). A
  step the sentinel skipped is marked there the same way (:func:`mark_skipped`), so the LR
  schedule stays where it was, as after an fp16 overflow; under fp16 Accelerate's GradScaler is
  handed to the sentinel and its overflow is recorded (``scaler.update`` backs off).
- **Who steps the engine.** On DeepSpeed, ``accelerator.backward`` calls ``engine.step()`` itself
  at the boundary; that call is the sentinel's (callbacks.EngineSteps), which applies the step or
  forces DeepSpeed's own overflow skip, and :meth:`AcceleratedSentinel.step` returns its result.

A process group of several ranks where Accelerate believes it runs alone is refused by name
(:func:`require_one_world`): on CPU ranks started by torchrun, ``Accelerator()`` without
``cpu=True`` leaves each rank training its own copy of the model.

Importing this module imports accelerate; importing ``nansentinel`` does not.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from nansentinel.callbacks import SentinelState
from nansentinel.result import StepResult
from nansentinel.step.prepared import require_one_world

#: The accelerate release the skip mark (:func:`mark_skipped`) was read from and tested with.
TESTED_ACCELERATE = "1.15"


class AcceleratedSentinel(SentinelState):
    """The sentinel for a loop on ``accelerate.Accelerator`` (see the module docstring).

    Args:
        accelerator: the ``Accelerator`` that prepared ``model`` and ``optimizer``.
        model: the model as ``accelerator.prepare`` returned it (DDP, the FSDP2 root, the
            DeepSpeed engine, or the model itself on one process).
        optimizer: the optimizer as ``accelerator.prepare`` returned it.
        replay: ``fn(module, batch) -> loss`` to replay a detection through the model (off by
            default; not under DeepSpeed), or a bool for the config field.
        **overrides: fields of :class:`~nansentinel.config.SentinelConfig` (keyword > env >
            default).

    Attributes: ``sentinel``, ``last``, ``skipped``: see
    :class:`~nansentinel.callbacks.SentinelState`.
    """

    def __init__(self, accelerator: Any, model: torch.nn.Module, optimizer: Any, *,
                 replay: Callable[[torch.nn.Module, Any], torch.Tensor] | bool | None = None,
                 **overrides: Any) -> None:
        function = replay if callable(replay) else None
        if replay is not None:
            overrides["replay"] = True if function is not None else replay
        SentinelState.__init__(self, **overrides)
        require_one_world(accelerator.num_processes, "Accelerate", "Accelerator(cpu=True)")
        self.accelerator = accelerator
        self.optimizer = optimizer
        self._marked = False
        self._returned: StepResult | None = None
        # Accelerate's optimizer wrapper steps only at the boundary and its zero_grad is a no-op
        # inside an accumulation window: the sentinel works on the optimizer underneath.
        self.build(model, getattr(optimizer, "optimizer", optimizer),
                   scaler=getattr(accelerator, "scaler", None), replay=function)

    def check_batch(self, batch: Any, *, ids: Any = None) -> Any:
        """``Sentinel.check_batch``: every micro-batch, before its backward."""
        return self.require("check_batch", "AcceleratedSentinel").check_batch(batch, ids=ids)

    def check_loss(self, loss: torch.Tensor | float) -> None:
        """``Sentinel.check_loss``: every micro-batch, before ``accelerator.backward``."""
        self.require("check_loss", "AcceleratedSentinel").check_loss(loss)

    def step(self) -> StepResult | None:
        """In place of ``optimizer.step()``, every micro-batch. Where Accelerate syncs the
        gradients (``accelerator.sync_gradients``) the step is decided with every rank, then
        Accelerate's own ``optimizer.step()`` runs (its GradScaler's step and update under
        fp16; a no-op after a skip, whose gradients are None), and a skip is marked for the
        scheduler; elsewhere nothing is decided and None is returned. On DeepSpeed the
        decision was taken in ``accelerator.backward``: its result is returned here once."""
        sentinel = self.require("step", "AcceleratedSentinel")
        if self.drives_engine:
            result = self.last if self.last is not self._returned else None
            self._returned = self.last
            return result
        if not self.accelerator.sync_gradients:
            return None
        if self._marked:
            mark_skipped(self.optimizer, False)
            self._marked = False
        result = self.decided(sentinel.step(optimizer_step=False))
        self.optimizer.step()
        if result is not None and not result.applied:
            self._marked = mark_skipped(self.optimizer, True)
        return result

    def close(self) -> None:
        """Close the sentinel at a point every rank reaches (and give a DeepSpeed engine its
        own ``step`` back)."""
        self.release()

    def __enter__(self) -> AcceleratedSentinel:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.release(abandon=kind is not None)


_warned: set[str] = set()


def mark_skipped(optimizer: Any, skipped: bool) -> bool:
    """Mark an Accelerate optimizer's step as skipped (or not), as its GradScaler does on an
    overflow, so that ``accelerator.optimizer_step_was_skipped`` holds and Accelerate's
    scheduler wrapper (the Trainer's own scheduler step too) leaves the LR where it is. False
    for an optimizer that is not Accelerate's.

    Accelerate reads the mark through the public ``step_was_skipped`` but sets it only in
    private (``_is_overflow``, accelerate 1.x, tested with 1.15); the mark is checked through
    the public read, and where an Accelerate release no longer honours it, said once instead of
    silently stepping the scheduler on skipped steps."""
    if not hasattr(type(optimizer), "step_was_skipped"):
        return False
    optimizer._is_overflow = skipped
    if optimizer.step_was_skipped != skipped:
        import accelerate

        if accelerate.__version__ not in _warned:
            _warned.add(accelerate.__version__)
            warnings.warn(
                f"nansentinel: accelerate {accelerate.__version__} no longer reads the skip mark "
                f"(_is_overflow) through step_was_skipped (tested with {TESTED_ACCELERATE}): on "
                "a step the sentinel skips, the LR scheduler will step", stacklevel=2,
            )
        return False
    return True
