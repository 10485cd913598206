"""Rank functions for the batch transfer tests (importable by spawned ranks)."""

from __future__ import annotations

import collections
import io
import os
from pathlib import Path
from typing import Any

import torch

from nansentinel.wire.collectives import Peers

Pair = collections.namedtuple("Pair", "a b")


class Evil:
    """Pickles to a call of os.system: what a hostile peer would send."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


class Meta:
    """A user's own class inside a batch: not plain data."""

    def __init__(self) -> None:
        self.note = "from rank 0"


def send_batch(rank: int, world: int) -> Any:
    peers = Peers(None, torch.device("cpu"))
    batch = {"x": torch.arange(4.0), "ids": [1, 2], "meta": Meta(), "pair": Pair(1, "b"),
             "name": "ok"}
    got = peers.send_object(batch if rank == 0 else None, 0, 1)
    return got if rank == 1 else None


def send_hostile(rank: int, world: int, *, marker: str) -> Any:
    peers = Peers(None, torch.device("cpu"))
    if rank == 0:
        buf = io.BytesIO()
        torch.save({"x": torch.ones(1), "evil": Evil(marker)}, buf)
        peers._move_bytes(buf.getvalue(), 0, 1)  # what a rank running hostile code could do
        return None
    got = peers.send_object(None, 0, 1)
    return {"got": got, "marker_exists": Path(marker).exists()}
