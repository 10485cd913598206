"""Pure checks: nested batches, loss, gradient norms; flags stay tensors."""

from __future__ import annotations

import math

import pytest
import torch

from nansentinel import checks

CPU = torch.device("cpu")


def test_batch_ignores_non_float_parts_and_finds_nested_nan() -> None:
    batch = {"ids": torch.arange(4), "mask": torch.ones(4, dtype=torch.bool), "name": "x",
             "none": None, "n": 3, "nested": [(torch.ones(3), {"deep": torch.zeros(2, 2)})]}
    flag, count = checks.batch_flag(batch, CPU)
    assert flag.dtype == torch.int32 and int(flag) == 0 and count == 2
    batch["nested"][0][1]["deep"][1, 1] = -math.inf
    assert int(checks.batch_flag(batch, CPU)[0]) == 1


def test_empty_and_tensorless_batches_are_harmless() -> None:
    for batch in ({}, [], None, "text", {"ids": torch.arange(3)}):
        flag, count = checks.batch_flag(batch, CPU)
        assert int(flag) == 0 and count == 0


def test_half_precision_batch_does_not_overflow_into_a_false_alarm() -> None:
    big = torch.full((4096,), 60000.0, dtype=torch.float16)  # sum of squares >> fp16 max
    assert int(checks.batch_flag(big, CPU)[0]) == 0
    big[7] = math.nan
    assert int(checks.batch_flag(big, CPU)[0]) == 1


def test_loss_scalar_and_per_sample() -> None:
    flag, value = checks.loss_value(torch.tensor(2.5))
    assert int(flag) == 0 and float(value) == 2.5
    flag, value = checks.loss_value(torch.tensor([1.0, 3.0]))
    assert int(flag) == 0 and float(value) == 2.0
    flag, _ = checks.loss_value(torch.tensor([1.0, math.inf]))
    assert int(flag) == 1


def test_grad_norms_per_tensor_and_grouping_by_dtype() -> None:
    grads = [torch.ones(4), torch.full((2,), 2.0), torch.zeros(3)]
    norms = checks.grad_norms(grads)
    assert norms.dtype == torch.float32
    assert norms.tolist() == pytest.approx([2.0, math.sqrt(8), 0.0])
    grads[1][0] = math.nan
    norms = checks.grad_norms(grads)
    assert math.isnan(norms[1]) and int(checks.nonfinite_flag(norms)) == 1
    assert math.isnan(float(checks.total_norm([norms])))
    half = [torch.full((4096,), 60000.0, dtype=torch.float16)]  # fp32 accumulation: no overflow
    assert math.isfinite(float(checks.grad_norms(half)[0]))
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2).half()),
              torch.nn.Parameter(torch.zeros(3))]
    for p in params:
        p.grad = torch.ones_like(p)
    groups = checks.by_device_and_dtype(params)
    assert [[id(p) for p in g] for g in groups] == [[id(params[0]), id(params[2])],
                                                    [id(params[1])]]


def test_total_norm_matches_torch() -> None:
    grads = [torch.randn(100), torch.randn(7, 3)]
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    assert float(checks.total_norm([checks.grad_norms(grads)])) == pytest.approx(float(expected))
