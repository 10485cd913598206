"""The one room of torch's insides: every private torch attribute the package reads.

nansentinel checks gradients where torch hands them over (FSDP2's reduce-scatter, pipelining's
stages), reads c10d's groups and timeouts, and leaves a rendezvous by hand. Those seams are
private and move between releases: FSDP2's ``_fsdp_param_group`` (torch 2.9-2.11) became
``_fsdp_param_groups`` (2.12.1, 2.13), pipelining's ``_shape_inference`` (2.9-2.11) became
``_forward_metadata_inference`` and ``_backward_metadata_inference`` (2.12.1, 2.13). Every read of
such a seam goes through a function here, so that a new torch that moves something breaks this
module, loudly, and nothing else.

Three rules:

- **Probe, don't compare versions.** A backport or a nightly has the attribute without the
  number, so each accessor looks for the names it knows, newest first, and adapts where the
  difference is a rename.
- **Refuse with our own error.** Where a seam is missing, :func:`require` (at construction)
  raises :class:`TorchTooOld`: the feature, the torch found and the minimum (the table
  :data:`FEATURES`, which docs/torch-support.md prints) — never an ``AttributeError`` from
  torch's insides, never a silent skip.
- **Version gates are named constants** (``TORCH_GE_2_X = _at_least("2.X")``, for a behaviour
  no probe can tell), read with one grep and deleted in one place when an old release is
  dropped; none is needed today.

This module imports ``torch.distributed`` lazily, inside the accessors that need it: the
launcher side imports it too (the rendezvous seams), and the checks import no collective.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _python_dispatch

from nansentinel.result import SentinelUsageError

#: The oldest torch release the project runs its tests on (CI's oldest lane): pyproject's
#: lower bound. Below it ``Sentinel(...)`` refuses.
MIN_TORCH = "2.9"


def _at_least(version: str) -> bool:
    """torch's own ``TorchVersion`` comparison, on the release number alone (a nightly
    ``2.16.0a0`` counts as 2.16)."""
    found = torch.__version__.split("+")[0]
    base = ".".join(found.split(".")[:2])
    return torch.torch_version.TorchVersion(base) >= version


class TorchTooOld(SentinelUsageError):
    """A feature needs a newer torch (or a seam this torch does not have)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Feature:
    """One capability that leans on a torch seam.

    Attributes:
        name: what the user asked for, as they would say it.
        minimum: the first torch release that has the seam (tested in CI from there).
        seam: what torch must provide (named in the refusal).
        instead: what to do below the minimum.
        present: probes the running torch (never a version comparison).
    """

    name: str
    minimum: str
    seam: str
    instead: str
    present: Callable[[], bool]


def _fsdp_custom_reduce_scatter() -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return hasattr(FSDPModule, "set_custom_reduce_scatter") and fsdp_divide_factors() is not None


def _fsdp1_comm_hook() -> bool:
    """FSDP1's per-state communication hook and the flat parameter's layout metadata."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:
        return False
    return (hasattr(FullyShardedDataParallel, "register_comm_hook")
            and hasattr(FlatParameter, "_init_metadata"))


def _pipelining() -> bool:
    """The stage's shape-inference seam, probed, not the release number: 2.9 and 2.10 have
    ``_shape_inference`` and the sentinel's seam works there. (torch 2.9.1's own GPipe and
    1F1B schedules over gloo abort in a send/recv size check, "8 vs 4", with no sentinel at
    all: a torch bug the sentinel neither causes nor could avoid by refusing, so it is said in
    docs/torch-support.md, not gated here.)"""
    try:
        from torch.distributed.pipelining import PipelineStage
    except ImportError:
        return False
    return any(hasattr(PipelineStage, n) for n in (*_SHAPE_INFERENCE_NEW, *_SHAPE_INFERENCE_OLD))


def _hash_tensor() -> bool:
    return hasattr(torch, "hash_tensor")


def _sentinel() -> bool:
    return _at_least(MIN_TORCH)


def _collective_hooks() -> bool:
    """``ProcessGroup.register_pre_hook`` (torch 2.14): a Python hook called with each
    collective's send buffers before the collective is issued, on every backend."""
    import torch.distributed as dist

    return dist.is_available() and hasattr(dist.ProcessGroup, "register_pre_hook")


