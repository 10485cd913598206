"""The DDP gradient path: this rank's local gradients, checked before their all-reduce.

Where the check reads: DDP copies each local gradient into its bucket and leaves ``.grad``
alone until the end of backward, when it copies the reduced buckets back (the default,
``gradient_as_bucket_view=False``). So once the last bucket has left, every ``.grad`` still
holds this rank's own gradient, and one fused per-parameter norm over all of them (one
multi-tensor launch per device and dtype, :meth:`DDPPath.check_at_last`) checks the step: the
bytes the buckets hold, read once, a few launches a step instead of one per bucket, and the
per-parameter norms that name a poisoned parameter come with them. The health exchange
leaves right after, with the gradients.

When (ddp_seam.py): on NCCL there is no Python comm hook at all: DDP all-reduces in C++ as
plain DDP does, and one callback at the end of backward, queued before DDP's own, checks and
launches. Elsewhere the sentinel's comm hook takes each bucket, in the order DDP makes them
ready, and averages it with DDP's default's arithmetic, on every backend — scale each element
by 1/world at fp32 (or divide it by the world, where DDP would), then sum; a world of one: a
plain sum (see :func:`averaging`) —; on the last bucket it checks and launches. Under
``policy="drop"`` a rank whose batch or loss was non-finite sends zeros in place of its
buckets (drop.py). Where the gradients are the buckets' own (``gradient_as_bucket_view=True``:
the all-reduce overwrites them in place) or a fire drill wrote into the first bucket, each
bucket is checked in its own hook call before its all-reduce.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Container, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nansentinel import checks
from nansentinel.engines.base import Capabilities, GradientSink, KeptNorms
from nansentinel.engines.ddp_seam import (
    END_OF_BACKWARD,
    EndOfBackward,
    seam_for,
    sparse_parameters,
)
from nansentinel.engines.local import BucketNorms, BucketPath, check_local_grads
from nansentinel.result import SentinelUsageError

log = logging.getLogger("nansentinel")


class DDPPath(BucketPath):
    """Checks DDP's local gradients before their all-reduce: at the end of backward under
    DDP's own all-reduce (NCCL), or in its communication hook (DDP allows one per model)."""

    CAPS = Capabilities(label="DDP", wraps=True, order_watched=True)
    mesh_groups: tuple[Any, ...] = ()

    @staticmethod
    def recognizes(model: Any) -> bool:
        return isinstance(model, DistributedDataParallel)

    @staticmethod
    def exchange_group(model: DistributedDataParallel) -> Any:
        """The ranks' exchange runs on DDP's group (or the one a wrapper names)."""
        return getattr(model, "sentinel_group", model.process_group)

    def __init__(self, model: DistributedDataParallel, sink: GradientSink) -> None:
        self.model = model
        self.sink = sink
        self.group = model.process_group
        self.world_size = dist.get_world_size(self.group)
        self.caps = self._capabilities()
        backend = str(dist.get_backend(self.group))
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        #: How a bucket is averaged (see :func:`averaging`).
        self.averaging = averaging(backend, device.type, self.world_size)
        #: This step's buckets are divided by the world, not multiplied by its inverse: what
        #: DDP's default does to gradients that already were its bucket views (see
        #: :meth:`_own_ends`).
        self.divides = False
        self._as_view = bool(getattr(model, "gradient_as_bucket_view", False))
        sparse = sparse_parameters(model.module)  # sorted apart once (ddp_seam.py)
        self._probe = next((p for p in model.parameters()
                            if p.requires_grad and id(p) not in sparse), None)
        self.buckets = 0
        #: This step's check waits for the last bucket (:meth:`check_at_last`); False: each
        #: bucket is checked in its own call (gradients that are bucket views, a drill).
        self.at_last = False
        self.keep_norms = False
        self._norms = BucketNorms(model)
        #: The trainable parameters by (device, dtype), each group one fused norm at the last
        #: bucket; DTensor parameters (tensor parallel) are normed through their local tensors,
        #: sparse gradients in groups of their own through their stored values.
        self._groups = grouped((p for p in model.module.parameters() if p.requires_grad),
                               sparse)
        self._dtensors = any(hasattr(p, "to_local") for p in model.parameters())
        # DDP's own collectives in its forward (the buffer broadcast, the bucket rebuild) lie
        # between its forward hooks and its module's: bracketed, they are left out of the
        # forward's collectives (collectives.ForwardCollectives), while a user's collective
        # inside the module, on the same group, still counts.
        self._handles = [
            model.register_forward_pre_hook(self._own_begins),
            model.module.register_forward_pre_hook(self._own_ends, prepend=True),
            model.module.register_forward_hook(self._own_begins),
            model.register_forward_hook(self._own_ends, prepend=True),
        ]
        #: The sentinel was closed (:meth:`release`): the comm hook only averages.
        self.released = False
        #: Where the step is checked (ddp_seam.py): DDP's C++ all-reduce and one callback at
        #: the end of backward, or this path's comm hook on every bucket.
        self.seam = seam_for(backend, as_view=self._as_view, per_reduction=sink.per_reduction,
                             sparse=bool(sparse))
        self._end: EndOfBackward | None = None
        self._warned = False
        if self.seam == END_OF_BACKWARD:
            self._end = EndOfBackward(model, self._at_end_of_backward)
            return
        try:
            model.register_comm_hook(self, _comm_hook)
        except RuntimeError as exc:
            raise SentinelUsageError(
                f"nansentinel: cannot register its DDP communication hook on rank "
                f"{dist.get_rank()}: {exc}. Construct the Sentinel before the first backward and "
                "do not register another comm hook."
            ) from exc

    def release(self) -> None:
        """The sentinel is closed (``Sentinel.close``): its hooks leave the model, and what
        DDP cannot unregister (a comm hook) averages as DDP's default does, checking nothing
        and launching no exchange. Idempotent."""
        self.released = True
        if self._end is not None:
            self._end.release()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _capabilities(self) -> Capabilities:
        """DDP's group holds this rank's replicas; DTensor parameters (tensor parallel) make a
        replica several ranks, which ``policy="drop"`` cannot leave out alone."""
        tensor_parallel = any(hasattr(p, "to_local") for p in self.model.parameters())
        broadcasts = getattr(self.model, "broadcast_buffers", False) and self.world_size > 1
        return dataclasses.replace(
            self.CAPS, replica_group=self.group, buffers_from=self.model if broadcasts else None,
            drop=("the DDP model holds DTensor parameters (tensor parallel): a data-parallel "
                  "replica is several ranks") if tensor_parallel else None)

    def _own_begins(self, *_: Any) -> None:
        forward = getattr(self.sink, "forward", None)
        if forward is not None:
            forward.aside()

    def _own_ends(self, *_: Any) -> None:
        forward = getattr(self.sink, "forward", None)
        if forward is not None:
            forward.resume()
        if self._as_view and self._probe is not None:
            self.divides = kept_as_view(self._probe.grad)

    def check_now(self) -> None:
        """No bucket was reduced this step (no backward, or every micro-batch under
        ``no_sync``): check the local gradients as they are. On the end-of-backward seam, a
        model whose output held no tensor to hook is said once: its gradients were reduced
        unchecked, and are checked now, where a NaN can no longer be blamed on one rank."""
        if self._end is not None and self._end.missed and not self._warned:
            self._warned = True
            log.warning(
                "nansentinel: rank %d: the DDP model's output held no floating tensor that "
                "requires grad, so the gradients of step %d were checked after DDP reduced "
                "them (a NaN is then blamed on every rank). Return tensors (in dicts, lists, "
                "tuples or dataclasses) from the model's forward.", dist.get_rank(self.group),
                self.sink.step_index)
        check_local_grads(self.model.parameters(), self.sink)

    def reset(self) -> None:
        super().reset()
        self.at_last = False
        if self._end is not None:
            self._end.queued = self._end.missed = False

    def first_bucket(self, buffer: torch.Tensor) -> None:
        """The step's first bucket: arm the watchdog and fire a due grad drill into it; the
        check may wait for the last bucket unless the gradients are the buckets' own or the
        drill wrote into this one (which ``.grad`` does not see)."""
        drilled = self.sink.before_reduction(buffer)
        self.at_last = not self._as_view and not drilled

    def check_at_last(self) -> None:
        """The step's local gradients, at the last bucket, before DDP copies the reduced
        buckets back: one norm per (device, dtype) group, from the per-parameter norms of one
        fused pass (kept with their names for the device gate)."""
        kept = self._norms.kept = KeptNorms() if self.keep_norms else None
        for params in self._groups:
            present = [(p, g) for p in params if (g := p.grad) is not None]
            if not present:
                continue
            grads = [g for _, g in present]
            norms = checks.grad_norms(grads, plain=not self._dtensors)
            self.sink.add_grad_norm(torch.linalg.vector_norm(norms))
            if kept is not None:
                kept.add([self._norms.names.get(id(p), "<unnamed>") for p, _ in present], norms)

    def _at_end_of_backward(self) -> None:
        """The end-of-backward seam: every bucket's all-reduce has left and ``.grad`` is still
        local: arm the watchdog, check the step, launch the exchange."""
        started = time.perf_counter()
        first = next((g for group in self._groups for p in group if (g := p.grad) is not None),
                     None)
        if first is not None:
            self.sink.before_reduction(first)
            self.check_at_last()
            self.sink.launch_exchange()
        self.sink.spent(time.perf_counter() - started)

    def bucket_norm(self, bucket: Any) -> torch.Tensor:
        """One L2 norm of the bucket's local gradients (local.BucketNorms)."""
        return self._norms.norm(bucket, self.keep_norms)


