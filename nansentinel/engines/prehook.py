"""The pre-hook gradient path: each gradient collective's send buffer, checked as it leaves.

For a model no engine of the registry recognises, in a job of several ranks: a research loop
that calls ``dist.all_reduce(p.grad)`` per parameter or per flattened bucket, a
``reduce_scatter_tensor`` loop, an engine outside the registry that reduces through
``torch.distributed``. torch 2.14 calls a process group's pre-hooks with each collective's
send buffers (``PreHookArgs.input_tensors``) before the collective is issued, on every
backend; this path registers one on every group of the job, so the buffer each rank sends is
checked before any other rank's values are mixed into it, which is where blame belongs.

Which collectives are the gradients': those issued once this step's backward has begun (a
forward hook on the model hooks its outputs; their first gradient marks the begin), until
the step's check is closed (``check_grads()``, or ``step()``), and that reduce what each rank
sends (all-reduce, reduce-scatter, reduce, all-to-all). An all-gather, a broadcast or a send
in the backward moves values already reduced (the shards a reduce-scatter returned, a
ZeRO-style parameter gather): a NaN from one rank sits there on every rank, so they are not
checked. Collectives before the backward are the forward's (tensor parallelism's
all-reduces, an MoE all-to-all): not gradients, but where a NaN crosses one, the first of
them whose send buffer was non-finite on some rank names the rank where it began. So each
keeps the norm of what this rank sent (one norm per collective, on the device, no host
sync), read only after a detection (:meth:`PreHookPath.first_forward_send`,
rare/live_trace.py): exact on the step itself, a transient fault and a run without a replay
function included. The sentinel's own collectives (the health exchange, the rare path) are
told by their caller, the first frame outside ``torch``, and never checked.

Each gradient collective costs one fused norm of its floating send buffers, on their device,
with no host sync (a 0-d tensor added to the step's row); the exchange leaves at ``step()``.
A loop that still calls ``check_grads()`` before its own all-reduce keeps working: its
gradients are checked there, as on the local path, and the collectives after it are left
alone. A step with no gradient collective (every micro-batch but the last under
accumulation, or a loop that reduces nothing) is checked at ``step()`` on the local
gradients, as on the local path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from nansentinel import checks
from nansentinel.common import torch_insides as insides
from nansentinel.engines.base import EXCHANGE, Capabilities, GradientSink, KeptNorms
from nansentinel.engines.ddp_seam import outputs
from nansentinel.engines.local import check_grads_now, naming_detail

log = logging.getLogger("nansentinel")

#: The sentinel's pre-hook id on every group ("NANS"): a later Sentinel in the same process
#: replaces an earlier one's hook instead of stacking a second.
HOOK_ID = 0x4E414E53
#: The collectives that reduce what each rank sends (``HookOpName``): a gradient reduction.
REDUCTIONS = frozenset({"ALLREDUCE", "ALLREDUCE_COALESCED", "REDUCE", "REDUCE_SCATTER",
                        "REDUCE_SCATTER_BASE", "REDUCE_SCATTER_TENSOR_COALESCED", "ALLTOALL",
                        "ALLTOALL_BASE"})


#: What the user called, by ``HookOpName`` (the names a replay's trace gives them too).
API_NAMES = {
    "ALLREDUCE": "all_reduce", "ALLREDUCE_COALESCED": "all_reduce_coalesced",
    "ALLGATHER": "all_gather", "ALLGATHER_BASE": "all_gather_into_tensor",
    "ALLGATHER_COALESCED": "all_gather_coalesced",
    "ALLGATHER_INTO_TENSOR_COALESCED": "all_gather_into_tensor_coalesced",
    "REDUCE_SCATTER": "reduce_scatter", "REDUCE_SCATTER_BASE": "reduce_scatter_tensor",
    "REDUCE_SCATTER_TENSOR_COALESCED": "reduce_scatter_tensor_coalesced",
    "ALLTOALL": "all_to_all", "ALLTOALL_BASE": "all_to_all_single",
}
#: Collectives that send nothing of this rank's (their tensors are buffers they fill).
_NO_INPUT = frozenset({"BARRIER", "RECV", "RECVANYSOURCE", "MONITORED_BARRIER"})
#: Collectives whose buffer is sent by the root alone (elsewhere it may be uninitialised).
_ROOTED = frozenset({"BROADCAST", "SCATTER"})


def contributed(name: str, tensors: list[torch.Tensor], root: int, rank: int
                ) -> list[torch.Tensor]:
    """The floating tensors this rank contributes to a forward collective ``name``: none for
    a barrier or a receive, a rooted collective's on its root only, else its inputs (an
    all-gather's too: tensor parallelism gathers each rank's activations)."""
    if name in _NO_INPUT or (name in _ROOTED and root != rank):
        return []
    return [t for t in tensors if t.is_floating_point() or t.is_complex()]


def sent(name: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The floating tensors this rank contributes to collective ``name`` when it is a
    reduction (else none: see the module's docstring)."""
    if name not in REDUCTIONS:
        return []
    return [t for t in tensors if t.is_floating_point() or t.is_complex()]