#: Every feature with a minimum of its own, by key (docs/torch-support.md is this table).
FEATURES: dict[str, Feature] = {
    "torch": Feature(
        name="nansentinel", minimum=MIN_TORCH,
        seam=f"torch >= {MIN_TORCH} (the oldest release CI tests)",
        instead="upgrade torch", present=_sentinel),
    "fsdp2": Feature(
        name="FSDP2 / HSDP gradient checks", minimum="2.9",
        seam="FSDPModule.set_custom_reduce_scatter and FSDP2's gradient divide factors",
        instead="upgrade torch, or use DDP", present=_fsdp_custom_reduce_scatter),
    "fsdp1": Feature(
        name="FSDP1 gradient checks", minimum="2.9",
        seam="FullyShardedDataParallel's communication hook (_comm_hook, _comm_hook_state) "
             "and its FlatParameter's layout (_fqns, _numels_with_padding, _is_padding_mask)",
        instead="upgrade torch, or use FSDP2 (fully_shard)", present=_fsdp1_comm_hook),
    "pipelining": Feature(
        name="pipeline stage boundary checks", minimum="2.9",
        seam="PipelineStage's shape-inference methods (_shape_inference, or "
             "_forward_metadata_inference and _backward_metadata_inference)",
        instead="upgrade torch", present=_pipelining),
    "fingerprints": Feature(
        name="replica fingerprints (fingerprint_every)", minimum="2.9",
        seam="torch.hash_tensor", instead="upgrade torch, or set fingerprint_every=0",
        present=_hash_tensor),
    "collective_hooks": Feature(
        name="checks of gradients reduced by hand (or by an engine nansentinel does not "
             "know) before each collective", minimum="2.14",
        seam="ProcessGroup.register_pre_hook (a hook given each collective's PreHookArgs: "
             "name, input_tensors, root, op_id)",
        instead="call sentinel.check_grads() after backward and before your own all-reduce, "
                "or use DDP or FSDP2", present=_collective_hooks),
}


def supported(key: str) -> bool:
    """Whether the running torch has the seam of feature ``key`` (probed once)."""
    return _probed(key)


@functools.cache
def _probed(key: str) -> bool:
    return bool(FEATURES[key].present())


def require(key: str, where: str = "") -> None:
    """Raise :class:`TorchTooOld` unless the running torch has feature ``key``'s seam.

    Args:
        key: a key of :data:`FEATURES`.
        where: what asked for it (a module's name), for the message.
    """
    if supported(key):
        return
    f = FEATURES[key]
    at = f" ({where})" if where else ""
    raise TorchTooOld(
        f"nansentinel: {f.name}{at} needs torch >= {f.minimum}; this is torch "
        f"{torch.__version__}, which lacks {f.seam}. {f.instead[0].upper()}{f.instead[1:]}."
    )


# --- FSDP2 (torch.distributed.fsdp._fully_shard) ---------------------------------------------


