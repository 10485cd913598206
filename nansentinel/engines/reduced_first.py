"""Below torch 2.14: a loop that reduced its gradients before they were checked is refused.

On the local path the user reduces the gradients and calls ``check_grads()`` before the
reduction. A loop that does not (it relies on ``step()`` to check, as on torch >= 2.14 where
each gradient collective is checked in a pre-hook, engines/prehook.py) would have its
gradients checked after the all-reduce, where one rank's NaN is on every rank and every
rank is blamed: silently wrong. So, on a torch without collective pre-hooks, in a job of
several ranks, the first step watches the default group's collective count (a host counter,
read through common/torch_insides.py) from the end of its backward to its check: a
collective in between is the loop's own reduction, and the Sentinel refuses with the feature,
the torch found and the minimum, before any update. From the second step on it costs
nothing (the hooks leave).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from nansentinel.common import torch_insides as insides
from nansentinel.engines.ddp_seam import outputs, queue_callback


def watches(model: Any, world_size: int) -> bool:
    """Whether the first step of ``model`` on the local path is watched: several ranks,
    no collective pre-hooks, no DTensor parameters (tensor parallel reduces inside autograd)."""
    return (world_size > 1 and dist.is_available() and dist.is_initialized()
            and not insides.supported("collective_hooks")
            and not any(hasattr(p, "device_mesh") for p in model.parameters()))


class ReducedFirst:
    """The default group's collective count at the end of the first step's backward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.group = insides.default_group()
        self.after: int | None = None
        self._queued = False
        self._handle = model.register_forward_hook(self._arm)

    def _arm(self, module: Any, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in outputs(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._queue, mode="any")

    def _queue(self, *_: Any) -> None:
        if not self._queued:
            self._queued = True
            queue_callback(self._read)

    def _read(self) -> None:
        self._queued = False
        try:
            self.after = insides.sequence_number(self.group)
        except (RuntimeError, AttributeError, NotImplementedError):
            self.after = None  # a backend that keeps no count: nothing to tell

    def check(self, step: int) -> None:
        """At the first step's check: refuse if a collective ran since its backward ended;
        then stop watching."""
        self._handle.remove()
        if self.after is None:
            return
        try:
            moved = insides.sequence_number(self.group) > self.after
        except (RuntimeError, AttributeError, NotImplementedError):
            return
        if moved:
            insides.require("collective_hooks", (
                f"rank {dist.get_rank()}, step {step}: a collective ran after backward and "
                "before the gradients were checked, so they were reduced unchecked and a NaN "
                "would be blamed on every rank"))
