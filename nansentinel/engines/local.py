"""The local gradient path: the ``.grad`` tensors of this rank, checked where they lie.

For a model in one process, and for users who reduce gradients by hand: they call
``check_grads()`` after backward and *before* their own all-reduce (``step()`` calls it when
nothing else did). One fused norm per (device, dtype) group of gradients.

DTensor gradients (FSDP2 on a world of one, tensor-parallel parameters when the user reduces by
hand) are checked through their local tensor: what this rank computed before any reduction,
which is where blame belongs. A ``Partial`` gradient's local tensor is this rank's addend, a
``Shard``'s its slice, a ``Replicate``'s the whole. So the gradient norm this rank reports
(``StepResult.local_grad_norm``) is the norm of its own local gradients, not of the model's
full gradient: under tensor parallel the full norm of a group is the root of the sum of its
peers' squares for sharded parameters, and a replicated parameter counts once on every peer.
Computing the full norm would take a collective on every step, and blame needs none.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any, cast

import torch

from nansentinel import checks
from nansentinel.engines.base import (
    EXCHANGE,
    PIPELINE_REPLICAS,
    Capabilities,
    GradientSink,
    KeptNorms,
)
from nansentinel.engines.reduced_first import ReducedFirst, watches


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad`` as a plain tensor: a DTensor gradient's local tensor, else the gradient."""
    grad = p.grad
    return None if grad is None else checks.local(grad)


def check_local_grads(params: Iterable[torch.Tensor], sink: GradientSink,
                      kept: KeptNorms | None = None,
                      names: dict[int, str] | None = None) -> None:
    """Fire a due grad drill into the first local gradient, then record one norm per
    (device, dtype) group of the local gradients; their per-parameter norms go to ``kept``
    too, by the names in ``names`` (parameter id -> name), where given."""
    pairs = [(p, g) for p in params if (g := local_grad(p)) is not None]
    if pairs:
        sink.before_reduction(pairs[0][1])
    for idx, norms in checks.grouped_norms([g for _, g in pairs]):
        sink.add_grad_norm(torch.linalg.vector_norm(norms))
        if kept is not None and names is not None:
            kept.add([names.get(id(pairs[i][0]), "<unnamed>") for i in idx], norms)


def scan_parameters(named: Iterable[tuple[str, torch.Tensor]], prefix: str = "") -> list[str]:
    """Names of the parameters whose local gradient holds a non-finite value: one fused norm
    per (device, dtype) group and one host copy — paid only after a detection."""
    pairs = [(n.removeprefix(prefix), g) for n, p in named if (g := local_grad(p)) is not None]
    names = []
    for idx, norms in checks.grouped_norms([g for _, g in pairs]):
        for j in (~torch.isfinite(norms)).nonzero().flatten().tolist():
            names.append(pairs[idx[j]][0])
    return names


def naming_detail(named: Iterable[tuple[str, torch.Tensor]], poisoned: bool,
                  prefix: str = "", kept: KeptNorms | None = None) -> dict[str, Any]:
    """A poisoned rank's parameters with non-finite local gradients, for the incident's
    gather; nothing on a healthy rank. From ``kept``, the norms kept before the reduction
    (the device gate: the gradients may be gone by the decision), in ``named``'s order, else
    by a scan of the gradients (before they are discarded)."""
    if not poisoned:
        return {}
    if kept is not None:
        names = kept.poisoned({n.removeprefix(prefix): i for i, (n, _) in enumerate(named)})
    else:
        names = scan_parameters(named, prefix)
    return {"parameters": names} if names else {}


def check_grads_now(model: torch.nn.Module, sink: GradientSink, *, keep: bool
                    ) -> KeptNorms | None:
    """Check ``model``'s local gradients as they are (no reduction ran), timed into
    ``sink``; with ``keep``, their per-parameter norms are returned for the device gate."""
    started = time.perf_counter()
    kept = KeptNorms() if keep else None
    if kept is not None:
        check_local_grads(model.parameters(), sink, kept,
                          {id(p): n for n, p in model.named_parameters()})
    else:
        check_local_grads(model.parameters(), sink)
    sink.spent(time.perf_counter() - started)
    return kept


