"""Pure checks: nested batches, loss, gradient norms; everything stays a tensor."""

from __future__ import annotations

import math

import pytest
import torch

from nansentinel import checks
from nansentinel.common import torch_insides as insides

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


def _every_layout() -> dict[str, torch.Tensor]:
    """One gradient of each layout a model can hold, all with the values 3, 4 (norm 5) where
    they store two; the sparse ones' shapes are far too large to densify (2**40 columns)."""
    big = 2 ** 40
    dense = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    return {
        "contiguous": dense.clone(),
        "transposed": dense.clone().t(),  # a non-contiguous stride
        "channels_last": torch.tensor([3.0, 4.0]).reshape(1, 2, 1, 1).contiguous(
            memory_format=torch.channels_last).expand(1, 2, 1, 1),
        "complex": torch.tensor([3.0 + 4.0j]),
        "half": torch.tensor([3.0, 4.0], dtype=torch.float16),
        "coo": torch.sparse_coo_tensor([[0, 1], [5, big - 1]], [3.0, 4.0], (2, big)).coalesce(),
        "csr": torch.sparse_csr_tensor([0, 1, 2], [5, big - 1], [3.0, 4.0], (2, big)),
        "csc": torch.sparse_csc_tensor([0, 1, 2], [0, 1], [3.0, 4.0], (2, 2)),
        "bsr": torch.sparse_bsr_tensor([0, 1], [0], [[[3.0], [4.0]]], (2, 1)),
        "bsc": torch.sparse_bsc_tensor([0, 1], [0], [[[3.0, 4.0]]], (1, 2)),
        "coo half": torch.sparse_coo_tensor([[0, 1]], torch.tensor([3.0, 4.0]).half(), (big,)),
    }


def test_every_layout_is_normed_through_its_values_without_densifying() -> None:
    """Strided (contiguous, transposed, channels_last, complex, half) and sparse (COO, CSR,
    CSC, BSR, BSC) gradients: 5.0 each, alone, in a sorted-apart group and mixed with dense
    ones of their dtype (the fused call's fallback); a NaN or Inf in the stored values is seen
    by each. The sparse shapes hold 2**41 elements: a densified one could not be allocated."""
    every = _every_layout()
    for name, t in every.items():
        assert float(checks.tensor_norm(t)) == pytest.approx(5.0), name
        assert checks.grad_norms([t, t]).tolist() == pytest.approx([5.0, 5.0]), name
        assert checks.batch_norms({"x": t}, CPU)[0].item() == pytest.approx(5.0), name
    sparse = [t for n, t in every.items() if t.layout != torch.strided and t.dtype == torch.float32]
    mixed = [torch.ones(4), *sparse, torch.zeros(2)]  # one dtype: one group, dense first
    (idx, norms), = checks.grouped_norms(mixed)
    assert idx == list(range(len(mixed)))
    assert norms.tolist() == pytest.approx([2.0] + [5.0] * len(sparse) + [0.0])
    for name, t in every.items():
        for bad in (math.nan, math.inf):
            poisoned = t.clone()
            values = insides.stored_values(poisoned)
            values[(-1,) * values.dim()] = bad
            assert not math.isfinite(checks.tensor_norm(poisoned)), (name, bad)
            assert not math.isfinite(checks.grad_norms([t, poisoned])[1]), (name, bad)
            if t.layout != torch.strided and t.dtype == torch.float32:
                assert not math.isfinite(checks.grad_norms([torch.ones(2), poisoned])[1])


def test_an_uncoalesced_gradient_reads_its_entries_a_bound_on_its_norm() -> None:
    """An embedding's sparse gradient holds an entry per occurrence of a token: the norm read
    is of the entries (sqrt(1 + 1 + 4) here), the tensor's is of their sums (sqrt(4 + 4)),
    at most sqrt(m) times the former with m = 2 repeats; a NaN entry is seen either way."""
    grad = torch.sparse_coo_tensor([[1, 1, 3]], [1.0, 1.0, 2.0], (2 ** 40,))
    assert not grad.is_coalesced()
    read = float(checks.tensor_norm(grad))
    assert read == pytest.approx(math.sqrt(6))
    assert float(checks.tensor_norm(grad.coalesce())) == pytest.approx(math.sqrt(8))
    assert math.sqrt(8) <= math.sqrt(2) * read
    insides.stored_values(grad)[0] = math.nan
    assert math.isnan(float(checks.tensor_norm(grad)))
    assert math.isnan(float(checks.tensor_norm(grad.coalesce())))


def test_a_layout_the_checks_cannot_read_is_refused_and_a_sparse_loss_is_no_loss() -> None:
    with pytest.raises(checks.ArgumentTypeError, match=r"layout torch\.sparse_coo"):
        checks.as_loss(torch.tensor([1.0]).to_sparse(), CPU, "rank 0, step 1")
