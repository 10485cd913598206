"""DeepSpeed: ``Sentinel(engine)`` for a ``deepspeed.DeepSpeedEngine``, ZeRO stages 0 to 3.

::

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    sentinel = nansentinel.Sentinel(engine)          # the optimizer is the engine's
    for x, y in loader:
        sentinel.check_batch((x, y))
        loss = loss_fn(engine(x), y)
        sentinel.check_loss(loss)
        engine.backward(loss)
        result = sentinel.step()                     # drives engine.step()

The sentinel's step flow is the one of every other model; this module gives it what it steps
and how a skip is done, and refuses what it has not been tested with:

- **the gradients** are checked before DeepSpeed reduces them, at each stage's seam
  (``engines/deepspeed.py``);
- **an apply** is ``engine.step()``;
- **a skip** is DeepSpeed's own overflow skip, forced on every rank alike: ``engine.step()``
  runs with the optimizer's overflow decision set, so DeepSpeed's code does what it does after
  an overflow it found itself: the step is not applied (weights and optimizer state as they
  were), the gradients are cleared, ``skipped_steps`` and ``global_steps`` advance, the LR
  scheduler does not step, and an fp16 dynamic loss scale backs off. Where DeepSpeed's
  decision is taken (DeepSpeed 0.19.8, private):

  - ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``):
    ``step()`` hands its overflow flag to ``_update_scale(overflow)`` and then discards the
    step if ``self.overflow`` is set; the sentinel wraps ``_update_scale`` for that one call;
  - ZeRO-0 in fp16/bf16 (``FP16_UnfusedOptimizer``): its overflow branch is
    ``_skip_invalid_grad_norm()``, which the sentinel calls in place of ``step()``;
  - ZeRO-0 in fp32 (a plain ``torch.optim`` optimizer): DeepSpeed never skips a step there (a
    NaN is applied, and every rank's weights are NaN from then on), so the sentinel does what
    DeepSpeed's fp16 optimizers do on an overflow: the optimizer's ``step`` does nothing for
    that call, and the engine reads ``optimizer.overflow`` (how the engine learns of a skip
    from the optimizers it wraps) as True; the engine then clears the gradients itself.

- **gradient accumulation**: every micro-batch's batch and loss (and, from ZeRO-2, its
  gradient buckets) are checked; :meth:`EngineAdapter.accumulating` lets ``step()`` on a
  micro-batch before the boundary (``engine.is_gradient_accumulation_boundary()``, public)
  count it with ``engine.step()`` and return None. The decision is taken once, at the boundary.
- **fp16**: DeepSpeed's dynamic loss scale plays the GradScaler's part (:class:`LossScale`):
  non-finite gradients alone are fp16 overflow, counted (``outcome == "overflow"``), not
  blamed, and ``engine.step()`` skips them and lowers the scale itself; a non-finite batch or
  loss is still blamed. bf16 and fp32 have no loss scale: non-finite gradients are blamed.

Refused, by a :class:`SentinelUsageError` naming what, where and what to do, at construction:
a DeepSpeed other than 0.19.8, pipeline engines, ZeRO-Offload, optimizer wrappers not listed
above (BF16_Optimizer, the fused FP16_Optimizer, ZenFlow), torch autocast, MoE, tensor or
sequence parallelism, DeepCompile, unmanaged gradient accumulation, rollbacks (the policy and
the spike actions), replay, the device gate, a second Sentinel on the same engine, and an own
optimizer, scaler, group or pipeline stages beside the engine; at the call,
``step(optimizer_step=False)``.

Importing this module (sentinel.py does) does not import DeepSpeed: DeepSpeed is imported only
inside the functions that run once an engine is handed to the Sentinel, in a process that has
imported it already.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from nansentinel.config import SentinelConfig, resolve_hostname
from nansentinel.engines.base import Given
from nansentinel.engines.deepspeed import DeepSpeedPath, seam_refusal
from nansentinel.result import SentinelUsageError
from nansentinel.wire.collectives import job_rank

#: The DeepSpeed release whose private seams this module and engines/deepspeed.py were read
#: from and tested with.
TESTED_VERSION = "0.19.8"
#: The optimizer wrappers whose overflow decision the skip knows how to force (see above).
ZERO, ZERO3, FP16_UNFUSED, TORCH = (
    "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "FP16_UnfusedOptimizer", "torch",
)


class EngineStep:
    """What the Sentinel steps in place of an optimizer under DeepSpeed.

    The Sentinel applies a step with ``optimizer.step()`` and discards a skipped step's
    gradients with ``optimizer.zero_grad()``. Under DeepSpeed the first is ``engine.step()``
    and the second is DeepSpeed's own overflow skip (:meth:`skip`): discarding the gradients
    without ``engine.step()`` would leave DeepSpeed's counters, its LR scheduler and its loss
    scale behind the steps that really ran.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.kind = optimizer_kind(engine)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The optimizer state this rank holds (ZeRO's: keyed by its flat fp32 partitions),
        what a read of the model's state reads (checks/state.py)."""
        return getattr(self.engine.optimizer, "state", {})

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The Sentinel's skip: :meth:`skip` (gradients are always dropped, as DeepSpeed's own
        overflow skip drops them)."""
        self.skip()

    def skip(self) -> None:
        """``engine.step()`` with DeepSpeed's overflow decision forced (see the module
        docstring). Called on every rank at the same step, so DeepSpeed's own collectives in
        its step pair up as on any other step."""
        with forced_overflow(self.engine, self.kind):
            self.engine.step()


class LossScale:
    """DeepSpeed's fp16 loss scale, seen by the Sentinel as a GradScaler: the Sentinel steps
    through it (``step(optimizer)``, then ``update()``), and its presence makes non-finite
    gradients alone fp16 overflow, not blame. ``engine.step()`` unscales, checks the reduced
    gradients for overflow, skips and updates the scale itself, so ``update`` has nothing
    left to do."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def is_enabled(self) -> bool:
        return True

    def step(self, optimizer: EngineStep) -> None:
        optimizer.step()

    def update(self) -> None:
        """Nothing: DeepSpeed updated its scale inside ``engine.step()``."""