def grouped(params: Iterable[torch.Tensor], sparse: Container[int] = ()
            ) -> list[list[torch.Tensor]]:
    """``params`` by (device, dtype) of their local values, in order: one fused norm each;
    those whose ids are in ``sparse`` (their gradients are sparse) in groups of their own."""
    groups: dict[tuple[torch.device, torch.dtype, bool], list[torch.Tensor]] = {}
    for p in params:
        t = checks.local(p)
        groups.setdefault((t.device, t.dtype, id(p) in sparse), []).append(p)
    return list(groups.values())


SCALE_THEN_SUM, SUM = "scale_then_sum", "sum"


def averaging(backend: str, device_type: str, world_size: int) -> str:
    """How the hook averages a bucket across ``world_size`` ranks: as DDP's default does, on
    every backend and in every dtype, so that a healthy step is plain DDP's bit for bit.

    DDP's default divides each gradient while copying it into its bucket (``mul_out`` with the
    scalar 1/world, computed at fp32 even for a bf16/fp16 bucket; ``div_`` by the world for a
    gradient that already is its bucket view, see :func:`kept_as_view`), then all-reduces with
    ``SUM``. The hook sees the bucket after the copy, so it scales the bucket the same way,
    then sums: ``SCALE_THEN_SUM``, whatever the backend and device.

    Not NCCL's ``AVG``: NCCL pre-multiplies each input by 1/world *rounded to the bucket's
    dtype* (``hostToDevRedOp``: ``__float2bfloat16(float(1.0/nRanks))``), so with bf16 buckets
    at 6, 12, 24, 48, 96 or 384 ranks every averaged gradient came out 0.195% too large
    (bf16(1/24) * 24 = 1.00195), and fp16 and other sizes were off by other amounts. NCCL's
    ``PreMulSum`` cannot fix it: its factor has the bucket's dtype too. Gloo has no ``AVG``.

    A world of one: a plain sum, which is the identity (DDP's division by one is exact),
    because NCCL's one-rank ``AVG`` dropped trailing elements (NVIDIA/nccl#1950, seen on
    2.27.5, fixed in 2.29.7) and FSDP2 forces a sum there for the same reason.
    ``backend`` and ``device_type`` no longer change the rule; they stay in the signature for
    the callers that record them.
    """
    del backend, device_type
    return SUM if world_size == 1 else SCALE_THEN_SUM


