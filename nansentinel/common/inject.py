"""Fire drills: make a rank non-finite on purpose, without touching the training script.

``NANSENTINEL_INJECT`` (or ``Sentinel(..., inject=...)``) holds one or more faults separated by
``;``, each a comma-separated list of ``key=value``::

    kind=grad,rank=2,step=5,value=nan
    kind=batch,host=node3,steps=5-9,value=inf;kind=loss,rank=0,step=12

- ``kind``: ``batch`` | ``loss`` | ``grad`` | ``bitflip`` | ``weight`` | ``optimizer_state``
  | ``buffer`` | ``hyperparameter`` (required); ``bitflip`` flips one low mantissa bit of one
  weight element after the rank's optimizer step (finite, ~0.05%: silent data corruption,
  found by the replica fingerprints of replicas.py; takes no value). The state kinds write
  the value into the model's own state as the step begins, before its forward (a memory fault
  between two steps, a bad restore): the first element of the first weight, of the first
  optimizer-state tensor (once the optimizer has stepped) or of the first floating buffer;
  ``hyperparameter`` writes param group 0's ``lr`` for that step as its health leaves (where
  the hyperparameters are read: a schedule written earlier would write over it) and puts the
  user's value back once the step is decided (rare/state.py, docs/recovery.md)
- ``rank=R`` or ``host=NAME``: where (neither: every rank — a divergence drill)
- ``step=S`` or ``steps=A-B`` (inclusive): when, counted like ``StepResult.step`` (required)
- ``value``: ``nan`` (default) | ``inf`` | ``-inf``

An injected fault is written into the real data (the batch's first floating-point element, the
loss value, or the first gradient element before its all-reduce), so it travels the same
detection path as a real fault does; the incident report marks it as injected. A batch fault
writes into the tensor that was passed to ``check_batch`` — a DataLoader's freshly collated
batch, normally; a batch that is a view of a cached dataset would keep the NaN.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from nansentinel.common.torch_insides import stored_values
from nansentinel.result import KINDS

_VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
#: The kinds a drill can inject: the local checks' kinds, a silent bit flip, and the model's
#: own state (its weights, optimizer state, floating buffers and a hyperparameter).
BITFLIP = "bitflip"
DRILLED_STATE = ("weight", "optimizer_state", "buffer")
INJECT_KINDS = (*KINDS, BITFLIP, *DRILLED_STATE, "hyperparameter")


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: ``kind`` at steps ``first..last`` on ``rank`` or ``host``."""

    kind: str
    first: int
    last: int
    value: float = math.nan
    rank: int | None = None
    host: str | None = None

    def matches(self, step: int, rank: int, host: str) -> bool:
        """True when this fault fires at ``step`` on the rank ``rank`` running on ``host``."""
        if not self.first <= step <= self.last:
            return False
        if self.rank is not None and self.rank != rank:
            return False
        return self.host is None or self.host == host


def parse_inject(spec: str) -> list[Fault]:
    """Parse a ``NANSENTINEL_INJECT`` spec; ``ValueError`` names the clause and key."""
    faults = []
    for n, clause in enumerate(c.strip() for c in spec.split(";")):
        if not clause:
            continue
        where = f"fault {n + 1} ({clause!r})"
        fields: dict[str, str] = {}
        for item in clause.split(","):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key or not value:
                raise ValueError(f"{where}: {item.strip()!r} is not key=value")
            if key in fields:
                raise ValueError(f"{where}: {key!r} given twice")
            fields[key] = value
        unknown = set(fields) - {"kind", "rank", "host", "step", "steps", "value"}
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {sorted(unknown)}; "
                "expected kind, rank or host, step or steps, value"
            )
        kind = fields.get("kind")
        if kind not in INJECT_KINDS:
            raise ValueError(
                f"{where}: kind={kind!r}, expected one of {', '.join(INJECT_KINDS)}")
        if kind == BITFLIP and "value" in fields:
            raise ValueError(f"{where}: kind=bitflip takes no value (it flips one bit)")
        if "rank" in fields and "host" in fields:
            raise ValueError(f"{where}: give rank or host, not both")
        if ("step" in fields) == ("steps" in fields):
            raise ValueError(f"{where}: give exactly one of step=S or steps=A-B")
        if "step" in fields:
            first = last = _int(where, "step", fields["step"])
        else:
            a, sep, b = fields["steps"].partition("-")
            if not sep:
                raise ValueError(f"{where}: steps={fields['steps']!r} is not A-B")
            first, last = _int(where, "steps", a), _int(where, "steps", b)
            if last < first:
                raise ValueError(f"{where}: steps={fields['steps']!r} ends before it starts")
        value_name = fields.get("value", "nan").lower()
        if value_name not in _VALUES:
            raise ValueError(f"{where}: value={value_name!r}, expected nan, inf or -inf")
        rank = _int(where, "rank", fields["rank"]) if "rank" in fields else None
        faults.append(
            Fault(kind, first, last, _VALUES[value_name], rank=rank, host=fields.get("host"))
        )
    if not faults:
        raise ValueError("the spec holds no fault")
    return faults