def fsdp_param_groups(module: Any) -> list[Any]:
    """The FSDP parameter groups of a ``fully_shard``-ed module: ``_fsdp_param_groups``
    (torch 2.12.1 and >= 2.13, a list) or ``_fsdp_param_group`` (2.9-2.11, one group or None)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [] if group is None else [group]
    raise TorchTooOld(
        f"nansentinel: FSDP2's state on torch {torch.__version__} has neither "
        "_fsdp_param_groups nor _fsdp_param_group: this torch is not supported for FSDP2."
    )


def fsdp_reduce_scatter(param_group: Any) -> Any:
    """The reduce-scatter an FSDP parameter group will call (its ``_reduce_scatter_comm``)."""
    return param_group._reduce_scatter_comm


def fsdp_all_reduce_hook(param_group: Any) -> Callable[[torch.Tensor], None] | None:
    """The all-reduce hook ``FSDPModule.set_all_reduce_hook`` gave an FSDP parameter group (its
    ``_all_reduce_hook``); None where none was set."""
    return getattr(param_group, "_all_reduce_hook", None)


def set_fsdp_all_reduce_hook(param_group: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """Put ``hook`` in place of an FSDP parameter group's all-reduce hook (after
    ``set_all_reduce_hook``, which sets it on every group of a module)."""
    param_group._all_reduce_hook = hook


def fsdp_all_reduce_group(param_group: Any) -> Any:
    """HSDP's replicate process group of an FSDP parameter group (``DDPMeshInfo`` only)."""
    return param_group._all_reduce_process_group


@functools.cache
def fsdp_divide_factors() -> Callable[..., Any] | None:
    """FSDP2's own ``_get_gradient_divide_factors`` (None: not in this torch)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _get_gradient_divide_factors,
        )
    except ImportError:
        return None
    return _get_gradient_divide_factors


@functools.cache
def fsdp_ddp_mesh_info() -> type | tuple[()]:
    """FSDP2's HSDP mesh type (``DDPMeshInfo``; ``()`` where missing: nothing is one)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo
    except ImportError:
        return ()
    return DDPMeshInfo


