"""What a step decided, and the errors the sentinel raises.

Kept apart from sentinel.py so that the metrics exporter, the launcher and the tests can use
these types without importing the training-loop machinery.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

#: The kinds of local check, in the order of the health vector.
KINDS = ("batch", "loss", "grad")
#: A pipeline stage's forward output went non-finite from finite inputs (pipeline.py): the
#: kind of a forward origin, beside those of the health vector.
ACTIVATION = "activation"
#: A floating buffer (a BatchNorm statistic) went non-finite on this rank: its own value, not
#: one a buffer broadcast brought (checks/buffers.py).
BUFFER = "buffer"
#: An optimizer hyperparameter (lr, betas, eps, ...) is non-finite as the step's health leaves.
HYPERPARAMETER = "hyperparameter"
#: The weights, buffers or optimizer state a rank holds are non-finite (rare/state.py).
STATE = "state"
#: The kinds of a rank's own state found non-finite (``StepResult.local_kinds``, the metric
#: ``nansentinel_state_nonfinite_total``): a weight or an optimizer-state tensor (read where a
#: NaN may have entered: rare/state.py), a floating buffer, a hyperparameter (every step).
WEIGHT, OPTIMIZER_STATE = "weight", "optimizer_state"
STATE_KINDS = (WEIGHT, OPTIMIZER_STATE, BUFFER, HYPERPARAMETER)
#: Every kind a rank can be named for, in report order.
ALL_KINDS = (*KINDS, ACTIVATION, BUFFER)

#: Ranks named one by one in a report or a diagnosis of missing ranks; the rest are counted, so
#: that neither grows with the world.
NAMED = 64

#: Verdicts: what caused a detection (replay.py; ``sdc``: replicas diverged, replicas.py;
#: ``state``: the model's own state is non-finite, rare/state.py).
VERDICTS = ("data", "host", "transient", "divergence", "sdc", STATE)



class Outcome(str, enum.Enum):
    """What became of a step, the same on every rank.

    A ``str`` subclass, so that JSON (reports, verdict files) and Prometheus labels carry the
    plain words (``outcome="rolled_back"``) and a comparison with the word still holds.
    """

    APPLIED = "applied"
    """The optimizer step ran on every rank."""
    SKIPPED = "skipped"
    """No rank stepped; the gradients were discarded."""
    OVERFLOW = "overflow"
    """fp16 overflow under GradScaler: the scaler's own step decided (it skips inf grads)."""
    ABORTED = "aborted"
    """Every rank raised :class:`NonFiniteError`."""
    EXCLUDED = "excluded"
    """Every rank raised :class:`HostExcludedError`: a host keeps poisoning the run."""
    ROLLED_BACK = "rolled_back"
    """Every rank restored the last good snapshot."""
    DROPPED = "dropped"
    """``policy="drop"``: the optimizer step ran on every rank, from the gradients of the ranks
    not named in ``bad_ranks`` (their contribution was replaced by zeros before the
    reduction, and the mean taken over the others)."""

    def __str__(self) -> str:
        return self.value


#: Step outcomes, in order; they are the ``outcome`` label of ``nansentinel_steps_total``.
OUTCOMES = tuple(o.value for o in Outcome)


