"""Recovery: restore the last good state, cool the learning rate down, skip ahead.

This is the playbook people follow by hand after a spike or a NaN (PaLM's remedy among them):
stop before the weights are ruined, restore the last good state, lower the learning rate near
the spike, skip the batches that led into it. Every rank holds an identical snapshot (taken at
the same healthy step, of identical weights) and restores it at the same step, so the replicas
stay identical without a collective.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from nansentinel.report import to_cpu


class SnapshotStore(Protocol):
    """Where last-good state goes: host memory by default, or the user's own checkpoints."""

    def save(self, step: int) -> None:
        """Save the current (healthy) state as of ``step``."""

    def load(self) -> int:
        """Restore the last saved state; return its step."""

    @property
    def step(self) -> int | None:
        """Step of the last saved state (None: nothing saved yet)."""


class MemorySnapshots:
    """Model, optimizer (and GradScaler) state copied to host memory.

    A copy is one device-to-host transfer of the weights and optimizer state every
    ``snapshot_every`` healthy steps; it is paid only when a rollback policy or action is on.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: Any = None) -> None:
        self.module, self.optimizer, self.scaler = module, optimizer, scaler
        self._state: dict[str, Any] | None = None
        self._step: int | None = None

    @property
    def step(self) -> int | None:
        return self._step

    def save(self, step: int) -> None:
        # One copy each, straight to host memory (a deepcopy first would duplicate the
        # optimizer state on the device before moving it).
        state = {
            "model": to_cpu(self.module.state_dict(), copy=True),
            "optimizer": to_cpu(self.optimizer.state_dict(), copy=True),
        }
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        self._state, self._step = state, step

    def load(self) -> int:
        if self._state is None or self._step is None:
            raise RuntimeError("no snapshot to roll back to")
        self.module.load_state_dict(self._state["model"])
        # A copy: load_state_dict keeps tensors that need no cast (CPU state for CPU params),
        # and the optimizer's in-place updates would then reach the snapshot.
        self.optimizer.load_state_dict(copy.deepcopy(self._state["optimizer"]))
        if self.scaler is not None and "scaler" in self._state:
            self.scaler.load_state_dict(self._state["scaler"])
        return self._step


class UserSnapshots:
    """The user's own save/load pair, e.g. writing and reading their checkpoints.

    Args:
        save: called with the step of a healthy state worth keeping.
        load: restores the last saved state and returns its step.
    """

    def __init__(self, save: Callable[[int], None], load: Callable[[], int]) -> None:
        self._save, self._load = save, load
        self._step: int | None = None

    @property
    def step(self) -> int | None:
        return self._step

    def save(self, step: int) -> None:
        self._save(step)
        self._step = step

    def load(self) -> int:
        return int(self._load())


@dataclasses.dataclass(slots=True)
class Cooldown:
    """A learning-rate factor in force for a number of steps after a rollback.

    Applied around ``optimizer.step()`` and undone right after it, so that it composes with
    any LR scheduler (which sets ``group["lr"]`` itself) instead of compounding with it.
    Rollbacks during a cooldown multiply the factors: a second rollback at 0.5 gives 0.25.
    """

    factor: float = 1.0
    steps_left: int = 0

    def start(self, factor: float, steps: int) -> None:
        self.factor = (self.factor if self.steps_left > 0 else 1.0) * factor
        self.steps_left = steps

    def state_dict(self) -> dict[str, Any]:
        return {"factor": self.factor, "steps_left": self.steps_left}

    def load_state_dict(self, state: dict[str, Any] | list[Any] | tuple[Any, ...]) -> None:
        """Restore :meth:`state_dict` (or the ``[factor, steps_left]`` pair older checkpoints
        hold)."""
        if isinstance(state, dict):
            self.factor, self.steps_left = float(state["factor"]), int(state["steps_left"])
        else:
            self.factor, self.steps_left = float(state[0]), int(state[1])

    @property
    def lr_factor(self) -> float:
        """The factor in force now (1 outside a cooldown)."""
        return self.factor if self.steps_left > 0 else 1.0

    def apply(self, optimizer: torch.optim.Optimizer) -> list[float] | None:
        """Scale every group's LR; return the previous values for :meth:`undo`."""
        if self.steps_left <= 0:
            return None
        saved = [g["lr"] for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * self.factor
        return saved

    def undo(self, optimizer: torch.optim.Optimizer, saved: list[float] | None) -> None:
        if saved is None:
            return
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.factor = 1.0
