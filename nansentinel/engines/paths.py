"""The registry of gradient paths: which path takes a model (:func:`recognize`, the one function a
new engine adds a line to), and what the Sentinel steps (:func:`steps_of`). The paths are
imported here only, inside these functions, so that the base types stay below every path."""

from __future__ import annotations

from typing import Any

import torch

from nansentinel.engines.base import Given, GradientSink, GradPath


def steps_of(given: Given, config: Any, env: Any) -> tuple[Any, Any, Any]:
    """What the Sentinel steps: ``(engine adapter, optimizer, scaler)``. A path whose engine
    steps its own optimizer (``caps.steps_optimizer``: DeepSpeed) adapts it (its
    ``adapt(given, config, env)``, which refuses what it does not support); any other model
    steps the optimizer and scaler it was given (the optimizer is then required)."""
    path = recognize(given.model)
    if path.CAPS.steps_optimizer:
        adapter = adapter_of(path)(given, config, env)
        return adapter, adapter.optimizer, adapter.scaler
    if given.optimizer is None:
        from nansentinel.result import SentinelUsageError

        raise SentinelUsageError("nansentinel: Sentinel(model, optimizer) needs the optimizer "
                                 "(only a DeepSpeed engine brings its own)")
    return None, given.optimizer, given.scaler


def adapter_of(path: Any) -> Any:
    """The adapter of a path whose engine steps its own optimizer (``caps.steps_optimizer``):
    ``adapt(given, config, env)``, which checks the Sentinel's other arguments against the
    engine and refuses what it does not support."""
    from nansentinel.engines import deepspeed_step

    adapters = {deepspeed_step.DeepSpeedPath: deepspeed_step.adapt}
    return adapters[path]


def registry() -> tuple[Any, ...]:
    """Every gradient path, in the order a model is offered to them (the first whose
    ``recognizes(model)`` is true takes it; the local path takes anything). A new engine is
    one module here and one line in this tuple: the matrix test takes its ``CAPS`` from here."""
    from nansentinel.engines.ddp import DDPPath
    from nansentinel.engines.deepspeed import DeepSpeedPath
    from nansentinel.engines.fsdp import FSDPPath
    from nansentinel.engines.fsdp1 import FSDP1Path
    from nansentinel.engines.local import LocalGradPath
    from nansentinel.engines.prehook import PreHookPath

    return (DDPPath, DeepSpeedPath, FSDP1Path, FSDPPath, PreHookPath, LocalGradPath)


def recognize(model: Any) -> Any:
    """The gradient path class that takes ``model``: the one a wrapper built by an
    integration names itself (``gradient_path``: torchft's DDP, whose path needs torchft
    and its lighthouse, so it is not offered every model), else the registry's first."""
    own = getattr(type(model), "gradient_path", None)
    if own is not None:
        return own
    return next(path for path in registry() if path.recognizes(model))


def exchange_group(model: Any) -> Any:
    """The process group a wrapper names for the ranks' exchange (DDP's own, or the
    ``sentinel_group`` a wrapper built on it names); None: the default group, if any."""
    own = getattr(recognize(model), "exchange_group", None)
    return own(model) if own is not None else None


def attach(model: torch.nn.Module, sink: GradientSink, *, staged: bool = False) -> GradPath:
    """Choose and install the gradient path for ``model`` (once, at construction).
    ``staged``: this rank holds pipeline stages (:meth:`Capabilities.staged`)."""
    from nansentinel.engines.local import LocalGradPath
    from nansentinel.engines.prehook import PreHookPath

    kind = recognize(model)
    if staged and kind is PreHookPath:  # stages send activations: checked at the boundaries
        kind = LocalGradPath
    path = kind(model, sink)
    if staged:
        path.caps = path.caps.staged()
    return path


def wrapper_of(module: torch.nn.Module, model: torch.nn.Module | None) -> bool:
    """True when ``module`` is the wrapper around ``model`` that reduces its gradients and that
    the Sentinel attaches to (a path whose ``caps.wraps``: DDP, a DeepSpeed engine). A
    framework that hands its callbacks the bare model (the Hugging Face Trainer) meets the
    wrapper at its first forward and asks here, so that no integration recognises an engine by
    itself."""
    return (model is not None and recognize(module).CAPS.wraps
            and getattr(module, "module", None) is model)


def sharded_in_place(model: Any) -> bool:
    """True for a model whose engine shards it in place (``caps.sharded``: FSDP2, FSDP1): a
    framework that hands its callbacks that model (the Hugging Face Trainer hands FSDP's root
    over) builds the Sentinel on it at once, instead of waiting for a wrapper's first
    forward (:func:`wrapper_of`)."""
    return bool(recognize(model).CAPS.sharded)


def takes_replay(model: Any) -> bool:
    """False for a model whose gradient path cannot run a replay (``caps.replay`` says why: a
    DeepSpeed engine's gradient hooks, FSDP2's reduce-scatter would reduce, in a replay's
    backward, the gradients being judged). A framework callback then builds the Sentinel
    without its replay function, unless the user asked for one (and gets the refusal)."""
    return recognize(model).CAPS.replay is None
