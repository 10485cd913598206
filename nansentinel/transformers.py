"""Hugging Face ``Trainer``: the sentinel as one callback.

::

    from nansentinel.transformers import SentinelCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[SentinelCallback()])

The Trainer (on Accelerate) wraps the model in DDP and steps the optimizer itself, and its
callbacks see neither the batch, nor the loss, nor the DDP wrapper. So (transformers 5.x):

- ``on_train_begin`` — after ``accelerator.prepare``. The Trainer hands callbacks the unwrapped
  model only, and no public attribute leads from it (nor from the optimizer, scheduler or data
  loaders callbacks get) to the DDP wrapper Accelerate built. On one process the
  :class:`Sentinel` is built here; on several, the wrapper is met at its first forward by
  torch's public global forward pre-hook (``register_module_forward_pre_hook``), armed only until
  then, and the :class:`Sentinel` is built on it there, registering its DDP comm hook before the
  first backward. A training forward of the model without a DDP wrapper around it (FSDP,
  DeepSpeed) is refused by name.
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
  Accelerate has no public setter: its read side (``step_was_skipped``) is public, the flag
  behind it (``_is_overflow``, accelerate 1.x, tested with 1.15) is not, so the mark is checked
  through the public read, and a test pins it (tests/frameworks/test_transformers.py).

An abort raises :class:`~nansentinel.result.NonFiniteError` out of ``trainer.train()`` on every
rank. Importing this module imports transformers; importing ``nansentinel`` does not.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from nansentinel.callbacks import SentinelState
from nansentinel.result import SentinelUsageError
from nansentinel.step.sentinel import Sentinel
from nansentinel.wire.collectives import job_rank, job_size


class SentinelCallback(SentinelState, TrainerCallback):
    """Checks every rank's batch, loss and gradients before the all-reduce; skips, rolls back
    or aborts the step cluster-wide. ``**overrides`` and the attributes: see
    :class:`~nansentinel.callbacks.SentinelState`; a detection is replayed through the model's
    forward with the saved inputs, when the model returns its loss (``replay=False``: not)."""

    def __init__(self, **overrides: Any) -> None:
        SentinelState.__init__(self, **overrides)
        self._hooks: list[Any] = []
        self._replaying = False
        self._marked: Any = None
        self._finder: Any = None
        self._model: torch.nn.Module | None = None
        self._raw: Any = None
        self._scaler: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()  # a second train() on the same callback starts afresh
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise SentinelUsageError(
                "nansentinel: the Trainer gave SentinelCallback no model or optimizer at "
                "on_train_begin"
            )
        # The Accelerate wrapper's zero_grad is a no-op inside an accumulation window and its
        # step hooks are not torch's: the sentinel works on the optimizer underneath.
        self._model, self._raw = model, getattr(optimizer, "optimizer", optimizer)
        self._scaler = getattr(optimizer, "scaler", None)
        world = job_size()
        if world > 1:
            self._finder = torch.nn.modules.module.register_module_forward_pre_hook(
                self._find_wrapper)
        else:
            self._build(model)
        self._hooks = [
            model.register_forward_pre_hook(self._check_inputs, with_kwargs=True),
            model.register_forward_hook(self._check_output),
        ]

    def _build(self, model: torch.nn.Module) -> None:
        self.build(model, self._raw, scaler=self._scaler, replay=self._replay)

    def _find_wrapper(self, module: torch.nn.Module, args: Any) -> None:
        """Global forward pre-hook, armed from train begin until the DDP wrapper of the model
        runs its first forward (it runs before the model's own, and before any backward)."""
        if isinstance(module, DistributedDataParallel) and module.module is self._model:
            self._stop_finding()
            self._build(module)
        elif module is self._model and self._training(module):
            self._stop_finding()
            raise SentinelUsageError(
                f"nansentinel: the Trainer runs {job_size()} ranks but did not wrap "
                "the model in DistributedDataParallel (FSDP or DeepSpeed?); SentinelCallback "
                f"supports DDP and single-process training (rank {job_rank()})"
            )

    def _stop_finding(self) -> None:
        if self._finder is not None:
            self._finder.remove()
            self._finder = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.decided(self._require().step(optimizer_step=False))

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        if self.last is not None and not self.last.applied and mark_skipped(optimizer, True):
            self._marked = optimizer  # cleared again at on_step_end

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._marked is not None:
            mark_skipped(self._marked, False)
            self._marked = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove the model hooks and close the sentinel (also after an exception)."""
        self._stop_finding()
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
        return self.require("a training forward", "on_train_begin")


_warned: set[str] = set()


def mark_skipped(optimizer: Any, skipped: bool) -> bool:
    """Mark an Accelerate optimizer's step as skipped (or not), as its GradScaler does on an
    overflow, so that ``accelerator.optimizer_step_was_skipped`` holds and the Trainer leaves
    the LR scheduler where it is. False for an optimizer that is not Accelerate's.

    Accelerate reads the mark through the public ``step_was_skipped`` but sets it only in
    private (``_is_overflow``); the mark is checked through the public read, and where an
    Accelerate release no longer honours it, said once instead of silently stepping the
    scheduler on skipped steps."""
    if not hasattr(type(optimizer), "step_was_skipped"):
        return False
    optimizer._is_overflow = skipped
    if optimizer.step_was_skipped != skipped:
        import accelerate

        if accelerate.__version__ not in _warned:
            _warned.add(accelerate.__version__)
            warnings.warn(
                f"nansentinel: accelerate {accelerate.__version__} no longer reads the skip mark "
                "(_is_overflow) through step_was_skipped (tested with 1.15): on a step the "
                "sentinel skips, the Trainer will step the LR scheduler", stacklevel=2,
            )
        return False
    return True
