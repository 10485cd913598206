"""What the model holds (issue 68), the pure parts: the state's reads, the hyperparameters,
the words, and the health row's buffer rule (a NaN broadcast from DDP's source rank names the
source, not the ranks it reached)."""

from __future__ import annotations

import math

import torch
from torch import nn

from nansentinel.checks.health import ROW, LocalHealth
from nansentinel.checks.state import (
    Poisoned,
    StateFindings,
    any_nonfinite,
    describe_ranks,
    named_state,
    nonfinite_flag,
    poisoned,
    poisoned_hyperparameters,
    read_hyperparameters,
)
from nansentinel.wire.schema import OwnRow, Totals, pack

CPU = torch.device("cpu")
NO_REF = torch.full((5,), math.inf)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(6, 4)).sum().backward()
    opt.step()
    return model, opt


def test_named_state_holds_weights_optimizer_state_and_floating_buffers_in_order() -> None:
    model, opt = _model()
    named = named_state(model, opt)
    kinds = {name: kind for name, kind, _ in named}
    assert kinds["0.weight"] == "weight" and kinds["0.weight.exp_avg_sq"] == "optimizer_state"
    assert kinds["1.running_mean"] == "buffer" and "1.num_batches_tracked" not in kinds
    assert next(n for n, _, _ in named_state(model, opt, skip=["0.weight"])) == "0.bias"


def test_poisoned_names_each_tensor_with_its_count_whatever_its_layout_and_size() -> None:
    model, opt = _model()
    assert poisoned(named_state(model, opt)) == []
    with torch.no_grad():
        model[2].weight[0, :3] = math.nan
        opt.state[model[0].weight]["exp_avg_sq"][1, 1] = math.inf
        model[1].running_var[0] = -math.inf
    found = poisoned(named_state(model, opt))
    assert [(p.name, p.kind, p.bad, p.numel) for p in found] == [
        ("0.weight.exp_avg_sq", "optimizer_state", 1, 32), ("2.weight", "weight", 3, 8),
        ("1.running_var", "buffer", 1, 8)]
    # fp16 values far past what an L2 norm survives are finite; a sparse tensor is read
    # through its values; a complex one as its pairs; a meta tensor has none to read.
    big = torch.full((4096,), 60000.0, dtype=torch.float16)
    sparse = torch.sparse_coo_tensor([[0, 3]], [1.0, math.nan], (5,))
    cplx = torch.tensor([1 + 1j, complex(1, math.nan)])
    extra = [("big", "weight", big), ("sparse", "weight", sparse), ("cplx", "weight", cplx),
             ("meta", "weight", torch.empty(3, device="meta"))]
    assert [(p.name, p.bad) for p in poisoned(extra)] == [("sparse", 1), ("cplx", 1)]
    assert int(any_nonfinite([big], CPU)) == 0 and int(any_nonfinite([big, sparse], CPU)) == 1


def test_hyperparameters_every_float_of_every_group_tuples_and_cpu_tensors_too() -> None:
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [w]}, {"params": [nn.Parameter(torch.ones(1))]}],
                            lr=torch.tensor(1e-3))
    assert read_hyperparameters(opt) == (True, []) and poisoned_hyperparameters(opt) == []
    opt.param_groups[1]["betas"] = (0.9, math.nan)
    opt.param_groups[0]["lr"] = torch.tensor(math.inf)
    assert read_hyperparameters(opt) == (False, [])
    found = poisoned_hyperparameters(opt)
    assert found[0] == (0, "lr", math.inf) and found[1][:2] == (1, "betas[1]")
    assert math.isnan(found[1][2]) and len(found) == 2


def test_the_words_name_ranks_alike_in_one_clause_and_stay_a_line_at_any_world() -> None:
    rows = {r: (f"node{r // 8}", ["weight fc.weight (1 of 4 elements non-finite)"])
            for r in range(1000)}
    rows[3] = ("node0", ["buffer bn.running_mean (2 of 8 elements non-finite)"])
    words = describe_ranks(rows)
    assert words.startswith("ranks 0, 1, 2, 4, 5, 6, 7, 8 and 991 more (hosts node0, node1")
    assert "rank 3 (host node0): buffer bn.running_mean" in words and len(words) < 400
    found = StateFindings(5, {2: [Poisoned("fc.weight", "weight", 1, 4)]}, {2: "h2"}, True)
    assert found.describe() == "rank 2 (host h2): weight fc.weight (1 of 4 elements non-finite)"
    assert found.named() == {2: ["weight fc.weight (1 of 4 elements non-finite)"]}


def _row(buffers: tuple[float, float, float], loss: float = 1.0) -> torch.Tensor:
    """A health row whose buffers are (as the step left them, own, as they arrived)."""
    return torch.tensor([1.0, loss, 1.0, 0.0, 1.0, 1.0, 0.0, *[0.0] * 5, 0.0, 0.0,
                         *buffers, 0.0])


