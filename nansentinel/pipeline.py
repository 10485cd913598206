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
tensors to learn its neighbours' shapes (``_forward_metadata_inference`` and
``_backward_metadata_inference``, private methods of ``PipelineStage`` in torch 2.13, tested
with it). Those calls are not the step: the watch wraps the two methods on the stage
instance so that its hooks, and :func:`shape_inference`, ignore them.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nansentinel import checks
from nansentinel.local import (
    BWD_ORIGIN,
    FWD_ORIGIN,
    LOSS_ORIGIN,
    RECV_ACT,
    RECV_GRAD,
    LocalHealth,
)

#: The private methods of ``PipelineStage`` (torch 2.13) that run shape inference.
_INFERENCE = ("_forward_metadata_inference", "_backward_metadata_inference")


class _Chunk:
    """One micro-batch's boundary flags on one stage (0-d device tensors)."""

    __slots__ = ("inputs_ok", "received_ok")

    def __init__(self, inputs_ok: torch.Tensor) -> None:
        self.inputs_ok = inputs_ok
        self.received_ok: torch.Tensor | None = None


class StageWatch:
    """The boundary checks of one pipeline stage on this rank.

    Args:
        stage: a ``torch.distributed.pipelining.PipelineStage`` (its ``submod``, ``is_first``
            and ``is_last`` are read; hooks go on ``submod``).
        health: returns the step's :class:`LocalHealth` (the sentinel's, renewed each step).
        device: where the flags live.
    """

    def __init__(
        self, stage: Any, health: Callable[[], LocalHealth], device: torch.device
    ) -> None:
        self.stage = stage
        self.health = health
        self.device = device
        self.first = bool(stage.is_first)
        self.last = bool(stage.is_last)
        self.inferring = 0
        #: The micro-batch whose forward is running; on the last stage, the last one run,
        #: which its loss is paired with (:meth:`pair_loss`).
        self.chunk: _Chunk | None = None
        self.handles: list[Any] = []
        for name in _INFERENCE:
            original = getattr(stage, name, None)
            if original is not None:
                setattr(stage, name, self._inference(original))
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
        if not tensors:
            return torch.zeros((), device=self.device)
        norms = [checks.tensor_norm(checks.local(t)).to(self.device) for t in tensors]
        return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))

    def _flag_ok(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """1.0 where every tensor is finite, else 0.0 (0-d, on the device)."""
        return torch.isfinite(self._norm(tensors)).to(torch.float32)

    def _before(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self.inferring:
            self.chunk = None
            return
        inputs = list(checks.float_tensors((args, kwargs)))
        norm = self._norm(inputs)
        ok = torch.isfinite(norm).to(torch.float32)
        local = self.health()
        if self.first:  # the stage's input is the batch (a micro-batch of it)
            local.batch_norms.append(norm)
        else:
            local.add_boundary(RECV_ACT, 1.0 - ok)
        chunk = self.chunk = _Chunk(ok)
        if not self.first:
            for t in inputs:
                if t.requires_grad:
                    self._hook(t, self._sent, chunk)

    def _after(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        chunk = self.chunk
        if chunk is None or self.inferring:
            return
        outputs = list(checks.float_tensors(output))
        out_ok = self._flag_ok(outputs)
        self.health().add_boundary(FWD_ORIGIN, chunk.inputs_ok * (1.0 - out_ok))
        for t in outputs:
            if t.requires_grad:
                self._hook(t, self._received, chunk)
        if not self.last:
            self.chunk = None

    def _hook(
        self, t: torch.Tensor, fn: Callable[[_Chunk, torch.Tensor], None], chunk: _Chunk
    ) -> None:
        """A one-shot gradient hook on ``t`` for ``chunk``. A stage reuses its receive
        buffers across steps, so a hook left on one would fire again for a later micro-batch
        with this one's flags: each fires once, and :meth:`reset` removes the rest."""
        fired: list[bool] = []

        def once(grad: torch.Tensor) -> None:
            if not fired:
                fired.append(True)
                fn(chunk, grad)

        self.handles.append(t.register_hook(once))

    def reset(self) -> None:
        """The step was decided: remove its gradient hooks (fired or not) and its chunk."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.chunk = None

    def _received(self, chunk: _Chunk, grad: torch.Tensor) -> None:
        """The gradient of the stage's output: from the next stage, or from the loss."""
        ok = self._flag_ok([grad])
        chunk.received_ok = ok if chunk.received_ok is None else chunk.received_ok * ok
        if not self.last:
            self.health().add_boundary(RECV_GRAD, 1.0 - ok)

    def _sent(self, chunk: _Chunk, grad: torch.Tensor) -> None:
        """The gradient of the stage's input, sent to the previous stage."""
        received = chunk.received_ok if chunk.received_ok is not None else chunk.inputs_ok
        self.health().add_boundary(BWD_ORIGIN, received * (1.0 - self._flag_ok([grad])))

    def pair_loss(self, loss: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """On the last stage: a micro-batch's loss, paired with the activations it came from
        and its targets (a non-finite loss from finite ones began here; with a non-finite
        target it is the batch's: the targets are checked as one)."""
        chunk = self.chunk
        if chunk is None:
            return
        bad = 1.0 - torch.isfinite(checks.loss_scalar(checks.local(loss))).to(torch.float32)
        ok = chunk.inputs_ok * self._flag_ok(targets)
        self.health().add_boundary(LOSS_ORIGIN, ok * bad.to(self.device))


def shape_inference(watches: list[StageWatch]) -> bool:
    """A pipeline schedule is running shape inference now (its loss call is not a step's)."""
    if any(w.inferring for w in watches):
        return True
    # A stage the sentinel does not watch: the loss is called from the inference itself.
    caller = sys._getframe(2)
    return caller is not None and caller.f_code.co_name in _INFERENCE


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


def targets(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The floating-point tensors of a loss function's arguments after the output."""
    return checks.float_tensors((args[1:], kwargs))