class Injector:
    """The faults that apply to one rank; records what it fired so tests can assert on it."""

    def __init__(self, faults: list[Fault], rank: int, host: str) -> None:
        self.faults = [f for f in faults if f.rank in (None, rank) and f.host in (None, host)]
        self.rank = rank
        self.host = host
        self.fired: list[tuple[int, str]] = []

    def value_for(self, kind: str, step: int) -> float | None:
        """The value to inject for ``kind`` at ``step`` on this rank, or None."""
        for fault in self.faults:
            if fault.kind == kind and fault.matches(step, self.rank, self.host):
                return fault.value
        return None

    def due(self, kind: str, step: int) -> bool:
        """True (and recorded) when a fault of ``kind`` fires at ``step`` on this rank: for
        faults that are not a written value (``bitflip``)."""
        if self.value_for(kind, step) is None:
            return False
        self.fired.append((step, kind))
        return True

    def poison(self, kind: str, step: int, tensor: torch.Tensor | None) -> bool:
        """Write the fault into the first element of ``tensor`` in place; True if it fired.

        A DTensor's (tensor parallel) fault goes into this rank's local tensor, the data this
        rank holds: indexing a sharded DTensor would all-gather it first, a collective issued
        by the drilled rank alone (a hang). A sparse tensor's goes into its first stored value
        (none stored: nothing to write, and it does not fire). Called on every
        step: nothing but a look at the faults unless one is due."""
        value = self.value_for(kind, step) if self.faults else None
        if value is None or tensor is None:
            return False
        with torch.no_grad():
            if hasattr(tensor, "to_local"):  # duck-typed: the launcher side imports this
                tensor = tensor.to_local()
            tensor = stored_values(tensor)
            if tensor.numel() == 0:
                return False
            tensor[(0,) * tensor.dim()] = value
        self.fired.append((step, kind))
        return True


def drill_targets(module: torch.nn.Module, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """``(kind, tensor)`` a state drill writes into (:data:`DRILLED_STATE`): the first
    non-empty weight, optimizer-state tensor and floating buffer of this rank (a DTensor's
    local shard, a ZeRO-3 parameter's partition), where it has one. The optimizer state of
    tensors the module does not hold (DeepSpeed ZeRO's flat partitions) counts after the
    module's parameters' (checks/state.py names it so too)."""
    found: dict[str, torch.Tensor] = {}
    states = getattr(optimizer, "state", None)
    states = states if isinstance(states, dict) else {}
    params = list(module.parameters())
    ids = {id(p) for p in params}
    for p in [*params, *(k for k in states if isinstance(k, torch.Tensor) and id(k) not in ids)]:
        if id(p) in ids and _own(p).numel():
            found.setdefault("weight", _own(p))
        state = states.get(p, {})
        for key in sorted(state, key=str):
            value = state[key]
            if isinstance(value, torch.Tensor) and value.is_floating_point() and \
                    value.layout == torch.strided and value.numel():
                found.setdefault("optimizer_state", _own(value))
    for b in module.buffers():
        if b.is_floating_point() and b.numel():
            found.setdefault("buffer", b)
            break
    return [(kind, found[kind]) for kind in DRILLED_STATE if kind in found]


def _own(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t`` (a DTensor's local shard; a released ZeRO-3 parameter's
    partition; duck-typed, no import)."""
    to_local = getattr(t, "to_local", None)
    own = to_local() if to_local is not None else t
    partition = getattr(t, "ds_tensor", None)
    if own.numel() == 0 and isinstance(partition, torch.Tensor):
        return partition
    return own


def _int(where: str, key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{where}: {key}={text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{where}: {key}={text!r} must be >= 0")
    return value
