"""The FSDP2 gradient path: check each FSDP group's local gradients before its reduce-scatter.

Under FSDP2 (``fully_shard``) the gradients are reduce-scattered inside ``backward()``, one FSDP
group (one ``fully_shard``-ed module) at a time. After that a NaN from one rank sits in some
rank's shard and blame is lost, so checking ``.grad`` at ``step()`` is too late. Since torch 2.9
``FSDPModule.set_custom_reduce_scatter(comm)`` hands a custom ``ReduceScatter`` this rank's flat,
padded, unsharded gradient buffer of one group, in the reduce dtype, just before the collective.
:class:`CheckedReduceScatter` takes one L2 norm of that buffer there (one read, one kernel — the
FSDP counterpart of the DDP bucket check), then calls the reduce-scatter FSDP would have called,
with the same op, group and buffers: healthy steps are bit-identical to plain FSDP2. Under
``policy="drop"`` a rank whose batch or loss was non-finite hands it zeros instead (drop.py).

The buffer FSDP hands over is already divided by its pre-divide factor where the reduce dtype
risks overflow (fp16: about the square root of the data-parallel size; not fp32 or bf16, see
torch's ``_get_gradient_divide_factors``). The norm is multiplied back by that factor, so the
gradient norm this rank reports is its own local gradient's, whatever the reduce dtype.

HSDP (a 2-D replicate × shard mesh) is the same: the check is before the shard group's
reduce-scatter, and the replicate all-reduce that follows changes nothing for blame.

Naming parameters needs no second read on the healthy step: the buffer is laid out as one row
per shard rank, each row the parameters' shards in FSDP's order, so its norm is taken per
column (one read), then per parameter over the columns (a read of 1/world of it), and the
group's norm is the norm of those. A poisoned rank names exactly the parameters whose own local
gradients were non-finite, whatever other ranks were poisoned in the same group. Where the
buffer does not hold every parameter of the group (some had no gradient this step, so the
layout is not known), the group's norm alone is kept and a detection falls back on the reduced
shards: every rank scans its reduced *sharded* gradients (a non-finite element of rank r's
local gradient lands, reduced, in some rank's shard of the same parameter), the scans are
combined in one max-reduce of a flag per parameter (run on every rank after every grad fault,
so that all ranks issue the same collectives; over the FSDP mesh's groups where they are not
the whole job, as under pipeline parallelism, whose stages hold different parameters), and the
poisoned rank gets the parameters of its
non-finite groups that some scan found non-finite.

The exchange leaves at ``step()``, one small all-reduce after backward (measured in
bench/README.md), because the number of groups that reduce in a backward is not known up front.

Modules sharded together in one ``fully_shard([a, b])`` call (torchtitan shards ``norm`` and
``lm_head`` so) share one FSDP state: its group is checked once, named ``a+b``.

Unsupported setups are refused at construction, naming the module and what to do, never
silently checked too late: several parameter groups in one module (``shard_placement_fn`` with
per-parameter meshes), a shard group of size 1 under a replicate dimension (FSDP then never
calls the reduce-scatter), the symmetric-memory reduce-scatter (``set_symm_mem_for_comm``), and
torch older than 2.9. A refusal leaves every module's reduce-scatter as it was, and so does
``close()`` (:meth:`FSDPPath.release`): a model watched once can be watched again.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from nansentinel import checks
from nansentinel.common import torch_insides as insides
from nansentinel.engines.base import Capabilities, GradientSink, KeptNorms
from nansentinel.engines.local import check_grads_now, scan_parameters
from nansentinel.result import SentinelUsageError

try:  # torch >= 2.6 (public)
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - depends on the installed torch
    FSDPModule = None  # type: ignore[assignment,misc]

# FSDP2's ReduceScatter base, its own choice of divide factors and its mesh kinds: private,
# read through the one room of torch's insides (common/torch_insides.py), which adapts
# between releases and refuses with our own error where a seam is missing.
ReduceScatter = insides.fsdp_reduce_scatter_base()

#: The first torch release whose FSDP2 accepts a custom reduce-scatter.
MIN_TORCH = insides.FEATURES["fsdp2"].minimum


def is_fsdp(model: torch.nn.Module) -> bool:
    """True for an FSDP2 model: ``fully_shard``-ed at its root, or below it (Lightning's
    ``ModelParallelStrategy`` shards submodules of the LightningModule in ``configure_model``,
    and the LightningModule is never the root). A clear error for trainable parameters that
    no ``fully_shard``-ed module holds: FSDP reduces no gradient of theirs, so nothing would
    check them before whatever reduces them. (FSDP1 models are taken before, by fsdp1.py.)"""
    if FSDPModule is None:
        return False
    if isinstance(model, FSDPModule):
        return True
    if isinstance(model, torch.nn.ModuleList) and len(model) and all(
        isinstance(part, FSDPModule) for part in model
    ):
        return True  # a pipeline rank's model parts (several stages), each an FSDP2 root
    sharded = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not sharded:
        return False
    held = {id(p) for _, m in sharded for p in cast(torch.nn.Module, m).parameters()}
    outside = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if outside:
        shown = ", ".join(repr(n) for n in outside[:3]) + (" ..." if len(outside) > 3 else "")
        raise SentinelUsageError(
            f"nansentinel: the model is fully_shard-ed below its root ({sharded[0][0]!r}), "
            f"but {len(outside)} trainable parameter(s) belong to no fully_shard-ed module "
            f"({shown}): FSDP2 reduces no gradient of theirs, so the sentinel cannot check "
            "them before their reduction. Call fully_shard on the module that holds them (or "
            "on the root, as torchtitan does)."
        )
    return True  # sharded below its root: every FSDP module is checked (FSDPPath)


class CheckedReduceScatter(ReduceScatter):  # type: ignore[valid-type,misc]  # probed base
    """FSDP's reduce-scatter with a check of this rank's local gradients in front of it.

    ``inner`` is the reduce-scatter FSDP had (its default, or the process-group allocating
    one): allocation and the collective are delegated to it unchanged. ``param_group`` is the
    module's FSDP parameter group, read at each call for its divide factor (the user may call
    ``set_gradient_divide_factor`` after construction).
    """

    def __init__(
        self, path: FSDPPath, index: int, inner: Any, module: str, param_group: Any
    ) -> None:
        self.path = path
        self.index = index
        self.inner = inner
        self.module = module
        self.param_group = param_group

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        if not self.path.sink.inferring:  # a pipeline's shape inference reduces no real step
            world = group.size() if group is not None else 1
            pre = predivide_factor(self.param_group, group, input_tensor.dtype,
                                   input_tensor.device.type)
            self.path.check(self.index, input_tensor, world=world, predivided=pre)
            self.path.sink.withhold(input_tensor)  # policy="drop": zeros (drop.py)
        return self.inner(
            output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
            async_op=async_op,
        )


class FSDPPath:
    """Installs a :class:`CheckedReduceScatter` on every FSDP group of an FSDP2 model."""

    CAPS = Capabilities(
        label="FSDP2", sharded=True,
        replay="its backward would reduce-scatter through the gradient path being judged",
        fingerprints="pure FSDP (no replicate dimension: every rank holds a different shard)",
    )
    recognizes = staticmethod(is_fsdp)
    #: Hand the step's norms over at ``take_norms`` (the device gate decides after the user
    #: zeroed the gradients and after :meth:`reset`); they are always taken (self.norms).
    keep_norms = False
    _kept: KeptNorms | None = None
    #: The FSDP mesh's process groups (shard, then replicate under HSDP) when they do not span
    #: the job (pipeline stages hold different parameters): the naming's flag per parameter is
    #: max-reduced over them, not the job. None: over the job's peers.
    replica_groups: list[Any] | None = None
    _replica_peers: list[Any] | None = None

    def __init__(self, model: torch.nn.Module, sink: GradientSink) -> None:
        insides.require("fsdp2")
        self.model = model
        self.sink = sink
        names = {id(p): n for n, p in model.named_parameters()}
        #: Per FSDP group: the module's name and its parameters' names, in FSDP's order.
        self.groups: list[tuple[str, list[str]]] = []
        #: Per FSDP group: each parameter's padded shard size (its width in a buffer row).
        self.widths: list[list[int]] = []
        #: (group index, 0-d norm, per-parameter norms or None) for every reduce-scatter of the
        #: step in progress; None where the buffer's layout was not known.
        self.norms: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        self.reduces = True  # False on a data-parallel world of one: FSDP reduces nothing
        #: The FSDP meshes' shard and replicate groups: its forward all-gathers run there.
        self.mesh_groups: list[Any] = []
        #: Per check installed: the module it was installed through, and the reduce-scatter
        #: it took the place of (:meth:`release` puts it back).
        self._installed: list[tuple[Any, CheckedReduceScatter]] = []
        try:
            for module_name, module in model.named_modules():
                if isinstance(module, FSDPModule):
                    self._install(module_name or "<root>", module, names)
        except BaseException:  # refused on a later module: the earlier ones as they were
            self.release()
            raise
        self.caps = self._capabilities()

    def release(self) -> None:
        """``close()`` (or a refused construction): each FSDP group's reduce-scatter is the one
        it had before, the same object, so that the model is FSDP's own again and a later
        Sentinel can watch it; a custom reduce-scatter the user set since is left alone.
        Idempotent."""
        installed, self._installed = self._installed, []
        for module, checked in installed:
            group = checked.param_group
            if insides.fsdp_reduce_scatter(group) is checked:
                module.set_custom_reduce_scatter(checked.inner)

    def _capabilities(self) -> Capabilities:
        """HSDP: the mesh's replicate dimension holds this rank's replicas; a mesh that does
        not span the job (TP or PP beside it) makes a replica several ranks, which
        ``policy="drop"`` cannot leave out alone; on a shard mesh of one nothing is reduced."""
        caps = dataclasses.replace(self.CAPS, reduces=self.reduces)
        if self.replica_groups is not None:
            caps = dataclasses.replace(caps, drop=(
                "the FSDP2 mesh does not span the job (tensor or pipeline parallel beside it): "
                "a data-parallel replica is several ranks"))
        for p in self.model.parameters():
            mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", ())
            if mesh is None:
                continue
            for dim, placement in enumerate(placements):
                if placement.is_replicate() and mesh.size(dim) > 1:
                    return dataclasses.replace(caps, fingerprints=None,
                                               replica_group=mesh.get_group(dim))
        return caps

    def _install(self, where: str, module: Any, names: dict[int, str]) -> None:
        param_groups = insides.fsdp_param_groups(module)
        if not param_groups:
            return  # a module whose parameters all belong to fully_shard-ed children
        if len(param_groups) > 1:
            raise SentinelUsageError(
                f"nansentinel: FSDP module {where!r} has {len(param_groups)} parameter groups "
                "(shard_placement_fn with per-parameter meshes); FSDP2 accepts a custom "
                "reduce-scatter only for one group, so its gradients cannot be checked before "
                "their reduction. Shard that module on one mesh."
            )
        group = param_groups[0]
        self._note_mesh(group.mesh_info)
        shard = getattr(group.mesh_info, "shard_mesh_size", 1)
        replicate = getattr(group.mesh_info, "replicate_mesh_size", 1)
        if shard == 1 and replicate > 1:
            raise SentinelUsageError(
                f"nansentinel: FSDP module {where!r} is sharded over a mesh dimension of size 1 "
                f"and replicated {replicate} ways: FSDP2 then skips the reduce-scatter and "
                "all-reduces the gradients where nansentinel cannot check them first. Use a "
                "shard dimension of at least 2, or DDP for pure replication."
            )
        if shard == 1:
            self.reduces = False  # one process: nothing is reduced, step() checks the grads
            return
        inner = insides.fsdp_reduce_scatter(group)
        kind = type(inner).__name__
        if isinstance(inner, CheckedReduceScatter) and inner.path is self:
            # Several modules sharded in one call (torchtitan's ``fully_shard([norm,
            # lm_head])``) share one FSDP state and group: it is checked once, and named
            # after all of them.
            name, params = self.groups[inner.index]
            self.groups[inner.index] = (f"{name}+{where}", params)
            inner.module = self.groups[inner.index][0]
            return
        if isinstance(inner, CheckedReduceScatter):
            raise SentinelUsageError(
                f"nansentinel: FSDP module {where!r} is already watched by another Sentinel; "
                "construct one Sentinel per model."
            )
        if "SymmMem" in kind:
            raise SentinelUsageError(
                f"nansentinel: FSDP module {where!r} uses the symmetric-memory reduce-scatter "
                "(set_symm_mem_for_comm), which cannot be combined with the custom "
                "reduce-scatter nansentinel checks gradients in. Drop set_symm_mem_for_comm."
            )
        params = [names.get(id(fp.sharded_param), "<unnamed>") for fp in group.fsdp_params]
        self.groups.append((where, params))
        self.widths.append([fp.padded_sharded_param_size.numel() for fp in group.fsdp_params])
        checked = CheckedReduceScatter(self, len(self.groups) - 1, inner, where, group)
        module.set_custom_reduce_scatter(checked)
        self._installed.append((module, checked))

    def _note_mesh(self, mesh_info: Any) -> None:
        """Keep every FSDP module's mesh groups (:attr:`mesh_groups`), and those of the first
        where they are not the whole job: under pipeline parallelism each stage's ranks hold
        other parameters, and a flag per parameter reduced over the job would pair up
        different lists (gloo: "Received data size doesn't match expected size")."""
        groups = [g for g in (getattr(mesh_info, "shard_process_group", None),
                              getattr(mesh_info, "replicate_process_group", None))
                  if g is not None]
        self.mesh_groups += [g for g in groups if g not in self.mesh_groups]
        if self._replica_peers is not None or self.replica_groups is not None:
            return
        if not (dist.is_available() and dist.is_initialized()):
            return
        if math.prod(g.size() for g in groups) != dist.get_world_size():
            self.replica_groups = groups

    def _max_over_replicas(self, peers: Any, values: list[float]) -> list[float]:
        """Element-wise max of ``values`` over the ranks that hold the same parameters: the
        job's peers, or the FSDP mesh's groups one after the other (every rank has the same
        mesh dimensions, so all issue the same collectives)."""
        if self.replica_groups is None:
            return peers.max_floats(values)
        if self._replica_peers is None:
            from nansentinel.wire.collectives import Peers

            self._replica_peers = [Peers(g, peers.comm_device) for g in self.replica_groups]
        for group in self._replica_peers:
            values = group.max_floats(values)
        return values

    def check(
        self, index: int, local_grads: torch.Tensor, *, world: int = 1, predivided: float = 1.0
    ) -> None:
        """One group's flat local gradients, just before their reduce-scatter (called by
        :class:`CheckedReduceScatter`, on FSDP's reduce-scatter stream). ``world``: the shard
        group's size (the buffer's rows); ``predivided``: what FSDP divided the buffer by."""
        started = time.perf_counter()
        if not self.norms:
            self.sink.before_reduction(local_grads)
        self.sink.reducing()
        widths = self.widths[index]
        per_param: torch.Tensor | None = None
        if widths and local_grads.numel() == world * sum(widths):
            per_param = parameter_norms(local_grads, world, widths)
            if predivided != 1.0:
                per_param = per_param * predivided
            norm = torch.linalg.vector_norm(per_param)
        else:  # some parameter had no gradient: the layout is not known, one norm
            norm = checks.tensor_norm(local_grads)
            if predivided != 1.0:
                norm = norm * predivided
        if local_grads.is_cuda:
            # Made on FSDP's reduce-scatter stream (the current stream here), read on the
            # default stream at step(), which FSDP's end of backward orders after the
            # reduce-scatters: tell the allocator, so the memory is not reused too early.
            for kept in (norm, per_param):
                if kept is not None:
                    kept.record_stream(torch.cuda.default_stream(local_grads.device))
        self.norms.append((index, norm, per_param))
        self.sink.add_grad_norm(norm)
        self.sink.spent(time.perf_counter() - started)

    def check_now(self) -> None:
        """No reduce-scatter ran this step (a world of one, or no backward): check the local
        gradients as they are."""
        if not self.norms:
            self._kept = check_grads_now(self.model, self.sink, keep=self.keep_norms)

    def take_norms(self) -> KeptNorms | None:
        """Under the device gate, this step's norms by parameter (no host read): a group
        whose buffer layout was not known stands for each of its parameters with its one norm,
        so a detection decided after the gradients are gone names the whole group."""
        if not self.keep_norms:
            return None
        kept, self._kept = self._kept, None
        if self.norms:
            kept = KeptNorms()
            for index, norm, per in self.norms:
                params = self.groups[index][1]
                kept.add(list(params), per if per is not None
                         else norm.reshape(1).expand(len(params)))
        return kept

    def naming_detail(self, poisoned: bool, peers: Any,
                      kept: KeptNorms | None = None) -> dict[str, Any]:
        """This rank's share of the naming, on every rank after a grad fault (see the module
        docstring): one max-reduce of a flag per parameter (is its reduced shard non-finite
        on some rank?), whose size is the model's, not the world's; then, on a poisoned rank,
        the parameters whose own norms before the reduce-scatter were non-finite (one host
        copy of the step's norms), or, for a group whose layout was not known, the parameters
        of that non-finite group that are non-finite after the reduction somewhere."""
        names = [n for n, _ in self.model.named_parameters()]
        scanned = scan_parameters(self.model.named_parameters())
        local = set(scanned)
        anywhere = self._max_over_replicas(peers, [float(n in local) for n in names])
        reduced = {n for n, flag in zip(names, anywhere, strict=True) if flag > 0}
        if not poisoned:
            return {}
        if kept is not None:  # the device gate: the gradients may be gone by now
            found = list(dict.fromkeys(kept.poisoned()))  # in reduce order, as below
            return {"parameters": found} if found else {}
        if not self.norms:  # nothing was reduced (a world of one): the local scan is exact
            return {"parameters": scanned} if scanned else {}
        device = self.norms[0][1].device
        values = torch.cat([
            checks.moved(per if per is not None else norm.reshape(1), device)
            for _, norm, per in self.norms
        ]).tolist()
        named: list[str] = []
        at = 0
        for index, _, per in self.norms:
            params = self.groups[index][1]
            if per is not None:
                flags = values[at:at + len(params)]
                at += len(params)
                named += [n for n, v in zip(params, flags, strict=True) if not math.isfinite(v)]
            else:
                at += 1
                if not math.isfinite(values[at - 1]):
                    named += [n for n in params if n in reduced] or params
        named = list(dict.fromkeys(named))  # a group reduced twice in one step: once each
        return {"parameters": named} if named else {}

    def reset(self) -> None:
        self.norms = []
        self._kept = None


def parameter_norms(flat: torch.Tensor, world: int, widths: list[int]) -> torch.Tensor:
    """Each parameter's L2 norm (fp32, 1-d) in FSDP's reduce-scatter buffer ``flat``: ``world``
    rows, each the parameters' padded shards side by side (``widths``, in FSDP's order).

    On an accelerator, :func:`segment_norms`: one norm down the rows, then one fused foreach
    over the parameters' segments. On the CPU a foreach norm over each parameter's columns
    (strided views): the CPU's foreach runs one norm per tensor anyway, with no launch to
    save, and its reduction down the rows of a wide matrix is slow (measured, 3.7 M floats in
    16 parameters: 157 ms at 4 rows and 17 ms at 64, against 3 ms this way). Either is one
    read of the buffer, with host work that grows with the parameters, not the world."""
    if flat.device.type != "cpu":
        return segment_norms(flat, world, widths)
    views = list(flat.view(world, -1).split(widths, dim=1))
    low = flat.dtype in (torch.float16, torch.bfloat16)
    return torch.stack(insides.foreach_norm(views, torch.float32 if low else None)).float()


def segment_norms(flat: torch.Tensor, world: int, widths: list[int]) -> torch.Tensor:
    """:func:`parameter_norms` as an accelerator takes it: one norm over
    ``flat.view(world, -1)`` down its rows (one kernel, one read of the buffer, fp32
    accumulation), then the norm of each parameter's run of those column norms (``widths``),
    in one foreach call over contiguous slices of that 1/world row, which CUDA fuses into a
    multi-tensor launch. A foreach norm over each parameter's columns of the buffer (strided
    views, not dense) fell back on CUDA to one kernel per parameter on the reduce-scatter
    stream, in front of every reduce-scatter (~700 launches a step at 70 B). A NaN or Inf
    stays in its parameter's segment, so poisoned ranks still name exactly their own."""
    columns = torch.linalg.vector_norm(flat.view(world, -1), 2, dim=0, dtype=torch.float32)
    return torch.stack(insides.foreach_norm(columns.split(widths)))


def predivide_factor(
    param_group: Any, reduce_scatter_group: Any, reduce_dtype: torch.dtype, device_type: str
) -> float:
    """What FSDP2 divided this group's reduce-scatter input by before handing it over: its
    own choice (``_get_gradient_divide_factors``, called with the arguments FSDP passes it),
    1.0 where it divides during or after the collective (fp32, bf16)."""
    all_reduce = (insides.fsdp_all_reduce_group(param_group)
                  if isinstance(param_group.mesh_info, insides.fsdp_ddp_mesh_info()) else None)
    divide_factors = insides.fsdp_divide_factors()
    assert divide_factors is not None  # insides.require("fsdp2") at construction
    pre, _, _, _ = divide_factors(
        reduce_scatter_group, all_reduce, reduce_dtype, device_type,
        param_group.gradient_divide_factor, param_group.force_sum_reduction_for_comms,
    )
    return float(pre) if pre else 1.0
