"""This rank's step in progress: what the checks record, and what the gradient paths report to.

``check_batch`` and ``check_loss`` add to the step's
:class:`~nansentinel.checks.health.LocalHealth`;
the gradient path (engines/) checks each reduction's local gradients and, with the last one,
launches the exchange of the step's health vector (``schema.pack``). Everything here stays on
the device: no host sync, no collective but the exchange's own sum.
"""

from __future__ import annotations

from typing import Any

import torch

from nansentinel import checks
from nansentinel.checks.buffers import FloatingBuffers
from nansentinel.checks.health import LocalHealth, to_device
from nansentinel.checks.pipeline import StageWatch
from nansentinel.checks.quarantine import Quarantine
from nansentinel.checks.state import (
    describe_hyperparameters,
    nonfinite_flag,
    poisoned_hyperparameters,
    read_hyperparameters,
)
from nansentinel.common.inject import DRILLED_STATE, Injector, drill_targets
from nansentinel.decide.spikes import SpikeDetector
from nansentinel.effects import drop
from nansentinel.effects.stop import stop_requested
from nansentinel.rare import samples as skip_list
from nansentinel.result import HYPERPARAMETER, SentinelUsageError
from nansentinel.step.record import Stage, StepRecord
from nansentinel.wire.collectives import ForwardCollectives, quiet_groups
from nansentinel.wire.context import Context
from nansentinel.wire.schema import pack


