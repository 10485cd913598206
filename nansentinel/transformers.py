"""Hugging Face ``Trainer``: the sentinel as one callback.

::

    from nansentinel.transformers import SentinelCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[SentinelCallback()])

The Trainer (on Accelerate) wraps the model in DDP and steps the optimizer itself, and its
callbacks see neither the batch, nor the loss, nor the DDP wrapper. So (transformers 5.x):

- ``on_train_begin`` — after ``accelerator.prepare``: the DDP module that wraps the callback's
  ``model`` is found (the Trainer hands callbacks the unwrapped model only, so the wrapper is
  looked up among the live objects, once) and the :class:`Sentinel` is built on it, which
  registers its DDP comm hook before the first backward.
- a forward pre-hook on the model — ``check_batch`` on the inputs of every training forward
  (each micro-batch under accumulation); a forward hook — ``check_loss`` on the ``loss`` the
  model returns. A loss computed outside the model (a custom ``compute_loss``) is not checked
  by itself; its non-finite gradients still are.
- ``on_pre_optimizer_step`` — ``step(optimizer_step=False)``, after gradient clipping and
  before ``optimizer.step()``. A skip sets every gradient to None: the update changes neither
  weights nor optimizer state.
- ``on_optimizer_step`` — on a skipped step the Accelerate optimizer is marked as skipped, as
  its GradScaler marks an overflow, so that the Trainer does what it does then: the LR
  scheduler does not step, ``global_step`` still advances, the accumulation window ends.

An abort raises :class:`~nansentinel.result.NonFiniteError` out of ``trainer.train()`` on every
rank. Importing this module imports transformers; importing ``nansentinel`` does not.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from nansentinel.config import SentinelConfig
from nansentinel.result import SentinelUsageError, StepResult
from nansentinel.sentinel import Sentinel


class SentinelCallback(TrainerCallback):
    """Checks every rank's batch, loss and gradients before the all-reduce; skips, rolls back
    or aborts the step cluster-wide.

    Args:
        **overrides: fields of :class:`~nansentinel.config.SentinelConfig` (keyword > env >
            default), checked here so that a typo fails before the job starts. With
            ``replay=True`` (the default) a detection is replayed through the model's forward
            with the saved inputs, when the model returns its loss.

    Attributes:
        sentinel: the :class:`Sentinel`, once training has started.
        last: the :class:`StepResult` of the latest optimizer step.
        skipped: ``{step: result}`` of every step that was not applied (skip or rollback).
    """

    def __init__(self, **overrides: Any) -> None:
        SentinelConfig.from_env(None, **overrides)  # fail now, not on every rank at train start
        self.overrides = overrides
        self.sentinel: Sentinel | None = None
        self.last: StepResult | None = None
        self.skipped: dict[int, StepResult] = {}
        self._hooks: list[Any] = []
        self._replaying = False
        self._marked: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()  # a second train() on the same callback starts afresh
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise SentinelUsageError(
                "nansentinel: the Trainer gave SentinelCallback no model or optimizer at "
                "on_train_begin"
            )
        wrapped = _ddp_wrapping(model)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if wrapped is None and world > 1:
            raise SentinelUsageError(
                f"nansentinel: the Trainer runs {world} ranks but did not wrap the model in "
                "DistributedDataParallel (FSDP or DeepSpeed?); SentinelCallback supports DDP "
                f"and single-process training (rank {dist.get_rank()})"
            )
        # The Accelerate wrapper's zero_grad is a no-op inside an accumulation window and its
        # step hooks are not torch's: the sentinel works on the optimizer underneath.
        raw = getattr(optimizer, "optimizer", optimizer)
        self.sentinel = Sentinel(
            wrapped if wrapped is not None else model, raw,
            scaler=getattr(optimizer, "scaler", None), replay=self._replay, **self.overrides,
        )
        self._hooks = [
            model.register_forward_pre_hook(self._check_inputs, with_kwargs=True),
            model.register_forward_hook(self._check_output),
        ]

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        result = self._require().step(optimizer_step=False)
        self.last = result
        if not result.applied:
            self.skipped[result.step] = result

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        if self.last is not None and not self.last.applied and hasattr(optimizer, "_is_overflow"):
            # What Accelerate's own GradScaler sets on an overflow: the Trainer then leaves
            # the LR scheduler where it is. Cleared again at on_step_end.
            optimizer._is_overflow = True  # type: ignore[union-attr]
            self._marked = optimizer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._marked is not None:
            self._marked._is_overflow = False
            self._marked = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove the model hooks and close the sentinel (also after an exception)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.sentinel is not None:
            self.sentinel.close()

    # --- model hooks ---------------------------------------------------------------------------

    def _training(self, module: torch.nn.Module) -> bool:
        return module.training and torch.is_grad_enabled() and not self._replaying

    def _check_inputs(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if self._training(module):
            self._require().check_batch({"args": args, **kwargs} if args else kwargs)

    def _check_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._training(module):
            return
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            self._require().check_loss(loss)

    def _replay(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Replay function: the model's own forward on the saved inputs, returning its loss."""
        inputs = dict(batch)
        args = inputs.pop("args", ())
        self._replaying = True
        try:
            output = module(*args, **inputs)
        finally:
            self._replaying = False
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise SentinelUsageError(
                "nansentinel: the model returned no loss during the replay (a custom "
                "compute_loss?); pass replay=False to SentinelCallback"
            )
        return loss

    def _require(self) -> Sentinel:
        if self.sentinel is None:
            raise SentinelUsageError(
                "nansentinel: SentinelCallback saw a training forward before on_train_begin "
                "built the sentinel"
            )
        return self.sentinel


def _ddp_wrapping(model: torch.nn.Module) -> DistributedDataParallel | None:
    """The DDP module that holds ``model`` (``ddp.module is model``), if any.

    The Trainer's callbacks receive the unwrapped model, and no reference leads from it to
    the wrapper Accelerate built, so the wrapper is looked up among the live objects: once, at
    train begin (tens of milliseconds per million objects)."""
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel) and obj.module is model:
            return obj
    return None
