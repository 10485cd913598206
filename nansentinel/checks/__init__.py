"""Pure tensor checks: tensors in, small tensors out, on the same device.

Nothing here synchronises with the host (no ``.item()``, no ``if tensor``), touches
``torch.distributed`` or does I/O: a check costs one fused reduction over the bytes it reads,
and its answer stays on the device until the sentinel's single decision point.

Why an L2 norm and not ``torch.isfinite(x).all()``: NaN and Inf propagate through a norm, so a
non-finite norm says the tensor holds a non-finite value, and the norm is something we want
anyway (gradient norm, spike detection). It is also far cheaper: on CPU, over 3.7 M floats, the
norm took 1.2 ms against 38 ms for ``isfinite().all()``. The one false alarm is a tensor of
finite values so large (beyond ~1e19 in fp32) that its norm overflows; a gradient that large
would wreck the weights anyway, and such a batch is almost surely corrupt.

DTensors (tensor parallel, FSDP2) are checked through their local tensor, :func:`local`: what
this rank holds and computed itself, before any collective. An operator on the DTensor itself
would return a DTensor (which the health row cannot be packed with) and may redistribute it: a
norm of a ``Partial`` DTensor all-reduces it first, a collective inside a check that only the
ranks reaching it would issue, and after which a NaN from one tensor-parallel peer is on all.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from nansentinel.common import torch_insides as insides
from nansentinel.result import ArgumentTypeError, SentinelUsageError

_HALF = (torch.float16, torch.bfloat16)
#: The layouts the checks read: strided, and the sparse ones through their stored values.
_READABLE = (torch.strided, torch.sparse_coo, torch.sparse_csr, torch.sparse_csc,
             torch.sparse_bsr, torch.sparse_bsc)
#: The largest finite fp32: a Python number past it is recorded as what fp32 makes of it, inf.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def tensors(obj: object) -> Iterator[torch.Tensor]:
    """Yield every tensor in any nesting of mappings, lists and tuples (other leaves — strings,
    None, numbers — are skipped), in order.

    Walked with a stack of its own, not recursion, so a deep nesting costs no Python frames;
    a container that holds itself (``x = []; x.append(x)``) is a
    :class:`~nansentinel.result.SentinelUsageError` naming the depth, not an endless walk or a
    ``RecursionError``. The same container twice side by side is walked twice, as before.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    path: list[int] = []  # ids of the containers being walked, outermost first
    walking: set[int] = set()  # the same ids, to look up
    stack: list[Iterator[object]] = []

    def enter(container: object) -> None:
        if id(container) in walking:
            raise SentinelUsageError(
                f"nansentinel: the batch holds itself: a {type(container).__name__} at depth "
                f"{len(path)} contains one of its own enclosing containers; give a batch of "
                "dicts, lists and tuples without cycles")
        path.append(id(container))
        walking.add(id(container))
        values = container.values() if isinstance(container, Mapping) else container
        stack.append(iter(values))  # type: ignore[call-overload]

    if isinstance(obj, Mapping | list | tuple):
        enter(obj)
    while stack:
        value = next(stack[-1], _END)
        if value is _END:
            stack.pop()
            walking.discard(path.pop())
        elif isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, Mapping | list | tuple):
            enter(value)


