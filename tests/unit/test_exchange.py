"""The health row and the cluster view, with no process group: the same code as N ranks."""

from __future__ import annotations

import math

import torch

from nansentinel.exchange import HealthExchange
from nansentinel.local import LocalHealth
from nansentinel.result import RankIdentity
from nansentinel.view import FIELDS, pack_row, unpack_view

CPU = torch.device("cpu")


def ident(rank: int, host: str = "h") -> RankIdentity:
    return RankIdentity(rank, rank, 2, host, "cpu")


def test_row_flags_each_kind_from_its_value() -> None:
    t = torch.tensor
    host = t([1.0, 1.0, 1.0, 0.0])
    row = pack_row(t(3.0), t(math.nan), t(-math.inf), host)
    assert row.shape == (FIELDS,) and row.dtype == torch.float32
    view = unpack_view(4, row.tolist() + pack_row(t(1.0), t(2.0), t(0.5), host).tolist(),
                       [ident(0), ident(1, "g")])
    bad, good = view.ranks
    assert bad.kinds == ("loss", "grad") and bad.injected and math.isnan(bad.loss or 0)
    assert good.healthy and good.loss == 2.0 and good.grad_norm == 0.5
    assert view.step == 4 and view.hosts == ["g", "h"] and [r.rank for r in view.bad()] == [0]


def test_local_health_accumulates_micro_batches_and_packs_without_a_group() -> None:
    local = LocalHealth(CPU)
    local.add_batch({"x": torch.ones(2)}, [torch.tensor(1.0)])
    local.add_batch({"x": torch.ones(2)}, [torch.tensor(math.nan)])  # second micro-batch
    local.add_loss(torch.tensor(1.0))
    local.add_loss(torch.tensor(3.0))
    local.add_grads(torch.tensor(3.0))  # two buckets
    local.add_grads(torch.tensor(4.0))
    exchange = HealthExchange(None, CPU, timeout=5)
    assert exchange.world_size == 1 and not exchange.launched
    exchange.launch(0, local.row())
    assert exchange.launched and exchange.settled()
    (mine,) = exchange.wait([ident(0)]).ranks
    assert mine.kinds == ("batch",) and mine.loss == 2.0 and mine.grad_norm == 5.0


def test_a_rank_without_loss_or_grads_reports_none() -> None:
    exchange = HealthExchange(None, CPU, timeout=5)
    exchange.launch(0, LocalHealth(CPU).row())
    (mine,) = exchange.wait([ident(0)]).ranks
    assert mine.healthy and mine.loss is None and mine.grad_norm is None


def test_plain_keeps_data_and_names_what_it_drops() -> None:
    import collections

    from nansentinel.collectives import plain

    point = collections.namedtuple("point", "x y")

    class Meta:
        pass

    batch = {"x": torch.ones(2), "n": [1, 2.5, None, "s", b"b", True], "m": Meta(),
             "t": (torch.zeros(1), Meta()), "p": point(1, 2), 3: "int key", (1, 2): "tuple key"}
    out, dropped = plain(batch)
    assert isinstance(out, dict) and set(out) == {"x", "n", "t", "p", 3}
    assert out["n"] == [1, 2.5, None, "s", b"b", True] and out["t"][1] is None
    assert out["p"] == (1, 2) and type(out["p"]) is tuple
    assert any(d.startswith("batch['m'] (") and "Meta" in d for d in dropped)
    assert any(d.startswith("batch['t'][1]") for d in dropped)
    assert any("point type" in d for d in dropped)
    assert any("key of type tuple" in d for d in dropped)
    assert plain(Meta()) == (None, [f"batch ({Meta.__module__}.{Meta.__qualname__})"])
    assert plain({"x": torch.ones(1)})[1] == []
