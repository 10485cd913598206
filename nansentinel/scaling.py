"""The caller's GradScaler after a step the sentinel skipped.

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
