"""One rank's health for the step in progress, kept on the device until the decision.

The training loop's checks add to it (several times under gradient accumulation: norms are
collected, losses averaged). The last gradient bucket, or ``step()``, packs it into the row
that the exchange sums across ranks, and only then are the flags taken, once per step.
Nothing here synchronises with the host, except :meth:`LocalHealth.nonfinite_parameters`,
which runs only after a detection.
"""

from __future__ import annotations

from typing import Any

import torch

from nansentinel import checks
from nansentinel.exchange import pack_row


class LocalHealth:
    """Batch norms, loss and per-parameter gradient norms of this rank for one step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.batch_norms: list[torch.Tensor] = []
        self.loss_sum: torch.Tensor | None = None
        self.loss_count = 0
        self.batch: Any = None
        """The last batch checked (kept by reference, for the report and the replay)."""
        self.grad_norms: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        """(parameters, their gradient norms) per bucket or dtype group."""
        self.injected = False
        self.quarantined = False

    def add_batch(self, batch: Any, norms: list[torch.Tensor]) -> None:
        self.batch_norms.extend(norms)
        self.batch = batch

    def add_loss(self, value: torch.Tensor) -> None:
        """Add a loss value (0-d); NaN and Inf propagate through the sum into the flag."""
        value = value.to(self.device)
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
        self.loss_count += 1

    def add_grads(self, params: list[torch.Tensor], norms: torch.Tensor) -> None:
        self.grad_norms.append((params, norms))

    def row(self) -> torch.Tensor:
        """The health row for the exchange (see ``exchange.pack_row``)."""
        zero = torch.zeros((), dtype=torch.int32, device=self.device)
        norms = [n.to(self.device) for _, n in self.grad_norms]
        all_norms = torch.cat(norms) if norms else None
        return pack_row(
            batch=checks.nonfinite_flag(torch.stack(self.batch_norms)) if self.batch_norms
            else zero,
            loss=checks.nonfinite_flag(self.loss_sum) if self.loss_sum is not None else zero,
            grad=checks.nonfinite_flag(all_norms) if all_norms is not None else zero,
            injected=self.injected,
            loss_value=(
                self.loss_sum / self.loss_count if self.loss_sum is not None
                else torch.zeros((), device=self.device)
            ),
            grad_norm=checks.total_norm([all_norms]) if all_norms is not None else zero,
            has_loss=self.loss_sum is not None,
            has_grad=all_norms is not None,
            quarantined=self.quarantined,
        )

    def nonfinite_parameters(self, names: dict[int, str]) -> list[str]:
        """Names of the parameters whose local gradient norm was non-finite: one host copy of
        norms computed anyway, and only after a detection."""
        found = []
        for params, norms in self.grad_norms:
            bad = (~torch.isfinite(norms)).nonzero().flatten().tolist()
            found.extend(names.get(id(params[i]), f"<unnamed {i}>") for i in bad)
        return found