def test_a_buffer_broadcast_from_its_source_names_the_source_not_the_ranks_it_reached() -> None:
    nan = math.nan
    # The source (rank 0): its own buffers were non-finite before DDP's broadcast.
    source = OwnRow.from_values(pack(_row((nan, nan, nan)), NO_REF, 0, amp=False).tolist())
    # A rank it reached: its own were finite, they arrived non-finite (and made its loss so).
    reached = OwnRow.from_values(pack(_row((nan, 1.0, nan), loss=nan), NO_REF, 1,
                                      amp=False).tolist())
    # A rank whose own forward made them non-finite after a finite arrival.
    made = OwnRow.from_values(pack(_row((nan, 1.0, 1.0)), NO_REF, 2, amp=True).tolist())
    assert source.flagged and "buffer" in source.kinds and not source.reached
    assert reached.flagged and reached.reached and reached.boundary == (
        "floating buffers received",)
    assert made.flagged and not made.reached and "buffer" in made.kinds
    totals = Totals.from_values([a + b + c for a, b, c in zip(
        *(pack(_row(x), NO_REF, r, amp=False).tolist()
          for r, x in enumerate([(nan, nan, nan), (nan, 1.0, nan), (1.0, 1.0, 1.0)])),
        strict=True)])
    assert totals.bad_buffer == 2 and totals.blamed == 1 and totals.reached == 1
    assert totals.device_skips  # the device gate's found_inf skips it too


def test_tensor_hyperparameters_on_an_accelerator_are_read_on_the_device_only() -> None:
    """A tensor lr or tensor betas on the GPU (capturable and fused optimizers take them) is
    never read on the host on a healthy step: it is listed for the device, folded into one
    0-d flag there, and raises the row's hyper_bad slot on the device path as on the host
    path; by name only on the rare path (tensors in a tuple too)."""
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([w], lr=torch.tensor(1e-3),
                            betas=(torch.tensor(0.9), torch.tensor(0.999)))
    assert read_hyperparameters(opt) == (True, [])  # on the CPU the host reads them itself
    opt.param_groups[0]["betas"] = (torch.tensor(math.nan), torch.tensor(0.999))
    assert read_hyperparameters(opt) == (False, [])  # a CPU tensor in a tuple is read too
    assert poisoned_hyperparameters(opt)[0][:2] == (0, "betas[0]")
    flag = nonfinite_flag([torch.tensor(1e-3), torch.tensor([0.9, math.inf])], CPU)
    assert flag.shape == () and flag.dtype == torch.float32 and float(flag) == 1.0
    assert float(nonfinite_flag([torch.tensor(1e-3), torch.tensor([0.9, 0.99])], CPU)) == 0.0
    for bad in (0.0, 1.0):  # the device row and the CPU's host row carry the same slot
        health = LocalHealth(CPU)
        health.add_loss(torch.tensor(1.0))
        health.hyper_flag = torch.tensor(bad)
        device_row = health.row().tolist()
        assert device_row[ROW.index("hyper_bad")] == bad
        assert health.host_row() == device_row
    meta = torch.optim.AdamW([w], lr=1e-3)  # a stand-in for a tensor on the GPU
    meta.param_groups[0]["lr"] = torch.tensor(1e-3, device="meta")
    finite, on_device = read_hyperparameters(meta)  # not read on the host: no sync
    assert finite and on_device == [meta.param_groups[0]["lr"]]


def test_a_non_finite_hyperparameter_is_counted_and_skips_but_blames_no_rank() -> None:
    row = _row((1.0, 1.0, 1.0))
    row[-1] = 1.0
    totals = Totals.from_values(pack(row, NO_REF, 3, amp=False).tolist())
    assert totals.bad_hyper == 1 and totals.blamed == 0 and totals.flagged == 0
    assert totals.device_skips


def test_a_buffer_holding_inf_by_design_counts_only_its_nan() -> None:
    """An additive attention mask of -inf (bench/recovery.py's model, many transformers) is
    the model's own: not refused at construction, not flagged in any step's row; a NaN in it
    still is."""
    from nansentinel.checks.buffers import FloatingBuffers
    from nansentinel.checks.state import constant_buffers

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.full((3, 3), -math.inf).triu(1))
    model.register_buffer("running_min", torch.tensor(math.inf))
    constants = constant_buffers(model)
    assert constants == {"mask", "running_min"}
    assert poisoned(named_state(model), constants) == []
    buffers = FloatingBuffers(model, constants=constants)
    model(torch.randn(5, 4))
    norms = buffers.norms()
    assert norms is not None and all(math.isfinite(float(n)) for n in norms)
    with torch.no_grad():
        model.mask[2, 0] = math.nan
        model[1].running_var[1] = math.inf
    found = poisoned(named_state(model), constants)
    assert [(p.name, p.bad) for p in found] == [("mask", 1), ("1.running_var", 1)]
    assert not math.isfinite(float(buffers.norms()[0]))  # type: ignore[index]
    # A NaN at construction makes no constant: refused, like any poisoned buffer.
    assert "mask" not in constant_buffers(model)
