"""Helpers shared by every test package (the fixtures over them are in conftest.py)."""

from __future__ import annotations

import socket
from typing import Any


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (servers retry on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])



_gathers: bool | None = None


def gathers_dtensors() -> bool:
    """Whether DTensors on the CPU's gloo can be gathered whole by torch itself (False on
    torch 2.9 to 2.12, whose gloo lacks the coalesced all-gather that DTensor's redistribution
    calls). Probed once per process with one all-gather of a one-element DTensor over the whole
    job, which fails cleanly (on every rank, before anything is sent) where gloo lacks it: call
    it where every rank calls it, as every gather here is called."""
    global _gathers
    if _gathers is None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        if not dist.is_initialized() or dist.get_backend() != "gloo":
            _gathers = True
            return _gathers
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        try:
            DTensor.from_local(torch.zeros(1), mesh, [Shard(0)]).full_tensor()
            _gathers = True
        except RuntimeError as exc:
            if "allgather_into_tensor_coalesced" not in str(exc):
                raise
            _gathers = False
    return _gathers


def full_tensor(t: Any) -> Any:
    """The whole of ``t``: a DTensor gathered on every rank (a collective: every rank calls
    it, in the same order), anything else as it is.

    ``DTensor.full_tensor()`` where torch can (:func:`gathers_dtensors`); elsewhere gathered by
    hand over each mesh dimension, innermost first (DTensor shards a tensor dimension split by
    several mesh dimensions outermost first), with ``all_gather_object`` so that uneven shards
    need no padding. A strided shard (FSDP2 over TP's dimension) is refused there, on every
    rank before any collective: its rows interleave, and the caller compares local shards.
    """
    full = getattr(t, "full_tensor", None)
    if full is None:
        return t
    if gathers_dtensors():
        return full()
    import torch
    import torch.distributed as dist

    if any(type(p).__name__ == "_StridedShard" for p in t.placements):
        raise NotImplementedError(f"a strided shard ({t.placements}) on a torch whose gloo "
                                  "cannot gather DTensors: compare local shards instead")
    mesh, value = t.device_mesh, t.to_local().detach().cpu()
    for dim in reversed(range(mesh.ndim)):
        placement = t.placements[dim]
        if placement.is_shard():
            parts: list[Any] = [None] * mesh.size(dim)
            dist.all_gather_object(parts, value, group=mesh.get_group(dim))
            value = torch.cat(parts, dim=placement.dim)
        elif placement.is_partial():
            dist.all_reduce(value, group=mesh.get_group(dim))  # a sum, as the tests make
    return value.to(t.device)
