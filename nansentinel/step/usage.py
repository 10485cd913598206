"""The training loop's misuses of the Sentinel, refused by name where they happen.

A sentinel handed the wrong objects, or called in an order it cannot honour, used to fail far
from the mistake (an ``AttributeError`` deep in an engine, a string optimizer accepted until
``step()``) or, worse, not at all: ``step()`` before any backward, or twice after one, was
"applied" on gradients that were absent or already used. Each check here is a few attribute
reads on the host (no tensor is read, nothing is synchronised), so it runs on every call, and
each raises :class:`SentinelUsageError` naming the call, the rank and the step, and what to do.

Where a check cannot tell (a DeepSpeed engine keeps its gradients in its own buffers; FSDP2
accumulates unsharded gradients off ``.grad``) it stays silent: only the local and DDP
gradient paths, whose gradients are the parameters' ``.grad``, are watched for the order of
backward and ``step()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nansentinel.common import doors
from nansentinel.engines.base import Capabilities
from nansentinel.result import ArgumentTypeError, SentinelUsageError


def check_objects(model: object, optimizer: object) -> None:
    """What ``Sentinel(model, optimizer)`` was handed: :func:`check_model`, then
    :func:`check_optimizer`."""
    check_model(model)
    check_optimizer(optimizer, model)


def check_arguments(hints: dict[str, Any], arguments: dict[str, Any]) -> None:
    """Each of ``Sentinel(...)``'s keyword ``arguments`` is of the type its annotation
    (``hints``) says, or a :class:`SentinelUsageError` names the argument, the type given and
    the type wanted, before anything is built (``scopes=[1]`` would otherwise fail as an
    ``AttributeError`` inside the assembly)."""
    for name, value in arguments.items():
        problem = doors.refusal(name, value, hints.get(name, Any))
        if problem is not None:
            raise ArgumentTypeError(f"nansentinel: Sentinel(..., {problem})")


def check_model(model: object) -> None:
    """``model`` is a ``torch.nn.Module`` (or a list of them: a pipeline rank's stages)."""
    parts = list(model) if isinstance(model, list | tuple) else [model]
    bad = next((p for p in parts if not isinstance(p, torch.nn.Module)), _NOTHING)
    if bad is not _NOTHING or not parts:
        raise SentinelUsageError(
            "nansentinel: Sentinel(model, ...) needs a torch.nn.Module (plain, DDP, FSDP2, a "
            "DeepSpeed engine) or a list of pipeline stage modules; got "
            f"{_what(bad) if parts else 'an empty list'}")


_NOTHING = object()


def check_optimizer(optimizer: object, model: object) -> None:
    """``optimizer`` is None or an optimizer (``step`` and ``param_groups``), and a torch
    optimizer holds at least one of the model's parameters."""
    if optimizer is None:
        return
    if not callable(getattr(optimizer, "step", None)) or not hasattr(optimizer, "param_groups"):
        raise SentinelUsageError(
            f"nansentinel: Sentinel(model, optimizer) needs an optimizer (a torch.optim."
            f"Optimizer, with step() and param_groups); got {_what(optimizer)}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        return  # a framework's wrapper: its parameters may be views we cannot match
    modules = model if isinstance(model, list | tuple) else [model]
    mine = {id(p) for m in modules for p in m.parameters()}  # type: ignore[union-attr]
    held = [p for group in optimizer.param_groups for p in group.get("params", [])]
    if mine and held and not any(id(p) in mine for p in held):
        raise SentinelUsageError(
            f"nansentinel: the optimizer ({type(optimizer).__name__}, {len(held)} "
            f"parameter(s)) holds none of the model's {len(mine)} parameters: it would step "
            "another model. Build it from this model's parameters (after wrapping it in "
            "FSDP2, before the Sentinel).")


def _what(obj: object) -> str:
    text = repr(obj)
    return f"{type(obj).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


class Usage:
    """The order of the loop's calls on one rank: live until ``close()``, a backward before
    each ``step()``, and (on the local path) the loss checked before its backward.

    A backward is seen by a post-accumulate-grad hook on two trainable parameters (the first
    and the last): two Python calls a backward, not one per parameter. Zeroing the gradients
    fires neither, so only a backward counts.

    Args:
        module: the unwrapped model.
        caps: the gradient path's capabilities: the order is watched where
            ``order_watched`` (the gradients are the parameters' own ``.grad``), a late
            ``check_loss`` refused where ``loss_first``.
        closed: whether the run is closed (the sentinel's end).
    """

    def __init__(self, module: torch.nn.Module, caps: Capabilities, closed: Any) -> None:
        trainable = [p for p in module.parameters() if p.requires_grad]
        watched = caps.order_watched and bool(trainable)
        self._trainable = trainable if watched else []
        probes = {id(p): p for p in (trainable[:1] + trainable[-1:])} if watched else {}
        self._handles: list[Any] = []
        try:
            for p in probes.values():
                self._handles.append(p.register_post_accumulate_grad_hook(self._accumulated))
        except RuntimeError:  # a parameter that is no leaf (a view another wrapper made)
            self.release()
            self._trainable = []
        self._closed = closed
        self._local = caps.loss_first
        self._backwards = 0
        self._at_step = 0
        self._loss_checked = False
        self._checked = False  # check_batch or check_loss this step

    def _accumulated(self, _param: torch.Tensor) -> None:
        self._backwards += 1

    def release(self) -> None:
        """Remove the hooks (``close()``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def live(self, call: str, rank: int, step: int) -> None:
        """``call`` is made before ``close()``."""
        self._checked |= call in ("check_batch", "check_loss")
        if self._closed():
            raise SentinelUsageError(
                f"nansentinel: {call}() on rank {rank} after the sentinel was closed (at step "
                f"{step}); build a new Sentinel to train on")

    def loss_checked(self, rank: int, step: int) -> None:
        """``check_loss``: on the local path, refused after this step's first backward when
        no loss was checked before it (its flag would describe a step already taken); with
        gradient accumulation each micro-batch's loss is checked before its own backward."""
        if self._local and self._handles and not self._loss_checked and \
                self._backwards != self._at_step:
            raise SentinelUsageError(
                f"nansentinel: check_loss() called on rank {rank} at step {step} after "
                "loss.backward(); call check_batch/check_loss before loss.backward(), then "
                "step()")
        self._loss_checked = True

    def stepping(self, rank: int, step: int) -> None:
        """``step()`` without the exchange launched: a backward since the last ``step()``,
        or at least a checked batch or loss. A step with a loss checked and no backward is
        the loop's choice (a non-finite loss it did not back-propagate), decided as such;
        a bare ``step()`` with neither decides nothing the loop asked for."""
        if not self._handles or self._checked or self._backwards != self._at_step:
            return
        if not any(p.grad is not None for p in self._trainable):
            raise SentinelUsageError(
                f"nansentinel: step() called on rank {rank} at step {step} before any "
                "loss.backward(): no parameter has a gradient; call check_batch, check_loss, "
                "loss.backward(), then step()")
        raise SentinelUsageError(
            f"nansentinel: step() called on rank {rank} at step {step} with no "
            "loss.backward() since the last step(): its gradients were used already; "
            "call loss.backward() before each step()")

    def stepped(self) -> None:
        """The step was decided: the next one starts here."""
        self._at_step = self._backwards
        self._loss_checked = self._checked = False


def chained(*calls: Callable[[], None] | None) -> Callable[[], None]:
    """One callable that makes each of ``calls`` (None skipped) in turn: the end's release."""
    def run() -> None:
        for call in calls:
            if call is not None:
                call()
    return run
