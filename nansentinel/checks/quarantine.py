"""The quarantine: batches with a ``data`` verdict, recognised by content if they come round.

A batch that made NaN on two hosts is the data's fault: no host earns a strike, and the same
batch seen again later (the next epoch, another rank) is skipped without blame. Recognising it
must not cost the normal step: a batch's *signature* is, per tensor, its dtype and shape (known
on the host) and four numbers computed on the device: the tensor's L2 norm (for floating
tensors: the very norm ``check_batch`` takes anyway, so a change anywhere in the tensor shows)
and ``sum, sum|x|, sum x^2`` in fp64 over a *sample* of at most ``SAMPLE`` elements, evenly
strided over the flattened tensor (for integer tensors such as token ids the sample is what
tells batches apart, together with the shape).

The bound, written down: once something is quarantined, matching a batch costs at most
``SAMPLE`` elements read per tensor (plus, for a non-contiguous tensor, one flattening copy),
whatever the batch's size, and a comparison against the entries with the same dtypes and
shapes; it reuses the norms the batch check computed. While nothing is quarantined, or no
entry has the batch's dtypes and shapes, nothing runs on the device; when one does, the sums
and the comparison run there and leave one 0-d flag that travels in the health row, with no
host sync. The quarantine holds at most ``size`` entries (the oldest goes first) and each
expires ``steps`` steps after its verdict, so it never grows into a per-step cost. It is saved
with the sentinel's state.

A sampled signature can take two batches that differ only outside the sample of an integer
tensor (and in no floating tensor) for the same batch: such a batch is then skipped without
blame, once, and counted; the norm of every floating tensor keeps that from happening to
batches whose float data differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

import torch

from nansentinel import checks
from nansentinel.common import report

log = logging.getLogger("nansentinel")


@dataclasses.dataclass(frozen=True, slots=True)
class Signature:
    """What identifies a batch's content: per tensor ``dtype`` and shape (``key``), and its
    norm and ``sum, sum|x|, sum x^2`` of a sample in fp64 (``stats``, ``PER_TENSOR`` per
    tensor; the norm of an integer tensor is 0)."""

    key: str
    stats: tuple[float, ...]

    @property
    def fingerprint(self) -> str:
        """A short hex digest, for reports and logs."""
        h = hashlib.sha1()
        parts = self.key.split("|") if self.key else []
        for i, part in enumerate(parts):
            h.update(f"{part}{list(self.stats[PER_TENSOR * i: PER_TENSOR * (i + 1)])}".encode())
        return h.hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        """JSON has no NaN or Inf: a non-finite number is written as a string (``"nan"``)."""
        return {"key": self.key, "stats": [report.json_float(x) for x in self.stats]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Signature:
        return cls(str(d["key"]), tuple(float(x) for x in d["stats"]))

    @property
    def current(self) -> bool:
        """Of this version's layout (older states kept three sums over every element)."""
        parts = len(self.key.split("|")) if self.key else 0
        return len(self.stats) == PER_TENSOR * parts


def signature_key(batch: Any) -> str:
    """The host part of a batch's signature: every tensor's dtype and shape (no device work)."""
    return "|".join(f"{t.dtype}{tuple(t.shape)}" for t in checks.tensors(batch))


#: Elements of each tensor that the sampled sums read, at most.
SAMPLE = 4096
#: Numbers per tensor in a signature: the norm, then three sums over the sample.
PER_TENSOR = 4


