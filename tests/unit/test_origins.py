"""Where a NaN began, in one process: the device rule of view.pack, the pipeline boundary
hooks on a stage run by hand, wrap_loss and shape inference, and origins.weigh."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import nansentinel
from nansentinel.checks.health import LocalHealth
from nansentinel.checks.pipeline import StageWatch, stages_of
from nansentinel.common import torch_insides as insides
from nansentinel.decide import origins
from nansentinel.decide.policy import is_blamed
from nansentinel.result import RankIdentity
from nansentinel.wire.collectives import ForwardCollectives
from nansentinel.wire.schema import OwnRow, Totals, pack
from nansentinel.wire.view import RankHealth

CPU = torch.device("cpu")
NO_REF = torch.full((5,), math.inf)
NAN = math.nan

#: The row's last slots, the model's own state: buffers' max-abs (left, own, arrived), hyper.
STATE_SLOTS = (0.0, 0.0, 0.0, 0.0)


def judged(batch: float, loss: float, grad: float, boundary: tuple[float, ...],
           *, amp: bool = False) -> tuple[OwnRow, Totals]:
    row = torch.tensor([batch, loss, grad, 0.0, 1.0, 1.0, 0.0, *boundary, 0.0, 0.0,
                        *STATE_SLOTS])
    vector = pack(row, NO_REF, 0, amp=amp)
    return OwnRow.from_values(vector.tolist()), Totals.from_values(vector.tolist())


@pytest.mark.parametrize(
    ("values", "boundary", "blamed", "reached"),
    [
        ((1.0, NAN, NAN), (0, 0, 0, 0, 0), 1, 0),   # no pipeline: non-finite is blamed
        ((1.0, NAN, NAN), (0, 0, 1, 0, 0), 0, 1),   # non-finite activations arrived
        ((1.0, 1.0, NAN), (0, 0, 0, 1, 0), 0, 1),   # non-finite gradients arrived
        ((1.0, 1.0, NAN), (1, 0, 0, 1, 0), 1, 0),   # its own output went bad, and came back
        ((1.0, 1.0, 1.0), (0, 1, 0, 0, 0), 1, 0),   # sent gradients alone (params finite)
        ((NAN, NAN, NAN), (0, 0, 0, 0, 0), 1, 0),   # its batch
        ((1.0, NAN, NAN), (0, 0, 1, 0, 1), 1, 0),   # a later micro-batch's own loss fault
    ],
)
def test_the_device_tells_an_origin_from_a_rank_it_reached(
    values: tuple[float, float, float], boundary: tuple[float, ...], blamed: int, reached: int
) -> None:
    own, totals = judged(*values, tuple(float(b) for b in boundary))
    assert (totals.blamed, totals.reached, totals.flagged) == (blamed, reached, 1)
    assert own.reached == bool(reached)


def test_under_amp_a_stage_reached_through_its_gradients_is_overflow_not_blame() -> None:
    _, totals = judged(1.0, 1.0, NAN, (0.0, 0.0, 0.0, 1.0, 0.0), amp=True)
    assert (totals.blamed, totals.reached, totals.flagged) == (0, 0, 0)
    _, totals = judged(1.0, NAN, NAN, (0.0, 0.0, 1.0, 0.0, 0.0), amp=True)
    assert (totals.blamed, totals.reached) == (0, 1)


def test_a_forward_origin_has_kind_activation_and_sent_gradients_kind_grad() -> None:
    own, _ = judged(1.0, 1.0, NAN, (1.0, 0.0, 0.0, 1.0, 0.0))
    assert own.kinds == ("grad", "activation") and own.boundary == (
        "forward output from finite inputs", "received gradients")
    own, _ = judged(1.0, 1.0, 1.0, (0.0, 1.0, 0.0, 0.0, 0.0))
    assert own.kinds == ("grad",)


def _rank(r: int, kinds: tuple[str, ...], groups: tuple[str, ...]) -> RankHealth:
    return RankHealth(RankIdentity(r, r, 4, f"node{r}", "cpu"), kinds, False, None, None,
                      forward_groups=groups)


def test_weigh_marks_the_ranks_downstream_of_an_earlier_fault_in_a_shared_group() -> None:
    named = [_rank(0, ("loss", "grad"), ("world",)), _rank(1, ("batch", "loss", "grad"),
             ("world",)), _rank(2, ("grad",), ("world",)), _rank(3, ("loss",), ("tp1",))]
    weighed = {r.rank: r for r in origins.weigh(named)}
    assert [r for r, h in weighed.items() if h.reached] == [0, 2]
    assert not weighed[1].reached and not weighed[3].reached  # rank 3 shares no group
    assert "after rank 1's batch" in weighed[0].boundary[-1]
    assert is_blamed(weighed[1]) and not is_blamed(weighed[0])


def test_weigh_names_both_when_no_collective_or_the_same_point() -> None:
    same_point = [_rank(0, ("batch",), ("world",)), _rank(1, ("batch",), ("world",))]
    assert not any(r.reached for r in origins.weigh(same_point))
    no_collective = [_rank(0, ("batch",), ()), _rank(1, ("loss",), ())]
    assert not any(r.reached for r in origins.weigh(no_collective))


class _Stage(SimpleNamespace):
    """What StageWatch reads of a PipelineStage, with the two inference methods."""

    def _forward_metadata_inference(self, x: torch.Tensor) -> torch.Tensor:
        return self.submod(x)

    def _backward_metadata_inference(self, loss_fn, out, target):  # type: ignore[no-untyped-def]
        return loss_fn(out, target)


class _PoisonGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return torch.full_like(grad, NAN)


class _Block(torch.nn.Linear):
    poison = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_PoisonGrad.apply(x) if self.poison else x)


def _stage(first: bool, last: bool) -> tuple[_Stage, StageWatch]:
    submod = _Block(4, 4)
    stage = _Stage(submod=submod, is_first=first, is_last=last, stage_index=0, group=None)
    return stage, StageWatch(stage, CPU)


def _flags(watch: StageWatch) -> list[float]:
    """The boundary flags the watch folds from the norms its hooks kept (then reset)."""
    local = LocalHealth(CPU)
    watch.fold(local)
    watch.reset()
    return [0.0] * 5 if local.boundary is None else local.boundary.tolist()


@pytest.mark.skipif(not insides.supported("pipelining"), reason="pipeline stage checks need "
                    f"torch >= {insides.FEATURES['pipelining'].minimum} (refused below)")
def test_a_middle_stage_pairs_each_micro_batch_on_the_device() -> None:
    stage, watch = _stage(first=False, last=False)
    x = torch.randn(2, 4, requires_grad=True)
    out = stage.submod(x)
    out.backward(torch.full_like(out, NAN))  # non-finite gradients arrive from the next stage
    assert _flags(watch) == [0.0, 0.0, 0.0, 1.0, 0.0]  # received, not begun here
    stage.submod.poison = True  # its backward turns the input's gradient non-finite
    for _ in range(3):  # three micro-batches, the last with a NaN activation
        y = torch.randn(2, 4, requires_grad=True)
        out = stage.submod(y)
        out.backward(torch.ones_like(out))
    stage.submod.poison = False
    y = torch.full((2, 4), NAN, requires_grad=True)
    stage.submod(y).sum().backward()
    assert _flags(watch) == [0.0, 1.0, 1.0, 0.0, 0.0]  # sent bad from finite received ones


@pytest.mark.skipif(not insides.supported("pipelining"), reason="pipeline stage checks need "
                    f"torch >= {insides.FEATURES['pipelining'].minimum} (refused below)")
def test_the_first_stage_checks_its_input_as_the_batch_and_inference_is_skipped() -> None:
    stage, watch = _stage(first=True, last=False)
    stage._forward_metadata_inference(torch.full((2, 4), NAN))  # uninitialised values
    assert watch.chunk is None and watch.chunks == []  # no micro-batch, so no batch norm
    x = torch.randn(2, 4)
    x[0, 0] = NAN
    stage.submod(x)
    local = LocalHealth(CPU)
    watch.fold(local)
    assert len(local.batch_norms) == 1 and math.isnan(float(local.batch_norms[0]))
    assert local.boundary is not None and local.boundary.tolist() == [0.0] * 5  # the batch's
    watch.reset()
    assert watch.handles == [] and watch.chunk is None and watch.chunks == []


@pytest.mark.skipif(not insides.supported("pipelining"), reason="pipeline stage checks need "
                    f"torch >= {insides.FEATURES['pipelining'].minimum} (refused below)")
def test_wrap_loss_checks_each_micro_batch_and_skips_shape_inference() -> None:
    model = torch.nn.Linear(4, 4)
    stage = _Stage(submod=model, is_first=False, is_last=True, stage_index=1, group=None)
    sentinel = nansentinel.Sentinel(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    stages=stage, metrics_port=0)
    loss_fn = sentinel.wrap_loss(torch.nn.functional.mse_loss)
    target = torch.randn(2, 4)
    stage._backward_metadata_inference(loss_fn, torch.full((2, 4), NAN), target)
    assert sentinel.local.loss_count == 0  # the inference call is passed through
    x = torch.randn(2, 4, requires_grad=True)
    out = model(x)
    loss = loss_fn(out, target)
    loss.backward()
    assert sentinel.local.loss_count == 1 and len(sentinel.local.batch_norms) == 1  # target
    result = sentinel.step()
    assert result.applied and result.reached == []
    x = torch.randn(2, 4, requires_grad=True)
    loss = loss_fn(model(x), torch.full((2, 4), math.inf))  # a bad target: the batch's
    loss.backward()
    result = sentinel.step()
    assert not result.applied and "batch" in result.kinds and "activation" not in result.kinds
    sentinel.close()


def test_stages_must_be_pipeline_stages() -> None:
    with pytest.raises(TypeError, match=r"stages\[1\] is a Linear"):
        stages_of([_Stage(submod=None, is_first=True, is_last=False, stage_index=0),
                   torch.nn.Linear(2, 2)])


def test_a_wrappers_own_collectives_are_left_out_of_the_forwards() -> None:
    """DDP's buffer broadcast, bracketed by aside()/resume(), is subtracted; the user's
    collective on the same group is not; a bracket left open hides nothing."""
    counts = {"0": 0, "tp": 0}
    forward = ForwardCollectives()
    forward._counts = lambda: dict(counts)  # type: ignore[method-assign]
    forward.aside()  # no forward counted yet: nothing to bracket
    forward.start()
    forward.aside()
    counts["0"] += 2  # DDP broadcasts its buffers
    forward.resume()
    assert forward.stop() == ()
    forward.start()
    forward.aside()
    counts["0"] += 1
    forward.resume()
    counts["0"] += 1  # the user's all-reduce inside the module
    assert forward.stop() == ("0",)
    forward.start()
    forward.aside()
    counts["tp"] += 1  # the wrapper never reached its module's hook
    assert forward.stop() == ("tp",)


def test_weigh_is_linear_when_every_rank_is_named() -> None:
    """A global NaN: every rank's loss, each with a forward collective of one group. The
    quadratic weighing took 1.2 s at 4,096 named ranks (about 30 s at 20,000); linear, it
    takes hundredths. With one rank's batch at the start, every other rank is reached."""
    import time  # CPU time: other processes on the machine do not count

    n = 20_000
    named = [_rank(r, ("loss",), ("world",)) for r in range(n)]
    started = time.process_time()
    weighed = origins.weigh(named)
    assert time.process_time() - started < 1.0
    assert not any(r.reached for r in weighed)
    named[n // 2] = _rank(n // 2, ("batch", "loss"), ("world",))
    started = time.process_time()
    weighed = origins.weigh(named)
    assert time.process_time() - started < 1.0
    assert [r.rank for r in weighed if not r.reached] == [n // 2]
    assert weighed[0].boundary[-1].endswith(f"after rank {n // 2}'s batch")