class EngineAdapter:
    """What the Sentinel takes from a DeepSpeed engine (built by :func:`adapt`)."""

    def __init__(self, engine: Any, where: str = "rank 0") -> None:
        self.engine = engine
        self.where = where
        self.optimizer = EngineStep(engine)
        self.scaler = LossScale(engine) if engine.fp16_enabled() else None

    def accumulating(self, *, optimizer_step: bool, step: int) -> bool:
        """True when this ``step()`` is a micro-batch before DeepSpeed's accumulation boundary:
        ``engine.step()`` counts it (as DeepSpeed users call it every micro-batch) and nothing
        is decided. False at the boundary, where the Sentinel decides and steps."""
        if not optimizer_step:
            raise SentinelUsageError(
                f"nansentinel: step(optimizer_step=False) on {self.where} at step {step}: not "
                "supported with a DeepSpeed engine, whose step the sentinel drives itself (to "
                "apply or to skip); nothing was decided or stepped. Call sentinel.step() in "
                "place of engine.step()."
            )
        if self.engine.is_gradient_accumulation_boundary():
            return False
        self.engine.step()
        return True


def adapt(given: Given, config: SentinelConfig, env: Mapping[str, str]) -> EngineAdapter:
    """An :class:`EngineAdapter` for the DeepSpeed engine ``given.model`` (the Sentinel's other
    arguments checked against it). Raises :class:`SentinelUsageError` for what is not
    supported (see the module docstring)."""
    where = _where(config, env)
    refusal = refusal_of(given, config)
    if refusal is not None:
        raise SentinelUsageError(
            f"nansentinel: cannot watch this DeepSpeed engine on {where} (before step 0): "
            f"{refusal}. Nothing was installed; the job stops here."
        )
    return EngineAdapter(given.model, where)


def refusal_of(given: Given, config: SentinelConfig) -> str | None:
    """Why the Sentinel cannot take this engine with these arguments, with what to do (None:
    it can). Pure reads of the engine's configuration."""
    import deepspeed

    engine, optimizer = given.model, given.optimizer
    version = _release(deepspeed.__version__)
    if version != TESTED_VERSION:
        return (f"DeepSpeed {deepspeed.__version__} is untested (nansentinel reads DeepSpeed's "
                f"private gradient and overflow seams of {TESTED_VERSION}); install "
                f"deepspeed=={TESTED_VERSION}, or watch a plain DDP model")
    ours = {"optimizer": optimizer is not None and optimizer not in (
                engine.optimizer, getattr(engine, "basic_optimizer", None)),
            "scaler": given.scaler is not None, "group": given.group is not None,
            "stages": given.stages is not None}
    extra = [name for name, on in ours.items() if on]
    if extra:
        return (f"{', '.join(extra)} given beside the engine; DeepSpeed's own are used (its "
                "optimizer and loss scale, its data-parallel group): pass the engine alone")
    caps = DeepSpeedPath.CAPS
    if given.replay is not None:
        return f"replay= is not supported: {caps.replay}; pass no replay"
    if given.snapshots is not None or config.rolls_back:
        return (f"rollbacks are not supported ({caps.rollback}); use policy='skip' or 'abort' "
                "and restore with engine.load_checkpoint")
    if config.gate == "device":
        return (f"gate='device' is not supported: {caps.device_gate} (DeepSpeed reads its "
                "overflow flag there itself); use gate='host' or 'auto'")
    setup = _setup_refusal(engine)
    if setup is not None:
        return setup
    return seam_refusal(engine)


