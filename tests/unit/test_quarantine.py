"""The quarantine: recognised on the device, bounded, expiring; nothing runs for a batch no
entry can match (issue 20, item 9)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nansentinel.checks.quarantine import Quarantine, signature

CPU = torch.device("cpu")


def _batch(seed: int, n: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 4, generator=g), "ids": torch.randint(0, 100, (n,), generator=g)}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_quarantined_batch_is_recognised_and_others_are_not() -> None:
    q = Quarantine(CPU)
    q.add(signature(_batch(1)), step=10)
    hit = q.match(_batch(1), step=11)
    assert hit is not None and hit.shape == () and hit.dtype == torch.float32 and hit == 1
    miss = q.match(_batch(2), step=11)
    assert miss is not None and miss == 0
    ids_changed = _batch(1)
    ids_changed["ids"][0] += 1  # one token id differs: another batch
    assert q.match(ids_changed, step=11) == 0


def test_nothing_runs_on_the_device_when_no_entry_can_match() -> None:
    q = Quarantine(CPU)
    same, other = _batch(1), _batch(1, n=16)
    with _Ops() as spy:
        assert q.match(same, step=0) is None  # empty
    assert spy.ops == []
    q.add(signature(same), step=0)
    with _Ops() as spy:
        assert q.match(other, step=1) is None  # other shapes: no entry can match
    assert spy.ops == []
    with _Ops() as spy:
        q.match(same, step=1)
    assert spy.ops and not any("item" in op or "_local_scalar" in op for op in spy.ops)


def test_entries_expire_and_the_oldest_goes_first() -> None:
    q = Quarantine(CPU, size=2, steps=5)
    for seed in (1, 2, 3):
        q.add(signature(_batch(seed)), step=seed)
    assert len(q) == 2 and q.match(_batch(1), step=4) == 0  # dropped: the oldest
    assert q.match(_batch(2), step=6) == 1  # expires at 2 + 5
    assert q.match(_batch(2), step=7) == 0 and len(q) == 1
    assert q.match(_batch(3), step=7) == 1
    q.add(signature(_batch(3)), step=7)  # seen again: its expiry moves on, no duplicate
    assert len(q) == 1 and q.match(_batch(3), step=11) == 1


def test_a_batch_holding_nan_matches_itself() -> None:
    b = _batch(1)
    b["x"][0, 0] = float("nan")
    q = Quarantine(CPU)
    q.add(signature(b), step=0)
    assert q.match(b, step=1) == 1


def test_state_round_trips_and_older_fingerprints_are_dropped_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    q = Quarantine(CPU, steps=50)
    q.add(signature(_batch(1)), step=3)
    state = q.state_dict()
    back = Quarantine(CPU, steps=50)
    back.load_state_dict(state, step=10)
    assert back.match(_batch(1), step=10) == 1 and list(back) == list(q)
    with caplog.at_level(logging.WARNING, logger="nansentinel"):
        back.load_state_dict(["0123456789abcdef", *state], step=60)  # and this one expired
    assert len(back) == 0 and "1 quarantined batch fingerprint(s)" in caplog.text
