"""The FSDP1 gradient path: each FSDP unit's local gradient, checked before its reduction.

FSDP1 (``FullyShardedDataParallel``) reduces each unit's flat gradient in its post-backward
hook, one unit (one wrapped module, one ``FlatParameter``) at a time. After that a NaN from one
rank sits in some rank's shard, so checking ``.grad`` at ``step()`` is too late. FSDP1 hands
its communication hook this rank's flat, *unsharded* gradient of the unit, in the reduce dtype,
just before the collective: padded to a multiple of the shard group with an output shard to
fill (the sharded strategies), or the flat gradient itself (``NO_SHARD``). That is the seam, on
every torch in the range (a private one: set through ``common/torch_insides.py``).

The hook replaces FSDP1's default reduction, so it does exactly what the default does, with
the factors and dtypes FSDP holds (``_runtime_utils._reduce_grad``): divide by the pre-divide
factor, reduce-scatter (or all-reduce, ``NO_SHARD``), then for ``HYBRID_SHARD`` all-reduce the
shard over the replicate group, then divide by the post-divide factor. Healthy steps are
bit-identical to plain FSDP1 (tested). Two things differ from ``register_comm_hook``: the hook
is set per unit, with that unit's own state (which flat parameter it holds: the names), and on
the hybrid strategies too, which ``register_comm_hook`` refuses because its hook would have to
run the replicate all-reduce itself — this one does. It runs that all-reduce on the stream the
hook is called on (FSDP's post-backward stream), not on FSDP's separate all-reduce stream: the
order FSDP's accumulation after the hook needs, at the cost of one overlap on a GPU.

The check is one fused pass: the flat gradient split at its parameters' boundaries (the flat
parameter's metadata: names, lengths with alignment padding), one foreach norm over those
contiguous slices (fp32 accumulation for fp16/bf16), and the unit's norm is the norm of those.
So a poisoned rank names exactly its own parameters from the norms taken before the reduction,
with no scan and no collective after a detection. Under ``policy="drop"`` a rank whose batch or
loss was non-finite reduces zeros (drop.py); a due grad drill is written into the step's first
flat gradient before it is checked.

The exchange leaves at ``step()`` (as on FSDP2): how many units reduce in one backward is not
known up front (a unit whose parameters got no gradient does not reduce).

Refused at construction, naming the unit and what to do: a communication hook already set
(the user's, or a low-precision compression hook: FSDP1 calls one hook, and the check is it),
another Sentinel's, trainable parameters outside every FSDP1 unit (nothing reduces them where
they could be checked), and torch without the seam.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from nansentinel import checks
from nansentinel.common import torch_insides as insides
from nansentinel.engines.base import Capabilities, GradientSink, KeptNorms
from nansentinel.engines.local import check_grads_now, naming_detail
from nansentinel.result import SentinelUsageError


def is_fsdp1(model: Any) -> bool:
    """True for an FSDP1 model: a ``FullyShardedDataParallel`` root, or a module holding FSDP1
    instances (then every trainable parameter must be in one, see :class:`FSDP1Path`)."""
    try:
        fsdp = insides.fsdp1_class()
    except ImportError:  # pragma: no cover - a torch without torch.distributed.fsdp
        return False
    return isinstance(model, torch.nn.Module) and any(
        isinstance(m, fsdp) for m in model.modules())


@dataclasses.dataclass(slots=True)
class CheckedUnit:
    """The hook state of one FSDP1 unit (FSDP1 passes it to :func:`_sharded_hook` /
    :func:`_unsharded_hook`): the path, the unit and where its names are kept. A plain object:
    an ``nn.Module`` attribute on the FSDP instance would be registered as a submodule."""

    path: FSDP1Path
    index: int
    unit: insides.FSDP1Unit
    keep: list[int]
    """Indices of the flat parameter's segments that are parameters (not padding)."""
    total: int
    """The flat parameter's unsharded length (its segments'), before world padding."""
    numels: list[int]
    """Its segments' lengths (the layout's), as ``split`` takes them."""