class CurrentStep:
    """The step this rank is in (``index``), and its health so far (``local``).

    Implements :class:`~nansentinel.engines.GradientSink` for the gradient path, which is
    attached after it (:meth:`attach`), since the path needs a sink at construction.

    Args:
        ctx: the run (its device, rank, exchange, the deadline of the step's collectives,
            whether a loss scale makes gradient overflow nobody's fault, and the policy: under
            ``drop`` a rank whose batch or loss is non-finite has its gradients withheld from
            the step's reductions, effects/drop.py).
        injector: the run's drills. quarantine: batches known to be bad (quarantine.py).
        module: the unwrapped model, whose floating buffers a skipped step puts back.
        spikes: the spike references, whose thresholds the device judges this rank's own
            spikes against (sent again only when they change).
    """

    def __init__(self, ctx: Context, injector: Injector, quarantine: Quarantine,
                 module: torch.nn.Module, spikes: SpikeDetector) -> None:
        self.device, self.rank, self.exchange = ctx.device, ctx.rank, ctx.exchange
        self.injector, self.deadline, self.amp = injector, ctx.deadline, ctx.amp
        self.module = module
        #: The floating buffers of ``module``, copied again for every step (buffers.py),
        #: before the gradient path's broadcast of them where it has one (:meth:`attach`).
        self.buffers = FloatingBuffers(module)
        self.quarantine, self.spikes = quarantine, spikes
        self.drop = ctx.config.policy == "drop"
        self._thresholds: tuple[int, torch.Tensor] | None = None
        self.index = 0
        self.local = LocalHealth(self.device)
        #: This step's vector as :meth:`launch_exchange` packed it, on this rank's device (its
        #: own section, this rank's health row, is read by a wider scope whose row leaves with
        #: the gradients: the row is computed once a step); None until then.
        self.packed: torch.Tensor | None = None
        #: On the CPU, the health row :meth:`launch_exchange` packed, as host floats (the own
        #: section of :attr:`packed`, not read back); None elsewhere or until then.
        self.host_row: list[float] | None = None
        #: This step's record (step/record.py): OPEN until the exchange leaves.
        self.record = StepRecord(self.index, self.local)
        self.gradients: Any = None
        #: Floating buffers holding +-Inf by design (an attention mask: checks/state.py
        #: ``constant_buffers``; the assembly sets them before :meth:`attach`).
        self.constants: frozenset[str] = frozenset()
        #: The optimizer a step applies with (the assembly sets it): its hyperparameters are
        #: read as the row is packed (checks/state.py), and the state drills write into it.
        self.optimizer: Any = None
        self.stages: list[StageWatch] = []
        self.forward = ForwardCollectives()
        #: The user's lr and the value a hyperparameter drill wrote over it this step.
        self._held_lr: tuple[Any, float] | None = None

    def attach(self, gradients: Any, stages: list[Any]) -> None:
        """The run's gradient path and pipeline stages (whose boundaries are checked, and
        whose groups' collectives, like the gradient path's own, are no forward's). Under
        ``policy="drop"`` a path that cannot leave a rank out is refused here (drop.py)."""
        if self.drop:
            drop.refuse_unsupported(gradients.caps, world_size=self.exchange.world_size,
                                    rank=self.rank)
        self.gradients = gradients
        self.buffers.close()  # copied before the path's broadcast where it has one
        self.buffers = FloatingBuffers(self.module, source=gradients.caps.buffers_from,
                                       constants=self.constants)
        self.stages = [StageWatch(s, self.device) for s in stages]
        self.forward = ForwardCollectives(exclude=quiet_groups(list(gradients.mesh_groups),
                                                               stages))
        self.reset()

    @property
    def step_index(self) -> int:
        return self.index

    def check_batch(self, batch: Any, ids: Any) -> None:
        with self.local.timed():
            self.require_open("check_batch")
            if self.local.batch is None and self.local.loss_count == 0:
                self.forward.start()  # the forward begins after the step's first batch check
            if ids is not None:
                self.local.ids.append((batch, skip_list.check_ids(
                    ids, batch, rank=self.rank, step=self.index)))
            if self.injector.faults and self.injector.poison(
                    "batch", self.index, next(checks.float_tensors(batch), None)):
                self.local.injected = True
            norms = checks.batch_norms(batch, self.device)
            quarantined = self.quarantine.match(batch, self.index, norms)
            if quarantined is not None:
                self.local.add_quarantined(quarantined)
            self.local.add_batch(batch, norms)

    def add_loss(self, loss: torch.Tensor | float) -> torch.Tensor:
        """Record the loss; returns the 0-d value recorded (on the device)."""
        with self.local.timed():
            self.require_open("check_loss")
            loss = checks.as_loss(loss, self.device, f"rank {self.rank}, step {self.index}")
            if self.injector.poison("loss", self.index, loss.detach()):
                self.local.injected = True
            if self.local.loss_count == 0:
                self.local.forward_groups = self.forward.stop()
            value = checks.loss_scalar(loss)
            self.local.add_loss(value)
        return value

    def require_open(self, what: str) -> None:
        if self.exchange.launched:
            raise SentinelUsageError(
                f"nansentinel: {what}() called on rank {self.rank} at step {self.index} "
                "after this step's health exchange already left with the gradients; call "
                "check_batch/check_loss before loss.backward(), then step()")

    def next(self) -> None:
        """The step was decided (or handed to the device gate): the next one begins."""
        self.index += 1
        self.reset()

    def restart_at(self, index: int) -> None:
        """The run resumes at step ``index`` (a checkpoint's)."""
        self.index = self.record.index = self.deadline.step = index

    def thresholds(self) -> torch.Tensor:
        """This rank's spike thresholds on the device, sent again only when its references
        changed (every tenth of a window): the step's own verdict is taken there."""
        version = self.spikes.version
        if self._thresholds is None or self._thresholds[0] != version:
            self._thresholds = (version, to_device(self.spikes.thresholds(), self.device))
        return self._thresholds[1]

    def reset(self) -> None:
        self.deadline.step = self.index
        self.buffers.reset()
        self.local = LocalHealth(self.device)
        self.packed = self.host_row = None
        self.record = StepRecord(self.index, self.local)
        self.gradients.reset()
        for watch in self.stages:
            watch.reset()
        self.forward.start()  # no check_batch this step: the forward begins now
        if self.injector.faults:
            self.local.injected = self._state_drills()

    def _state_drills(self) -> bool:
        """The state drills due at this step, written as it begins (before its forward), as a
        memory fault between two steps would be: one element of the first weight, optimizer
        state tensor or floating buffer (inject.py). The user's ``lr`` a hyperparameter drill
        wrote over at the step before is put back (see :meth:`_hyperparameter_drill`)."""
        held, self._held_lr = self._held_lr, None
        groups = getattr(self.optimizer, "param_groups", None) or []
        if held is not None and groups and groups[0].get("lr") is held[1]:
            groups[0]["lr"] = held[0]
        fired = False
        if any(self.injector.value_for(kind, self.index) is not None for kind in DRILLED_STATE):
            for kind, tensor in drill_targets(self.module, self.optimizer):
                fired = self.injector.poison(kind, self.index, tensor) or fired
        return fired

    def _hyperparameter_drill(self) -> bool:
        """A hyperparameter drill due at this step writes param group 0's ``lr`` as the row
        leaves (where the hyperparameters are read), not as the step begins: a loop's
        schedule writes the rate after the step before (``scheduler.step()``) or at the top
        of the iteration, and would write over a drill written earlier. The user's value is
        put back once the step is decided (:meth:`_state_drills`, at the next step)."""
        value = self.injector.value_for(HYPERPARAMETER, self.index)
        groups = getattr(self.optimizer, "param_groups", None) or []
        if value is None or not groups or "lr" not in groups[0]:
            return False
        self.injector.fired.append((self.index, HYPERPARAMETER))
        self._held_lr = (groups[0]["lr"], value)
        groups[0]["lr"] = value
        return True

    # --- engines.GradientSink ---------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.exchange.world_size

    @property
    def inferring(self) -> bool:
        return any(w.inferring for w in self.stages)

    @property
    def per_reduction(self) -> bool:
        return self.drop or any(f.kind == "grad" for f in self.injector.faults)

    def before_reduction(self, local_grads: torch.Tensor) -> bool:
        """The step's first gradients are about to be reduced: arm the watchdog, and write a
        due grad drill into them (before the reduction, as a real fault would be); True if
        it did."""
        self.deadline.arm()
        if self.injector.poison("grad", self.index, local_grads):
            self.local.injected = True
            return True
        return False

    def reducing(self) -> None:
        self.deadline.restart()

    def withhold(self, local_grads: torch.Tensor) -> None:
        """Under ``policy="drop"``: ``local_grads`` (about to be reduced) become zeros if this
        rank's batch or loss is non-finite, a flag taken at the step's first reduction and
        kept for the others, then packed into the exchange (drop.py). Else nothing."""
        if not self.drop:
            return
        if self.local.dropped is None:
            self.local.dropped = drop.flag_of(self.local)
        drop.withhold(local_grads, self.local.dropped)

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        self.local.add_grads(norm)

    def launch_exchange(self) -> None:
        """Pack this rank's health vector and start summing it across ranks (asynchronous)."""
        self.reducing()
        for watch in self.stages:  # the pipeline boundaries' norms become the row's flags
            watch.fold(self.local)
        self.local.stop_signal = stop_requested()  # a signal so far travels with this row
        self.local.buffers = self.buffers.norms()  # the model's own state travels with it too
        if self.injector.faults and self._hyperparameter_drill():
            self.local.injected = True
        finite, on_device = (read_hyperparameters(self.optimizer) if self.optimizer is not None
                             else (True, []))
        self.local.hyper_bad = not finite
        self.local.hyper_flag = nonfinite_flag(on_device, self.device) if on_device else None
        if self.local.hyper_bad:  # the rare case: named now, while they are as stepped
            self.local.hyper = describe_hyperparameters(
                poisoned_hyperparameters(self.optimizer))
        # On the CPU the row is read as host floats and packed as such (schema.pack).
        row = self.local.host_row() if self.device.type == "cpu" else self.local.row()
        self.host_row = row if isinstance(row, list) else None
        self.packed = pack(row, self.thresholds(), self.rank, amp=self.amp,
                           dropped=self.local.dropped)
        self.exchange.launch(self.index, self.packed)
        self.record.to(Stage.LAUNCHED)

    def diagnosed(self, future: torch.futures.Future, step: int,
                  reduced_in_place: torch.Tensor) -> torch.futures.Future:
        return self.exchange.diagnosed(future, step, reduced_in_place)

    def spent(self, seconds: float) -> None:
        self.local.seconds += seconds
