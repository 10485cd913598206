"""The health row and the cluster view: the data the exchange carries, without the wire.

Each rank packs its health into one row of ``FIELDS`` floats (:func:`pack_row`); the exchange
sums the rows of all ranks, each in its own slot, into one vector; :func:`unpack_view` turns
that vector, read on the host, into a :class:`ClusterView`, the same on every rank. The
decision (policy.py), the reports and the replay read only the view, so they import this pure
module and no collective.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from nansentinel.result import KINDS, RankIdentity

# Layout of one rank's row in the health vector.
# Three values whose finiteness is the check (batch norm, loss, gradient norm), then four
# host-known flags. No flag is computed on the device: a NaN or Inf survives the element-wise
# sum in its own slot (x + 0 = x), so the host reads finiteness after the one sync.
F_BATCH_NORM, F_LOSS_VALUE, F_GRAD_NORM, F_INJECTED, F_HAS_LOSS, F_HAS_GRAD, F_QUARANTINED = (
    range(7)
)
FIELDS = 7


@dataclasses.dataclass(frozen=True, slots=True)
class RankHealth:
    """One rank's part of the cluster view."""

    identity: RankIdentity
    kinds: tuple[str, ...]
    injected: bool
    loss: float | None
    grad_norm: float | None
    quarantined: bool = False

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def healthy(self) -> bool:
        return not self.kinds


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterView:
    """Every rank's health at one step; built from identical data on every rank."""

    step: int
    ranks: tuple[RankHealth, ...]

    def bad(self, kinds: tuple[str, ...] = KINDS) -> list[RankHealth]:
        """Ranks with a non-finite value of one of ``kinds``."""
        return [r for r in self.ranks if set(r.kinds) & set(kinds)]

    @property
    def hosts(self) -> list[str]:
        return sorted({r.identity.hostname for r in self.ranks})

    @property
    def injected(self) -> bool:
        return any(r.injected for r in self.ranks)

    @property
    def quarantined(self) -> bool:
        return any(r.quarantined for r in self.ranks)

    def values(self, signal: str) -> list[float | None]:
        """Every rank's ``loss`` or ``grad_norm`` (None where the rank had none)."""
        return [getattr(r, signal) for r in self.ranks]


def pack_row(
    batch_norm: torch.Tensor,
    loss_value: torch.Tensor,
    grad_norm: torch.Tensor,
    host_flags: torch.Tensor,
) -> torch.Tensor:
    """One rank's health row (layout ``F_*``) as an fp32 vector: two kernels.

    ``batch_norm``, ``loss_value`` and ``grad_norm`` are 0-d fp32 tensors on one device (zero
    when absent). ``host_flags`` holds ``injected, has_loss, has_grad, quarantined`` on the same
    device (the caller caches those few constant tensors, since a host-to-device copy per step
    would synchronise the stream).
    """
    return torch.cat([torch.stack([batch_norm, loss_value, grad_norm]), host_flags])


def unpack_view(step: int, values: list[float], identities: list[RankIdentity]) -> ClusterView:
    """Turn the summed vector (as host floats) into a :class:`ClusterView`."""
    ranks = []
    for r, ident in enumerate(identities):
        row = values[r * FIELDS : (r + 1) * FIELDS]
        checked = (F_BATCH_NORM, F_LOSS_VALUE, F_GRAD_NORM)
        kinds = tuple(
            k for k, f in zip(KINDS, checked, strict=True) if not math.isfinite(row[f])
        )
        ranks.append(
            RankHealth(
                identity=ident,
                kinds=kinds,
                injected=bool(row[F_INJECTED]),
                loss=row[F_LOSS_VALUE] if row[F_HAS_LOSS] else None,
                grad_norm=row[F_GRAD_NORM] if row[F_HAS_GRAD] else None,
                quarantined=bool(row[F_QUARANTINED]),
            )
        )
    return ClusterView(step, tuple(ranks))