def kept_as_view(grad: torch.Tensor | None) -> bool:
    """Whether DDP's default would *divide* this gradient by the world rather than multiply it
    by 1/world: it does when the gradient already is a view of its bucket when backward
    reaches it (``gradient_as_bucket_view=True`` and gradients zeroed in place, not set to
    None), and multiplies while copying otherwise. The two differ in the last bit of an fp32
    gradient at a world that is not a power of two. Probed on one parameter after each
    forward (a gradient set to None since, or a fresh one accumulated under ``no_sync``, is no
    view of anything), so the hook does what DDP's reducer does without a per-parameter hook.
    """
    return grad is not None and grad._base is not None


def scale(buffer: torch.Tensor, world_size: int, divides: bool) -> None:
    """Scale a bucket by 1/world in place, as DDP's default does before its ``SUM``: the
    scalar is computed at fp32 (torch's ``opmath``) for a bf16/fp16 bucket too."""
    if divides:
        buffer.div_(world_size)
    else:
        buffer.mul_(1.0 / world_size)


def _comm_hook(state, bucket):
    """Check the bucket on this rank, then average it across ranks as DDP's default does.

    The ``then`` callback stays on every backend: DDP's Python hook interface accepts only a
    future whose value is a Python object (a raw ``work.get_future()`` fails DDP's internal
    assert ``result.isPyObject()``, checked on torch 2.13), so the callback costs nothing a
    Python hook could avoid, and it turns a dead peer into an error naming the missing rank.

    Deliberately unannotated: DDP inspects the annotations and rejects the string forms that
    ``from __future__ import annotations`` produces."""
    started = time.perf_counter()
    path: DDPPath = state
    sink = path.sink
    buffer = bucket.buffer()
    if path.released:  # the sentinel is closed: DDP's default average, nothing checked
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return default_hooks.allreduce_hook(path.group, bucket)
    if path.buckets == 0:
        path.first_bucket(buffer)
    path.buckets += 1
    if not path.at_last:
        sink.add_grad_norm(path.bucket_norm(bucket))
    sparse = buffer.layout != torch.strided
    if sparse:  # the bucket is the .grad itself, summed in place: reduce a copy (ddp_seam.py)
        buffer = buffer.clone()
    sink.withhold(buffer)  # policy="drop": a poisoned rank sends zeros (drop.py)
    if path.averaging == SCALE_THEN_SUM:  # DDP divides a sparse gradient
        scale(buffer, path.world_size, path.divides or sparse)
    work = dist.all_reduce(buffer, group=path.group, async_op=True)
    # A failure (a peer died) becomes the step's one diagnosis, naming the missing ranks.
    future = sink.diagnosed(work.get_future(), sink.step_index, buffer)
    if bucket.is_last():
        if path.at_last:
            path.check_at_last()
        sink.launch_exchange()
    sink.spent(time.perf_counter() - started)
    return future
