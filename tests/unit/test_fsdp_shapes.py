"""The FSDP2 shapes the gradient path takes (one fake process group of 2, no collective run):
sharded at the root, sharded below it (Lightning's ``ModelParallelStrategy`` recipe, where the
LightningModule is never the root), and the one shape refused, trainable parameters that no
``fully_shard``-ed module holds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nansentinel import engines
from nansentinel.engines import fsdp
from nansentinel.result import SentinelUsageError


@pytest.fixture()
def two_ranks() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


class Wrapper(nn.Module):
    """A LightningModule's shape: the trained network is a submodule."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        self.scale = nn.Parameter(torch.ones(1)) if extra else None


def test_a_model_sharded_below_its_root_is_fsdp(two_ranks: object) -> None:
    from torch.distributed.fsdp import fully_shard

    model = Wrapper()
    fully_shard(model.net[0], mesh=two_ranks)
    fully_shard(model.net, mesh=two_ranks)
    assert fsdp.is_fsdp(model)


def test_parameters_outside_every_sharded_module_are_refused_by_name(two_ranks: object) -> None:
    from torch.distributed.fsdp import fully_shard

    model = Wrapper(extra=True)
    fully_shard(model.net, mesh=two_ranks)
    with pytest.raises(SentinelUsageError, match=r"below its root \('net'\).*'scale'.*fully_shard"):
        fsdp.is_fsdp(model)
    model.scale.requires_grad_(False)  # frozen: nothing to reduce, nothing to check
    assert fsdp.is_fsdp(model)


def test_wrappers_are_recognised_in_the_engines_layer(two_ranks: object) -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = nn.Linear(2, 2)
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # no collective at init
    nn.Module.__init__(ddp)
    ddp.module = model
    assert engines.wrapper_of(ddp, model)
    assert not engines.wrapper_of(ddp, nn.Linear(2, 2))
    assert not engines.wrapper_of(model, model)
    assert engines.takes_replay(ddp) and engines.takes_replay(model)