@dataclasses.dataclass(frozen=True, slots=True)
class RankIdentity:
    """Where a rank runs: left at the rendezvous store at start, and sent by the rank itself
    when a detection names it, so that blame can say which host."""

    rank: int
    local_rank: int
    world_size: int
    hostname: str
    device: str
    gpu: str = ""
    gpu_uuid: str = ""

    def to_json(self) -> dict[str, object]:
        """The fields as a JSON-able dict (``RankIdentity(**d)`` reads it back)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """The cluster-wide decision for one step; identical on every rank except the
    ``local_*`` fields, which describe this rank."""

    step: int
    """Index of the step just decided (0-based, counts every call to ``step()``)."""
    applied: bool
    """True when ``optimizer.step()`` ran on this (and therefore every) rank."""
    outcome: Outcome
    """What became of the step (an :class:`Outcome`, which is also its word)."""
    bad_ranks: list[int]
    """Ranks where a non-finite value began: their own batch, loss, forward output or
    gradients were non-finite from finite inputs (on a ``dropped`` step: the ranks left out).
    Sorted."""
    bad_hosts: list[str]
    """Hosts of ``bad_ranks``, sorted, without repeats."""
    kinds: list[str]
    """Which of ``batch``, ``loss``, ``grad`` were non-finite on any rank; ``buffer`` when a
    floating buffer was, ``hyperparameter`` an optimizer hyperparameter, ``state`` when a
    rank's weights, buffers or optimizer state held a non-finite value (``poisoned_state``
    names them), ``replica`` when a replica's weights or optimizer state silently diverged
    (``bad_ranks`` names it)."""
    local_kinds: list[str]
    """Which kinds were non-finite on this rank."""
    local_loss: float | None
    """This rank's loss before any reduction (None when ``check_loss`` was not called)."""
    local_grad_norm: float | None
    """This rank's gradient L2 norm before the all-reduce (None when there were no grads)."""
    consecutive_skips: int
    """Skipped steps in a row, this one included."""
    injected: bool = False
    """True when a fire-drill fault (NANSENTINEL_INJECT) was injected at this step."""
    overflow: bool = False
    """True when GradScaler-handled fp16 overflow was seen (not blamed on a rank)."""
    report_path: str | None = None
    """The incident report written for this step (on the rank that wrote it)."""
    verdict: str | None = None
    """Replay verdict (data, host, transient, divergence); ``sdc`` when replicas diverged
    (kind ``replica``, see replicas.py); ``state`` when the model's own state was non-finite
    (``poisoned_state``); None when no replay ran."""
    excluded_hosts: list[str] = dataclasses.field(default_factory=list)
    """Hosts the cluster has decided to exclude so far."""
    parameters: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    """For grad faults: rank -> names of parameters holding non-finite gradients there."""
    spikes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Signal (``loss``, ``grad_norm``) -> ranks whose value spiked (-1: the cluster mean)."""
    local_spikes: list[str] = dataclasses.field(default_factory=list)
    """Signals that spiked on this rank: ``loss``, ``grad_norm``, and ``batch`` (its batch's
    norm over its running median: the input changed)."""
    quarantined: bool = False
    """True when a rank was fed a batch quarantined earlier (verdict ``data``)."""
    rolled_back_to: int | None = None
    """The step whose snapshot was restored, when this step rolled back."""
    lr_factor: float = 1.0
    """Learning-rate factor in force after this step (below 1 during a rollback cooldown)."""
    lr_held: bool = False
    """True when a param group's learning rate jumped past ``lr_jump_ratio`` x the highest it
    had applied and this step ran at its last applied rate instead (docs/recovery.md)."""
    reason: str = ""
    """Why the step was not applied as is (empty when it was)."""
    collapsed: dict[str, float] = dataclasses.field(default_factory=dict)
    """Signal (``loss``, ``grad_norm``) -> the cluster mean over its running median, where it
    collapsed far below its level (degenerate data: docs/recovery.md)."""
    recovery: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Where a recovery is in progress or this step is part of one: ``lost_steps`` (left
    unapplied so far) against ``max_lost_steps``, ``failed_snapshots`` (rolled back to without
    the loss coming back: never restored again), ``checking_snapshot``."""
    reached: list[int] = dataclasses.field(default_factory=list)
    """Ranks whose values went non-finite only downstream of a ``bad_ranks`` rank within the
    step (a pipeline stage's received activations or gradients, or a collective in the
    forward): named, never blamed or struck. Sorted."""
    buffers_restored: int = 0
    """Floating buffers (BatchNorm running statistics, EMA buffers) put back as they were
    before this step's forward, because the step was not applied (0 when it was), or, on a
    ``dropped`` step, on this rank because its own forward took the poisoned batch."""
    poisoned_state: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    """Rank -> its weights, floating buffers or optimizer state found non-finite at this step
    (``name (kind, k of n elements non-finite)``), where the state was examined (an incident,
    a snapshot kept: rare/state.py); ``state_action`` says what was done."""
    state_action: str = ""
    """``repaired`` (from a finite replica), ``rolled_back``, ``aborted`` or ``not_kept`` (a
    snapshot not kept) where ``poisoned_state`` names something; empty otherwise."""
    stop_signal: int = 0
    """A signal asked some rank to stop (15 SIGTERM: a scheduler's time limit or ``scancel``;
    2 SIGINT), the same on every rank: this is the last step. Save a checkpoint now; the next
    sentinel call (or ``close()``) raises :class:`StopRequested` (exit 128 + the signal).
    0: no stop was asked."""

    @property
    def stop_requested(self) -> bool:
        """Every rank stops after this step (see :attr:`stop_signal`): checkpoint now."""
        return self.stop_signal != 0

    @property
    def healthy(self) -> bool:
        """True when no rank reported a non-finite value."""
        return not self.bad_ranks


# --- torchft's section (nansentinel.torchft): the step as every replica group decided it ---


