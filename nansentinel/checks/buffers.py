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
sync). Buffers are small next to the weights (a BatchNorm keeps two per channel), so the copy
costs one fused kernel a step; a model without floating buffers pays nothing.
"""

from __future__ import annotations

from typing import Any

import torch


class FloatingBuffers:
    """The floating buffers of ``module`` as they were before this step's first forward.

    The buffers are looked up by module and name at every copy, so a buffer the model
    reassigns (``module.to()``, a cache rebuilt) is followed, not a stale tensor.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._where = [
            (mod, name) for mod in module.modules() for name, b in mod._buffers.items()
            if b is not None and b.is_floating_point()
        ]
        self._saved: list[torch.Tensor] | None = None
        self._taken = False
        self._handle = (module.register_forward_pre_hook(self._before_forward)
                        if self._where else None)

    def __len__(self) -> int:
        return len(self._where)

    def _live(self) -> list[torch.Tensor]:
        return [mod._buffers[name] for mod, name in self._where]  # type: ignore[misc]

    def _before_forward(self, *_: Any) -> None:
        if self._taken:
            return
        live = [b.detach() for b in self._live()]
        if self._saved is None or any(
            s.shape != b.shape or s.dtype != b.dtype or s.device != b.device
            for s, b in zip(self._saved, live, strict=True)
        ):
            self._saved = [b.clone() for b in live]
        else:
            torch._foreach_copy_(self._saved, live)
        self._taken = True

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
            torch._foreach_copy_([b.detach() for b in self._live()], self._saved)
        return len(self._saved)

    def restore_where(self, found_inf: torch.Tensor) -> None:
        """On the device: put the buffers back where ``found_inf`` (0-d, 1 = the step is
        skipped) says so, else leave them; no host sync."""
        if not self._taken or self._saved is None:
            return
        skip = found_inf > 0
        with torch.no_grad():
            for b, s in zip(self._live(), self._saved, strict=True):
                b.copy_(torch.where(skip.to(b.device), s, b))

    def reset(self) -> None:
        """The next forward starts a new step: copy again."""
        self._taken = False

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