@functools.cache
def fsdp_reduce_scatter_base() -> type:
    """FSDP2's ``ReduceScatter`` base class (``object`` before torch 2.9)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:
        return object
    return ReduceScatter


# --- FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) ------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class FlatLayout:
    """One FSDP1 flat parameter's layout: each original parameter's name (relative to the
    FSDP module's wrapped module), and each segment's length in the unsharded flat tensor
    (alignment padding included, flagged in ``padding``), in FSDP's order."""

    names: tuple[str, ...]
    numels: tuple[int, ...]
    padding: tuple[bool, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class FSDP1Unit:
    """One FSDP1 instance that reduces gradients (it holds a flat parameter): what the
    sentinel's communication hook needs of it, read once at construction."""

    state: Any
    """The ``FullyShardedDataParallel`` instance (FSDP1's state object)."""
    layout: FlatLayout
    sharded: bool
    """Its gradients are reduce-scattered (FULL_SHARD, SHARD_GRAD_OP, HYBRID_*); False:
    all-reduced (NO_SHARD)."""
    hybrid: bool
    """HYBRID_SHARD or _HYBRID_SHARD_ZERO2: an all-reduce over ``inter_group`` follows."""
    group: Any
    """The process group of its reduce-scatter (or NO_SHARD's all-reduce)."""
    inter_group: Any
    """HYBRID: the replicate group; else None."""


#: What the FSDP1 path reads of each FSDP1 instance after construction.
_FSDP1_STATE_SEAMS = ("_comm_hook", "_comm_hook_state", "_gradient_predivide_factor",
                      "_gradient_postdivide_factor")


def fsdp1_class() -> type:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def fsdp1_unit(state: Any) -> FSDP1Unit | None:
    """The unit of one ``FullyShardedDataParallel`` instance, None where it holds no flat
    parameter (every parameter belongs to a nested instance)."""
    handle = getattr(state, "_handle", None)
    if handle is None:
        return None
    flat = handle.flat_param
    try:
        layout = FlatLayout(tuple(flat._fqns), tuple(flat._numels_with_padding),
                            tuple(bool(b) for b in flat._is_padding_mask))
        strategy = state.sharding_strategy.name
        hybrid = strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
        unit = FSDP1Unit(
            state=state, layout=layout, sharded=bool(handle.uses_sharded_strategy),
            hybrid=hybrid, group=state.process_group,
            inter_group=state._inter_node_pg if hybrid else None)
        for seam in _FSDP1_STATE_SEAMS:  # read at each reduction: probed here, once
            getattr(state, seam)
    except AttributeError as exc:
        raise TorchTooOld(
            f"nansentinel: FSDP1's state on torch {torch.__version__} lacks {exc.name!r}: "
            "this torch is not supported for FSDP1 gradient checks. Use FSDP2 (fully_shard)."
        ) from exc
    return unit


def fsdp1_comm_hook(state: Any) -> tuple[Any, Any]:
    """The communication hook an FSDP1 instance calls, and its state (None, None: FSDP's
    default reduction)."""
    return state._comm_hook, state._comm_hook_state


def set_fsdp1_comm_hook(state: Any, hook: Any, hook_state: Any) -> None:
    """Install ``hook`` on one FSDP1 instance: set as ``register_comm_hook`` sets it, but per
    instance (each gets its own ``hook_state``) and for the hybrid strategies too, whose
    replicate all-reduce the hook then runs itself (``register_comm_hook`` refuses them)."""
    state._comm_hook = hook
    state._comm_hook_state = hook_state


def fsdp1_divide_factors(state: Any) -> tuple[float, float]:
    """FSDP1's gradient (pre-divide, post-divide) factors, read at each reduction (FSDP's own
    default path reads them there too)."""
    return state._gradient_predivide_factor, state._gradient_postdivide_factor


def clean_fsdp1_name(name: str) -> str:
    """A name without FSDP1's and the checkpoint wrapper's prefixes (torch's own rule)."""
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    return str(clean_tensor_name(name))


def reduce_scatter_into() -> Callable[..., Any]:
    """The one-tensor reduce-scatter FSDP1 calls: ``reduce_scatter_single`` where this torch
    has it, else ``reduce_scatter_tensor`` (the same collective under its older name)."""
    import torch.distributed as dist

    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --- sparse layouts ------------------------------------------------------------------------------


def stored_values(t: torch.Tensor) -> torch.Tensor:
    """The values a sparse tensor stores, as a dense tensor sharing its memory (a write lands
    in ``t``); a strided tensor as it is.

    COO: ``_values()``, its raw entries, because ``values()`` refuses an uncoalesced tensor
    (``nn.Embedding(sparse=True)``'s gradients are uncoalesced: a repeated token is an entry
    per occurrence); CSR, CSC, BSR, BSC: ``values()``. The zeros a sparse tensor leaves out
    are finite, so these values hold every non-finite element it has. Another layout
    (``torch._mkldnn``) is returned as it is, for the caller to refuse by name."""
    layout = t.layout
    if layout == torch.strided:
        return t
    if layout == torch.sparse_coo:
        return t._values()
    return t.values() if layout in _COMPRESSED else t


#: The compressed sparse layouts, whose ``values()`` are their stored values.
_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def coo_indices(t: torch.Tensor) -> torch.Tensor:
    """A COO tensor's raw indices (``_indices()``: ``indices()`` refuses an uncoalesced one),
    one column per stored value of :func:`stored_values`."""
    return t._indices()


# --- foreach kernels (torch._foreach_*) --------------------------------------------------------


def foreach_norm(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None
                 ) -> list[torch.Tensor]:
    """One L2 norm per tensor in one fused call (``torch._foreach_norm``), accumulated in
    ``dtype`` where given."""
    if dtype is None:
        return list(torch._foreach_norm(list(tensors), 2))
    return list(torch._foreach_norm(list(tensors), 2, dtype=dtype))


def foreach_max_abs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One max-abs (``ord=inf`` norm) per tensor in one fused call: finite exactly when every
    element is (NaN and Inf propagate through the max), whatever the values' size."""
    return list(torch._foreach_norm(list(tensors), math.inf))


def foreach_mul_(tensors: Sequence[torch.Tensor], factor: Any) -> None:
    """``t *= factor`` for every tensor, in one fused call."""
    torch._foreach_mul_(list(tensors), factor)


def foreach_copy_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``target.copy_(source)`` pairwise, in one fused call."""
    torch._foreach_copy_(list(targets), list(sources))


# --- c10d: groups, backends, stores ------------------------------------------------------------


def default_group() -> Any:
    """The default process group (raises where none is initialised)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group()


def default_store() -> Any:
    """The default process group's store (torchrun's agent store, or the init_method's)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def group_backends(pg: Any) -> list[Any]:
    """The backends of ``pg``, one a device type. Call it on the thread that issues ``pg``'s
    collectives: c10d's first look at a device type inserts into an unlocked map."""
    return list({id(b): b for b in (pg._get_backend(d) for d in pg._device_types)}.values())


def backend_timeout(backend: Any) -> Any:
    """A backend's timeout as its options hold it (a ``timedelta``, or None)."""
    return getattr(getattr(backend, "options", None), "_timeout", None)


def named_groups() -> list[tuple[Any, str]]:
    """Every process group torch knows, with its name (c10d's registry)."""
    import torch.distributed as dist

    return list(dist.distributed_c10d._world.pg_names.items())


def sequence_number(pg: Any) -> int:
    """How many collectives ``pg`` has issued (a host counter in gloo and NCCL alike);
    raises where its backend keeps none."""
    return int(pg._get_sequence_number_for_group())


def resolve_group(name: str) -> Any:
    """The process group registered under ``name`` (functional collectives name groups)."""
    return torch._C._distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]


def register_pre_hook(pg: Any, hook_id: int, fn: Callable[[Any], None]) -> None:
    """Call ``fn(args)`` before each collective issued on ``pg`` (``PreHookArgs``: ``name``,
    ``input_tensors``, ``output_tensors``, ``root``, ``op_id``); one hook per ``hook_id``
    and group, replaced by a second registration under the same id (torch 2.14)."""
    pg.register_pre_hook(hook_id, fn)


def unregister_pre_hook(pg: Any, hook_id: int) -> None:
    """Remove the pre-hook ``hook_id`` of ``pg`` (nothing if there is none)."""
    pg.unregister_pre_hook(hook_id)


def hook_op(args: Any) -> tuple[str, list[torch.Tensor], int, int]:
    """A ``PreHookArgs`` read once: the collective's name (``ALLREDUCE``), the tensors this
    rank sends, the root (-1 when it has none) and the group's ``op_id``."""
    name = args.name
    return (getattr(name, "name", None) or str(name).rsplit(".", 1)[-1],
            list(args.input_tensors), int(args.root), int(args.op_id))


def nccl_trace_dump() -> Callable[[], bytes] | None:
    """NCCL's flight recorder dump (``_dump_nccl_trace``), or None in a build without it."""
    return getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)