class LocalGradPath:
    """Checks the parameters' local ``.grad`` tensors on demand."""

    CAPS = Capabilities(label="local gradients", reduces=False, replica_group=EXCHANGE,
                        order_watched=True, loss_first=True)
    mesh_groups: tuple[Any, ...] = ()

    @staticmethod
    def recognizes(model: Any) -> bool:
        return True  # anything the other paths did not take

    def __init__(self, model: torch.nn.Module, sink: GradientSink) -> None:
        self.model = model
        self.sink = sink
        caps = self.CAPS
        if sink.world_size > 1:
            caps = dataclasses.replace(caps, drop=(
                "the gradients are reduced by hand (check_grads() before your own "
                "all-reduce), and nansentinel cannot replace this rank's contribution in a "
                "reduction it does not run; use DDP or FSDP2"))
        if any(hasattr(p, "device_mesh") for p in model.parameters()):
            caps = dataclasses.replace(caps, fingerprints=PIPELINE_REPLICAS)
        self.caps = caps
        self.keep_norms = False
        self._kept: KeptNorms | None = None
        #: Below torch 2.14, the first step of a job of several ranks is watched for a
        #: reduction before the check (reduced_first.py); None: not watched.
        self._first = ReducedFirst(model) if watches(model, sink.world_size) else None

    def check_now(self) -> None:
        first, self._first = self._first, None
        if first is not None and not self.caps.pipelined:  # stages send between checks
            first.check(self.sink.step_index)
        self._kept = check_grads_now(self.model, self.sink, keep=self.keep_norms)

    def take_norms(self) -> KeptNorms | None:
        kept, self._kept = self._kept, None
        return kept

    def naming_detail(self, poisoned: bool, peers: Any,
                      kept: KeptNorms | None = None) -> dict[str, Any]:
        return naming_detail(self.model.named_parameters(), poisoned, kept=kept)

    def reset(self) -> None:
        self._kept = None


class BucketNorms:
    """One step's bucket norms of a wrapper whose communication hook sees DDP's buckets (DDP,
    torchft's DDP): the one place both paths take a bucket's norm, keep its per-parameter
    norms for the device gate, and name the poisoned parameters after a detection."""

    def __init__(self, wrapper: torch.nn.Module) -> None:
        self.wrapper = wrapper
        #: Parameter id -> its name in the wrapped module.
        self.names = {id(p): n for n, p in cast(torch.nn.Module, wrapper.module).named_parameters()}
        #: This step's per-parameter norms, where the device gate keeps them.
        self.kept: KeptNorms | None = None

    def norm(self, bucket: Any, keep: bool) -> torch.Tensor:
        """One L2 norm of the bucket's local gradients (fp32 accumulation, NaN and Inf
        propagate): of the flat buffer (one read, one kernel), or, with ``keep``, of the
        per-parameter norms taken in one fused multi-tensor pass over the same bytes. A sparse
        gradient's bucket is that gradient alone, as its buffer (DDP lists no ``gradients()``
        for it): normed through its stored values."""
        if not keep:
            return checks.tensor_norm(bucket.buffer())
        grads = bucket.gradients()
        norms = checks.grad_norms(grads) if grads else checks.tensor_norm(bucket.buffer())[None]
        if self.kept is None:
            self.kept = KeptNorms()
        self.kept.add([self.names.get(id(p), "<unnamed>") for p in bucket.parameters()], norms)
        return torch.linalg.vector_norm(norms)

    def take(self) -> KeptNorms | None:
        """This step's kept norms (None: not kept), forgotten here."""
        kept, self.kept = self.kept, None
        return kept

    def naming_detail(self, poisoned: bool, kept: KeptNorms | None) -> dict[str, Any]:
        """From the norms kept before the reduction (the device gate), or by a scan of the
        gradients: after the all-reduce a NaN sits wherever any rank had one, so this rank's
        scan shows its own (and, with several poisoned ranks, theirs too)."""
        return naming_detail(self.wrapper.named_parameters(), poisoned, prefix="module.",
                             kept=kept)


class BucketPath:
    """The calls a gradient path whose communication hook sees DDP's buckets (DDP, torchft's
    DDP) answers alike, from its :class:`BucketNorms` (``_norms``) and the step's bucket count
    (``buckets``): written once for both."""

    _norms: BucketNorms
    buckets: int

    def take_norms(self) -> KeptNorms | None:
        return self._norms.take()

    def naming_detail(self, poisoned: bool, peers: Any,
                      kept: KeptNorms | None = None) -> dict[str, Any]:
        return self._norms.naming_detail(poisoned, kept)

    def reset(self) -> None:
        self.buckets = 0
        self._norms.kept = None