_END = object()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own values of ``t``: a DTensor's local tensor (detached; no collective, no
    copy), any other tensor as it is. Whatever the placements, that is what a check on this
    rank can vouch for: a ``Replicate`` dimension's full value, a ``Shard``'s slice, a
    ``Partial``'s addend before the pending reduction. A non-finite value in any of them is
    non-finite on this rank first, which is where blame belongs."""
    to_local = getattr(t, "to_local", None)  # duck-typed: checks import no torch.distributed
    if to_local is None:
        return t
    return to_local().detach()


def float_tensors(obj: object) -> Iterator[torch.Tensor]:
    """Yield the floating-point (and complex) tensors of a nested batch.

    Integer and bool tensors (token ids, masks), strings, None and numbers are ignored: they
    cannot hold NaN, and a batch may legitimately carry them beside the data.
    """
    return (t for t in tensors(obj) if t.is_floating_point() or t.is_complex())


def tensor_norm(t: torch.Tensor) -> torch.Tensor:
    """L2 norm of ``t`` as a 0-d fp32 tensor: one read of its bytes.

    Half-precision tensors are reduced with fp32 accumulation so that an ordinary large batch
    does not overflow fp16's 65504 and raise a false alarm; fp64 in fp64, then cast. A DTensor's
    norm is its local tensor's (:func:`local`), a plain tensor on this rank's device. Detached:
    a check's norm of a tensor that requires grad (an activation) must not join the autograd
    graph, which would keep the tensor alive with it.

    A sparse tensor (COO, CSR, CSC, BSR, BSC) is normed through the values it stores
    (:func:`~nansentinel.common.torch_insides.stored_values`), never densified: the zeros it
    leaves out add nothing to a norm and are finite. Coalesced, that is the tensor's own norm.
    Uncoalesced (a COO gradient of ``nn.Embedding(sparse=True)`` holds an entry per
    occurrence of a token), an index stored ``m`` times is the sum of its ``m`` entries, and
    the norm read is of the entries, not of their sums: the tensor's norm is at most
    ``sqrt(m)`` times it (Cauchy-Schwarz), ``m`` the most times one index repeats. Finiteness
    is exact either way: a non-finite entry makes its sum non-finite, and entries large enough
    for their sum to overflow (~3.4e38 in fp32) overflow the norm's squares long before
    (~1.8e19). The one gap is half precision, whose norm accumulates in fp32: fp16 entries
    each under 65504 whose sum passes it read finite here and overflow where the tensor is
    coalesced.
    """
    t = local(t)
    if t.requires_grad:  # a detach is a dispatch of its own: only where it is needed
        t = t.detach()
    if t.layout != torch.strided:
        t = insides.stored_values(t)
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype in _HALF:
        return torch.linalg.vector_norm(t, dtype=torch.float32)
    norm = torch.linalg.vector_norm(t)
    return norm if norm.dtype == torch.float32 else norm.float()


def batch_norms(batch: object, device: torch.device) -> list[torch.Tensor]:
    """One 0-d fp32 norm per floating-point tensor of a nested batch, on ``device``.

    Tensors on another device are reduced where they live and only their 0-d norm is moved
    (non-blocking towards an accelerator). The flag is taken later, once per step, from all
    the norms together (``view.pack_row``), which keeps a check to one kernel per tensor.
    A sparse tensor is checked through its stored values (the zeros it leaves out are
    finite); a meta tensor, which holds no values, is a :class:`SentinelUsageError` naming it.
    """
    norms = []
    for n, t in enumerate(float_tensors(batch)):
        unreadable = _unreadable(t, device)
        if unreadable:
            raise ArgumentTypeError(f"nansentinel: check_batch(batch): its floating-point "
                                    f"tensor #{n} is {unreadable}")
        norms.append(moved(tensor_norm(t), device))
    return norms


def _unreadable(t: torch.Tensor, device: torch.device,
                layouts: tuple[torch.layout, ...] = _READABLE) -> str | None:
    """Why the checks cannot read ``t``'s values for a rank on ``device`` (a meta tensor has
    none, unless the rank itself is on meta: shapes only, as the device tests run; a layout
    not in ``layouts``), or None."""
    if t.is_meta and device.type != "meta":
        return ("a meta tensor (shapes only, no values to check: materialise it with "
                "to_empty() and load its weights first)")
    if t.layout not in layouts:
        return f"a tensor of layout {t.layout}, which the checks cannot read"
    return None


def loss_scalar(loss: torch.Tensor) -> torch.Tensor:
    """The loss as an fp32 0-d tensor: itself when scalar, its mean otherwise (per-sample
    losses can be passed as they are; a NaN or Inf anywhere propagates into the mean).

    A DTensor loss (tensor parallel: torchtitan's loss-parallel cross entropy, or an output
    kept as a DTensor) is recorded as this rank's local value, a plain tensor (:func:`local`):

    - ``Replicate``: the loss itself, the same on every peer;
    - ``Partial``: this rank's addend of the pending reduction (``Partial(avg)``: a value of
      the loss's size; ``sum``: its share). If the sum is non-finite, some addend is, and the
      rank holding it is where the NaN began; its spike references follow its own addend;
    - ``Shard``: the mean of this rank's elements (0 if it holds none: an empty mean would be
      a NaN that no rank made).

    Not the reduced loss, on purpose: reducing would be a collective inside ``check_loss``
    (every peer would have to call it identically, even one whose loop raised), a wait in the
    middle of the forward, and it would put one peer's NaN on all of them, so blame could not
    tell them apart.
    """
    detached = loss.detach()
    if detached.is_complex():
        raise TypeError("a complex loss cannot be checked; pass a real-valued loss")
    if hasattr(detached, "to_local"):
        detached = local(detached)
        if detached.numel() == 0:  # an empty shard holds no loss (numel is host metadata)
            return detached.float().sum()
    if detached.numel() == 1:
        if detached.dim() == 0 and detached.dtype == torch.float32:
            return detached  # the usual loss: nothing to reshape or cast (each a dispatch)
        return detached.reshape(()).float()
    return detached.float().mean()


def as_loss(loss: object, device: torch.device, where: str) -> torch.Tensor:
    """``loss`` as a tensor to check: a number becomes a 0-d tensor made on ``device`` (no host
    copy on CUDA); anything else than a non-empty floating tensor is an ``ArgumentTypeError`` (a
    ``TypeError`` too) naming
    ``where`` (rank and step)."""
    if isinstance(loss, int | float) and not isinstance(loss, bool):
        try:
            value = float(loss)
        except OverflowError:  # an integer past float's range: what fp32/fp64 make of it
            value = math.inf if loss > 0 else -math.inf
        if abs(value) > _FLOAT32_MAX and math.isfinite(value):  # torch.full would refuse it
            value = math.copysign(math.inf, value)
        return torch.full((), value, device=device)
    if not isinstance(loss, torch.Tensor):
        raise ArgumentTypeError(f"nansentinel: check_loss expects a tensor or a number, got "
                                f"{type(loss).__name__} ({where})")
    unreadable = _unreadable(loss, device, (torch.strided,))  # a sparse loss is no loss
    if unreadable:
        raise ArgumentTypeError(f"nansentinel: check_loss expects a tensor it can read, got "
                                f"{unreadable} ({where})")
    if not (loss.is_floating_point() or loss.is_complex()) or loss.numel() == 0:
        raise ArgumentTypeError(f"nansentinel: check_loss expects a non-empty floating-point "
                                f"loss, got dtype {loss.dtype} with {loss.numel()} elements "
                                f"({where})")
    return loss


def grad_norms(grads: Sequence[torch.Tensor], *, plain: bool = False) -> torch.Tensor:
    """Per-tensor L2 norms of ``grads`` (one device and dtype, as in a DDP bucket) as one
    fp32 vector, using the fused multi-tensor kernel (one launch on CUDA), so a bucket costs
    about one read of its bytes.

    The per-tensor norms are kept so that, only after a detection, the poisoned rank can name
    the parameters that held the non-finite values without a second pass. DTensor gradients
    are normed through their local tensors (:func:`local`): this rank's own, before any
    reduction. ``plain``: the caller knows none is a DTensor (a look-up per tensor saved, on
    the DDP hook's last bucket).

    Sparse gradients (``nn.Embedding(sparse=True)``) are normed through their stored values
    (:func:`tensor_norm` says what that norm is), never densified; the fused kernel has no
    sparse kernel. A caller that sorts them apart (DDP's path, by DDP's own rule, once at
    construction) hands a group whose first gradient is sparse, and its values are normed in
    one fused call. A sparse gradient inside a group of dense ones (gradients reduced by hand,
    where any parameter may get one) fails the fused call, and the group is normed again
    through each gradient's stored values: that is paid only where a sparse gradient is, so a
    dense step does no work per tensor it did not do before.
    """
    if not grads:
        return torch.zeros(0, dtype=torch.float32)
    if not plain:
        grads = [local(g) for g in grads]
    if grads[0].layout != torch.strided:  # a group sorted apart: every one is sparse
        grads = [insides.stored_values(g) for g in grads]
    dtype = torch.float32 if grads[0].dtype in _HALF else None
    try:
        norms = insides.foreach_norm(grads, dtype)
    except RuntimeError:  # NotImplementedError too: a sparse gradient among dense ones?
        values = [insides.stored_values(g) for g in grads]
        if all(v is g for v, g in zip(values, grads, strict=True)):
            raise  # all strided: the failure is not the layout's
        norms = insides.foreach_norm(values, dtype)
    return torch.stack(norms).to(torch.float32)


def grouped_norms(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Per-tensor L2 norms of ``tensors``, one fused kernel per (device, dtype) group.

    Returns ``(indices, norms)`` per group: ``norms[j]`` is the norm of ``tensors[indices[j]]``,
    so a caller can name the tensor behind a non-finite norm (only after a detection).
    DTensors are grouped by their local tensors' device and dtype; sparse tensors with the
    dense ones of their dtype (:func:`grad_norms` reads them through their stored values).
    """
    tensors = [local(t) for t in tensors]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return [(idx, grad_norms([tensors[i] for i in idx])) for idx in groups.values()]


def moved(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
          ) -> torch.Tensor:
    """``t`` on ``device`` (and in ``dtype``): itself when it is there already, else a copy
    that does not block the host towards an accelerator. The one way the sentinel moves its
    small tensors (norms, flags, hashes) between devices."""
    if t.device == device and (dtype is None or t.dtype == dtype):
        return t
    return t.to(device, dtype=dtype, non_blocking=device.type != "cpu")
