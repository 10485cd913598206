"""Pure checks: nested batches, loss, gradient norms; everything stays a tensor."""

from __future__ import annotations

import math

import pytest
import torch

from nansentinel import checks

CPU = torch.device("cpu")


def finite(norms: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(n)) for n in norms)


def test_batch_ignores_non_float_parts_and_finds_nested_nan() -> None:
    batch = {"ids": torch.arange(4), "mask": torch.ones(4, dtype=torch.bool), "name": "x",
             "none": None, "n": 3, "nested": [(torch.ones(3), {"deep": torch.zeros(2, 2)})]}
    norms = checks.batch_norms(batch, CPU)
    assert len(norms) == 2 and finite(norms) and all(n.dtype == torch.float32 for n in norms)
    batch["nested"][0][1]["deep"][1, 1] = -math.inf
    assert not finite(checks.batch_norms(batch, CPU))
    assert [t.shape for t in checks.tensors(batch)] == [(4,), (4,), (3,), (2, 2)]


def test_empty_and_tensorless_batches_are_harmless() -> None:
    for batch in ({}, [], None, "text", {"ids": torch.arange(3)}):
        assert checks.batch_norms(batch, CPU) == []


def test_half_precision_batch_does_not_overflow_into_a_false_alarm() -> None:
    big = torch.full((4096,), 60000.0, dtype=torch.float16)  # sum of squares >> fp16 max
    assert finite(checks.batch_norms(big, CPU))
    big[7] = math.nan
    assert not finite(checks.batch_norms(big, CPU))
    assert finite(checks.batch_norms(torch.ones(3, dtype=torch.float64), CPU))


def test_loss_scalar_and_per_sample() -> None:
    assert float(checks.loss_scalar(torch.tensor(2.5))) == 2.5
    assert float(checks.loss_scalar(torch.tensor([1.0, 3.0]))) == 2.0
    assert math.isinf(float(checks.loss_scalar(torch.tensor([1.0, math.inf]))))
    assert math.isnan(float(checks.loss_scalar(torch.tensor([math.inf, -math.inf]))))
    with pytest.raises(TypeError, match="complex"):
        checks.loss_scalar(torch.ones(2, dtype=torch.complex64))


def test_grad_norms_per_tensor_and_grouping_by_dtype() -> None:
    grads = [torch.ones(4), torch.full((2,), 2.0), torch.zeros(3)]
    norms = checks.grad_norms(grads)
    assert norms.dtype == torch.float32
    assert norms.tolist() == pytest.approx([2.0, math.sqrt(8), 0.0])
    grads[1][0] = math.nan
    assert math.isnan(checks.grad_norms(grads)[1])
    half = [torch.full((4096,), 60000.0, dtype=torch.float16)]  # fp32 accumulation: no overflow
    assert math.isfinite(float(checks.grad_norms(half)[0]))
    mixed = [torch.ones(2), torch.ones(2).half(), torch.full((3,), math.nan)]
    groups = checks.grouped_norms(mixed)
    assert [idx for idx, _ in groups] == [[0, 2], [1]]
    assert groups[0][1][0].item() == pytest.approx(math.sqrt(2))
    assert math.isnan(groups[0][1][1].item())
