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
place, and so are sparse gradients, each DDP's bucket of its own: :func:`sparse_parameters`),
and on gloo, where the hook's future turns a dead peer's "connection reset" into the diagnosis
that names it (on NCCL that future completes at enqueue and can carry no error: the watchdog
names a dead peer there either way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from nansentinel import checks
from nansentinel.common import torch_insides as insides

HOOK, END_OF_BACKWARD = "comm hook", "end of backward"


def seam_for(backend: str, *, as_view: bool, per_reduction: bool, sparse: bool = False) -> str:
    """:data:`END_OF_BACKWARD` on NCCL where no bucket must pass through the sentinel and
    ``.grad`` stays local until DDP's end of backward; else :data:`HOOK`. ``sparse``: some
    gradient is sparse, and DDP's own all-reduce writes its sum into that ``.grad`` in place
    (:func:`sparse_parameters`)."""
    if backend == "nccl" and not as_view and not per_reduction and not sparse:
        return END_OF_BACKWARD
    return HOOK


def sparse_parameters(module: torch.nn.Module) -> set[int]:
    """The ids of the parameters whose gradients DDP reduces as sparse: DDP's own rule
    (``DistributedDataParallel._build_params_for_reducer``), a trainable parameter of an
    ``nn.Embedding`` or ``nn.EmbeddingBag`` built with ``sparse=True``, judged by the first
    module that holds it (a weight tied to a later ``nn.Linear`` counts as the embedding's).
    DDP refuses a sparse gradient anywhere else, so the set is exact, and the path sorts these
    apart once, here, instead of looking at every gradient's layout every step.

    DDP gives each such gradient a bucket of its own whose buffer is the ``.grad`` tensor
    itself (no copy, no ``bucket.gradients()``), and its all-reduce (gloo's; NCCL has none)
    writes the coalesced sum back into it: so the comm hook reduces a copy of it, and the
    check reads ``.grad`` through its stored values like any other local gradient."""
    seen: set[int] = set()
    sparse: set[int] = set()
    for mod in module.modules():
        for p in mod.parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if isinstance(mod, torch.nn.Embedding | torch.nn.EmbeddingBag) and mod.sparse:
                sparse.add(id(p))
    return sparse


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
