"""PyTorch Lightning: the sentinel as one callback.

::

    from nansentinel.lightning import SentinelCallback
    trainer = L.Trainer(strategy="ddp", devices=8, num_nodes=4, callbacks=[SentinelCallback()])

Lightning runs the loop, wraps the model and steps the optimizer itself, so the three calls go
into its hooks (the order is Lightning 2.6's automatic optimization):

- ``on_train_start`` — after ``strategy.setup`` has wrapped the model: the :class:`Sentinel` is
  built on ``trainer.strategy.model``, which is, by strategy: the DDP module (its comm hook,
  registered before the first backward; Lightning's own ``ddp_comm_hook`` argument is honoured
  on CUDA only, this path works on every device); the LightningModule under
  ``ModelParallelStrategy``, FSDP2-sharded below its root in ``configure_model`` (a checked
  reduce-scatter on every ``fully_shard``-ed module); the DeepSpeed engine under
  ``DeepSpeedStrategy`` (each ZeRO stage's seam); the LightningModule on one device.
- ``on_train_batch_start`` — ``check_batch`` (once per micro-batch under accumulation).
- ``on_before_backward`` — ``check_loss``; the backward then runs the comm hook, which checks
  each bucket before its all-reduce (no comm hook under ``no_sync`` micro-batches: the last one
  carries the whole accumulated gradient).
- ``on_before_optimizer_step`` — ``step(optimizer_step=False)``, inside Lightning's closure,
  after backward and before gradient clipping and the optimizer's update. A skip sets every
  gradient to None, so the update that follows changes neither weights nor optimizer state.
  Under DeepSpeed, Lightning's ``engine.step()`` right after this hook is the sentinel's step
  (callbacks.EngineSteps): it applies, or skips through DeepSpeed's own overflow path.

On a skipped step Lightning does what it does when its own GradScaler skips: ``global_step``
advances, step-interval LR schedulers step, and the accumulation window ends (its gradients
are discarded). An abort raises :class:`~nansentinel.result.NonFiniteError` out of
``trainer.fit`` on every rank.

Importing this module imports Lightning; importing ``nansentinel`` does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from nansentinel.callbacks import SentinelState
from nansentinel.result import SentinelUsageError
from nansentinel.step.sentinel import Sentinel


class SentinelCallback(SentinelState, pl.Callback):
    """Checks every rank's batch, loss and gradients before the all-reduce; skips, rolls back
    or aborts the step cluster-wide. ``**overrides`` and the attributes: see
    :class:`~nansentinel.callbacks.SentinelState`; a detection is replayed through the
    LightningModule's own ``training_step`` (``replay=False``: not)."""

    def __init__(self, **overrides: Any) -> None:
        SentinelState.__init__(self, **overrides)
        self._state: dict[str, Any] | None = None

    # --- Lightning hooks, in the order they run ----------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise SentinelUsageError(
                "nansentinel: SentinelCallback needs automatic optimization; with manual "
                "optimization call sentinel.check_batch/check_loss/step yourself "
                f"(rank {trainer.global_rank})"
            )
        if len(trainer.optimizers) != 1:
            raise SentinelUsageError(
                f"nansentinel: SentinelCallback supports one optimizer, the LightningModule "
                f"configured {len(trainer.optimizers)} (rank {trainer.global_rank})"
            )
        self.release()  # a second fit() on the same callback starts afresh
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        model = trainer.strategy.model
        if model is None:  # set by every strategy's setup, which runs before train start
            raise SentinelUsageError(
                f"nansentinel: SentinelCallback found no model on {type(trainer.strategy).__name__}"
                f" at train start (rank {trainer.global_rank})")
        sentinel = self.build(model, trainer.optimizers[0], scaler=scaler,
                              replay=_replay_training_step)
        if self._state is not None:
            sentinel.load_state_dict(self._state)
            self._state = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._require().check_batch(batch)

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._require().check_loss(loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        sentinel = self._require()
        if not self.drives_engine:  # DeepSpeed: decided in Lightning's engine.step() next
            self.decided(sentinel.step(optimizer_step=False))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.release()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        # No collective: the exception may be this rank's alone (an abort is every rank's,
        # and its own stop path already met the others).
        self.release(abandon=True)

    # --- checkpoints: the sentinel's counters travel with Lightning's ------------------------

    def state_dict(self) -> dict[str, Any]:
        if self.sentinel is not None:
            return self.sentinel.state_dict()
        return dict(self._state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_train_start builds the sentinel.
        if self.sentinel is not None:
            self.sentinel.load_state_dict(state_dict)
        else:
            self._state = dict(state_dict) if state_dict else None

    # --- internals ---------------------------------------------------------------------------

    def _require(self) -> Sentinel:
        return self.require("a training batch", "on_train_start")


def _replay_training_step(module: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Replay function built from the LightningModule's own ``training_step``."""
    output = module.training_step(batch, 0)  # type: ignore[operator]
    if isinstance(output, Mapping):
        output = output.get("loss")
    if not isinstance(output, torch.Tensor):
        raise SentinelUsageError(
            "nansentinel: training_step returned no loss tensor during the replay; "
            "pass replay=False to SentinelCallback"
        )
    return output
