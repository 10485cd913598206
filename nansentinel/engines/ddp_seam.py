"""Where the DDP path checks a step: in a Python comm hook, or at the end of backward.

DDP calls a Python communication hook once per gradient bucket, and that call is a floor of
its own (on an H200, a bare Python hook cost 1.022 of a 625 M bf16 step at 25 MB buckets,
against DDP's C++ all-reduce). The check no longer needs a call per bucket: DDP copies each
local gradient into its bucket and leaves ``.grad`` alone until its own end-of-backward
callback copies the reduced buckets back (``gradient_as_bucket_view=False``, the default), so
one callback queued on the autograd engine before DDP's own reads every local gradient, once
every bucket's all-reduce has left. :class:`EndOfBackward` queues it from a gradient hook on
the DDP model's outputs, the first thing a backward computes, so it runs before DDP's
finalisation, which DDP queues when its last bucket is ready.

That seam is :func:`seam_for`'s choice on NCCL. A comm hook stays where a bucket must pass
through the sentinel (``policy="drop"`` zeroes a poisoned rank's buckets; a grad drill writes
into one), where the gradients are the buckets' own views (the all-reduce overwrites them in
place), and on gloo, where the hook's future turns a dead peer's "connection reset" into the
diagnosis that names it (on NCCL that future completes at enqueue and can carry no error: the
watchdog names a dead peer there either way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nansentinel import checks
from nansentinel.common import torch_insides as insides

HOOK, END_OF_BACKWARD = "comm hook", "end of backward"


def seam_for(backend: str, *, as_view: bool, per_reduction: bool) -> str:
    """:data:`END_OF_BACKWARD` on NCCL where no bucket must pass through the sentinel and
    ``.grad`` stays local until DDP's end of backward; else :data:`HOOK`."""
    if backend == "nccl" and not as_view and not per_reduction:
        return END_OF_BACKWARD
    return HOOK


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the backward in progress ends, after the callbacks queued before it
    (DDP queues its finalisation when its last bucket is ready). The engine runs final
    callbacks with the gradients' streams synced to the current one."""
    insides.queue_backward_callback(fn)


def outputs(obj: Any) -> list[torch.Tensor]:
    """The floating tensors of a model's output: nested mappings, lists, tuples and
    dataclasses (where DDP looks for them too)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return [t for value in obj for t in outputs(value)]
    return list(checks.float_tensors(obj))


class EndOfBackward:
    """Queues ``on_end`` once per reducing backward, from a gradient hook on the DDP model's
    outputs (a forward hook arms it; forwards under ``no_sync`` or without grad do not).

    Args:
        model: the DDP model (its ``require_backward_grad_sync`` says whether the backward
            of this forward reduces).
        on_end: the step's check and the exchange's launch.
    """

    def __init__(self, model: Any, on_end: Callable[[], None]) -> None:
        self.model, self.on_end = model, on_end
        self.queued = False
        #: A reducing forward returned no tensor to hook (said once, at ``step()``).
        self.missed = False
        self._handle: Any = model.register_forward_hook(self.arm)

    def release(self) -> None:
        """Stop arming (``Sentinel.close``): later backwards are DDP's alone, with no check
        and no exchange launched into a closed sentinel. A backward already armed queues
        nothing either. Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()

    def arm(self, module: Any, args: Any, output: Any) -> None:
        """After DDP's forward: hook the first gradient the backward computes."""
        if not torch.is_grad_enabled() or not self.model.require_backward_grad_sync:
            return
        tensors = [t for t in outputs(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self.queue, mode="any")
        else:
            self.missed = True

    def queue(self, *_: Any) -> None:
        if not self.queued and self._handle is not None:
            self.queued = True
            queue_callback(self.on_end)