class FSDP1Path:
    """Installs a checking communication hook on every FSDP1 unit of the model."""

    # Not ``wraps``: the sentinel watches the FSDP1 root itself (its state_dict() is FSDP1's,
    # which a rollback needs), and a model that only holds FSDP1 units inside is recognised too.
    CAPS = Capabilities(
        label="FSDP1", sharded=True,
        replay="its backward would reduce through the gradient path being judged",
        fingerprints="FSDP1 sharding without replicas (FULL_SHARD / SHARD_GRAD_OP: every rank "
                     "holds a different shard)",
    )
    recognizes = staticmethod(is_fsdp1)
    #: Hand the step's norms over at ``take_norms`` (they are always taken: self.norms).
    keep_norms = False
    _kept: KeptNorms | None = None

    def __init__(self, model: torch.nn.Module, sink: GradientSink) -> None:
        insides.require("fsdp1")
        self.model = model
        self.sink = sink
        #: Per unit: its parameters' full names (as the user's module names them).
        self.names: list[list[str]] = []
        #: (unit index, 0-d norm, per-parameter norms) of every reduction of this step.
        self.norms: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        units: list[CheckedUnit] = []
        fsdp = insides.fsdp1_class()
        for where, module in model.named_modules():
            if not isinstance(module, fsdp):
                continue
            unit = insides.fsdp1_unit(module)
            if unit is None:
                continue
            units.append(self._unit(where, unit, len(units)))
        self._refuse_outside(fsdp)
        for checked in units:  # installed only once every unit passed its checks
            hook = _sharded_hook if checked.unit.sharded else _unsharded_hook
            insides.set_fsdp1_comm_hook(checked.unit.state, hook, checked)
        self.units = units
        #: FSDP1's process groups: its forward all-gathers of parameters run there, and
        #: carry no batch's NaN to another rank's loss (origins.py).
        self.mesh_groups: list[Any] = []
        for checked in units:
            for g in (checked.unit.group, checked.unit.inter_group):
                if g is not None and g not in self.mesh_groups:
                    self.mesh_groups.append(g)
        self.caps = self._capabilities()

    def _unit(self, where: str, unit: insides.FSDP1Unit, index: int) -> CheckedUnit:
        label = insides.clean_fsdp1_name(where) or "<root>"
        hook, state = insides.fsdp1_comm_hook(unit.state)
        if isinstance(state, CheckedUnit):
            raise SentinelUsageError(
                f"nansentinel: FSDP1 unit {label!r} is already watched by another Sentinel; "
                "construct one Sentinel per model.")
        if hook is not None:
            raise SentinelUsageError(
                f"nansentinel: FSDP1 unit {label!r} already has a communication hook "
                f"({getattr(hook, '__name__', type(hook).__name__)}); FSDP1 calls one hook per "
                "unit, and nansentinel checks each rank's gradients in it before their "
                "reduction. Remove register_comm_hook (for a low-precision reduction use "
                "MixedPrecision(reduce_dtype=...)), or construct the Sentinel without it.")
        layout = unit.layout
        prefix = insides.clean_fsdp1_name(where)
        self.names.append([f"{prefix}.{n}" if prefix else n for n in layout.names])
        keep = [i for i, pad in enumerate(layout.padding) if not pad]
        if len(keep) != len(layout.names):
            raise insides.TorchTooOld(
                f"nansentinel: FSDP1 unit {label!r} on torch {torch.__version__} names "
                f"{len(layout.names)} parameters for {len(keep)} segments of its flat "
                "parameter: this torch's layout is not supported for FSDP1 gradient checks.")
        return CheckedUnit(self, index, unit, keep, sum(layout.numels), list(layout.numels))

    def _refuse_outside(self, fsdp: type) -> None:
        """Trainable parameters in no FSDP1 unit: nothing reduces them in a hook, so nothing
        would check them before whatever reduces them."""
        held = {id(p) for m in self.model.modules() if isinstance(m, fsdp)
                for p in m.parameters()}
        outside = [n for n, p in self.model.named_parameters()
                   if p.requires_grad and id(p) not in held]
        if outside:
            shown = ", ".join(repr(n) for n in outside[:3]) + (" ..." if len(outside) > 3 else "")
            raise SentinelUsageError(
                f"nansentinel: the model holds FSDP1 units, but {len(outside)} trainable "
                f"parameter(s) belong to none ({shown}): FSDP1 reduces no gradient of theirs, "
                "so the sentinel cannot check them before their reduction. Wrap the root "
                "module in FullyShardedDataParallel (an auto_wrap_policy wraps the rest).")

    def _capabilities(self) -> Capabilities:
        """NO_SHARD: the shard group holds this rank's replicas; HYBRID: the replicate group
        does. A group that does not span the job makes a replica several ranks, which
        ``policy="drop"`` cannot leave out alone."""
        caps = self.CAPS
        if not self.units:
            return dataclasses.replace(caps, reduces=False)
        unit = self.units[0].unit
        spans = unit.group.size() * (unit.inter_group.size() if unit.hybrid else 1)
        if dist.is_initialized() and spans != dist.get_world_size():
            caps = dataclasses.replace(caps, drop=(
                "the FSDP1 process groups do not span the job: a data-parallel replica is "
                "several ranks"))
        if not unit.sharded:
            return dataclasses.replace(caps, fingerprints=None, replica_group=unit.group)
        if unit.hybrid and unit.inter_group.size() > 1:
            return dataclasses.replace(caps, fingerprints=None, replica_group=unit.inter_group)
        return caps

    def check(self, checked: CheckedUnit, flat: torch.Tensor) -> None:
        """One unit's flat local gradients, just before their reduction (FSDP's post-backward
        stream): per-parameter norms over the flat parameter's segments, in one fused pass."""
        started = time.perf_counter()
        if not self.norms:
            self.sink.before_reduction(flat)
        self.sink.reducing()
        segments = flat[:checked.total].split(checked.numels)
        low = flat.dtype in (torch.float16, torch.bfloat16)
        norms = insides.foreach_norm(segments, torch.float32 if low else None)
        if len(checked.keep) != len(norms):
            norms = [norms[i] for i in checked.keep]
        per_param = torch.stack(norms)
        if per_param.dtype != torch.float32:
            per_param = per_param.float()
        norm = torch.linalg.vector_norm(per_param)
        if flat.is_cuda:
            # Made on FSDP's post-backward stream, read on the default stream at step(),
            # which FSDP's end of backward orders after it: tell the allocator.
            for kept in (norm, per_param):
                kept.record_stream(torch.cuda.default_stream(flat.device))
        self.norms.append((checked.index, norm, per_param))
        self.sink.add_grad_norm(norm)
        self.sink.spent(time.perf_counter() - started)

    def check_now(self) -> None:
        """No unit reduced this step (no backward, or every micro-batch under ``no_sync``):
        check the local gradients as they are."""
        if not self.norms:
            self._kept = check_grads_now(self.model, self.sink, keep=self.keep_norms)

    def take_norms(self) -> KeptNorms | None:
        """Under the device gate: this step's per-parameter norms (no host read)."""
        if not self.keep_norms:
            return None
        kept, self._kept = self._kept, None
        if self.norms:
            kept = KeptNorms()
            for index, _, per in self.norms:
                kept.add(list(self.names[index]), per)
        return kept

    def naming_detail(self, poisoned: bool, peers: Any,
                      kept: KeptNorms | None = None) -> dict[str, Any]:
        """A poisoned rank's parameters whose local gradients were non-finite before their
        reduction, from the norms taken in the hook (one host copy, a detection only); no
        collective, on any rank."""
        if not poisoned:
            return {}
        if kept is not None:
            found = list(dict.fromkeys(kept.poisoned()))
            return {"parameters": found} if found else {}
        if not self.norms:  # nothing was reduced: the local gradients as they lie
            return naming_detail(self.model.named_parameters(), poisoned)
        values = torch.cat([checks.moved(per, self.norms[0][2].device)
                            for _, _, per in self.norms]).tolist()
        named: list[str] = []
        at = 0
        for index, _, per in self.norms:
            names = self.names[index]
            named += [n for n, v in zip(names, values[at:at + len(names)], strict=True)
                      if not math.isfinite(v)]
            at += per.numel()
        named = list(dict.fromkeys(named))  # a unit reduced twice in one step: once each
        return {"parameters": named} if named else {}

    def reset(self) -> None:
        self.norms = []
        self._kept = None


