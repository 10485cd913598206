"""The failure diagnosis at the rendezvous store: the live ranks name the missing ones with
O(world) store requests in all, never O(world) per rank (which is O(world^2) on one store)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nansentinel.result import RankIdentity
from nansentinel.wire import exchange

WORLD = 96


class CountingStore:
    """A thread-safe in-memory store that counts the requests (and keys) it is asked."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.requests = 0
        self.keys = 0
        self._lock = threading.Lock()

    def _count(self, keys: int = 1) -> None:
        with self._lock:
            self.requests += 1
            self.keys += keys

    def set(self, key: str, value: str) -> None:
        self._count()
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        self._count()
        return self.store.get(key)

    def add(self, key: str, n: int) -> int:
        self._count()
        return self.store.add(key, n)

    def check(self, keys: list[str]) -> bool:
        self._count(len(keys))
        return self.store.check(keys)

    def wait(self, keys: list[str], timeout: Any) -> None:
        self._count(len(keys))
        self.store.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        self._count()
        return self.store.delete_key(key)


def _rank(r: int) -> exchange.HealthExchange:
    ex = exchange.HealthExchange(None, torch.device("cpu"), timeout=1.0)
    ex.rank, ex.world_size = r, WORLD
    ex.identity = RankIdentity(r, r % 8, WORLD, f"node{r // 8}", "cpu")
    return ex


@pytest.mark.timeout(60)
def test_live_ranks_name_the_missing_ones_with_linear_store_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = CountingStore()
    monkeypatch.setattr(exchange, "_default_store", lambda: store)
    monkeypatch.setattr(exchange, "diagnosis_grace", lambda timeout: 0.5)
    ranks = [_rank(r) for r in range(WORLD)]
    missing = {13, 70}
    for r in ranks:  # every rank left its identity at start (one write each)
        if r.rank != 13:  # rank 13 died before it could
            r.publish(RankIdentity(r.rank, 0, WORLD, f"node{r.rank // 8}", "cpu"))
    store.requests = store.keys = 0
    errors: dict[int, Any] = {}

    def diagnose(ex: exchange.HealthExchange) -> None:
        errors[ex.rank] = ex.diagnose(5, RuntimeError("Connection reset by peer"))

    threads = [threading.Thread(target=diagnose, args=(r,)) for r in ranks
               if r.rank not in missing]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(errors) == WORLD - len(missing)
    for rank, err in errors.items():
        assert err.missing == [13, 70], (rank, err)
        assert "no answer from rank 13, rank 70 (node8)" in str(err), str(err)
        assert f"on rank {rank} on host node{rank // 8}" in str(err)
    # Each live rank: a few requests; the one that looked: a chunk, then its keys one by one.
    assert store.requests <= 8 * WORLD, store.requests
    assert store.keys <= 12 * WORLD, store.keys


@pytest.mark.timeout(30)
def test_when_every_rank_checks_in_the_last_one_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    store = CountingStore()
    monkeypatch.setattr(exchange, "_default_store", lambda: store)
    monkeypatch.setattr(exchange, "diagnosis_grace", lambda timeout: 5.0)
    ranks = [_rank(r) for r in range(WORLD)]
    for r in ranks[1:]:  # the others are alive in step 9, blocked behind a slow peer
        r.check_in(9)
        r.check_in(9)  # said once per step, whoever asks again
    err = ranks[0].diagnose(9, None)
    assert err.missing == [] and "every rank checked in" in str(err)
    assert store.requests <= 4 * WORLD
