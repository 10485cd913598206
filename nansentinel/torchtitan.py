"""torchtitan 0.3.0: the sentinel as torchtitan's trainer, chosen by one registry function.

::

    # my_registry.py
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from nansentinel.torchtitan import with_sentinel

    def my_cfg():
        return with_sentinel(llama3_debugmodel())

    torchrun --nproc-per-node 8 -m torchtitan.train --module my_registry --config my_cfg

torchtitan builds every component from a nested ``Config`` dataclass whose ``build()`` makes its
owner class (``torchtitan/config/configurable.py``); ``torchtitan.train`` calls ``build()`` on
the config the registry function returns. :func:`with_sentinel` returns the same config as a
:class:`SentinelTrainer.Config`, so the trainer built is :class:`SentinelTrainer`, torchtitan's
own ``Trainer`` with the three calls in its loop:

- ``__init__`` — after torchtitan has parallelised the model and built its optimizers, the
  :class:`~nansentinel.step.sentinel.Sentinel` is built on the model (FSDP2: a checked
  reduce-scatter on every FSDP group) and torchtitan's ``OptimizersContainer``. Under pipeline
  parallelism, on this rank's model parts with the schedule's stages (their boundaries are
  checked, so the stage where a NaN began is named alone and the others go to ``reached``),
  and the schedule's loss function is wrapped with ``wrap_loss`` (each micro-batch's loss
  before its backward): torchtitan builds the schedule inside ``Trainer.__init__``, so both are
  read from the built schedule (:func:`pipeline_stages` names the private seams);
- ``forward_backward_step`` — ``check_batch`` on the input dict (on the first stage under PP;
  token ids are integers: only float inputs are checked), ``check_loss`` on the loss as the
  loss function returns it, before ``loss.backward()``; unreduced local gradients are checked
  after the last backward, before torchtitan's ``clip_grad_norm_`` mixes the ranks' norms;
- ``train_step`` — torchtitan's own ``self.optimizers.step()`` first decides the step with
  every rank (``sentinel.step(optimizer_step=False)``, from a step pre-hook of the container):
  on a skip every gradient is set to None, so the container's update that follows changes
  neither weights nor optimizer state, and the LR schedulers step after it as after an
  overflow. torchtitan then stops on a non-finite logged loss ("Loss is not finite …
  Stopping training"); for a step the sentinel skipped, that stop is caught, since the loss
  was not applied, and training goes on. A loss that is non-finite on a step the sentinel
  applied still stops the run.

``optimizer_step=False`` rather than ``step()``: torchtitan calls ``self.optimizers.step()``
itself, between its gradient clipping and the LR schedulers, and there is no GradScaler to
hand over. Refused at construction, with what to use instead: pipeline schedules other than
those of :data:`PIPELINE_SCHEDULES` and torchtitan's validator under PP (it runs the watched
training schedule), rollback (its LR cooldown scales ``param_groups``, which the container
does not forward to the optimizers it wraps), and CUDA graphs (a captured forward/backward
replays the kernels, not the sentinel's per-step bookkeeping).

torchtitan's fault-tolerant trainer (``torchtitan/experiments/torchft``, FSDP2 inside each
torchft replica group, the groups averaged in FSDP's all-reduce hooks) takes the same
function: given a ``FaultTolerantTrainer.Config`` (``llama3_torchft_debugmodel()`` made
synchronous), :func:`with_sentinel` returns a :class:`SentinelFTTrainer.Config`, and with
``--fault_tolerance.enable`` the sentinel is :func:`nansentinel.torchft.Sentinel` on the model,
the optimizers and torchtitan's torchft ``Manager``: every rank of every group vetoes the same
step, the culprit's group, rank and host are named on all of them, and a struck-out group
leaves while the others train on. The sentinel asks ``should_commit()`` once a step, so
torchft's ``TorchFTOptimizersContainer.Config`` becomes :class:`SentinelFTOptimizers.Config`
(the same fields) and the trainer starts each step's quorum. Refused there too: DiLoCo and
LocalSGD (``fault_tolerance.semi_sync_method``), another optimizers container, PP
(:func:`refuse_fault_tolerance`). docs/torchft.md has the launch, the checks and the test.

Importing this module imports torchtitan; importing ``nansentinel`` does not.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterator
from typing import Annotated, Any

import torch

try:
    import tyro
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.experiments.torchft.config.job_config import FaultTolerance
    from torchtitan.experiments.torchft.manager import TorchFTManager
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
    from torchtitan.trainer import Trainer
except ImportError as exc:  # pragma: no cover - depends on what is installed
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        raise ImportError(
            "nansentinel.torchtitan needs torchtitan: pip install torchtitan==0.3.0 (the "
            f"version it is tested with) — {exc}"
        ) from exc
    raise ImportError(  # installed, but written for another torch (0.3.0 imports 2.13's API)
        f"nansentinel.torchtitan: torchtitan is installed but does not import on torch "
        f"{torch.__version__} ({exc}); torchtitan 0.3.0, the version nansentinel is tested "
        "with, needs torch >= 2.13 (docs/torch-support.md)"
    ) from exc

from nansentinel.common import torch_insides as insides
from nansentinel.config import SentinelConfig
from nansentinel.result import SentinelUsageError, StepResult
from nansentinel.step.sentinel import Sentinel

log = logging.getLogger("nansentinel")

#: Where torchtitan 0.3.0's ``Trainer.train_step`` stops on a non-finite logged loss.
LOSS_STOP = "Loss is not finite"

#: The pipeline schedules (``--parallelism.pipeline-parallel-schedule``) watched under
#: torchtitan: one stage per rank (GPipe, 1F1B) or several (Interleaved1F1B).
PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


class SentinelTrainer(Trainer):
    """torchtitan's ``Trainer`` with every rank's batch, loss and gradients checked before
    the gradient reduction, and each step applied, skipped or aborted by every rank at once.

    Attributes:
        sentinel: the :class:`~nansentinel.step.sentinel.Sentinel`.
        last: the :class:`~nansentinel.result.StepResult` of the latest optimizer step.
        skipped: ``{torchtitan step: result}`` of every step that was not applied.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        sentinel: Annotated[dict[str, Any], tyro.conf.Suppress] = dataclasses.field(
            default_factory=dict
        )
        """Fields of :class:`~nansentinel.config.SentinelConfig` handed to the Sentinel
        (keyword > ``NANSENTINEL_*`` environment > default; on the command line, set the
        environment)."""

    sentinel: Sentinel
    last: StepResult | None
    skipped: dict[int, StepResult]

    def __init__(self, config: Any) -> None:
        settings = SentinelConfig.from_env(None, **config.sentinel)
        refuse_unsupported(config, settings)
        super().__init__(config)
        self.last = None
        self.skipped = {}
        self._groups = 0
        self.sentinel = self._watch(config.sentinel)
        if self.parallel_dims.pp_enabled:
            schedule = self.pp_schedule
            insides.set_schedule_loss_fn(schedule, _TrainingLoss(schedule, self.sentinel))
        else:
            # torchtitan's Trainer assigns loss_fn without an annotation mypy can follow
            self.loss_fn = _CheckedLoss(self.loss_fn, self.sentinel)  # type: ignore[has-type]
        # torchtitan's own `self.optimizers.step()` decides first (see the module docstring).
        self.optimizers.register_step_pre_hook(self._decide)

    def _watch(self, keywords: dict[str, Any]) -> Sentinel:
        """The sentinel on the built model and optimizers (under PP, on this rank's parts and
        the schedule's stages)."""
        if self.parallel_dims.pp_enabled:
            parts = self.model_parts
            return Sentinel(parts[0] if len(parts) == 1 else parts, self.optimizers,
                            stages=pipeline_stages(self.pp_schedule), **keywords)
        return Sentinel(self.model_parts[0], self.optimizers, **keywords)

    def forward_backward_step(
        self,
        *,
        input_dict: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
        labels: torch.Tensor | list[torch.Tensor],
        global_valid_tokens: torch.Tensor,
    ) -> torch.Tensor:
        # Under PP the batch enters on the first stage (its micro-batches; the last stage's
        # targets are checked by the schedule's loss function, with each micro-batch's loss).
        if not self.parallel_dims.pp_enabled or self.pp_has_first_stage:
            self.sentinel.check_batch(input_dict)
        loss = super().forward_backward_step(
            input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
        )
        self._groups += 1
        if self._groups == self.gradient_accumulation_steps and (
                not self.sentinel.gradients.caps.reduces):
            # Gradients no reduction checked (FSDP on a mesh of one, as under PP on one rank
            # per stage) are checked here, after the last backward and before torchtitan's
            # clip_grad_norm_: its norm is all-reduced over the pipeline (and TP) ranks, and
            # one rank's NaN norm scales every rank's gradients to NaN.
            self.sentinel.check_grads()
        return loss

    def train_step(
        self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> None:
        self.last = None
        self._groups = 0
        stopped = False
        try:
            super().train_step(data_iterator)
        except RuntimeError as exc:
            last = self.last
            if last is None or last.applied or not str(exc).startswith(LOSS_STOP):
                raise
            # Every rank skipped this step (the decision is the same everywhere) and every
            # rank stops here: torchtitan logs no metrics for it, and training goes on.
            stopped = True
        result = self.last
        if result is not None and not result.applied:
            self.skipped[self.step] = result
            if self.sentinel.rank == 0:
                log.warning(
                    "nansentinel: torchtitan step %d (sentinel step %d) %s, not applied: "
                    "weights and optimizer state unchanged, the LR schedule moves on%s",
                    self.step, result.step, result.outcome,
                    "; torchtitan's stop on its non-finite loss was passed over"
                    if stopped else "",
                )
            elif stopped:  # under PP the last stage logs the loss and stops, not rank 0
                log.info(
                    "nansentinel: rank %d: torchtitan's stop on its non-finite loss at step %d "
                    "was passed over (the sentinel skipped the step on every rank)",
                    self.sentinel.rank, self.step,
                )

    def close(self) -> None:
        """torchtitan's ``main`` calls this after training and from its ``except`` block:
        after an exception (possibly this rank's alone) the sentinel is abandoned without a
        collective, else closed at a common point of every rank (``Sentinel.close``)."""
        sentinel = getattr(self, "sentinel", None)
        if sentinel is not None:
            if sys.exc_info()[0] is not None:
                sentinel.abandon()
            else:
                sentinel.close()
        super().close()

    def _decide(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step pre-hook of torchtitan's ``OptimizersContainer``: decide with every rank; on
        a skip the gradients are None and the container's update changes nothing."""
        self.last = self.sentinel.step(optimizer_step=False)


class SentinelFTOptimizers(TorchFTOptimizersContainer):
    """torchtitan's ``TorchFTOptimizersContainer`` whose ``step()`` and ``zero_grad()`` are
    the plain container's: the sentinel asks ``Manager.should_commit()`` (once a step, on
    every group alike, in its step pre-hook) and :class:`SentinelFTTrainer` starts the
    quorum. torchft's ``OptimizerWrapper`` would ask ``should_commit()`` a second time, and
    start a quorum where the sentinel sets a vetoed step's gradients to None. The rest
    (optimizer state kept ready for healing, the cached state dict) is torchtitan's."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TorchFTOptimizersContainer.Config):
        pass

    def step(self, *args: Any, **kwargs: Any) -> None:
        OptimizersContainer.step(self, *args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        OptimizersContainer.zero_grad(self, *args, **kwargs)


class SentinelFTManager(TorchFTManager):
    """torchtitan's ``TorchFTManager`` with torchft's ``init_sync`` as a setting
    (``--fault_tolerance.init_sync``), which torchtitan does not offer: torchft syncs step 0
    by healing every replica group from one, and under torchtitan's trainer the serving
    group's state dict is taken in torchft's quorum thread while its first forward runs,
    where FSDP2's state_dict hooks reshard the parameters under it (seen on CPU: "aten.mm got
    mixed torch.Tensor and DTensor"). Off, the groups start alike from the same seed
    (``--debug.seed``), as torchft's DDP examples do. :func:`with_sentinel` makes the fault
    tolerance config this one's (the same fields)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FaultTolerance):
        init_sync: bool = True
        """torchft's step-0 sync (``Manager(init_sync=...)``): every replica group healed
        from one before the first step. False: start every group from the same seed
        (``debug.seed``) instead."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        if self.enabled and not config.init_sync:
            insides.set_torchft_init_sync(self.manager, False)


class SentinelFTTrainer(SentinelTrainer, FaultTolerantTrainer):
    """torchtitan's fault-tolerant trainer (``torchtitan/experiments/torchft``) under the
    sentinel: :class:`SentinelTrainer`'s calls, and with ``--fault_tolerance.enable`` a
    :func:`nansentinel.torchft.Sentinel` on the model (FSDP2 inside the replica group, the
    groups averaged in torchtitan's FSDP all-reduce hook), torchtitan's optimizers and its
    torchft ``Manager``: every rank of every replica group vetoes the same step, names the
    culprit group, rank and host, and a struck-out group leaves (docs/torchft.md)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FaultTolerantTrainer.Config):
        sentinel: Annotated[dict[str, Any], tyro.conf.Suppress] = dataclasses.field(
            default_factory=dict
        )
        """As :attr:`SentinelTrainer.Config.sentinel`."""
        fault_tolerance: SentinelFTManager.Config = dataclasses.field(
            default_factory=SentinelFTManager.Config)
        """torchtitan's fault tolerance settings, and torchft's ``init_sync``
        (:class:`SentinelFTManager`)."""

    def _watch(self, keywords: dict[str, Any]) -> Sentinel:
        if not self.ft_manager.enabled:
            return super()._watch(keywords)
        if self.parallel_dims.dp_shard < 2:  # -1 resolved: a group of one process, or TP
            raise SentinelUsageError(_UNSHARDED.format(self.parallel_dims.dp_shard))
        import nansentinel.torchft as nft  # torchft is installed: the manager was built

        return nft.Sentinel(self.model_parts[0], self.optimizers,
                            manager=self.ft_manager.manager, **keywords)

    def train_step(
        self, data_iterator: Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]
    ) -> None:
        if self.ft_manager.enabled:  # what torchft's OptimizerWrapper.zero_grad() did
            self.ft_manager.manager.start_quorum()
        super().train_step(data_iterator)


class _CheckedLoss:
    """torchtitan's loss function with ``check_loss`` on its result, before the backward.

    Installed on the trainer after it is built, so torchtitan's validator keeps the loss
    function it was given (its losses are not training steps)."""

    def __init__(self, inner: Any, sentinel: Sentinel) -> None:
        self.inner = inner
        self.sentinel = sentinel

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        self.sentinel.check_loss(out[0] if isinstance(out, tuple) else out)
        return out

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class _TrainingLoss:
    """The pipeline schedule's loss function, checked with :meth:`Sentinel.wrap_loss` on
    training steps: each micro-batch's loss before its backward.

    ``schedule.eval`` (torchtitan's validator runs the same schedule) sets the schedule's
    ``_has_backward`` to False for its duration: those losses are not a training step's and
    go through unchecked (validation under PP is refused for the boundary hooks' sake anyway,
    see :func:`refuse_unsupported`)."""

    def __init__(self, schedule: Any, sentinel: Sentinel) -> None:
        self.schedule = schedule
        self.inner = insides.schedule_loss_fn(schedule)
        self.checked = sentinel.wrap_loss(self.inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.checked if insides.schedule_has_backward(self.schedule) else self.inner
        return fn(*args, **kwargs)


def pipeline_stages(schedule: Any) -> list[Any]:
    """This rank's ``PipelineStage`` objects of a built torchtitan pipeline schedule.

    torchtitan 0.3.0 builds the stages and the schedule inside ``Trainer.__init__``
    (``pipelining_fn``) and keeps only the schedule. Private seams of torch 2.13's
    ``torch.distributed.pipelining.schedules`` (tested with torch 2.13 and torchtitan 0.3.0):
    ``PipelineScheduleSingle._stage``, ``PipelineScheduleMulti._stages``, and, for the loss,
    ``_PipelineSchedule._loss_fn`` (read by ``_compute_loss`` and by the first step's shape
    inference at call time, so replacing it after the schedule is built takes effect) and
    ``_has_backward`` (False during ``eval``)."""
    stages = insides.schedule_stages(schedule)
    if not stages or not insides.has_loss_fn(schedule):
        raise SentinelUsageError(
            f"nansentinel: the pipeline schedule {type(schedule).__name__} has no "
            "_stage/_stages or _loss_fn (torch 2.13's private attributes, read to watch the "
            "stages and check each micro-batch's loss): this torch version is not supported "
            "under torchtitan's pipeline parallelism."
        )
    return list(stages)


def with_sentinel(config: Trainer.Config, **overrides: Any
                  ) -> SentinelTrainer.Config | SentinelFTTrainer.Config:
    """``config`` with :class:`SentinelTrainer` as its trainer, or :class:`SentinelFTTrainer`
    for torchtitan's fault-tolerant trainer's config (``FaultTolerantTrainer.Config``, as
    ``torchtitan.experiments.torchft.llama3.config_registry`` returns it).

    Args:
        config: a torchtitan ``Trainer.Config`` or ``FaultTolerantTrainer.Config``, as a
            registry function returns it (``llama3_debugmodel()``); its fields are taken as
            they are, except the two below.
        **overrides: fields of :class:`~nansentinel.config.SentinelConfig` for the Sentinel
            (keyword > ``NANSENTINEL_*`` environment > default), checked here so that a typo
            fails when the config is built.

    CUDA graphs are turned off (``training.disable_cuda_graphs``): a captured forward/backward
    replays the kernels without the sentinel's per-step checks. Under fault tolerance,
    torchtitan's ``TorchFTOptimizersContainer.Config`` becomes
    :class:`SentinelFTOptimizers.Config` (the same fields): the sentinel asks
    ``should_commit()``, not torchft's optimizer wrapper.
    """
    ft = type(config) is FaultTolerantTrainer.Config or isinstance(
        config, SentinelFTTrainer.Config)
    if not ft and type(config) is not Trainer.Config and not isinstance(
            config, SentinelTrainer.Config):
        raise SentinelUsageError(
            f"nansentinel: with_sentinel takes torchtitan's Trainer.Config or "
            f"FaultTolerantTrainer.Config, got {type(config).__qualname__} (another "
            "trainer's config). Subclass nansentinel.torchtitan.SentinelTrainer with your "
            "trainer's changes instead."
        )
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields["sentinel"] = {**fields.get("sentinel", {}), **overrides}
    fields["training"] = dataclasses.replace(config.training, disable_cuda_graphs=True)
    if ft and not isinstance(config.fault_tolerance, SentinelFTManager.Config):
        fields["fault_tolerance"] = SentinelFTManager.Config(**{
            f.name: getattr(config.fault_tolerance, f.name)
            for f in dataclasses.fields(config.fault_tolerance) if f.init})
    if ft and type(config.optimizer) is TorchFTOptimizersContainer.Config:
        fields["optimizer"] = SentinelFTOptimizers.Config(**{
            f.name: getattr(config.optimizer, f.name)
            for f in dataclasses.fields(config.optimizer) if f.init})
    out = (SentinelFTTrainer.Config if ft else SentinelTrainer.Config)(**fields)
    refuse_unsupported(out, SentinelConfig.from_env(None, **out.sentinel))
    return out


def refuse_unsupported(config: Trainer.Config, settings: SentinelConfig) -> None:
    """Raise :class:`SentinelUsageError` for a setup the sentinel cannot watch under
    torchtitan's trainer, naming the field and what to use instead."""
    parallelism = config.parallelism
    if parallelism.pipeline_parallel_degree > 1:
        schedule = parallelism.pipeline_parallel_schedule
        if parallelism.pipeline_parallel_schedule_csv or schedule not in PIPELINE_SCHEDULES:
            what = (f"parallelism.pipeline_parallel_schedule_csv="
                    f"{parallelism.pipeline_parallel_schedule_csv!r}"
                    if parallelism.pipeline_parallel_schedule_csv
                    else f"parallelism.pipeline_parallel_schedule={schedule!r}")
            raise SentinelUsageError(
                f"nansentinel: {what}: under torchtitan's trainer the sentinel watches the "
                f"pipeline schedules {', '.join(PIPELINE_SCHEDULES)}; the others split the "
                "backward into input and weight passes (or run a custom action list), which "
                "its stage boundary checks are not tested with. Use one of those."
            )
        if config.validator.enable:
            raise SentinelUsageError(
                "nansentinel: validator.enable=True with parallelism.pipeline_parallel_degree="
                f"{parallelism.pipeline_parallel_degree}: torchtitan's validator runs the "
                "training pipeline schedule, whose stages the sentinel watches: validation "
                "forwards would count into the next training step's health. Validate "
                "without the sentinel (a separate run from a checkpoint), or without PP."
            )
    for field in ("policy", "loss_spike_action", "grad_spike_action", "collapse_action"):
        if getattr(settings, field) == "rollback":
            raise SentinelUsageError(
                f"nansentinel: {field}='rollback' is not supported under torchtitan's "
                "trainer: the rollback's learning-rate cooldown scales the optimizer's "
                "param_groups, which torchtitan's OptimizersContainer does not forward to "
                "the optimizers it wraps. Use policy='skip' or 'abort' and spike actions "
                "'warn' or 'skip', and torchtitan's checkpoints (--checkpoint.enable) to go "
                "back to a good state."
            )
    if settings.lr_jump_ratio:
        raise SentinelUsageError(
            f"nansentinel: lr_jump_ratio={settings.lr_jump_ratio:g} is not supported under "
            "torchtitan's trainer: holding a learning-rate jump writes the optimizer's "
            "param_groups, which torchtitan's OptimizersContainer does not forward to the "
            "optimizers it wraps, so the jump would reach the weights though the log said it "
            "was held. Set lr_jump_ratio=0 (NANSENTINEL_LR_JUMP_RATIO=0)."
        )
    if settings.policy == "drop":
        raise SentinelUsageError(
            "nansentinel: policy='drop' is not supported under torchtitan's trainer: it clips "
            "the gradients (training.max_norm) before its optimizers step, while a dropped "
            "step's gradients are still the kept ranks' sum over the world (the sentinel "
            "rescales them at the step), and it stops on the non-finite global loss a dropped "
            "step logs. Use policy='skip'."
        )
    if not config.training.disable_cuda_graphs:
        raise SentinelUsageError(
            "nansentinel: training.disable_cuda_graphs=False: a CUDA graph replays the "
            "captured forward/backward without the sentinel's checks of each step. Keep "
            "--training.disable-cuda-graphs (with_sentinel sets it)."
        )
    fault_tolerance = getattr(config, "fault_tolerance", None)
    if fault_tolerance is not None and fault_tolerance.enable:
        refuse_fault_tolerance(config)


#: Fault tolerance on an FSDP shard degree below 2 inside the replica group.
_UNSHARDED = (
    "nansentinel: fault_tolerance.enable with a data-parallel shard degree of {} inside the "
    "replica group: FSDP2 then reduce-scatters nothing, and its all-reduce hook sends each "
    "rank's gradients to the other groups before the sentinel could check them and name this "
    "group. Shard over at least 2 ranks a group (--parallelism.data_parallel_shard_degree)."
)


def refuse_fault_tolerance(config: Any) -> None:
    """Raise :class:`SentinelUsageError` for a fault-tolerant setup (``--fault_tolerance.
    enable``) the sentinel cannot watch, naming the field and what to use instead."""
    ft = config.fault_tolerance
    if ft.semi_sync_method is not None:
        raise SentinelUsageError(
            f"nansentinel: fault_tolerance.semi_sync_method={ft.semi_sync_method!r}: "
            "LocalSGD and DiLoCo train each replica group alone and average the weights "
            "every fault_tolerance.sync_steps steps inside torchft, so no step's gradients "
            "leave the group for the sentinel to veto with should_commit(). Train "
            "synchronously (semi_sync_method=None, torchtitan's default) to run under the "
            "sentinel."
        )
    if not isinstance(config.optimizer, SentinelFTOptimizers.Config):
        raise SentinelUsageError(
            f"nansentinel: fault_tolerance.enable with optimizer "
            f"{type(config.optimizer).__qualname__}: under fault tolerance the sentinel asks "
            "should_commit() itself, and torchtitan needs its TorchFTOptimizersContainer "
            "(healing reads its state). Start from a config with TorchFTOptimizersContainer."
            "Config (llama3_torchft_debugmodel's): with_sentinel makes it "
            "SentinelFTOptimizers.Config."
        )
    if config.parallelism.data_parallel_shard_degree == 1:
        raise SentinelUsageError(_UNSHARDED.format(1))
    if config.parallelism.pipeline_parallel_degree > 1:
        raise SentinelUsageError(
            "nansentinel: fault_tolerance.enable with parallelism.pipeline_parallel_degree="
            f"{config.parallelism.pipeline_parallel_degree}: the sentinel of a torchft "
            "replica group watches one model, not a pipeline's stages. Use FSDP inside each "
            "replica group, or pipeline parallelism without fault tolerance."
        )
