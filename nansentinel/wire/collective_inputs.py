"""What a collective was given: the inputs of the ``c10d`` operations a replay issues.

A replay after a detection (replay.py) runs under a dispatch mode that sees every collective
the user's forward and loss issue, as the operations torch dispatches: ``c10d``'s
(``dist.all_reduce`` is ``c10d.allreduce_``, ``dist.all_to_all_single`` is
``c10d.alltoall_base_``) and the functional ones (``_c10d_functional``: DTensor's
redistributions, ``torch.distributed._functional_collectives``). Where a non-finite value
first *entered* a collective says where it began: the rank whose input to collective #k was
non-finite while every input to #1..#k-1 on every rank was finite made it itself; every rank
it reached got it from a collective's output (origins.py, trace.py).

This module only reads the arguments: which of them are what this rank contributes (the
output buffers of an all-gather or a receive are not, nor a broadcast's or a scatter's buffer
on any rank but the root, whose memory may be uninitialised), and keeps one 0-d device flag
per collective, read once at the end of the replay with the loss: no host sync per
collective. Found by the operations' schemas (argument names, tested with torch 2.13), so an
operation whose arguments move between versions is still read by name.
"""

from __future__ import annotations

from typing import Any

import torch

from nansentinel import checks
from nansentinel.common import torch_insides as insides

#: The dispatch namespaces of collectives (the legacy ``c10d_functional`` too).
NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
#: Operations of those namespaces that are no collective: a wait, autograd's wrapper of a
#: functional result, NCCL's own NaN check.
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd", "check_for_nan"})
#: Collectives with no input of this rank's (their tensors are buffers they fill).
_NO_INPUT = frozenset({"barrier", "monitored_barrier_", "recv_", "recv_any_source_", "irecv"})
#: Collectives whose input counts on the root alone (elsewhere the tensor is a buffer).
_ROOTED = frozenset({"broadcast_", "broadcast", "scatter_"})
#: The names an input argument goes by, first match wins (``input_tensors`` before
#: ``tensors``: an all-gather's ``output_tensors`` are never read).
_INPUT_ARGS = ("input_tensors", "input_tensor", "input_list", "inputs", "input", "tensors",
               "self", "shard")


def is_collective(func: Any) -> bool:
    """``func`` (a dispatched operation) is a collective: a ``c10d`` or functional one, not a
    wait or a wrapper."""
    return (getattr(func, "namespace", None) in NAMESPACES
            and func._opname not in _NOT_COLLECTIVES and "wait" not in func._opname)


def _arg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, a.default_value)
    return None


def _names(func: Any) -> set[str]:
    return {a.name for a in func._schema.arguments}


def _group(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The process group a collective runs on (None when its arguments do not say)."""
    import torch.distributed as dist

    pg = _arg(func, args, kwargs, "process_group")
    if pg is not None:
        return pg if isinstance(pg, dist.ProcessGroup) else dist.ProcessGroup.unbox(pg)
    name = _arg(func, args, kwargs, "group_name")
    if isinstance(name, str):
        return insides.resolve_group(name)
    return name if isinstance(name, dist.ProcessGroup) else None


def group_name(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The name of the collective's process group (``?`` when it cannot be read)."""
    try:
        group = _group(func, args, kwargs)
        return str(group.group_name) if group is not None else "?"
    except Exception:  # an argument torch changed: the name is for the report only
        return "?"


def inputs(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The floating tensors this rank contributes to the collective ``func(*args)``.

    A rooted collective (broadcast, scatter) contributes on its root only; a batch of
    point-to-point operations, its sends. A rooted one whose root cannot be read contributes
    nothing: a buffer taken for an input could hold uninitialised NaN and blame a healthy
    rank."""
    name = func._opname
    if name in _NO_INPUT:
        return []
    if name == "batch_p2p_ops":
        ops = _arg(func, args, kwargs, "op_list") or []
        tensors = _arg(func, args, kwargs, "tensors") or []
        return [t for op, t in zip(ops, tensors, strict=False) if "send" in op
                and (t.is_floating_point() or t.is_complex())]
    arg = next((n for n in _INPUT_ARGS if n in _names(func)), None)
    if arg is None:
        return []
    if name in _ROOTED:
        root = _arg(func, args, kwargs, "root_rank")
        root = _arg(func, args, kwargs, "src") if root is None else root
        try:
            group = _group(func, args, kwargs)
            if group is None or root is None or int(group.rank()) != int(root):
                return []
        except Exception:  # the root cannot be told: contribute nothing (see above)
            return []
    return list(checks.float_tensors(_arg(func, args, kwargs, arg)))


class InputFlags:
    """One 0-d device flag per collective a replay issued: were its inputs on this rank
    finite. Kept on the device (a norm per input tensor, fused as the checks do); the host
    reads them once, with the replay's loss (:meth:`first`)."""

    def __init__(self) -> None:
        #: (place in the replay's issue order, what it was, 0-d "finite" flag).
        self.seen: list[tuple[int, str, torch.Tensor]] = []

    def record(self, index: int, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> None:
        """Flag collective ``index``'s inputs before it runs (an in-place all-reduce
        overwrites them; on CUDA the flag's kernel is queued before the collective's). An
        operation whose arguments cannot be read is left unflagged rather than failing the
        replay: the trace can then miss an origin, never invent one."""
        try:
            given = inputs(func, args, kwargs)
            if not given:
                return
            norms = [checks.tensor_norm(t) for t in given]
            dev = norms[0].device
            flag = torch.isfinite(torch.stack([n.to(dev) for n in norms])).all()
        except Exception:  # an operation torch changed: see above
            return
        what = f"{func._opname.strip('_')} on group {group_name(func, args, kwargs)}"
        self.seen.append((index, what, flag))

    def flags(self, device: torch.device) -> list[torch.Tensor]:
        """The flags as fp32 on ``device``, in order, to be read with the loss."""
        return [f.to(device).float() for _, _, f in self.seen]

    def first(self, values: list[float]) -> tuple[int, str] | None:
        """The first collective whose input was non-finite, from the flags' host ``values``
        (:meth:`flags`, read back): its place and what it was; None when every one was
        finite."""
        for (index, what, _), ok in zip(self.seen, values, strict=True):
            if not ok:
                return index, what
        return None
