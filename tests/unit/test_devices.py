"""The device rule, without a GPU: every tensor the sentinel makes follows the device of the
tensors it came from, and one that lives elsewhere is moved once (or left out) by rule.

torch's ``meta`` device stands in for the accelerator: like CUDA it refuses to be stacked or
concatenated with a CPU tensor (``FakeTensorMode``'s fake ``cuda`` on a CPU build lets a 0-d
CPU tensor into ``torch.stack``, so it would not catch the mixing these tests are about). The
checks are pure, so shapes, dtypes and devices are all they need.
"""

from __future__ import annotations

import math

import torch

from nansentinel import checks
from nansentinel.checks.health import LocalHealth
from nansentinel.checks.quarantine import signature_stats
from nansentinel.rare.replicas import comparand, fingerprint, replicated_state
from nansentinel.step.gate import GatedOptimizer
from nansentinel.wire.schema import SIZE, pack

ACC = torch.device("meta")  # the accelerator
CPU = torch.device("cpu")


def _trained_on_the_accelerator(**adam: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model on the accelerator after one step of AdamW with its defaults (not fused, not
    capturable), which keeps each parameter's ``step`` on the CPU."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).to(ACC)
    opt = torch.optim.AdamW(model.parameters(), **adam)  # type: ignore[arg-type]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


def test_fingerprints_of_the_default_adamw_on_an_accelerator_stay_there() -> None:
    model, opt = _trained_on_the_accelerator()
    state = replicated_state(model, opt)
    assert {t.device for _, t in state} == {ACC, CPU}  # the CPU step beside the moments
    # Without a device, the fingerprint follows the first tensor (a parameter).
    fp = fingerprint([t for _, t in state])
    assert fp.device == ACC and fp.shape == (len(state),) and fp.dtype == torch.int64
    assert comparand(fp).device == ACC
    assert fingerprint([t for _, t in state], ACC).device == ACC
    assert fingerprint([], ACC).device == ACC


def test_fingerprints_on_one_device_are_unchanged_by_the_rule() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(5), torch.zeros(0), torch.tensor(3.0)]
    expected = torch.stack([torch.hash_tensor(tensors[0]),
                            torch.zeros((), dtype=torch.uint64),
                            torch.hash_tensor(tensors[2])]).view(torch.int64) & ((1 << 63) - 1)
    assert torch.equal(fingerprint(tensors), expected)


def test_the_checks_answer_on_the_device_they_are_asked_for() -> None:
    batch = {"host": torch.randn(2, 3), "acc": torch.randn(2, 3, device=ACC),
             "ids": torch.arange(2)}
    assert [n.device for n in checks.batch_norms(batch, ACC)] == [ACC, ACC]
    assert checks.tensor_norm(torch.randn(3, device=ACC)).device == ACC
    assert checks.loss_scalar(torch.randn(4, device=ACC)).device == ACC
    assert checks.grad_norms([torch.randn(3, device=ACC)] * 2).device == ACC
    groups = checks.grouped_norms([torch.randn(3), torch.randn(2, device=ACC), torch.randn(1)])
    assert [(idx, norms.device) for idx, norms in groups] == [([0, 2], CPU), ([1], ACC)]
    assert signature_stats(batch, ACC).device == ACC


def test_the_row_the_vector_and_found_inf_stay_on_the_device() -> None:
    local = LocalHealth(ACC)
    local.add_batch(None, checks.batch_norms(torch.randn(3), ACC))
    local.add_loss(torch.tensor(2.0))  # a loss computed on the host joins the device's row
    local.add_grads(checks.grad_norms([torch.randn(3, device=ACC)])[0])
    row = local.row()
    assert row.device == ACC
    vector = pack(row, torch.full((5,), math.inf, device=ACC), 3, amp=False)
    assert vector.device == ACC and vector.shape == (SIZE,)
    gate = GatedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), ACC)
    assert gate.found_inf(vector, False).device == ACC
    assert gate.found_inf(vector, True).device == ACC
    # Under gloo the vector is summed on the host: found_inf is moved to the optimizer's device.
    assert gate.found_inf(torch.zeros(SIZE), False).device == ACC
