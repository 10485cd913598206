"""The FSDP2 gradient path: check each FSDP group's local gradients before its reduce-scatter.

Under FSDP2 (``fully_shard``) the gradients are reduce-scattered inside ``backward()``, one FSDP
group (one ``fully_shard``-ed module) at a time. After that a NaN from one rank sits in some
rank's shard and blame is lost, so checking ``.grad`` at ``step()`` is too late. Since torch 2.9
``FSDPModule.set_custom_reduce_scatter(comm)`` hands a custom ``ReduceScatter`` this rank's flat,
padded, unsharded gradient buffer of one group, in the reduce dtype, just before the collective.
:class:`CheckedReduceScatter` takes one L2 norm of that buffer there (one read, one kernel — the
FSDP counterpart of the DDP bucket check), then calls the reduce-scatter FSDP would have called,
with the same op, group and buffers: healthy steps are bit-identical to plain FSDP2.

HSDP (a 2-D replicate × shard mesh) is the same: the check is before the shard group's
reduce-scatter, and the replicate all-reduce that follows changes nothing for blame.

Naming parameters costs nothing on the healthy step: the hook records one norm per group.
After a detection every rank scans its reduced *sharded* gradients (a non-finite element of
rank r's local gradient lands, reduced, in some rank's shard of the same parameter), the scans
are combined in one max-reduce of a flag per parameter, and each poisoned rank's parameters
are those of its non-finite groups that some rank's scan found non-finite. With one poisoned
rank this is exact; two poisoned ranks with faults in the same group both get that group's
non-finite parameters.

The exchange leaves at ``step()``, one small all-reduce after backward (measured in
bench/README.md), because the number of groups that reduce in a backward is not known up front.

Unsupported setups are refused at construction, naming the module and what to do, never
silently checked too late: several parameter groups in one module (``shard_placement_fn`` with
per-parameter meshes), a shard group of size 1 under a replicate dimension (FSDP then never
calls the reduce-scatter), the symmetric-memory reduce-scatter (``set_symm_mem_for_comm``), and
torch older than 2.9.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from nansentinel import checks
from nansentinel.gradpaths import GradientSink
from nansentinel.gradpaths.local_grads import check_local_grads, scan_parameters
from nansentinel.result import SentinelUsageError

try:  # torch >= 2.6 (public); 2.4–2.5 kept FSDP2 under _composable
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - depends on the installed torch
    try:
        from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef]
    except ImportError:
        FSDPModule = None  # type: ignore[assignment,misc]

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - torch < 2.9
    ReduceScatter = object  # type: ignore[assignment,misc]

#: The first torch release whose FSDP2 accepts a custom reduce-scatter.
MIN_TORCH = "2.9"


def is_fsdp(model: torch.nn.Module) -> bool:
    """True for an FSDP2 root module; a clear error for FSDP1 and for a root left unsharded."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel) or any(
        isinstance(m, FullyShardedDataParallel) for m in model.modules()
    ):
        raise SentinelUsageError(
            "nansentinel: FSDP1 (FullyShardedDataParallel) is not supported: its gradients are "
            "reduced where nansentinel cannot check them per rank first. Use FSDP2 "
            "(torch.distributed.fsdp.fully_shard), which nansentinel checks before each "
            "reduce-scatter."
        )
    if FSDPModule is None:
        return False
    if isinstance(model, FSDPModule):
        return True
    inner = next((n for n, m in model.named_modules() if isinstance(m, FSDPModule)), None)
    if inner is not None:
        raise SentinelUsageError(
            f"nansentinel: the model is not fully_shard-ed at its root, but its submodule "
            f"{inner!r} is. Call fully_shard(model) on the root too (as torchtitan does) and "
            "hand the Sentinel that root module."
        )
    return False