def _withheld(checked: CheckedUnit, flat: torch.Tensor) -> None:
    """Check, then zero under ``policy="drop"`` (a pipeline's shape inference is no step)."""
    sink = checked.path.sink
    if not sink.inferring:
        checked.path.check(checked, flat)
        sink.withhold(flat)


def _div_if_needed(tensor: torch.Tensor, factor: float) -> None:
    """FSDP1's own rule (``_runtime_utils._div_if_needed``): divide only by a factor > 1."""
    if factor > 1:
        tensor.div_(factor)


def _sharded_hook(checked: CheckedUnit, padded: torch.Tensor, shard: torch.Tensor) -> None:
    """FULL_SHARD, SHARD_GRAD_OP and the hybrid strategies: check ``padded`` (this rank's
    unsharded flat gradient), then reduce it into ``shard`` as FSDP1's default does."""
    _withheld(checked, padded)
    unit = checked.unit
    pre, post = insides.fsdp1_divide_factors(unit.state)
    _div_if_needed(padded, pre)
    insides.reduce_scatter_into()(shard, padded, group=unit.group)
    if unit.hybrid:
        dist.all_reduce(shard, group=unit.inter_group)
    _div_if_needed(shard, post)


def _unsharded_hook(checked: CheckedUnit, grad: torch.Tensor) -> None:
    """NO_SHARD: check this rank's flat gradient, then all-reduce it as FSDP1's default does."""
    _withheld(checked, grad)
    pre, post = insides.fsdp1_divide_factors(checked.unit.state)
    _div_if_needed(grad, pre)
    dist.all_reduce(grad, group=checked.unit.group)
    _div_if_needed(grad, post)
