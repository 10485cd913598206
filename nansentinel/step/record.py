"""One step's record, from its checks to its end, with the states it passes through.

::

    OPEN ──launch──> LAUNCHED ──read──> READ ──decide──> DECIDED ──finish──> DONE
      └──────────────────┴─────────────────┴───────────────┴──abandon──> ABANDONED

- ``OPEN``: the loop's checks add to the step's health (``check_batch``, ``check_loss``, the
  gradient path's checks before each reduction).
- ``LAUNCHED``: the health vector has left with the last reduction (or at ``step()``). On the
  device gate the optimizer has stepped too, skipped on the device where the vector says so;
  the record then waits for the next sentinel call (or a read of its result).
- ``READ``: the summed totals are on the host: the step's one host sync.
- ``DECIDED``: the decision is taken and acted on (optimizer step or discard, rollback,
  incident); the result is known. A device-gated step decided by a read of its result on one
  rank stays here until the next sentinel call, because what it still owes every rank together
  (the snapshot, the replica check) are collectives.
- ``DONE``: the snapshot, the replica check and the metrics have run; an abort is raised from
  here, on every rank at the same call.
- ``ABANDONED``: the loop failed on this rank; the record is forgotten without a collective.

The healthy host-gated step passes through every state inside one ``step()``; the device gate
splits it after ``LAUNCHED``. :class:`PendingResult` is what a device-gated ``step()`` returns.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from nansentinel.checks.health import LocalHealth
from nansentinel.result import Outcome, ResultPending, StepResult
from nansentinel.wire.schema import OwnRow, Totals

if TYPE_CHECKING:
    from nansentinel.checks.state import StateFindings
    from nansentinel.decide.policy import Decision
    from nansentinel.engines import KeptNorms
    from nansentinel.wire.view import ClusterView


class Stage(enum.Enum):
    """Where a step is on its way (see the module docstring)."""

    OPEN = "open"
    LAUNCHED = "launched"
    READ = "read"
    DECIDED = "decided"
    DONE = "done"
    ABANDONED = "abandoned"


#: The transitions: every path a step can take, written out.
NEXT: dict[Stage, frozenset[Stage]] = {
    Stage.OPEN: frozenset({Stage.LAUNCHED, Stage.ABANDONED}),
    Stage.LAUNCHED: frozenset({Stage.READ, Stage.ABANDONED}),
    Stage.READ: frozenset({Stage.DECIDED, Stage.ABANDONED}),
    Stage.DECIDED: frozenset({Stage.DONE, Stage.ABANDONED}),
    Stage.DONE: frozenset(),
    Stage.ABANDONED: frozenset(),
}


@dataclasses.dataclass(slots=True, eq=False)
class StepRecord:
    """Everything one step carries from its checks to its end (see the module docstring)."""

    index: int
    local: LocalHealth
    stage: Stage = Stage.OPEN
    # --- LAUNCHED on the device gate -----------------------------------------------------
    gated: bool = False
    """The optimizer stepped on the device, gated by ``found_inf`` (gate.py)."""
    host: torch.Tensor | None = None
    """The summed vector's host copy (pinned on CUDA), landing behind :attr:`event`."""
    event: Any = None
    skipped: bool = False
    """The host had decided to skip already (batches discarded after a rollback)."""
    buffers: int = 0
    """Floating buffers put back on the device if the gated step was skipped."""
    kept: KeptNorms | None = None
    """The step's per-parameter gradient norms, taken before the reduction: a detection names
    the poisoned parameters from them (the gradients themselves are the user's by then)."""
    # --- READ ------------------------------------------------------------------------------
    values: list[float] | None = None
    state: StateFindings | None = None
    """What the ranks hold that is not finite, where the state was read and something was
    found (rare/state.py): the decision's, and what the acts repair."""
    # --- DECIDED ---------------------------------------------------------------------------
    view: ClusterView | None = None
    decision: Decision | None = None
    result: StepResult | None = None
    spent: float = 0.0
    """The sentinel's own seconds on this step so far."""
    snapshot: bool = False
    """A snapshot is due in the tail (an applied step the sentinel stepped)."""

    def to(self, stage: Stage) -> None:
        """Move to ``stage``: only along :data:`NEXT` (a wrong order is a bug, said here)."""
        if stage not in NEXT[self.stage]:
            raise AssertionError(f"nansentinel: step {self.index} cannot go from "
                                 f"{self.stage.value} to {stage.value}")
        self.stage = stage

    def read(self) -> list[float]:
        """The summed vector on the host (``LAUNCHED`` -> ``READ``): waits for the copy only
        if it has not landed (the event is asked first, which is no sync)."""
        if self.values is None:
            if self.event is not None and not self.event.query():
                self.event.synchronize()
            assert self.host is not None
            self.values = self.host.tolist()
        return self.values

    def landed(self) -> bool:
        """The host copy has landed (nothing left to wait for)."""
        return self.event is None or bool(self.event.query())

    @property
    def totals(self) -> Totals:
        return Totals.from_values(self.read())

    @property
    def own(self) -> OwnRow:
        return OwnRow.from_values(self.read())

    @property
    def decided(self) -> StepResult:
        assert self.result is not None, f"step {self.index} is {self.stage.value}"
        return self.result


