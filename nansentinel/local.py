"""One rank's health for the step in progress, kept on the device until the decision.

The training loop's checks add to it (several times under gradient accumulation: flags are
OR-ed, losses averaged); the last gradient bucket, or ``step()``, packs it into the row that
the exchange sums across ranks. Nothing here synchronises with the host, except
:meth:`LocalHealth.nonfinite_parameters`, which runs only after a detection.
"""

from __future__ import annotations

from typing import Any

import torch

from nansentinel import checks
from nansentinel.exchange import pack_row


class LocalHealth:
    """Flags, loss and per-parameter gradient norms of this rank for one step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.batch_flag: torch.Tensor | None = None
        self.loss_flag: torch.Tensor | None = None
        self.loss_sum: torch.Tensor | None = None
        self.loss_count = 0
        self.batch: Any = None
        """The last batch checked (kept by reference, for the report and the replay)."""
        self.grad_norms: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        """(parameters, their gradient norms) per bucket or dtype group."""
        self.injected = False
        self.quarantined = False

    def add_batch(self, batch: Any, flag: torch.Tensor) -> None:
        self.batch_flag = flag if self.batch_flag is None else torch.maximum(self.batch_flag, flag)
        self.batch = batch

    def add_loss(self, flag: torch.Tensor, value: torch.Tensor) -> None:
        flag, value = flag.to(self.device), value.to(self.device)
        if self.loss_flag is None or self.loss_sum is None:
            self.loss_flag, self.loss_sum = flag, value
        else:
            self.loss_flag = torch.maximum(self.loss_flag, flag)
            self.loss_sum = self.loss_sum + value
        self.loss_count += 1

    def add_grads(self, params: list[torch.Tensor], norms: torch.Tensor) -> None:
        self.grad_norms.append((params, norms))

    def row(self) -> torch.Tensor:
        """The health row for the exchange (see ``exchange.pack_row``)."""
        zero = torch.zeros((), dtype=torch.int32, device=self.device)
        norms = [n.to(self.device) for _, n in self.grad_norms]
        all_norms = torch.cat(norms) if norms else None
        return pack_row(
            batch=self.batch_flag if self.batch_flag is not None else zero,
            loss=self.loss_flag if self.loss_flag is not None else zero,
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
