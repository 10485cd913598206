"""Hugging Face ``Trainer``: the sentinel as one callback.

::

    from nansentinel.transformers import SentinelCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[SentinelCallback()])

The Trainer (on Accelerate) wraps the model, steps the optimizer itself, and its callbacks see
neither the batch, nor the loss, nor the wrapper. So (transformers 5.x):

- ``on_train_begin`` — after ``accelerator.prepare``. The Trainer hands callbacks the bare
  model, except under FSDP, where the model it hands over is the FSDP2 root itself: the
  :class:`Sentinel` is built on it at once (a checked reduce-scatter on every ``fully_shard``-ed
  module). Under DDP and DeepSpeed no public attribute leads from the model (nor from the
  optimizer, scheduler or data loaders callbacks get) to the wrapper Accelerate built, so the
  wrapper is met at its first forward by torch's public global forward pre-hook
  (``register_module_forward_pre_hook``), armed only until then, and the :class:`Sentinel` is
  built on it there, before the first backward: on the DDP module (its comm hook) or on the
  DeepSpeed engine (each ZeRO stage's seam). On one process without DeepSpeed it is built here
  on the model. A training forward of the bare model on several ranks is refused by name, and
  so is a Trainer that runs each rank alone in a process group of several (CPU ranks without
  ``use_cpu=True``).
- a forward pre-hook on the model — ``check_batch`` on the inputs of every training forward
  (each micro-batch under accumulation); a forward hook — ``check_loss`` on the ``loss`` the
  model returns. A loss computed outside the model (a custom ``compute_loss``) is not checked
  by itself; its non-finite gradients still are.
- ``on_pre_optimizer_step`` — ``step(optimizer_step=False)``, after gradient clipping and
  before ``optimizer.step()``. A skip sets every gradient to None: the update changes neither
  weights nor optimizer state. Under DeepSpeed the step was decided already: Accelerate calls
  ``engine.step()`` from ``accelerator.backward`` at the accumulation boundary, and that call is
  the sentinel's (callbacks.EngineSteps), which applies the step or forces DeepSpeed's own
  overflow skip on every rank.
- ``on_optimizer_step`` — on a skipped step the Accelerate optimizer is marked as skipped, as
  its GradScaler marks an overflow, so that the Trainer does what it does then: the LR
  scheduler does not step, ``global_step`` still advances, the accumulation window ends
  (accelerate.mark_skipped). Under DeepSpeed, Accelerate reads DeepSpeed's own overflow flag,
  which the forced skip sets.

An abort raises :class:`~nansentinel.result.NonFiniteError` out of ``trainer.train()`` on every
rank. Importing this module imports transformers; importing ``nansentinel`` does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from nansentinel import engines
from nansentinel.accelerate import mark_skipped, require_one_world
from nansentinel.callbacks import SentinelState
from nansentinel.result import SentinelUsageError
from nansentinel.step.sentinel import Sentinel
from nansentinel.wire.collectives import job_rank, job_size

__all__ = ["SentinelCallback", "mark_skipped"]


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
        require_one_world(getattr(args, "world_size", None), "the Trainer",
                          "TrainingArguments(use_cpu=True)")
        # The Accelerate wrapper's zero_grad is a no-op inside an accumulation window and its
        # step hooks are not torch's: the sentinel works on the optimizer underneath.
        self._model, self._raw = model, getattr(optimizer, "optimizer", optimizer)
        self._scaler = getattr(optimizer, "scaler", None)
        if engines.sharded_in_place(model):  # the Trainer hands FSDP's root over
            self._build(model)
        elif job_size() > 1 or getattr(args, "deepspeed_plugin", None) is not None:
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
        """Global forward pre-hook, armed from train begin until the wrapper of the model (DDP,
        a DeepSpeed engine) runs its first forward (it runs before the model's own, and before
        any backward)."""
        if engines.wrapper_of(module, self._model):
            self._stop_finding()
            self._build(module)
        elif module is self._model and self._training(module):
            self._stop_finding()
            if job_size() == 1:  # one process under DeepSpeed's plugin, but no engine: as is
                self._build(module)
                return
            raise SentinelUsageError(
                f"nansentinel: the Trainer runs {job_size()} ranks but neither wrapped the model "
                "in DistributedDataParallel or a DeepSpeed engine nor sharded it with FSDP2 "
                "(fsdp_config version 2); SentinelCallback supports those and single-process "
                f"training (rank {job_rank()})"
            )

    def _stop_finding(self) -> None:
        if self._finder is not None:
            self._finder.remove()
            self._finder = None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sentinel = self._require()
        if not self.drives_engine:  # DeepSpeed: decided in accelerator.backward's engine.step()
            self.decided(sentinel.step(optimizer_step=False))

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        if (self.last is not None and not self.last.applied and not self.drives_engine
                and mark_skipped(optimizer, True)):
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
        self.release()

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