class CheckedReduceScatter(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP's reduce-scatter with a check of this rank's local gradients in front of it.

    ``inner`` is the reduce-scatter FSDP had (its default, or the process-group allocating
    one): allocation and the collective are delegated to it unchanged.
    """

    def __init__(self, path: FSDPPath, index: int, inner: Any, module: str) -> None:
        self.path = path
        self.index = index
        self.inner = inner
        self.module = module

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
        self.path.check(self.index, input_tensor)
        return self.inner(
            output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
            async_op=async_op,
        )


class FSDPPath:
    """Installs a :class:`CheckedReduceScatter` on every FSDP group of an FSDP2 model."""

    name = "fsdp"

    def __init__(self, model: torch.nn.Module, sink: GradientSink) -> None:
        if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
            raise SentinelUsageError(
                f"nansentinel: FSDP2 needs torch >= {MIN_TORCH} (FSDPModule."
                f"set_custom_reduce_scatter, to check gradients before their reduce-scatter); "
                f"this is torch {torch.__version__}. Upgrade torch, or use DDP."
            )
        self.model = model
        self.sink = sink
        names = {id(p): n for n, p in model.named_parameters()}
        #: Per FSDP group: the module's name and its parameters' names, in FSDP's order.
        self.groups: list[tuple[str, list[str]]] = []
        #: (group index, 0-d norm) for every reduce-scatter of the step in progress.
        self.norms: list[tuple[int, torch.Tensor]] = []
        self.reduces = True  # False on a data-parallel world of one: FSDP reduces nothing
        for module_name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                self._install(module_name or "<root>", module, names)

    def _install(self, where: str, module: Any, names: dict[int, str]) -> None:
        param_groups = module._get_fsdp_state()._fsdp_param_groups
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
        inner = group._reduce_scatter_comm
        kind = type(inner).__name__
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
        module.set_custom_reduce_scatter(
            CheckedReduceScatter(self, len(self.groups) - 1, inner, where)
        )

    def check(self, index: int, local_grads: torch.Tensor) -> None:
        """One group's flat local gradients, just before their reduce-scatter (called by
        :class:`CheckedReduceScatter`, on FSDP's reduce-scatter stream)."""
        started = time.perf_counter()
        if not self.norms:
            self.sink.before_reduction(local_grads)
        self.sink.reducing()
        norm = checks.tensor_norm(local_grads)
        if local_grads.is_cuda:
            # Made on FSDP's reduce-scatter stream (the current stream here), read on the
            # default stream at step(), which FSDP's end of backward orders after the
            # reduce-scatters: tell the allocator, so the memory is not reused too early.
            norm.record_stream(torch.cuda.default_stream(local_grads.device))
        self.norms.append((index, norm))
        self.sink.add_grad_norm(norm)
        self.sink.spent(time.perf_counter() - started)

    def check_now(self) -> None:
        """No reduce-scatter ran this step (a world of one, or no backward): check the local
        gradients as they are."""
        if not self.norms:
            started = time.perf_counter()
            check_local_grads(self.model.parameters(), self.sink)
            self.sink.spent(time.perf_counter() - started)

    def naming_detail(self, poisoned: bool, peers: Any) -> dict[str, Any]:
        """This rank's share of the naming, on every rank after a grad fault (see the module
        docstring): one max-reduce of a flag per parameter (is its reduced shard non-finite
        on some rank?), whose size is the model's, not the world's; then, on a poisoned rank,
        the parameters of its groups that were non-finite before the reduce-scatter (one host
        copy of a few norms) and non-finite after it somewhere."""
        names = [n for n, _ in self.model.named_parameters()]
        scanned = scan_parameters(self.model.named_parameters())
        local = set(scanned)
        anywhere = peers.max_floats([float(n in local) for n in names])
        reduced = {n for n, flag in zip(names, anywhere, strict=True) if flag > 0}
        if not poisoned:
            return {}
        if self.norms:
            values = torch.stack([n.to(self.norms[0][1].device) for _, n in self.norms]).tolist()
            bad = sorted({i for (i, _), v in zip(self.norms, values, strict=True)
                          if not math.isfinite(v)})
            suspects = [name for i in bad for name in self.groups[i][1]]
            named = [n for n in suspects if n in reduced] or suspects
        else:  # nothing was reduced (a world of one): the local scan is exact
            named = scanned
        return {"parameters": named} if named else {}

    def reset(self) -> None:
        self.norms = []
