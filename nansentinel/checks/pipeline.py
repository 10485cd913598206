"""Pipeline stages: check what arrives from, and leaves for, the neighbouring stages.

Under pipeline parallelism (``torch.distributed.pipelining``) a NaN that begins on one stage
travels forward with the activations into every later stage, and back with the gradients
into every earlier one. Every rank it reaches then holds a non-finite loss or gradients, and
checking those alone would blame them all. The origin is the stage whose *inputs* at a
boundary were finite and whose *outputs* were not:

- forward: the first stage whose received activations were finite and whose output (or, on the
  last stage, loss) was not;
- backward: the stage whose received gradients were finite and whose sent gradients were not
  (a stage whose parameter gradients alone went non-finite, with nothing non-finite received,
  is the origin too: view.pack's rule for every rank);
- batch: the first stage, whose input is the batch (checked here as ``check_batch`` would).

:class:`StageWatch` checks each micro-batch at those boundaries with ordinary module hooks on
``stage.submod`` (a forward pre-hook for the received activations, a forward hook for the
output) and tensor hooks for the gradients (on the output: received; on the input: sent).
Each check is one fused norm on the device and a 0/1 flag; a micro-batch's flags are paired
(input with output, received with sent) on the device and kept as four flags of the health row
(local.py), so a rank is judged an origin or merely *reached* with no host sync and no extra
collective: the one exchange over the whole job carries them.

Shape inference: on its first step a stage runs a forward and backward on uninitialised
tensors to learn its neighbours' shapes (private methods of ``PipelineStage``:
``_shape_inference`` in torch 2.9-2.12, ``_forward_metadata_inference`` and
``_backward_metadata_inference`` from 2.13; common/torch_insides.py names them). Those calls
are not the step: the watch wraps them on the stage instance so that its hooks, and
:func:`shape_inference`, ignore them. A torch with neither is refused at construction: the
pass over zero tensors would otherwise be watched as a real micro-batch.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from nansentinel import checks
from nansentinel.checks.health import LocalHealth, combined
from nansentinel.common import torch_insides as insides


class _Chunk:
    """One micro-batch's boundary norms on one stage (0-d device tensors; None: not seen)."""

    __slots__ = ("inputs", "loss", "output", "received", "sent", "targets")

    def __init__(self, inputs: torch.Tensor) -> None:
        self.inputs = inputs
        self.output: torch.Tensor | None = None
        self.received: torch.Tensor | None = None
        self.sent: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.targets: torch.Tensor | None = None


