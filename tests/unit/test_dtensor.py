"""DTensor batches, losses and gradients (tensor parallel) are checked through their local
tensors: a plain 0-d fp32 tensor on this rank's device, no collective, and the same results as
the plain tensors they hold.

The checks run on a real DTensor over a 2-rank mesh of torch's fake backend (collectives are
no-ops, and ``CommDebugMode`` counts any that DTensor would issue); the Sentinel's own step runs
on a 1-rank gloo group, where a DTensor loss failed to pack into the health row before.
"""

from __future__ import annotations

import datetime
import importlib.util
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

if importlib.util.find_spec("numpy") is None:  # the floors lane (tests/run_floor_lane.sh)
    pytest.skip("torch's CommDebugMode imports numpy, which nansentinel does not need: the "
                "floors lane leaves it out, the main lane runs these", allow_module_level=True)
from torch.distributed.tensor.debug import CommDebugMode

import nansentinel
from nansentinel import checks
from nansentinel.checks.health import LocalHealth
from nansentinel.engines.local import LocalGradPath, check_local_grads, scan_parameters

CPU = torch.device("cpu")


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    """A 1-D mesh of 2 ranks of the fake backend; this process is rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def dt(local: torch.Tensor, mesh: DeviceMesh, placement: Any) -> DTensor:
    return DTensor.from_local(local, mesh, [placement], run_check=False)


def plain_and_silent(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``fn()``, asserting it issued no collective and returned a plain fp32 tensor."""
    with CommDebugMode() as comms:
        out = fn()
    assert comms.get_total_counts() == 0, comms.get_comm_counts()
    assert type(out) is torch.Tensor and out.dtype == torch.float32 and out.device == CPU
    return out


PLACEMENTS = [Replicate(), Partial("sum"), Partial("avg")]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
def test_a_scalar_dtensor_loss_is_this_ranks_local_value(mesh: DeviceMesh, placement: Any) -> None:
    loss = dt(torch.tensor(2.5, requires_grad=True), mesh, placement)
    value = plain_and_silent(lambda: checks.loss_scalar(loss))
    assert value.shape == () and float(value) == 2.5 and not value.requires_grad
    bad = dt(torch.tensor(math.nan), mesh, placement)
    assert math.isnan(float(plain_and_silent(lambda: checks.loss_scalar(bad))))


def test_a_sharded_loss_is_the_mean_of_this_ranks_elements(mesh: DeviceMesh) -> None:
    """Per-token losses sharded on the sequence: this rank's elements; none held is 0, not the
    NaN of an empty mean."""
    loss = dt(torch.tensor([1.0, 3.0], dtype=torch.bfloat16), mesh, Shard(0))
    assert loss.shape == (4,)  # global: the peer holds two more
    assert float(plain_and_silent(lambda: checks.loss_scalar(loss))) == 2.0
    loss.to_local()[1] = math.inf
    assert math.isinf(float(plain_and_silent(lambda: checks.loss_scalar(loss))))
    empty = DTensor.from_local(torch.zeros(0), mesh, [Shard(0)], run_check=False,
                               shape=torch.Size([1]), stride=(1,))
    assert float(plain_and_silent(lambda: checks.loss_scalar(empty))) == 0.0


def test_the_mean_of_a_sharded_loss_is_a_partial_and_checked_without_a_collective(
    mesh: DeviceMesh,
) -> None:
    per_token = dt(torch.tensor([1.0, 3.0]), mesh, Shard(0))
    loss = per_token.mean()  # a Partial(avg): what a loss-parallel mean gives before reducing
    assert loss.placements[0].is_partial()
    assert float(plain_and_silent(lambda: checks.loss_scalar(loss))) == 2.0


@pytest.mark.parametrize("placement", [*PLACEMENTS, Shard(0)], ids=str)
def test_dtensor_batches_and_gradients_are_normed_on_their_local_tensors(
    mesh: DeviceMesh, placement: Any
) -> None:
    """A Partial's norm would all-reduce it first (a collective inside a check): the local
    norm is taken instead, for batches, single norms and fused gradient norms alike."""
    values = torch.tensor([3.0, 4.0])
    t = dt(values.clone(), mesh, placement)
    assert float(plain_and_silent(lambda: checks.tensor_norm(t))) == 5.0
    batch = {"x": t, "ids": dt(torch.arange(2), mesh, Replicate()), "y": torch.ones(4)}
    norms = checks.batch_norms(batch, CPU)
    assert [type(n) for n in norms] == [torch.Tensor, torch.Tensor]
    assert [float(n) for n in norms] == [5.0, 2.0]
    grads = plain_and_silent(lambda: checks.grad_norms([t, dt(torch.ones(4), mesh, placement)]))
    assert grads.tolist() == [5.0, 2.0]
    t.to_local()[0] = math.nan
    assert not torch.isfinite(checks.batch_norms(batch, CPU)[0])
    assert math.isnan(checks.grad_norms([t])[0])


def test_the_health_row_packs_dtensor_values(mesh: DeviceMesh) -> None:
    """The failure torchtitan's loss-parallel loss met: ``row()`` stacks the loss with plain
    tensors ("aten.cat.default got mixed torch.Tensor and DTensor")."""
    health = LocalHealth(CPU)
    health.add_batch(None, checks.batch_norms(dt(torch.ones(4), mesh, Shard(0)), CPU))
    health.add_loss(checks.loss_scalar(dt(torch.tensor(1.5), mesh, Replicate())))
    health.add_loss(dt(torch.tensor(2.5), mesh, Partial("avg")))  # handed over as it is
    health.add_grads(dt(torch.tensor(3.0), mesh, Replicate()))
    row = plain_and_silent(health.row)
    # no stop, no buffers, every hyperparameter finite
    assert row.tolist() == [2.0, 2.0, 3.0, 0.0, 1.0, 1.0, 0.0, *[0.0] * 5, 0.0, 0.0, *[0.0] * 4]