def sample(t: torch.Tensor, n: int = SAMPLE) -> torch.Tensor:
    """At most ``n`` elements of ``t``, evenly strided over its flattened elements (a view of
    a contiguous tensor: nothing is copied); the same elements for the same shape."""
    flat = t.reshape(-1)
    step = max(1, -(-flat.numel() // n))
    return flat[::step]


def signature_stats(
    batch: Any, device: torch.device, norms: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """The device part: per tensor its norm and ``sum, sum|x|, sum x^2`` of its sample, in
    fp64, one flat tensor on ``device`` (no host sync). ``norms``: the floating tensors' norms
    as ``checks.batch_norms`` took them (computed here when not given). A DTensor's numbers
    are its local tensor's (``checks.local``): plain tensors, and no collective."""
    floats = iter(norms if norms is not None else checks.batch_norms(batch, device))
    rows = []
    for t in checks.tensors(batch):
        d = checks.local(t).detach()
        norm = (checks.moved(next(floats), device)
                if d.is_floating_point() or d.is_complex() else None)
        if d.is_complex():
            d = torch.view_as_real(d)
        s = sample(d).double()
        sums = checks.moved(torch.stack([s.sum(), s.abs().sum(), s.pow(2).sum()]), device)
        head = norm.double().reshape(1) if norm is not None else torch.zeros(
            1, dtype=torch.float64, device=device)
        rows.append(torch.cat([head, sums]))
    if not rows:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat(rows)


def signature(batch: Any) -> Signature:
    """A batch's whole signature, on the host (a detection only: one host copy)."""
    stats = signature_stats(batch, torch.device("cpu"))
    return Signature(signature_key(batch), tuple(stats.tolist()))


@dataclasses.dataclass(slots=True)
class _Entry:
    signature: Signature
    expires: int  # the first step at which it is no longer recognised


class Quarantine:
    """Signatures of batches with a ``data`` verdict, bounded and expiring.

    Args:
        device: where a batch's sums are computed and compared.
        size: the most entries kept; adding one more drops the oldest.
        steps: how many steps after its verdict an entry is recognised.
    """

    def __init__(self, device: torch.device, *, size: int = 64, steps: int = 100_000) -> None:
        self.device = device
        self.size = size
        self.steps = steps
        self._entries: list[_Entry] = []
        # key -> [entries, 3 * tensors] on the device (None: no entry has that key)
        self._tables: dict[str, torch.Tensor | None] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Any:
        """The fingerprints, oldest first."""
        return iter([e.signature.fingerprint for e in self._entries])

    def add(self, sig: Signature, step: int) -> None:
        """Quarantine a batch from ``step`` on (again: its expiry moves on)."""
        self._entries = [e for e in self._entries if e.signature != sig]
        self._entries.append(_Entry(sig, step + self.steps))
        del self._entries[: max(0, len(self._entries) - self.size)]
        self._tables.clear()

    def expire(self, step: int) -> None:
        """Drop the entries that expired before ``step`` (a host comparison per entry)."""
        kept = [e for e in self._entries if e.expires > step]
        if len(kept) != len(self._entries):
            self._entries = kept
            self._tables.clear()

    def match(
        self, batch: Any, step: int, norms: list[torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """A 0-d fp32 flag on the device, 1 when ``batch`` is quarantined; None when no entry
        can match (nothing quarantined, or no entry with its dtypes and shapes): then nothing
        ran on the device. ``norms``: the batch check's norms of its floating tensors."""
        if not self._entries:
            return None
        self.expire(step)
        table = self._table(signature_key(batch))
        if table is None:
            return None
        stats = signature_stats(batch, self.device, norms)
        # NaN sums (a batch holding NaN) match NaN sums, as the fingerprint's text did.
        same = (table == stats) | (table.isnan() & stats.isnan())
        return same.all(dim=1).any().to(torch.float32)

    def _table(self, key: str) -> torch.Tensor | None:
        if key not in self._tables:
            rows = [e.signature.stats for e in self._entries if e.signature.key == key]
            self._tables[key] = (
                torch.tensor(rows, dtype=torch.float64).to(self.device) if rows else None
            )
        return self._tables[key]

    def state_dict(self) -> list[dict[str, Any]]:
        return [{**e.signature.to_json(), "expires": e.expires} for e in self._entries]

    def load_state_dict(self, state: list[Any], step: int) -> None:
        """Restore :meth:`state_dict`. Entries saved by older versions (bare fingerprints, or
        sums over every element) cannot be compared with this version's signatures and are
        dropped, with a warning naming how many."""
        self._entries, self._tables = [], {}
        legacy = 0
        for s in state:
            sig = Signature.from_json(s) if isinstance(s, dict) else None
            if sig is None or not sig.current:
                legacy += 1
                continue
            self._entries.append(_Entry(sig, int(s["expires"])))
        del self._entries[: max(0, len(self._entries) - self.size)]
        self.expire(step)
        if legacy:
            log.warning(
                "nansentinel: %d quarantined batch fingerprint(s) in the loaded state come from "
                "an older version and cannot be recognised on the device; they are dropped "
                "(the batches are skipped only if they make NaN again)", legacy,
            )
