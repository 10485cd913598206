"""Choosing the gradient path: what is refused at construction, and how names are resolved."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nansentinel.engines import fsdp
from nansentinel.engines.local import naming_detail, scan_parameters


def test_fsdp1_is_taken_by_its_own_path() -> None:
    """An FSDP1 root, or a module holding FSDP1 instances, goes to the FSDP1 path (its comm
    hook), never to FSDP2's."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from nansentinel import engines
    from nansentinel.engines.fsdp1 import FSDP1Path, is_fsdp1

    legacy = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # needs no GPU
    nn.Module.__init__(legacy)
    outer = nn.Sequential(legacy)
    assert is_fsdp1(legacy) and is_fsdp1(outer)
    assert engines.recognize(legacy) is FSDP1Path and engines.recognize(outer) is FSDP1Path
    assert not fsdp.is_fsdp(legacy) and not is_fsdp1(nn.Linear(2, 2))


def test_plain_modules_are_not_fsdp() -> None:
    assert not fsdp.is_fsdp(nn.Linear(2, 2))


class _OtherShards:
    """The other ranks' part of the max-reduce: their per-parameter non-finite flags."""

    def __init__(self, *others: list[float]) -> None:
        self.others = others
        self.calls = 0

    def max_floats(self, values: list[float]) -> list[float]:
        self.calls += 1
        return [max(column) for column in zip(values, *self.others, strict=True)]


def _sharded(norms: list[float], nonfinite: set[str],
             per_param: list[list[float] | None] | None = None) -> fsdp.FSDPPath:
    """An FSDP path over groups a (a.weight, a.bias) and b (b.weight) whose reduce-scatter
    inputs had ``norms`` (and, where ``per_param`` gives them, these per-parameter norms; else
    the layout was not known), and whose reduced local shards are non-finite in
    ``nonfinite``."""
    model = nn.Module()
    model.a, model.b = nn.Linear(1, 1), nn.Linear(1, 1, bias=False)
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, float("nan") if name in nonfinite else 0.0)
    path = fsdp.FSDPPath.__new__(fsdp.FSDPPath)
    path.model = model
    path.groups = [("a", ["a.weight", "a.bias"]), ("b", ["b.weight"])]
    per = per_param or [None] * len(norms)
    path.norms = [(i, torch.tensor(v), None if p is None else torch.tensor(p))
                  for i, (v, p) in enumerate(zip(norms, per, strict=True))]
    return path


def test_fsdp_names_each_poisoned_rank_from_every_ranks_share() -> None:
    # Rank 1's group a was non-finite before the reduce-scatter; its a.weight NaN landed in
    # rank 0's shard, and rank 1's own shard holds the b.weight NaN of rank 2's group b.
    rank1 = _sharded([float("nan"), 1.0], {"b.weight"})
    peers = _OtherShards([1.0, 0.0, 0.0], [0.0, 0.0, 0.0])  # ranks 0 and 2's shards
    assert rank1.naming_detail(True, peers) == {"parameters": ["a.weight"]}
    rank2 = _sharded([1.0, float("nan")], set())
    assert rank2.naming_detail(True, _OtherShards([1.0, 0.0, 0.0], [0.0, 0.0, 1.0])) == {
        "parameters": ["b.weight"]}
    # A healthy rank takes part in the reduce (every rank issues it) and names nothing.
    healthy = _OtherShards([0.0, 0.0, 1.0])
    assert _sharded([1.0, 1.0], {"a.weight"}).naming_detail(False, healthy) == {}
    assert healthy.calls == 1
    # Nothing reduced (a world of one): the local scan is exact.
    alone = _sharded([], {"a.bias"})
    alone.norms = []
    assert alone.naming_detail(True, _OtherShards()) == {"parameters": ["a.bias"]}


def test_fsdp_naming_under_a_pipeline_reduces_over_the_fsdp_mesh_not_the_job() -> None:
    # A pipeline stage's FSDP mesh is not the job: the other stages hold other parameters, so
    # the flags are reduced over the mesh's groups only (here a mesh of one: none at all).
    path = _sharded([float("nan"), 1.0], {"a.weight"})
    path.replica_groups = []
    job = _OtherShards([0.0, 1.0, 1.0])
    assert path.naming_detail(True, job) == {"parameters": ["a.weight"]}
    assert job.calls == 0
    # Over the mesh's groups, one max-reduce each, in order (shard, then replicate).
    path._replica_peers = [_OtherShards([0.0, 1.0, 0.0]), _OtherShards([0.0, 0.0, 0.0])]
    assert path.naming_detail(True, job) == {"parameters": ["a.weight", "a.bias"]}
    assert [g.calls for g in path._replica_peers] == [1, 1] and job.calls == 0


