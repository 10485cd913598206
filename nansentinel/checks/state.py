"""What the model holds: its weights, floating buffers, optimizer state and hyperparameters.

The step's checks read what flows into the reduction (the batch, the loss, the gradients). A
NaN can also enter where nothing flows: a bit flip in one rank's weights, a checkpoint restored
with a NaN in it, a scheduler that returns NaN, a BatchNorm statistic gone bad. These are the
pure reads of that state, checked where a NaN enters (DESIGN.md, "What the model holds"),
never every tensor every step:

- the whole state once at construction and at each documented restore, and on an incident
  (the rare path, rare/state.py): :func:`named_state`, :func:`poisoned`;
- the hyperparameters as each step's health leaves (:func:`read_hyperparameters`): the
  host's own floats, and the tensors on an accelerator on the device (:func:`nonfinite_flag`),
  one flag in the health row; by name after a detection: :func:`poisoned_hyperparameters`.

Why a max-abs norm (``ord=inf``) and not the L2 norm the gradient checks use: a state tensor
is read on the rare path only, where a false alarm costs a verdict, and ``max |x|`` is finite
exactly when every element is (NaN and Inf propagate through the max), whatever the values'
size: an L2 norm of Adam's ``exp_avg_sq`` in fp16 overflows long before any element does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from nansentinel.checks import local
from nansentinel.common import torch_insides as insides
from nansentinel.result import BUFFER, OPTIMIZER_STATE, WEIGHT

#: Tensors named per rank in a message (the report has them all).
SHOWN = 8


@dataclasses.dataclass(frozen=True, slots=True)
class Poisoned:
    """One state tensor holding non-finite elements on this rank."""

    name: str
    """The parameter's or buffer's qualified name; optimizer state as ``param.key``."""
    kind: str
    """``weight``, ``buffer`` or ``optimizer_state``."""
    bad: int
    """Its non-finite elements (this rank's local shard's, for a DTensor)."""
    numel: int
    """Its elements (this rank's)."""

    def describe(self) -> str:
        return (f"{self.kind.replace('_', ' ')} {self.name} ({self.bad} of {self.numel} "
                "elements non-finite)")

    def to_json(self) -> list[Any]:
        return [self.name, self.kind, self.bad, self.numel]

    @classmethod
    def from_json(cls, w: Sequence[Any]) -> Poisoned:
        return cls(str(w[0]), str(w[1]), int(w[2]), int(w[3]))


def named_state(
    module: torch.nn.Module, optimizer: Any = None, *, skip: Iterable[str] = (),
    buffers: bool = True,
) -> list[tuple[str, str, torch.Tensor]]:
    """``(name, kind, local tensor)`` of every parameter, floating buffer and floating tensor
    of each parameter's optimizer state, in the same order on every replica (a DTensor's local
    shard, a ZeRO-3 parameter's partition; the parameters named in ``skip`` left out).
    Optimizer state is named ``param.state_key``; a parameter the optimizer does not hold has
    none. Tensors the optimizer holds that the module does not (DeepSpeed ZeRO's flat fp32
    partitions, the keys of its state) are named by their place: ``optimizer.0`` (a weight)
    and ``optimizer.0.exp_avg``."""
    skipped = set(skip)
    state = getattr(optimizer, "state", None) if optimizer is not None else None
    held_by = state if isinstance(state, dict) else {}
    out: list[tuple[str, str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, p in module.named_parameters():
        seen.add(id(p))
        if name in skipped:
            continue
        out.append((name, WEIGHT, _own(p)))
        out.extend(_optimizer_state(name, held_by.get(p, {})))
    others = [key for key in held_by if isinstance(key, torch.Tensor) and id(key) not in seen]
    for i, key in enumerate(others):
        out.append((f"optimizer.{i}", WEIGHT, _own(key)))
        out.extend(_optimizer_state(f"optimizer.{i}", held_by[key]))
    if buffers:
        out.extend((name, BUFFER, local(b).detach()) for name, b in module.named_buffers()
                   if b.is_floating_point() or b.is_complex())
    return out


def _optimizer_state(name: str, held: Any) -> list[tuple[str, str, torch.Tensor]]:
    """The floating tensors of one parameter's optimizer state, by key."""
    out = []
    for key in sorted(held, key=str):
        value = held[key]
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            out.append((f"{name}.{key}", OPTIMIZER_STATE, local(value).detach()))
    return out


def _own(p: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a parameter: a DTensor's local shard; a DeepSpeed ZeRO-3
    parameter's partition (``ds_tensor``) while the parameter itself is released (empty: the
    forward gathers it from the partitions); any other tensor as it is."""
    own = local(p).detach()
    partition = getattr(p, "ds_tensor", None)  # duck-typed: checks import no engine
    if own.numel() == 0 and isinstance(partition, torch.Tensor):
        return partition.detach()
    return own


def _values(t: torch.Tensor) -> torch.Tensor:
    """What is read of ``t``: a sparse tensor's stored values (its zeros are finite), a complex
    tensor as its real pairs."""
    t = insides.stored_values(t)
    return torch.view_as_real(t) if t.is_complex() else t


def poisoned(named: Sequence[tuple[str, str, torch.Tensor]],
             constants: frozenset[str] = frozenset()) -> list[Poisoned]:
    """The tensors of ``named`` (:func:`named_state`) holding a non-finite element, in order;
    a buffer of ``constants`` (:func:`constant_buffers`) only where it holds a NaN.

    One fused max-abs norm per (device, dtype) group and one host read per group; the
    non-finite elements are counted only in the tensors found (a detection's or a restore's
    cost, never a healthy step's). A meta tensor holds no values: skipped."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    values = [_values(t) for _, _, t in named]
    masked = [i for i, (name, kind, _) in enumerate(named)
              if kind == BUFFER and name in constants]
    for i, t in enumerate(values):
        if t.numel() and not t.is_meta and i not in masked:
            groups.setdefault((t.device, t.dtype), []).append(i)
    found = [i for i in masked if bool(values[i].isnan().any())]
    for indices in groups.values():
        norms = insides.foreach_max_abs([values[i] for i in indices])
        finite = torch.isfinite(torch.stack(list(norms))).tolist()
        found.extend(i for i, ok in zip(indices, finite, strict=True) if not ok)
    out = []
    for i in sorted(found):
        name, kind, t = named[i]
        v = values[i]
        bad = v.isnan() if i in masked else ~torch.isfinite(v)
        out.append(Poisoned(name, kind, int(bad.sum()), v.numel()))
    return out


def constant_buffers(module: torch.nn.Module) -> frozenset[str]:
    """The floating buffers that hold +-Inf by design, read once at construction: an additive
    attention mask of ``-inf`` (``torch.full((T, T), -inf).triu(1)``), a running minimum
    started at ``+inf``. Their infinities are the model's own, not a fault, and only a NaN in
    them is (:func:`poisoned`, the health row's buffer norms). A buffer holding a NaN at
    construction is not one of them: it is refused. One host read per buffer, once."""
    out = set()
    for name, b in module.named_buffers():
        if not (b.is_floating_point() or b.is_complex()) or not b.numel() or b.is_meta:
            continue
        v = _values(local(b))
        if bool(torch.isinf(v).any()) and not bool(torch.isnan(v).any()):
            out.add(name)
    return frozenset(out)


@dataclasses.dataclass(frozen=True, slots=True)
class StateFindings:
    """What the ranks hold that is not finite, the same on every rank."""

    step: int
    poisoned: dict[int, list[Poisoned]]
    """Rank (in the exchange's group) -> its non-finite tensors."""
    hosts: dict[int, str]
    """Rank -> its host, for the poisoned ranks."""
    repairable: bool
    """Every poisoned tensor has a finite copy on a rank of the same replica group."""
    why: str = ""
    """Why not, in words (empty when it is)."""

    @property
    def ranks(self) -> list[int]:
        return sorted(self.poisoned)

    @property
    def bad_hosts(self) -> list[str]:
        return sorted(set(self.hosts.values()))

    @property
    def tensors(self) -> list[str]:
        """Every poisoned tensor's name, on any rank, sorted."""
        return sorted({p.name for found in self.poisoned.values() for p in found})

    def describe(self) -> str:
        """The poisoned ranks, their hosts and their first tensors (ranks holding the same
        named together, so that a checkpoint poisoned on every rank is one clause)."""
        return describe_ranks({r: (self.hosts.get(r, "?"), [p.describe() for p in found])
                               for r, found in self.poisoned.items()})

    def named(self) -> dict[int, list[str]]:
        """Rank -> its poisoned tensors in words (``StepResult.poisoned_state``)."""
        return {r: [p.describe() for p in found] for r, found in sorted(self.poisoned.items())}

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "repairable": self.repairable, "why": self.why,
                "ranks": {str(r): {"host": self.hosts.get(r, "?"),
                                   "tensors": [p.to_json() for p in found]}
                          for r, found in sorted(self.poisoned.items())}}


def describe_ranks(rows: dict[int, tuple[str, list[str]]]) -> str:
    """``ranks 0, 1, 2 (host node1): weight fc.weight (1 of 16 elements non-finite)``: rank ->
    (host, what it holds in words), ranks holding the same words named in one clause, at most
    :data:`SHOWN` ranks, hosts and words each (the rest counted), so that a message stays a
    line at any world size."""
    clauses: dict[tuple[str, ...], list[int]] = {}
    for rank in sorted(rows):
        clauses.setdefault(tuple(rows[rank][1]), []).append(rank)
    parts = []
    for words, ranks in clauses.items():
        hosts = sorted({rows[r][0] for r in ranks})
        who = ", ".join(map(str, ranks[:SHOWN])) + (
            f" and {len(ranks) - SHOWN} more" if len(ranks) > SHOWN else "")
        where = ", ".join(hosts[:SHOWN]) + (
            f" and {len(hosts) - SHOWN} more" if len(hosts) > SHOWN else "")
        what = ", ".join(words[:SHOWN]) + (
            f", and {len(words) - SHOWN} more" if len(words) > SHOWN else "")
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {who} "
                     f"(host{'s' if len(hosts) > 1 else ''} {where}): {what}")
    return "; ".join(parts)


def any_nonfinite(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d int64 on ``device``: 1 where some tensor holds a non-finite element, else 0; no
    host sync (one fused max-abs per device and dtype group, moved together). For a pass that
    reads every tensor anyway (the replica fingerprints) and has its own host read."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        v = _values(t)
        if v.numel() and not v.is_meta:
            groups.setdefault((v.device, v.dtype), []).append(v)
    flags = [(~torch.isfinite(torch.stack(insides.foreach_max_abs(ts)))).any().to(
        device, torch.int64, non_blocking=device.type != "cpu") for ts in groups.values()]
    if not flags:
        return torch.zeros((), dtype=torch.int64, device=device)
    return flags[0] if len(flags) == 1 else torch.stack(flags).amax()


# --- hyperparameters ----------------------------------------------------------------------


def _elements(value: Any) -> Iterable[tuple[str, Any]]:
    """``(suffix, element)`` of one param-group entry: the entry itself, or each element of a
    tuple or list (Adam's ``betas``: ``[0]``, ``[1]``)."""
    if isinstance(value, tuple | list):
        yield from ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        yield "", value


def read_hyperparameters(optimizer: Any) -> tuple[bool, list[torch.Tensor]]:
    """One pass over every param group's entries, each step as its health leaves: whether
    the floating hyperparameters the host reads without a sync (floats, one-element CPU
    tensors, in tuples too) are all finite, and the floating tensors on an accelerator (a
    tensor ``lr`` on the GPU, as capturable and fused optimizers take, or tensor ``betas``),
    which the host never reads (each read would sync): :func:`nonfinite_flag` checks them on
    the device. A sum of finite hyperparameters stays finite (they are rates, decays and
    epsilons, nowhere near 1e308), and a NaN or an Inf anywhere makes it non-finite."""
    total, on_device = 0.0, []
    for group in optimizer.param_groups:
        for key, value in group.items():
            kind = type(value)
            if kind is float:
                total += value
                continue
            if key == "params" or not (kind is tuple or kind is list
                                       or isinstance(value, torch.Tensor)):
                continue
            for v in (value if kind is tuple or kind is list else (value,)):
                if type(v) is float:
                    total += v
                elif isinstance(v, torch.Tensor) and v.is_floating_point():
                    if v.device.type != "cpu":
                        on_device.append(v)
                    elif v.numel() == 1:
                        total += float(v)
    return math.isfinite(total), on_device


def nonfinite_flag(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d fp32 on ``device``: 1.0 where any element of ``tensors`` is not finite (no host
    sync: the health row carries it as its ``hyper_bad`` slot)."""
    values = torch.cat([t.detach().reshape(-1).to(device, torch.float32) for t in tensors])
    return (~torch.isfinite(values)).any().to(torch.float32)


def poisoned_hyperparameters(optimizer: Any) -> list[tuple[int, str, float]]:
    """``(param group, key, value)`` of every non-finite hyperparameter (``betas[1]`` for an
    element of a tuple), tensors on an accelerator included: read on the rare path only (a
    report, a refusal), where a sync costs nothing that matters."""
    out: list[tuple[int, str, float]] = []
    for g, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if key == "params":
                continue
            for suffix, v in _elements(value):
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == 1:
                    v = float(v)
                if type(v) is float and not math.isfinite(v):
                    out.append((g, key + suffix, v))
    return out


def describe_hyperparameters(found: Sequence[tuple[int, str, float]]) -> str:
    """``param group 0's lr is nan, param group 1's betas[1] is inf`` (at most 8 named)."""
    words = [f"param group {g}'s {key} is {value}" for g, key, value in found[:8]]
    more = f", and {len(found) - 8} more" if len(found) > 8 else ""
    return ", ".join(words) + more