def all_gather_into() -> Callable[..., Any]:
    """The one-tensor all-gather: ``all_gather_single`` where this torch has it, else
    ``all_gather_into_tensor`` (the same collective under its older name)."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --- optimizers --------------------------------------------------------------------------------


def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` reads ``found_inf`` and skips on the device, as
    GradScaler drives it: torch's fused optimizers say so with ``_step_supports_amp_scaling``
    (fused Adagrad only from torch 2.13: before it, its kernel ignores found_inf)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


# --- pipelining (torch.distributed.pipelining) -------------------------------------------------

_SHAPE_INFERENCE_NEW = ("_forward_metadata_inference", "_backward_metadata_inference")
_SHAPE_INFERENCE_OLD = ("_shape_inference",)
#: Every name a stage's shape inference runs under, in any supported torch.
SHAPE_INFERENCE_NAMES = frozenset(_SHAPE_INFERENCE_NEW + _SHAPE_INFERENCE_OLD)


def shape_inference_methods(stage: Any) -> tuple[str, ...]:
    """The names of the methods with which ``stage`` infers its neighbours' shapes on its
    first step (on zero tensors: not a micro-batch): the newest names this torch has."""
    for names in (_SHAPE_INFERENCE_NEW, _SHAPE_INFERENCE_OLD):
        if all(hasattr(stage, n) for n in names):
            return names
    raise TorchTooOld(
        f"nansentinel: PipelineStage on torch {torch.__version__} has no shape-inference "
        f"method nansentinel knows ({', '.join(_SHAPE_INFERENCE_NEW + _SHAPE_INFERENCE_OLD)}): "
        "its first step could be taken for a micro-batch. This torch is not supported for "
        "pipeline stage checks."
    )


def schedule_stages(schedule: Any) -> list[Any]:
    """A built pipeline schedule's stages on this rank (``_stages``, or one ``_stage``)."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [] if stage is None else [stage]
    return list(stages)


