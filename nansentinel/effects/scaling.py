"""The GradScaler after a step the sentinel skipped.

Our own step (``Sentinel(..., scaler=)``, ``step()`` calling ``scaler.step`` and
``scaler.update``): a skipped or rolled-back step calls neither, but the loop may already have
called ``scaler.unscale_(optimizer)`` (PyTorch's AMP recipe with gradient clipping), and the
scaler then refuses the next step's ``unscale_`` ("has already been called on this optimizer
since the last update()"). :func:`settle` ends the scaler's step as ``update`` would, keeping
its scale and growth count as they were: a NaN the sentinel blamed on a rank is not an fp16
overflow, so the scale is not halved for it.

With ``step(optimizer_step=False)`` the framework steps the optimizer itself, through its
GradScaler (Lightning's ``16-mixed``, the Hugging Face Trainer's fp16). A skip sets every
gradient to ``None`` so that the framework's step changes nothing; but a GradScaler that has
not unscaled yet then finds no gradient to check, records no inf check, and raises in
``scaler.step`` ("No inf checks were recorded for this optimizer", non-fused optimizers) or in
``scaler.update`` ("No inf checks were recorded prior to update", fused ones, which skip the
unscale). :func:`record_skip` makes the scaler see the skip as what it is, an overflow: its
step is skipped and its scale backs off, on every rank alike (every rank skips together).
A scaler that had unscaled already (Lightning does so before clipping) keeps what it found
in the reduced gradients, which every rank shares.
"""

from __future__ import annotations

from typing import Any

import torch


def settle(scaler: Any) -> None:
    """End ``scaler``'s step after a skip: its per-optimizer records (``unscale_`` called, inf
    checks) are cleared, so the next step can unscale, and the scale and growth count stay as
    they were. A disabled scaler, or one that never scaled this run, is left alone.

    ``update(new_scale)`` does exactly that in torch 2.3 to 2.13: it sets the scale (to its
    own value here), leaves the growth tracker, and refreshes the per-optimizer states. The
    scale is read on the host (one sync, on a skipped step only).
    """
    if not hasattr(scaler, "unscale_") or not scaler.is_enabled():
        return  # not a GradScaler (DeepSpeed's loss scale settles itself), or off
    if getattr(scaler, "_scale", True) is None:  # nothing scaled yet: nothing to settle
        return
    scaler.update(float(scaler.get_scale()))


def record_skip(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Record one overflow in ``scaler`` for ``optimizer``, whose gradients were just set to
    None; return whether it was recorded (False: the scaler had unscaled already this step,
    or it is disabled, or the optimizer has no parameter).

    Uses only the scaler's public ``unscale_``: one parameter (the smallest) briefly holds an
    infinite gradient while the scaler unscales, so the scaler's own check finds the overflow
    on that parameter's device, as it would have in the poisoned gradients.
    """
    if not getattr(scaler, "is_enabled", lambda: True)():
        return False
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        return False
    probe = min(params, key=lambda p: p.numel())
    held = probe.grad
    probe.grad = torch.full_like(probe, float("inf"))
    try:
        scaler.unscale_(optimizer)
    except RuntimeError as exc:
        if "already been called" not in str(exc):
            raise
        return False
    finally:
        probe.grad = held
    return True