class StageWatch:
    """The boundary checks of one pipeline stage on this rank.

    A hook only takes one norm and keeps it with its micro-batch; :meth:`fold` turns the step's
    norms into the five flags once, when the health row is packed, in a fixed dozen kernels
    whatever the number of micro-batches (a flag per hook cost a tenth of a small stage's
    step on CPU).

    Args:
        stage: a ``torch.distributed.pipelining.PipelineStage`` (its ``submod``, ``is_first``
            and ``is_last`` are read; hooks go on ``submod``).
        device: where the norms and flags live.
    """

    def __init__(self, stage: Any, device: torch.device) -> None:
        insides.require("pipelining")
        self.stage = stage
        self.device = device
        self.first = bool(stage.is_first)
        self.last = bool(stage.is_last)
        self.inferring = 0
        #: This step's micro-batches, in the order their forwards ran.
        self.chunks: list[_Chunk] = []
        #: The micro-batch whose forward is running; on the last stage, the last one run,
        #: which its loss is paired with (:meth:`pair_loss`).
        self.chunk: _Chunk | None = None
        self.handles: list[Any] = []
        # fold()'s columns: inputs 0, output 1, received 2, sent 3, loss 4, targets 5, one 6.
        # BOUNDARY order: fwd origin = in & !out; bwd origin = received & !sent; received
        # activation bad = !in (not on the first stage, whose input is the batch); received
        # gradient bad = !received (not on the last, whose comes from its loss); loss origin
        # = in & targets & !loss.
        index = functools.partial(torch.tensor, dtype=torch.long, device=device)
        self._pairs = (index([0, 2, 6, 6, 0]), index([1, 3, 0, 2, 4]), index([6, 6, 6, 6, 5]))
        self._mask = torch.tensor([1.0, 1.0, float(not self.first), float(not self.last), 1.0],
                                  device=device)
        self._zero = torch.zeros((), device=device)
        for name in insides.shape_inference_methods(stage):
            setattr(stage, name, self._inference(getattr(stage, name)))
        stage.submod.register_forward_pre_hook(self._before, with_kwargs=True)
        stage.submod.register_forward_hook(self._after, with_kwargs=True)

    def _inference(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            self.inferring += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.inferring -= 1
        return run

    def _norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One L2 norm of ``tensors`` (one fused norm each, on the device; 0 for none)."""
        return combined(checks.batch_norms(tensors, self.device), self._zero)

    def _before(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self.inferring:
            self.chunk = None
            return
        inputs = list(checks.float_tensors((args, kwargs)))
        chunk = self.chunk = _Chunk(self._norm(inputs))
        if not self.first:  # the first stage's input is the batch: fold() checks it as one
            for t in inputs:
                if t.requires_grad:
                    self._hook(t, _SENT, chunk)

    def _after(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        chunk = self.chunk
        if chunk is None or self.inferring:
            return
        outputs = list(checks.float_tensors(output))
        chunk.output = self._norm(outputs)
        self.chunks.append(chunk)
        for t in outputs:
            if t.requires_grad:
                self._hook(t, _RECEIVED, chunk)
        if not self.last:
            self.chunk = None

    def _hook(self, t: torch.Tensor, slot: str, chunk: _Chunk) -> None:
        """A one-shot gradient hook on ``t`` that keeps the gradient's norm in ``chunk``'s
        ``slot`` (several tensors: their joint norm). A stage reuses its receive buffers
        across steps, so a hook left on one would fire again for a later micro-batch with
        this one's chunk: each fires once, and :meth:`reset` removes the rest."""
        fired: list[bool] = []

        def once(grad: torch.Tensor) -> None:
            if fired:
                return
            fired.append(True)
            norm = self._norm([grad])
            old = getattr(chunk, slot)
            setattr(chunk, slot, norm if old is None else torch.hypot(old, norm))

        self.handles.append(t.register_hook(once))

    def pair_loss(self, loss: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """On the last stage: a micro-batch's loss (0-d) and its targets' norms, kept with the
        activations it came from (:meth:`fold` pairs them)."""
        if self.chunk is not None:
            self.chunk.loss = checks.moved(loss, self.device)
            self.chunk.targets = combined(targets, self._zero)

    def fold(self, local: LocalHealth) -> None:
        """Turn this step's norms into the row's boundary flags (a dozen kernels on the
        device, whatever the number of micro-batches; no host sync): a forward output or loss
        non-finite from finite inputs (and targets), sent gradients non-finite from finite
        received ones, a non-finite activation or gradient received from another stage. A
        gradient that never came (a micro-batch without backward) counts as finite."""
        chunks = [c for c in self.chunks if c.output is not None]
        if not chunks:
            return
        if self.first:  # the stage's input is the batch (its micro-batches)
            local.batch_norms.extend(c.inputs for c in chunks)
        zero = self._zero
        finite = torch.isfinite(torch.stack([
            zero if x is None else x  # never `x or zero`: truth of a tensor is a host sync
            for c in chunks
            for x in (c.inputs, c.output, c.received, c.sent, c.loss, c.targets, zero)
        ]).view(len(chunks), 7)).to(torch.float32)
        # Per micro-batch, in BOUNDARY order: ok-before x bad-after x ok-beside.
        before, after, beside = (finite.index_select(1, i) for i in self._pairs)
        flags = (before * (1.0 - after) * beside).amax(0) * self._mask
        local.add_boundaries(flags)

    def reset(self) -> None:
        """The step was decided: remove its gradient hooks (fired or not) and its chunks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.chunks = []
        self.chunk = None


_RECEIVED, _SENT = "received", "sent"


def shape_inference(watches: list[StageWatch]) -> bool:
    """A pipeline schedule is running shape inference now (its loss call is not a step's)."""
    if any(w.inferring for w in watches):
        return True
    # A stage the sentinel does not watch: the loss is called from the inference itself.
    caller = sys._getframe(2)
    return caller is not None and caller.f_code.co_name in insides.SHAPE_INFERENCE_NAMES


def stages_of(stages: Any) -> list[Any]:
    """``stages`` (one stage or several) as a list, each checked to be a pipeline stage."""
    items = list(stages) if isinstance(stages, list | tuple) else [stages]
    for i, s in enumerate(items):
        if not all(hasattr(s, a) for a in ("submod", "is_first", "is_last", "stage_index")):
            raise TypeError(
                f"nansentinel: stages[{i}] is a {type(s).__name__}, not a "
                "torch.distributed.pipelining PipelineStage (it needs submod, is_first, "
                "is_last and stage_index)"
            )
    return items



def wrap_loss(
    loss_fn: Callable[..., Any], stages: list[StageWatch], add_loss: Callable[[Any], Any],
    health: Callable[[], LocalHealth], device: torch.device,
) -> Callable[..., Any]:
    """``loss_fn`` checked, for a pipeline schedule (``Sentinel.wrap_loss``).

    Each micro-batch's loss is checked (``add_loss``, the sentinel's ``check_loss``) before its
    backward, and paired with the activations it came from, so a loss that went non-finite on
    the last stage from finite received activations is named there and one that arrived
    non-finite is not; the targets (the arguments after the output) are checked as a batch of
    the step (``health()``: this step's record). The schedule's shape-inference call on its
    first step, made on uninitialised values, is passed through unchecked."""
    watch = next((w for w in stages if w.last), None)

    @functools.wraps(loss_fn)
    def checked(output: Any, *args: Any, **kwargs: Any) -> Any:
        loss = loss_fn(output, *args, **kwargs)
        if shape_inference(stages):
            return loss
        value = add_loss(loss)
        local = health()
        with local.timed():
            targets = checks.batch_norms((args, kwargs), device)
            local.batch_norms.extend(targets)
            if watch is not None:
                watch.pair_loss(value, targets)
        return loss

    return checked