def test_two_poisoned_ranks_in_one_group_each_name_their_own_parameters() -> None:
    # Ranks 1 and 2 both poisoned group a: rank 1 in a.weight, rank 2 in a.bias. Every shard
    # holds both after the reduction; each rank's own per-parameter norms tell them apart.
    nan = float("nan")
    peers = _OtherShards([1.0, 1.0, 0.0])
    rank1 = _sharded([nan, 1.0], {"a.weight", "a.bias"}, [[nan, 1.0], [1.0]])
    rank2 = _sharded([nan, 1.0], {"a.weight", "a.bias"}, [[1.0, nan], [1.0]])
    assert rank1.naming_detail(True, peers) == {"parameters": ["a.weight"]}
    assert rank2.naming_detail(True, peers) == {"parameters": ["a.bias"]}
    # Only the groups whose layout was not known fall back on the reduced shards.
    mixed = _sharded([nan, nan], {"a.bias", "b.weight"}, [[1.0, nan], None])
    assert mixed.naming_detail(True, _OtherShards([0.0, 0.0, 0.0])) == {
        "parameters": ["a.bias", "b.weight"]}
    assert peers.calls == 2  # every rank still issues the one max-reduce


def test_parameter_norms_read_fsdps_reduce_scatter_layout() -> None:
    """The buffer FSDP2 builds (its own chunk_cat: row r holds shard r of every parameter,
    padded on dim 0) gives each parameter's norm back, in fp32 and fp16."""
    world = 4
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(4, 2, 2)]
    padded = [-(-g.shape[0] // world) * (g.numel() // g.shape[0]) for g in grads]
    for dtype, rel in ((torch.float32, 1e-6), (torch.float16, 1e-3)):
        flat = torch.empty(world * sum(padded), dtype=dtype)
        torch.ops.fsdp.chunk_cat([g.to(dtype) for g in grads], dim=0, num_chunks=world,
                                 out=flat.view(world, -1))
        norms = fsdp.parameter_norms(flat, world, padded)
        assert norms.dtype == torch.float32
        expected = torch.stack([torch.linalg.vector_norm(g) for g in grads])
        torch.testing.assert_close(norms, expected, rtol=rel, atol=0)
    flat.view(world, -1)[3, padded[0] + 1] = float("inf")  # parameter 1's last shard
    assert fsdp.parameter_norms(flat, world, padded).isfinite().tolist() == [True, False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameter_norms_on_an_accelerator_read_the_buffer_once_and_hand_foreach_dense_slices(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
) -> None:
    """Issue 35 item 5: on an accelerator (the same code, run here on the CPU) one norm over
    ``flat.view(world, -1)`` reads the buffer (counted by the profiler: one
    ``linalg_vector_norm`` of a ``world``-row input, where a foreach over each parameter's
    strided columns made one per parameter, as CUDA's foreach does for views that are not
    dense), then the per-parameter segments are contiguous slices of one row, which CUDA's
    foreach norm takes in its fused multi-tensor path."""
    from torch.profiler import ProfilerActivity, profile

    world, widths = 8, [6, 3, 10, 1, 0] * 20  # 100 parameters, one of each five empty here
    flat = torch.randn(world * sum(widths), generator=torch.Generator().manual_seed(0))
    flat = flat.to(dtype)
    dense: list[bool] = []
    real = torch._foreach_norm

    def foreach_norm(tensors: list[torch.Tensor], *args: object, **kwargs: object) -> object:
        dense.extend(t.is_contiguous() for t in tensors)
        return real(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", foreach_norm)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        norms = fsdp.segment_norms(flat, world, widths)
    reads = [e for e in prof.events() if e.name == "aten::linalg_vector_norm"
             and e.input_shapes and len(e.input_shapes[0]) == 2
             and e.input_shapes[0][0] == world]
    assert len(reads) == 1, f"{len(reads)} norms read the {world}-row buffer"
    assert len(dense) == len(widths) and all(dense)
    columns = flat.float().view(world, -1).split(widths, dim=1)
    expected = torch.stack([torch.linalg.vector_norm(c) for c in columns])
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(fsdp.parameter_norms(flat, world, widths), expected, rtol=1e-6,
                               atol=0)  # the CPU's own way, the same norms
    flat.view(world, -1)[5, 6 + 3 + 4] = float("nan")  # parameter 2's shard on row 5
    poisoned = fsdp.segment_norms(flat, world, widths).isfinite()
    assert poisoned.tolist() == [i != 2 for i in range(len(widths))]


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _param_group(replicate: int | None = None, factor: float | None = None) -> object:
    from types import SimpleNamespace

    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    kind = DDPMeshInfo if replicate else FSDPMeshInfo
    return SimpleNamespace(
        mesh_info=kind.__new__(kind), gradient_divide_factor=factor,
        force_sum_reduction_for_comms=False,
        _all_reduce_process_group=_Group(replicate) if replicate else None,
    )


def test_predivide_factor_is_fsdps_own() -> None:
    """FSDP2 divides an fp16 reduce-scatter input before the collective (by about the root of
    the data-parallel size), never an fp32 or bf16 one. Pins the private
    ``_get_gradient_divide_factors`` FSDP's divide factor comes from."""
    import inspect

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    params = list(inspect.signature(_fsdp_collectives._get_gradient_divide_factors).parameters)
    assert params == ["reduce_scatter_group", "all_reduce_group", "reduce_dtype", "device_type",
                      "factor", "force_sum_reduction_for_comms"], (
        f"torch {torch.__version__} changed FSDP2's _get_gradient_divide_factors (tested with "
        "2.9 to 2.13): nansentinel.engines.fsdp.predivide_factor must follow it")
    factor = fsdp.predivide_factor
    assert factor(_param_group(), _Group(4), torch.float16, "cuda") == 2.0
    assert factor(_param_group(), _Group(2), torch.float16, "cuda") == 2.0
    assert factor(_param_group(), _Group(8), torch.float16, "cuda") == 4.0
    assert factor(_param_group(replicate=4), _Group(2), torch.float16, "cuda") == 4.0  # HSDP
    assert factor(_param_group(factor=16.0), _Group(4), torch.float16, "cuda") == 4.0
    for dtype in (torch.float32, torch.bfloat16):
        assert factor(_param_group(), _Group(8), dtype, "cuda") == 1.0
        assert factor(_param_group(replicate=2), _Group(4), dtype, "cpu") == 1.0


def test_local_scan_names_nonfinite_gradients_and_strips_the_prefix() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[1].bias.grad[0] = float("inf")
    named = [(f"module.{n}", p) for n, p in model.named_parameters()]
    assert scan_parameters(named, prefix="module.") == ["1.bias"]
    assert naming_detail(model.named_parameters(), poisoned=False) == {}
    assert naming_detail(model.named_parameters(), poisoned=True) == {"parameters": ["1.bias"]}


def _nccl_avg_input(x: torch.Tensor, world: int) -> torch.Tensor:
    """What NCCL's ``AVG`` adds up for one rank's input: ``x`` times 1/world rounded to the
    input's dtype first (NCCL's ``hostToDevRedOp``: ``ncclDevPreMulSum`` with
    ``__float2bfloat16(float(1.0/nRanks))`` for bf16, ``__float2half`` for fp16)."""
    return x * torch.tensor(1.0 / world, dtype=torch.float32).to(x.dtype)


def _plain_ddp_input(x: torch.Tensor, world: int) -> torch.Tensor:
    """What DDP's default adds up (with ``SUM``): each gradient multiplied by the scalar
    1/world while it is copied into the bucket (``at::mul_out`` with a wrapped double scalar,
    computed at fp32 for bf16/fp16)."""
    out = torch.empty_like(x)
    torch.mul(x, 1.0 / world, out=out)
    return out


def _hook_input(rule: str, x: torch.Tensor, world: int) -> torch.Tensor:
    """What the hook hands its all-reduce under ``rule`` (the reduction's op is then SUM)."""
    if rule == "avg":  # the rule before issue 35: NCCL's AVG on CUDA
        return _nccl_avg_input(x, world)
    from nansentinel.engines.ddp import SCALE_THEN_SUM, SUM, scale

    assert rule in (SCALE_THEN_SUM, SUM)
    y = x.clone()
    if rule == SCALE_THEN_SUM:
        scale(y, world, divides=False)
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", [("nccl", "cuda"), ("gloo", "cpu"), ("gloo", "cuda")])
def test_ddp_averages_with_plain_ddps_arithmetic_on_every_backend(
    dtype: torch.dtype, backend: tuple[str, str],
) -> None:
    """Each rank's contribution to the sum is what plain DDP contributes, bit for bit: the
    scale 1/world at fp32, never rounded to bf16/fp16 first as NCCL's AVG does (0.195% too
    large at 24 ranks in bf16: ``bf16(1/24) * 24``)."""
    from nansentinel.engines.ddp import averaging

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(dtype)
    for world in (2, 3, 6, 24, 96, 1000):
        rule = averaging(*backend, world)
        got, want = _hook_input(rule, x, world), _plain_ddp_input(x, world)
        assert torch.equal(got, want), (backend, dtype, world, rule)
    assert torch.tensor(1 / 24).bfloat16().float().item() * 24 == pytest.approx(1.00195, abs=1e-5)


def test_a_world_of_one_sums_and_gradients_kept_as_views_are_divided() -> None:
    from nansentinel.engines.ddp import SUM, averaging, kept_as_view

    # NCCL's one-rank AVG dropped trailing elements (NVIDIA/nccl#1950): a sum is the identity.
    assert averaging("nccl", "cuda", 1) == averaging("gloo", "cpu", 1) == SUM
    bucket = torch.zeros(8)
    assert kept_as_view(bucket[2:6].view(2, 2))  # DDP's gradient_as_bucket_view, kept
    assert not kept_as_view(torch.zeros(2, 2)) and not kept_as_view(None)
