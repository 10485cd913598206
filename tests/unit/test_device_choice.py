"""Where the sentinel's tensors live: the device a rank computes on, read from one parameter
(issue 20, item 7: under FSDP2's CPUOffloadPolicy the shard is in host memory, the work on the
mesh's device)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nansentinel.checks.health import local_device


class _Offloaded:
    """A DTensor's two facts the choice reads: its local tensor, and its mesh's device type
    (a real DTensor on a CUDA mesh cannot be built on a CPU-only machine)."""

    def __init__(self, local: torch.Tensor, mesh_type: str) -> None:
        self.local = local
        self.device_mesh = SimpleNamespace(device_type=mesh_type)

    def to_local(self) -> torch.Tensor:
        return self.local


def test_an_offloaded_shard_takes_the_device_of_its_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    param = _Offloaded(torch.zeros(2), "cuda")
    assert local_device([param]) == torch.device("cuda", 3)  # type: ignore[arg-type]


def test_a_shard_on_its_mesh_device_and_plain_tensors_keep_theirs() -> None:
    assert local_device([_Offloaded(torch.zeros(2), "cpu")]) == torch.device("cpu")  # type: ignore[arg-type]
    assert local_device([torch.zeros(2, device="meta")]) == torch.device("meta")
    assert local_device([torch.nn.Parameter(torch.zeros(2))]) == torch.device("cpu")


def test_a_real_dtensor_on_a_cpu_mesh_is_on_the_cpu() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        param = distribute_tensor(torch.zeros(4), mesh, [Shard(0)])
        assert local_device([param]) == torch.device("cpu")
        assert param.device_mesh.device_type == "cpu"  # the attribute the choice reads
    finally:
        dist.destroy_process_group()