T = TypeVar("T")


class _Early(Generic[T]):
    """A field a pending result answers before its step is decided, from the vector alone
    (no collective)."""

    name: str

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: PendingResult | None, owner: type | None = None) -> T:
        assert obj is not None
        if obj.resolved:
            return getattr(obj.resolve(), self.name)
        return obj.early(self.name)


class _Decided(Generic[T]):
    """A field that needs the step's decision: decided on the read when that needs no
    collective, else :class:`ResultPending` until the next sentinel call."""

    name: str

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: PendingResult | None, owner: type | None = None) -> T:
        assert obj is not None
        return getattr(obj.resolve(), self.name)


class PendingResult:
    """The :class:`StepResult` of a step gated on the device, decided at the next sentinel
    call; ``step()`` returns it on the device gate.

    Reading a field never runs a collective. The first read of a decided field waits for the
    cluster's totals (one host sync, by the caller's choice): a step that found nothing is then
    decided on the spot, locally, and every field answers. A step that found something is
    named and decided with every rank at the next sentinel call (``check_batch``,
    ``check_loss``, ``step``, ``close``), where an abort is raised; before that only the early
    fields answer (``step``, ``applied`` — exact: the device already skipped it —,
    ``injected`` and ``local_*``) and the others raise :class:`ResultPending`.
    :meth:`resolve` returns the plain ``StepResult`` once decided. Its fields are
    :class:`StepResult`'s, each declared here with its type (a test keeps them in step).
    """

    __slots__ = ("_early", "_resolve", "_result")

    step = _Early[int]()
    applied = _Early[bool]()
    injected = _Early[bool]()
    local_kinds = _Early[list[str]]()
    local_loss = _Early[float | None]()
    local_grad_norm = _Early[float | None]()
    outcome = _Decided[Outcome]()
    bad_ranks = _Decided[list[int]]()
    bad_hosts = _Decided[list[str]]()
    kinds = _Decided[list[str]]()
    consecutive_skips = _Decided[int]()
    overflow = _Decided[bool]()
    report_path = _Decided[str | None]()
    verdict = _Decided[str | None]()
    excluded_hosts = _Decided[list[str]]()
    parameters = _Decided[dict[int, list[str]]]()
    spikes = _Decided[dict[str, list[int]]]()
    local_spikes = _Decided[list[str]]()
    quarantined = _Decided[bool]()
    rolled_back_to = _Decided[int | None]()
    lr_factor = _Decided[float]()
    lr_held = _Decided[bool]()
    reason = _Decided[str]()
    collapsed = _Decided[dict[str, float]]()
    recovery = _Decided[dict[str, Any]]()
    reached = _Decided[list[int]]()
    buffers_restored = _Decided[int]()
    poisoned_state = _Decided[dict[int, list[str]]]()
    state_action = _Decided[str]()
    stop_signal = _Decided[int]()
    healthy = _Decided[bool]()
    stop_requested = _Decided[bool]()

    def __init__(self, resolve: Callable[[], None], early: Callable[[str], Any]) -> None:
        self._resolve: Callable[[], None] | None = resolve
        self._early: Callable[[str], Any] | None = early
        self._result: StepResult | BaseException | None = None

    def set(self, value: StepResult | BaseException) -> None:
        self._result = value
        self._resolve = None
        self._early = None

    def early(self, name: str) -> Any:
        assert self._early is not None
        return self._early(name)

    def resolve(self) -> StepResult:
        """The decided result (decided now if that needs no collective; raises the abort the
        decision raised, or :class:`ResultPending` before a detection's decision)."""
        if self._result is None and self._resolve is not None:
            self._resolve()
        if isinstance(self._result, BaseException):
            raise self._result
        if self._result is None:
            raise ResultPending("nansentinel: a device-gated step's result was never decided")
        return self._result

    @property
    def resolved(self) -> bool:
        return self._result is not None

    def __repr__(self) -> str:
        if self._result is None:
            return "PendingResult(<decided at the next sentinel call>)"
        return f"PendingResult({self._result!r})"

    def __eq__(self, other: object) -> bool:
        other = other.resolve() if isinstance(other, PendingResult) else other
        return self.resolve() == other

    __hash__ = None  # type: ignore[assignment]


#: What a device-gated result answers before its step is decided.
EARLY_FIELDS = frozenset(name for name, value in vars(PendingResult).items()
                         if isinstance(value, _Early))