def own_collective() -> bool:
    """The collective being issued is the sentinel's own (the exchange, the rare path): the
    first Python frame outside ``torch`` belongs to ``nansentinel``. A collective issued
    from C++ (DDP's reducer, an autograd thread) has no such frame and is the user's."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("torch"):
            return module.startswith("nansentinel")
        frame = frame.f_back
    return False


class PreHookPath:
    """Checks each gradient collective's send buffers in a process-group pre-hook (torch
    >= 2.14), for a model that no other path takes in a job of several ranks."""

    CAPS = Capabilities(
        label="collective pre-hooks", replica_group=EXCHANGE,
        drop=("the gradients are reduced by hand (a loop's own all-reduce, or an engine "
              "nansentinel does not know), and nansentinel cannot replace this rank's "
              "contribution in a reduction it does not run; use DDP or FSDP2"))
    mesh_groups: tuple[Any, ...] = ()

    @staticmethod
    def recognizes(model: Any) -> bool:
        """A plain module (no engine before this one took it) in a job of several ranks,
        without DTensor parameters (tensor parallel reduces inside autograd: the local path),
        on a torch with pre-hooks (below 2.14: the local path, check_grads() before the
        reduction, and a loop that reduced first is refused there, local.py)."""
        return (isinstance(model, torch.nn.Module) and dist.is_available()
                and dist.is_initialized() and dist.get_world_size() > 1
                and not any(hasattr(p, "device_mesh") for p in model.parameters())
                and insides.supported("collective_hooks"))

    def __init__(self, model: torch.nn.Module, sink: GradientSink) -> None:
        insides.require("collective_hooks", "engines/prehook.py")
        self.model, self.sink = model, sink
        self.caps = self.CAPS
        self.keep_norms = False
        self._kept: KeptNorms | None = None
        #: Gradient collectives checked this step (0: ``step()`` checks the local gradients).
        self.checked = 0
        #: The step's check is closed (``check_grads()`` or ``step()`` ran it): later
        #: collectives of the step are neither checked nor counted.
        self.closed = False
        #: This step's backward has begun: collectives from now on are the gradients'.
        self.backward = False
        self._names: dict[int, str] | None = None
        #: This step's forward collectives, in this rank's order: what each was, and the
        #: norm of what this rank sent (None: nothing of its own); and the step before's.
        self._sends: list[tuple[str, torch.Tensor | None]] = []
        self._previous: tuple[int, list[tuple[str, torch.Tensor | None]]] = (-1, [])
        #: The same for this step's gradient collectives (the norms the step's row already
        #: sums: kept by reference, nothing more computed), and the step before's.
        self._grad_sends: list[tuple[str, torch.Tensor | None]] = []
        self._grad_previous: tuple[int, list[tuple[str, torch.Tensor | None]]] = (-1, [])
        self._hooked: dict[str, Any] = {}
        self._failed = False
        model.register_forward_pre_hook(self._forward_begins)
        model.register_forward_hook(self._arm)
        self._hook_groups()

    # --- the hooks -----------------------------------------------------------------------

    def _hook_groups(self) -> None:
        """Register the pre-hook on every group not hooked yet (groups made after the
        Sentinel are found at the next step)."""
        for pg, name in insides.named_groups():
            if name not in self._hooked:
                insides.register_pre_hook(pg, HOOK_ID, functools.partial(self._on, pg))
                self._hooked[name] = pg

    def _forward_begins(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            self.backward = False

    def _arm(self, module: Any, args: Any, output: Any) -> None:
        """After the forward: the first gradient of its outputs marks the backward's begin."""
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in outputs(output) if t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._backward_begins,
                                                          mode="any")

    def _backward_begins(self, *_: Any) -> None:
        self.backward = True

    def _on(self, pg: Any, args: Any) -> None:
        """The pre-hook: never raises into the user's collective (a failure is said once,
        and the step is then checked at ``step()`` as on the local path)."""
        if self.closed or self._failed or own_collective():
            return
        started = time.perf_counter()
        try:
            name, tensors, root, _ = insides.hook_op(args)
            if self.backward:
                given = sent(name, tensors)
                if given:
                    self._gradient(given, name, pg)
            else:
                self._forward(name, contributed(name, tensors, root, pg.rank()), pg)
        except Exception as exc:  # the user's collective must go on
            self._failed = True
            log.error("nansentinel: rank %d: the collective pre-hook failed at step %d (%s: "
                      "%s); this run's gradients are checked at step() from now on",
                      dist.get_rank(), self.sink.step_index, type(exc).__name__, exc)
        self.sink.spent(time.perf_counter() - started)

    def _gradient(self, given: list[torch.Tensor], name: str, pg: Any) -> None:
        """A gradient collective: arm the watchdog (a due drill writes into the first
        buffer), then one fused norm per (device, dtype) of what this rank sends."""
        if self.checked == 0:
            self.sink.before_reduction(given[0])
            if self.keep_norms:
                self._kept = KeptNorms()
                named = [(n, p.grad) for n, p in self.model.named_parameters()
                         if p.grad is not None]
                self._names = dict(zip(addresses([g for _, g in named]),
                                       [n for n, _ in named], strict=True))
        self.checked += 1
        what = f"{API_NAMES.get(name, name.lower())} on group {pg.group_name}"
        if len(given) == 1 and self._kept is None:
            norm = checks.tensor_norm(given[0])
            self.sink.add_grad_norm(norm)
            self._grad_sends.append((what, norm))
            return
        parts = []
        for idx, norms in checks.grouped_norms(given):
            norm = torch.linalg.vector_norm(norms)
            self.sink.add_grad_norm(norm)
            parts.append(norm)
            if self._kept is not None:
                names = self._names or {}
                self._kept.add([names.get(a, f"<buffer of collective #{self.checked}>")
                                for a in addresses([given[i] for i in idx])], norms)
        # One place per collective (several dtypes or devices: one more tiny norm).
        self._grad_sends.append((what, parts[0] if len(parts) == 1 else torch.linalg.vector_norm(
            torch.stack([p.to(parts[0].device) for p in parts]))))

    def _forward(self, name: str, given: list[torch.Tensor], pg: Any) -> None:
        """A forward collective: the norm of what this rank sends in it (0-d, on the device,
        read only after a detection: live_trace.py). One with nothing of this rank's (a
        barrier, a receive) keeps its place, so that places line up across ranks."""
        norm = None
        if given:
            norms = [checks.tensor_norm(t) for t in given]
            norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(
                torch.stack([n.to(norms[0].device) for n in norms]))
        what = API_NAMES.get(name, name.lower())
        self._sends.append((f"{what} on group {pg.group_name}", norm))

    def first_forward_send(self, step: int) -> tuple[int, str] | None:
        """This rank's first forward collective of ``step`` (this step or the one before:
        the device gate decides a step at the next call) whose send buffers were non-finite:
        its place (1-based, in this rank's order) and what it was; None: none was. One host
        read, after a detection only."""
        sends = self._sends if step == self.sink.step_index else (
            self._previous[1] if self._previous[0] == step else [])
        return _first_nonfinite(sends)

    def first_gradient_send(self, step: int) -> tuple[int, str] | None:
        """This rank's first gradient collective of ``step`` whose send buffers were
        non-finite: its place (1-based, among the step's checked gradient collectives, in
        this rank's order) and what it was; None: none was. A reduce-scatter spreads one
        rank's NaN into a peer's shard, and a later collective of that shard (a global norm's
        all-reduce) then leaves the peer non-finite too: the first place tells the origin
        from the ranks it reached (detection.py). One host read, after a detection only."""
        sends = self._grad_sends if step == self.sink.step_index else (
            self._grad_previous[1] if self._grad_previous[0] == step else [])
        return _first_nonfinite(sends)

    # --- engines.GradPath ----------------------------------------------------------------

    def check_now(self) -> None:
        """``check_grads()`` or ``step()``: the gradient collectives checked the step (their
        buffers left before any peer's values came in); where none ran, the local gradients
        as they are (a loop that checks before its own all-reduce, an accumulation step)."""
        if self.checked == 0:
            self._kept = check_grads_now(self.model, self.sink, keep=self.keep_norms)
        self.closed = True

    def take_norms(self) -> KeptNorms | None:
        kept, self._kept = self._kept, None
        return kept

    def naming_detail(self, poisoned: bool, peers: Any,
                      kept: KeptNorms | None = None) -> dict[str, Any]:
        """From the norms kept at the hooks (the device gate: a flattened buffer is named as
        the collective that sent it), else by a scan of the gradients: after the reduction a
        NaN sits wherever any rank had one, so this rank's scan shows its own."""
        if poisoned and kept is not None:
            order = {n: i for i, (n, _) in enumerate(self.model.named_parameters())}
            names = kept.poisoned()
            known = sorted((n for n in names if n in order), key=order.__getitem__)
            return ({"parameters": known + [n for n in names if n not in order]}
                    if names else {})
        return naming_detail(self.model.named_parameters(), poisoned)

    def reset(self) -> None:
        self.checked = 0
        self.closed = self.backward = False
        self._kept = self._names = None
        self._previous, self._sends = (self.sink.step_index - 1, self._sends), []
        self._grad_previous = (self.sink.step_index - 1, self._grad_sends)
        self._grad_sends = []
        if len(self._hooked) != len(insides.named_groups()):
            self._hook_groups()

    def release(self) -> None:
        """At ``close()``: the hooks leave every group (the user's collectives after the run
        pay nothing)."""
        for pg in self._hooked.values():
            with contextlib.suppress(RuntimeError):  # a group destroyed since: hooks gone
                insides.unregister_pre_hook(pg, HOOK_ID)
        self._hooked.clear()
        self.closed = True


def addresses(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's data pointer, the key that names a sent buffer by the gradient it is (or
    begins): a sparse gradient's is its stored values' (it has no storage of its own, and
    ``data_ptr()`` raises), looked up only where a plain read failed."""
    try:
        return [t.data_ptr() for t in tensors]
    except RuntimeError:
        return [insides.stored_values(t).data_ptr() for t in tensors]


def _first_nonfinite(sends: list[tuple[str, torch.Tensor | None]]) -> tuple[int, str] | None:
    """The first (place, what) of ``sends`` whose norm is non-finite (one host read of the
    norms together), None when every one was finite or none was sent."""
    places = [(i, what, n) for i, (what, n) in enumerate(sends, 1) if n is not None]
    if not places:
        return None
    finite = torch.isfinite(torch.stack([n.detach().float().cpu()
                                         for _, _, n in places])).tolist()
    return next(((i, what) for (i, what, _), ok in zip(places, finite, strict=True)
                 if not ok), None)