def test_local_gradients_of_dtensor_parameters_are_this_ranks_shards(mesh: DeviceMesh) -> None:
    """On the local path the norm is the local shards' (before any reduction), and a NaN in
    one shard names that parameter."""
    weight = torch.nn.Parameter(dt(torch.zeros(2, 2), mesh, Shard(0)))
    bias = torch.nn.Parameter(dt(torch.zeros(2), mesh, Replicate()))
    weight.grad = dt(torch.full((2, 2), 2.0), mesh, Shard(0))
    bias.grad = dt(torch.tensor([3.0, 0.0]), mesh, Partial("sum"))

    class Sink:
        def __init__(self) -> None:
            self.norms: list[torch.Tensor] = []

        def before_reduction(self, local_grads: torch.Tensor) -> None:
            assert type(local_grads) is torch.Tensor

        def add_grad_norm(self, norm: torch.Tensor) -> None:
            self.norms.append(norm)

    sink = Sink()
    with CommDebugMode() as comms:
        check_local_grads([weight, bias], sink)  # type: ignore[arg-type]
    assert comms.get_total_counts() == 0
    (norm,) = sink.norms
    assert type(norm) is torch.Tensor and float(norm) == 5.0  # sqrt(4 * 2^2 + 3^2)
    bias.grad.to_local()[1] = math.inf
    assert scan_parameters([("weight", weight), ("bias", bias)]) == ["bias"]


@pytest.mark.parametrize("placement", [*PLACEMENTS, Shard(0), Shard(1)], ids=str)
def test_a_drill_writes_into_this_ranks_local_tensor_without_a_collective(
    mesh: DeviceMesh, placement: Any
) -> None:
    """Indexing a sharded DTensor all-gathers it: a drill on one rank would issue a
    collective no other rank does (a hang), and write nowhere this rank holds."""
    from nansentinel.common.inject import Injector, parse_inject

    injector = Injector(parse_inject("kind=batch,rank=0,step=3"), 0, "h")
    t = dt(torch.ones(2, 3), mesh, placement)
    with CommDebugMode() as comms:
        assert not injector.poison("batch", 2, t)
        assert injector.poison("batch", 3, t)
    assert comms.get_total_counts() == 0, comms.get_comm_counts()
    assert math.isnan(t.to_local()[0, 0]) and int(torch.isnan(t.to_local()).sum()) == 1
    assert not torch.isfinite(checks.batch_norms(t, CPU)[0])


@pytest.mark.parametrize("placement", [*PLACEMENTS, Shard(0)], ids=str)
def test_a_dtensor_batchs_signature_is_taken_on_its_local_tensor(
    mesh: DeviceMesh, placement: Any
) -> None:
    """Quarantine matching runs on every checked batch once something is quarantined, and
    the replay signs the blamed batch: both on the local tensor, without a collective."""
    from nansentinel.checks.quarantine import signature, signature_stats

    batch = {"x": dt(torch.tensor([1.0, -2.0]), mesh, placement), "y": torch.ones(2)}
    stats = plain_and_silent(lambda: signature_stats(batch, CPU).float())
    root5 = float(torch.tensor(5.0).sqrt())  # the norm of [1, -2], in fp32 as checks take it
    assert stats.tolist() == pytest.approx([root5, -1.0, 3.0, 5.0, 2 ** 0.5, 2.0, 2.0, 2.0])
    assert signature(batch).stats == signature({"x": torch.tensor([1.0, -2.0]),
                                                "y": torch.ones(2)}).stats


@pytest.fixture
def one_rank(free_port: Callable[[], int]) -> Iterator[DeviceMesh]:
    """A real 1-rank gloo group and its mesh."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_sentinel_steps_on_a_dtensor_loss_and_skips_its_nan(
    one_rank: DeviceMesh, tmp_path: Any
) -> None:
    """A tensor-parallel model whose output stays a DTensor: healthy steps apply, a NaN
    written into the batch (not by the drill) skips the step and names the rank."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    parallelize_module(model, one_rank, {"0": ColwiseParallel(),
                                         "2": RowwiseParallel(use_local_output=False)})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outcomes, losses = [], []
    with nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), metrics_port=0) as sentinel:
        assert isinstance(sentinel.gradients, LocalGradPath)
        for step in range(3):
            x = torch.ones(2, 4)
            if step == 1:
                x[0, 0] = math.nan
            sentinel.check_batch(x)
            loss = model(x).pow(2).mean()
            assert isinstance(loss, DTensor) and loss.placements == (Replicate(),)
            sentinel.check_loss(loss)
            loss.backward()
            result = sentinel.step()
            opt.zero_grad(set_to_none=True)
            outcomes.append((str(result.outcome), result.bad_ranks, result.kinds))
            losses.append(result.local_loss)
    assert outcomes == [("applied", [], []), ("skipped", [0], ["batch", "loss", "grad"]),
                        ("applied", [], [])]
    assert losses[0] is not None and math.isfinite(losses[0])
    assert all(torch.isfinite(p.to_local()).all() for p in model.parameters())