def _setup_refusal(engine: Any) -> str | None:
    """The DeepSpeed features the checks and the skip were not built and tested for."""
    import deepspeed

    if isinstance(engine, deepspeed.PipelineEngine):
        return ("a PipelineEngine (train_batch runs DeepSpeed's own schedule, outside the "
                "sentinel's three calls); use a DeepSpeedEngine without pipeline parallelism")
    if engine.optimizer is None:
        return "the engine has no optimizer; pass one to deepspeed.initialize"
    for what, cfg in (("offload_optimizer", engine.zero_offload_optimizer()),
                      ("offload_param", engine.zero_offload_param())):
        device = getattr(getattr(cfg, "device", None), "value", getattr(cfg, "device", None))
        if cfg is not None and device not in (None, "none"):
            return (f"ZeRO-Offload ({what} on {device}) is untested with nansentinel (its "
                    "gradients go to host buffers, its overflow flag is kept apart); drop the "
                    "offload to use the sentinel")
    features = {
        "torch autocast (torch_autocast)": engine.torch_autocast_enabled(),
        "MoE layers": getattr(engine, "has_moe_layers", False),
        "tensor parallelism (mpu or AutoTP)": engine.mpu is not None or engine.autotp_size() > 1,
        "sequence parallelism": getattr(engine, "sequence_parallel_size", 1) > 1,
        "DeepCompile": engine.is_deepcompile_enabled(),
        "ZenFlow": bool(getattr(engine, "zenflow", False)),
        "unmanaged gradient accumulation (managed_gradient_accumulation=false)":
            not engine.managed_gradient_accumulation(),
    }
    on = [name for name, enabled in features.items() if enabled]
    if on:
        return f"{', '.join(on)} untested with nansentinel; turn it off to use the sentinel"
    if optimizer_kind(engine) is None:
        return (f"DeepSpeed wrapped the optimizer in {type(engine.optimizer).__name__}, whose "
                "overflow skip nansentinel cannot force (supported: DeepSpeedZeroOptimizer, "
                "DeepSpeedZeroOptimizer_Stage3, FP16_UnfusedOptimizer, a torch.optim optimizer "
                "at ZeRO-0 fp32); use a torch.optim optimizer, and for bf16 at ZeRO-1 keep "
                "data_types.grad_accum_dtype at bf16")
    return None


def optimizer_kind(engine: Any) -> str | None:
    """Which of the supported optimizer wrappers the engine stepped (exact types: a subclass,
    such as ZenFlow's, may decide on overflow elsewhere); None for any other."""
    opt = engine.optimizer
    name = type(opt).__name__
    if name in (ZERO, ZERO3, FP16_UNFUSED) and type(opt).__module__.startswith("deepspeed."):
        return name
    if isinstance(opt, torch.optim.Optimizer) and opt is getattr(engine, "basic_optimizer", None):
        return TORCH
    return None


@contextlib.contextmanager
def forced_overflow(engine: Any, kind: str | None = None) -> Iterator[None]:
    """Within this block, the engine's optimizer takes its overflow branch at its step (see the
    module docstring for where that is, per wrapper). Undone on exit, whatever happened."""
    opt = engine.optimizer
    kind = kind or optimizer_kind(engine)
    if kind in (ZERO, ZERO3):
        update_scale = opt._update_scale

        def overflowed(has_overflow: bool) -> None:
            opt.overflow = True
            update_scale(True)

        with _shadowed(opt, "_update_scale", overflowed):
            yield
    elif kind == FP16_UNFUSED:
        with _shadowed(opt, "step", lambda closure=None: opt._skip_invalid_grad_norm()):
            yield
    else:
        # Gradients stay (DeepSpeed may clip them: it needs them there); the update does not
        # run, and the engine reads the overflow as after an fp16 optimizer's skip.
        with _shadowed(opt, "step", lambda closure=None: None), \
                _shadowed(opt, "overflow", True):
            yield


@contextlib.contextmanager
def _shadowed(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name`` is ``value`` inside the block; afterwards what it was (an instance
    attribute put back, such as a torch LR scheduler's wrapper of ``optimizer.step``, or none,
    so that the class's own is seen again)."""
    missing = object()
    held = vars(obj).get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if held is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, held)


def _release(version: str) -> str:
    """``0.19.8`` of ``0.19.8``, ``0.19.8+abc123`` or ``0.19.8.dev0``."""
    match = re.match(r"\d+\.\d+\.\d+", version)
    return match.group() if match else version


def _where(config: SentinelConfig, env: Mapping[str, str]) -> str:
    return f"rank {job_rank()} (host {resolve_hostname(config.hostname, env)})"
