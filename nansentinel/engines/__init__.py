"""Where this rank's gradients are checked: always on the local gradients, before they are
reduced across ranks, because after the reduction a NaN from one rank is on every rank.

One path is chosen once, at construction, from the model the user hands the Sentinel:

- ``ddp``: a ``DistributedDataParallel`` model. Its communication hook checks each flat bucket,
  then averages it as DDP's default does; the last bucket launches the health exchange.
- ``fsdp``: an FSDP2 (``fully_shard``) model, 1-D or HSDP. A custom reduce-scatter checks each
  FSDP group's flat, padded, unsharded gradient buffer, then runs FSDP's own reduce-scatter
  unchanged; the exchange leaves at ``step()``.
- ``deepspeed``: a ``deepspeed.DeepSpeedEngine``. Each ZeRO stage's local gradients, before
  DeepSpeed reduces them: all of them before its all-reduce (ZeRO-0/1), each IPG bucket before
  its reduce (ZeRO-2), each bucket before its reduce-scatter into partitions (ZeRO-3).
- ``local``: anything else (one process, or users who reduce gradients by hand and call
  ``check_grads()`` before their reduction): one fused norm per (device, dtype) group of the
  local ``.grad`` tensors.

Each path talks to the sentinel through the few methods of :class:`GradientSink`, so it can be
read (and replaced) without the rest of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from nansentinel.wire.collectives import ForwardCollectives, Peers


class GradientSink(Protocol):
    """What a gradient path reports to (the step in progress: current.CurrentStep)."""

    @property
    def step_index(self) -> int: ...

    @property
    def forward(self) -> ForwardCollectives:
        """The count of this rank's forward collectives (origins.py): a path whose wrapper
        issues its own collectives in the forward (DDP's buffer broadcast) brackets them with
        ``aside()`` and ``resume()``."""

    @property
    def inferring(self) -> bool:
        """A pipeline schedule's shape inference is running: its gradients are not a step's."""

    def before_reduction(self, local_grads: torch.Tensor) -> None:
        """``local_grads`` is about to be reduced: arm the watchdog, fire a due grad drill."""

    def reducing(self) -> None:
        """A reduction of this step is being launched: the watchdog counts from now."""

    def withhold(self, local_grads: torch.Tensor) -> None:
        """``local_grads`` (already checked) are about to be reduced: under ``policy="drop"``
        they become zeros if this rank's batch or loss was non-finite (drop.py)."""

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """Record one 0-d gradient norm of this rank (on the device; no host sync)."""

    def launch_exchange(self) -> None:
        """Start the health exchange now (the last reduction of the step has been launched)."""

    def diagnosed(
        self, future: torch.futures.Future, step: int, reduced_in_place: torch.Tensor
    ) -> torch.futures.Future:
        """``future`` (the in-place reduction of ``reduced_in_place`` in ``step``) resolving to
        that tensor, with a failure turned into the step's one diagnosis, the error that
        names the missing ranks and hosts."""

    def spent(self, seconds: float) -> None:
        """Add ``seconds`` of the sentinel's own work to this step's cost."""


class GradPath(Protocol):
    """One way of checking the local gradients before their reduction."""

    #: ``ddp``, ``fsdp``, ``deepspeed`` or ``local``.
    name: str
    #: Process groups the path's own collectives run on in the forward (FSDP2's parameter
    #: all-gathers): they carry no batch's NaN to another rank's loss (origins.py).
    mesh_groups: Sequence[Any]

    def check_now(self) -> None:
        """Check the local gradients now, at ``check_grads()`` (or at ``step()`` when no
        reduction checked them this step: no backward, or every micro-batch under ``no_sync``)."""

    def naming_detail(self, poisoned: bool, peers: Peers) -> dict[str, Any]:
        """After a gradient fault, on every rank, before the gradients are discarded: this
        rank's share of the report, with ``parameters``, the fully-qualified names of its
        parameters whose local gradients were non-finite before the reduction, where this
        rank was ``poisoned``. May run a collective of ``peers`` (FSDP2), the same on every
        rank; its size does not depend on the world size."""

    def reset(self) -> None:
        """Forget this step's per-parameter records (called after every decision)."""


def attach(model: torch.nn.Module, sink: GradientSink) -> GradPath:
    """Choose and install the gradient path for ``model`` (once, at construction)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        from nansentinel.engines.ddp import DDPPath

        return DDPPath(model, sink)
    from nansentinel.engines import deepspeed, fsdp

    if deepspeed.is_engine(model):
        return deepspeed.DeepSpeedPath(model, sink)
    if fsdp.is_fsdp(model):
        return fsdp.FSDPPath(model, sink)
    from nansentinel.engines.local import LocalGradPath

    return LocalGradPath(model, sink)


def wrapper_of(module: torch.nn.Module, model: torch.nn.Module) -> bool:
    """True when ``module`` is the wrapper around ``model`` that reduces its gradients and that
    the Sentinel attaches to: ``DistributedDataParallel``, or a DeepSpeed engine. A framework
    that hands its callbacks the bare model (the Hugging Face Trainer) meets the wrapper at its
    first forward and asks here, so that no integration recognises an engine by itself."""
    from torch.nn.parallel import DistributedDataParallel

    from nansentinel.engines import deepspeed

    if isinstance(module, DistributedDataParallel) or deepspeed.is_engine(module):
        return getattr(module, "module", None) is model
    return False


def takes_replay(model: Any) -> bool:
    """False for a model whose gradient path cannot run a replay: a DeepSpeed engine, whose
    gradient hooks would reduce, in a replay's backward, the gradients being judged. A framework
    callback then builds the Sentinel without its replay function, unless the user asked for
    one (and gets the engine's refusal)."""
    from nansentinel.engines import deepspeed

    return not deepspeed.is_engine(model)
