"""Floating buffers put back after a step that was not applied.

Skipping the optimizer step keeps the weights as they were, but a forward updates more than
the weights: BatchNorm's running statistics, EMA buffers and any other floating buffer the
model writes in its forward already took the poisoned batch when the step is judged. Under DDP
rank 0's buffers are broadcast at the next forward, so one rank's NaN statistics reach every
rank, and the model in ``eval()`` then outputs NaN on all of them: "step skipped, weights
untouched" would not be true.

So the floating buffers are copied once per step, at the step's first forward (a forward
pre-hook on the unwrapped module: under DDP after its own buffer broadcast, so every replica
copies the same values), into copies allocated once; a step that is not applied puts them
back. On the device gate the decision comes later, so the copies go back on the device at the
gated optimizer step itself, by the same ``found_inf`` that skips it (``torch.where``: no host
sync), in one flat pass per dtype and device, whatever the number of buffers. Buffers are small
next to the weights (a BatchNorm keeps two per channel), so the copy costs one fused kernel a
step; a model without floating buffers pays nothing.

The buffers are the model's state, and a NaN can enter them without any batch, loss or
gradient showing it: a bit flip in a running statistic, which BatchNorm uses only in
``eval()``. So they are checked every step beside the gradients, with three max-abs norms
(:meth:`FloatingBuffers.norms`, NaN and Inf propagate through a max, no host sync): this rank's
own buffers as the step began (the copy), the buffers as the forward began, and as the step
left them. Under DDP's buffer broadcast (``broadcast_buffers=True``) the copy is taken before
it (a pre-hook on the DDP wrapper, ``source``), so that a NaN broadcast from the source rank
is told from one this rank made: the source's own copy is non-finite and it is the origin,
while the ranks it reached hold their own finite copies, which a skipped step puts back, and
which a repair of the source can come from (rare/state.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nansentinel.common import torch_insides as insides


class FloatingBuffers:
    """The floating buffers of ``module`` as they were before this step's first forward.

    The buffers are looked up by module and name at every copy, so a buffer the model
    reassigns (``module.to()``, a cache rebuilt) is followed, not a stale tensor.
    """

    def __init__(self, module: torch.nn.Module, source: torch.nn.Module | None = None,
                 constants: frozenset[str] = frozenset()) -> None:
        named = [(f"{prefix}.{name}" if prefix else name, mod, name)
                 for prefix, mod in module.named_modules() for name, b in mod._buffers.items()
                 if b is not None and b.is_floating_point()]
        self._where = [(mod, name) for _, mod, name in named]
        #: Buffers holding +-Inf by design (checks/state.py ``constant_buffers``: an additive
        #: attention mask): only a NaN in them counts; the others are read whole.
        self._constant = [i for i, (qualified, _, _) in enumerate(named)
                          if qualified in constants]
        self._saved: list[torch.Tensor] | None = None
        #: The copies as flat tensors, one per (dtype, device): the buffers' indices, the flat
        #: copy, and a flat staging area of the same size for :meth:`restore_where`, with its
        #: views shaped as the buffers.
        self._flats: list[tuple[list[int], torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []
        self._taken = False
        #: The max-abs of this rank's own buffers at the copy, and as the forward began (0-d
        #: fp32 on their device; None until this step's first forward).
        self._own: torch.Tensor | None = None
        self._arrived: torch.Tensor | None = None
        copied_on = source if source is not None and self._where else module
        self._handles = [copied_on.register_forward_pre_hook(self._before_forward)
                         ] if self._where else []
        if self._where and source is not None:  # after the broadcast, as the forward begins
            self._handles.append(module.register_forward_pre_hook(self._as_arrived))

    def __len__(self) -> int:
        return len(self._where)

    def _live(self) -> list[torch.Tensor]:
        return [mod._buffers[name] for mod, name in self._where]

    def _before_forward(self, *_: Any) -> None:
        if self._taken:
            return
        live = [b.detach() for b in self._live()]
        if self._saved is None or any(
            s.shape != b.shape or s.dtype != b.dtype or s.device != b.device
            for s, b in zip(self._saved, live, strict=True)
        ):
            self._allocate(live)
        assert self._saved is not None
        insides.foreach_copy_(self._saved, live)
        self._taken = True
        self._own = (_max_abs([flat for _, flat, _, _ in self._flats]) if not self._constant
                     else self._norm_of(self._saved))
        self._arrived = None

    def _as_arrived(self, *_: Any) -> None:
        """The buffers as the forward begins, after the broadcast (once a step)."""
        if self._taken and self._arrived is None:
            self._arrived = self._live_norm()

    def _live_norm(self) -> torch.Tensor:
        return self._norm_of(self._live())

    def _norm_of(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One max-abs over ``tensors`` (the buffers, live or copied), fused per dtype and
        device; a constant buffer's +-Inf counts for nothing, its NaN as NaN."""
        constant = set(self._constant)
        parts = [torch.stack(insides.foreach_max_abs(group))
                 for indices, _, _, _ in self._flats
                 if (group := [tensors[i] for i in indices if i not in constant])]
        for i in self._constant:
            t = tensors[i]
            parts.append(torch.where(t.isnan().any(), math.nan, 0.0).to(t.device).reshape(1))
        return _max_abs(parts)

    def norms(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The buffers' max-abs as the step leaves them, this rank's own as it began, and as
        its forward began (``own`` where nothing was broadcast), on the device; None when no
        forward ran this step (or the model has no floating buffer)."""
        if not self._taken or self._own is None:
            return None
        arrived = self._arrived if self._arrived is not None else self._own
        return self._live_norm(), self._own, arrived

    def _allocate(self, live: list[torch.Tensor]) -> None:
        """The copies as views of one flat tensor per dtype and device (so that a restore on
        the device is one pass over each), and a staging area beside each."""
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, b in enumerate(live):
            groups.setdefault((b.dtype, b.device), []).append(i)
        saved: list[torch.Tensor | None] = [None] * len(live)
        self._flats = []
        for (dtype, device), indices in groups.items():
            sizes = [live[i].numel() for i in indices]
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            for i, part in zip(indices, flat.split(sizes), strict=True):
                saved[i] = part.view(live[i].shape)
            staging = torch.empty_like(flat)
            views = [part.view(live[i].shape)
                     for i, part in zip(indices, staging.split(sizes), strict=True)]
            self._flats.append((indices, flat, staging, views))
        self._saved = [t for t in saved if t is not None]

    @property
    def copied(self) -> int:
        """How many buffers this step's copy holds (0 before the step's first forward)."""
        return len(self._where) if self._taken else 0

    def restore(self) -> int:
        """Put the buffers back as they were before the step; returns how many (0: nothing
        was copied this step, e.g. no forward ran)."""
        if not self._taken or self._saved is None:
            return 0
        with torch.no_grad():
            insides.foreach_copy_([b.detach() for b in self._live()], self._saved)
        return len(self._saved)

    def restore_where(self, found_inf: torch.Tensor) -> None:
        """On the device: put the buffers back where ``found_inf`` (0-d, 1 = the step is
        skipped) says so, else leave them; no host sync.

        Every step of the device gate runs this, healthy or not, so it is one flat pass per
        dtype and device, not a ``where`` and a ``copy_`` per buffer (212 launches a step for
        ResNet-50): the live buffers are gathered into the staging area (one fused foreach
        copy), selected against the flat copy by one ``where`` in place, and scattered back
        (one fused foreach copy). A kept buffer is copied out and back bit for bit."""
        if not self._taken or self._saved is None:
            return
        skip = found_inf > 0
        live = self._live()
        with torch.no_grad():
            for indices, flat, staging, views in self._flats:
                mine = [live[i] for i in indices]  # buffers: no autograd history to detach
                insides.foreach_copy_(views, mine)
                torch.where(skip.to(flat.device), flat, staging, out=staging)
                insides.foreach_copy_(mine, views)

    def reset(self) -> None:
        """The next forward starts a new step: copy again."""
        self._taken = False
        self._own = self._arrived = None

    def close(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()


def _max_abs(parts: list[torch.Tensor]) -> torch.Tensor:
    """One 0-d fp32 max-abs over ``parts`` (flat tensors or per-tensor norms, each on one
    device and dtype): finite exactly when every element is; no host sync."""
    maxima = [torch.linalg.vector_norm(p, math.inf).float() if p.numel()
              else p.new_zeros((), dtype=torch.float32) for p in parts]
    if len(maxima) == 1:
        return maxima[0]
    device = maxima[0].device
    return torch.stack([m.to(device, non_blocking=True) for m in maxima]).amax()