def has_loss_fn(schedule: Any) -> bool:
    return hasattr(schedule, "_loss_fn")


def schedule_loss_fn(schedule: Any) -> Any:
    """The loss function a schedule calls (read at call time, so it may be replaced)."""
    return schedule._loss_fn


def set_schedule_loss_fn(schedule: Any, fn: Any) -> None:
    schedule._loss_fn = fn


def schedule_has_backward(schedule: Any) -> bool:
    """False while the schedule runs an evaluation (``schedule.eval``)."""
    return bool(schedule._has_backward)


# --- torchft -----------------------------------------------------------------------------------


def set_torchft_init_sync(manager: Any, on: bool) -> None:
    """Whether a built torchft ``Manager`` syncs step 0 by healing every replica group from
    one (its ``init_sync`` argument). torchtitan builds the Manager with torchft's default;
    torchft 0.2.0 keeps the argument as ``_init_sync``, read at each quorum, so setting it
    before the first quorum is the argument's effect. Probed: a torchft without it is
    refused, naming the version nansentinel is tested with."""
    if not isinstance(getattr(manager, "_init_sync", None), bool):
        raise SentinelUsageError(
            f"nansentinel: this torchft's Manager ({type(manager).__module__}) keeps no "
            "_init_sync (torchft 0.2.0's), so fault_tolerance.init_sync=False cannot be "
            "applied under torchtitan's trainer; leave it True (torchft's default) or use "
            "torchft 0.2.0")
    manager._init_sync = on


# --- autograd ---------------------------------------------------------------------------------


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Queue ``fn`` to run when the backward in progress ends, after the callbacks queued
    before it (the autograd engine's final callbacks, which DDP and FSDP use too)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


# --- autograd dispatch ---------------------------------------------------------------------------


#: The base of a mode that sees every operation of a replay.
TorchDispatchMode = _python_dispatch.TorchDispatchMode


# --- the elastic rendezvous (launcher side) ------------------------------------------------------


def leave_rendezvous(handler: Any, seconds: float) -> None:
    """Make a dynamic rendezvous handler stop its keep-alives and leave the rendezvous now,
    waiting at most ``seconds`` (raises where this torch lacks the seams)."""
    import time

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    handler._stop_heartbeats()
    handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + seconds)


def elastic_terminate_handler() -> Callable[[int, Any], None]:
    """The signal handler torchrun's agent installs for its workers' life (it raises
    ``SignalException``, which the agent turns into stopping the workers)."""
    from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

    return _terminate_process_handler


def names_this_machine(host: str) -> bool:
    """Whether a rendezvous endpoint's ``host`` is this machine, by torch's own rule (the one
    the c10d rendezvous uses to decide which node serves its store)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(host))


def rendezvous_store(handler: Any) -> Any:
    """The c10d rendezvous backend's TCPStore a handler holds (None where it holds none)."""
    return getattr(handler, "_store", None)


# --- host memory ---------------------------------------------------------------------------------


def host_cache_emptiable() -> bool:
    """Whether freed pinned blocks can be given back to the system
    (``torch.accelerator.empty_host_cache``, in torch 2.12 and later, with an accelerator)."""
    return hasattr(torch.accelerator, "empty_host_cache") and torch.accelerator.is_available()


def empty_host_cache() -> None:
    torch.accelerator.empty_host_cache()