@dataclasses.dataclass(frozen=True, slots=True)
class PoisonedGroup:
    """A replica group that did not apply a step, and one culprit in it, as the group named
    itself (a group with two culprit ranks is two of these)."""

    group: str
    """The replica group's id (``Manager(replica_id=...)``)."""
    rank: int
    """The culprit's rank inside the replica group, as the group's ranks agreed it (-1: the
    group skipped without a culprit rank, or its culprits' ranks and hosts could not be
    paired)."""
    host: str
    """The culprit's host ("" where the group skipped without a culprit)."""
    step: int
    """torchft's step (``Manager.current_step()``), the same on every group."""
    kinds: list[str]
    """Which of ``batch``, ``loss``, ``grad`` were non-finite there (empty: a spike or a
    quarantined batch made it skip)."""
    reason: str = ""
    leaving: bool = False
    """It was struck out and leaves the quorum after this step."""


@dataclasses.dataclass(frozen=True, slots=True)
class FTStepResult(StepResult):
    """The step as every replica group decided it: :class:`StepResult`'s fields (``applied``
    true only when this group committed and stepped, or committed under
    ``step(optimizer_step=False)``, where the caller steps), and torchft's side."""

    committed: bool = False
    """``Manager.should_commit()`` was True on this group."""
    poisoned: list[PoisonedGroup] = dataclasses.field(default_factory=list)
    """The groups that did not apply the step, named by themselves, the same on every group."""
    regrouped: bool = False
    """The manager errored in this step (a peer died, an all-reduce or the quorum failed):
    not committed; the next quorum regroups."""
    torchft_step: int = 0
    """``Manager.current_step()`` when the step began: the count the incident reports, the
    exclusion record and the logs name the step by."""


class NanSentinelError(Exception):
    """The base of every error the package raises: ``except nansentinel.NanSentinelError``
    catches each refusal (a bad setting, a call out of order, a torch too old), abort and
    exclusion. Each error keeps the builtin base callers already catch (``ConfigError`` is a
    ``ValueError``, ``NonFiniteError`` a ``RuntimeError``, ...). Not :class:`StopRequested`:
    a stop is a ``SystemExit`` that ends the process cleanly, which ``except Exception`` must
    not catch."""


class NonFiniteError(NanSentinelError, RuntimeError):
    """Raised on every rank, at the same step, when the policy aborts the run.

    The message names step, ranks, hosts and kinds; ``result`` carries the full decision.
    """

    def __init__(self, message: str, result: StepResult) -> None:
        super().__init__(message)
        self.result = result


class HostExcludedError(NonFiniteError):
    """Raised on every rank when the cluster decides to exclude a host that keeps
    poisoning the run; the launcher keeps that host out of the next rendezvous."""


class NonFiniteStateError(NonFiniteError):
    """Raised on every rank when the model's own state holds a non-finite value that nothing
    can repair: at construction or at a documented restore (a checkpoint with a NaN in it),
    or on an incident where no replica and no snapshot holds a finite copy. The message names
    the tensors, ranks, hosts and element counts; ``nansentinel run`` exits 6."""


class ExchangeTimeoutError(NanSentinelError, RuntimeError):
    """The step's collectives failed or did not complete in time; the message names the ranks
    (and hosts) that did not answer, ``missing`` lists them."""

    def __init__(self, message: str, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])


class StopRequested(SystemExit):
    """Raised by the sentinel call after a step whose result had ``stop_requested``, on every
    rank alike: a ``SystemExit`` whose code is 128 + the signal (143 for SIGTERM, 130 for
    SIGINT), so an uncaught one ends the process with the code a shell would report for the
    signal, without a traceback, after the loop's ``finally`` blocks ran. The launcher reads
    this rank's ``stopped`` verdict (docs/launch.md). ``step``: the last step decided;
    ``signal``: the signal's number."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(128 + signum)
        self.signal, self.step = signum, step


class SentinelUsageError(NanSentinelError, RuntimeError):
    """The training loop called the sentinel in an order it cannot honour."""


class ArgumentTypeError(SentinelUsageError, TypeError):
    """A public call was handed a value of a type it cannot take; the message names the
    argument, the type given and the type wanted. Also a ``TypeError``, as Python's own
    refusals of a wrong type are."""


class ResultPending(SentinelUsageError):
    """A field of a device-gated step's result was read before that step was decided.

    A step that found something is decided at the next sentinel call on every rank (its
    naming, replay and report are collectives, which a read must never start); until then
    only ``step``, ``applied`` and this rank's own fields (``local_*``, ``injected``) can be
    read."""
