"""Fire-drill specs: parsing, errors naming the clause, and matching by rank, host and step."""

from __future__ import annotations

import math

import pytest
import torch

from nansentinel.common.inject import Injector, parse_inject


def test_parse_several_faults() -> None:
    faults = parse_inject(
        "kind=grad,rank=2,step=5,value=nan; kind=batch,host=node3,steps=5-9,value=-inf"
    )
    assert faults[0].kind == "grad" and faults[0].rank == 2
    assert faults[0].first == faults[0].last == 5
    assert faults[1].host == "node3" and (faults[1].first, faults[1].last) == (5, 9)
    assert faults[1].value == -math.inf and math.isnan(faults[0].value)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("kind=weights,rank=1,step=2", ["kind='weights'", "batch, loss, grad"]),
        ("kind=grad,rank=1", ["exactly one of step"]),
        ("kind=grad,rank=1,step=2,value=zero", ["value='zero'"]),
        ("kind=grad,rank=1,host=a,step=2", ["rank or host"]),
        ("kind=grad,step=9-3", ["step='9-3' is not an integer"]),
        ("kind=grad,steps=9", ["not A-B"]),
        ("kind=grad,steps=9-3", ["ends before it starts"]),
        ("kind=grad,step=2,colour=red", ["unknown key", "colour"]),
        ("kind=grad,step", ["not key=value"]),
        ("", ["no fault"]),
    ],
)
def test_bad_specs_name_the_problem(spec: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        parse_inject(spec)
    for word in words:
        assert word in str(info.value)


def test_injector_matches_rank_host_and_step_range() -> None:
    faults = parse_inject("kind=loss,host=b,steps=3-4,value=inf;kind=grad,step=1")
    on_b = Injector(faults, rank=5, host="b")
    on_a = Injector(faults, rank=0, host="a")
    assert on_b.value_for("loss", 3) == math.inf and on_b.value_for("loss", 5) is None
    assert on_a.value_for("loss", 3) is None
    assert math.isnan(on_a.value_for("grad", 1))  # no rank or host: every rank
    t = torch.ones(2, 2)
    assert on_b.poison("loss", 4, t) and t[0, 0] == math.inf and t[1, 1] == 1
    assert on_b.fired == [(4, "loss")]
    assert not on_b.poison("loss", 9, t)


def test_a_grad_drill_writes_into_a_sparse_gradients_stored_values() -> None:
    """DDP hands a sparse gradient as its own bucket: the drill goes into its first stored
    value (which the gradient itself holds); one that stores none has nothing to write."""
    drill = Injector(parse_inject("kind=grad,step=1"), rank=0, host="a")
    grad = torch.sparse_coo_tensor([[3, 3, 7]], [1.0, 2.0, 3.0], (2 ** 40,))
    assert drill.poison("grad", 1, grad)
    assert math.isnan(grad._values()[0]) and grad._values()[1:].tolist() == [2.0, 3.0]
    csr = torch.eye(3).to_sparse_csr()
    assert drill.poison("grad", 1, csr) and math.isnan(csr.values()[0])
    empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), [], (5,))
    assert not drill.poison("grad", 1, empty)
    assert drill.fired == [(1, "grad"), (1, "grad")]
