"""The types every gradient path shares: what a path reports to (:class:`GradientSink`), what
it is (:class:`GradPath`), what it supports (:class:`Capabilities`), the norms it keeps
(:class:`KeptNorms`) and what the user handed the Sentinel (:class:`Given`). The paths and
their choice are in engines/paths.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from nansentinel.wire.collectives import ForwardCollectives, Peers


class GradientSink(Protocol):
    """What a gradient path reports to (the step in progress: current.CurrentStep)."""

    @property
    def step_index(self) -> int: ...

    @property
    def forward(self) -> ForwardCollectives:
        """The count of this rank's forward collectives (origins.py): a path whose wrapper
        issues its own collectives in the forward (DDP's buffer broadcast) brackets them with
        ``aside()`` and ``resume()``."""

    @property
    def world_size(self) -> int:
        """The ranks of the step's exchange: the world its decision spans."""

    @property
    def inferring(self) -> bool:
        """A pipeline schedule's shape inference is running: its gradients are not a step's."""

    @property
    def per_reduction(self) -> bool:
        """Every reduction must pass through the path (``policy="drop"`` withholds a poisoned
        rank's gradients in it, a grad drill writes into it): a path that can check the step
        without a seam in each reduction (DDP's end of backward) keeps that seam."""

    def before_reduction(self, local_grads: torch.Tensor) -> bool:
        """``local_grads`` is about to be reduced: arm the watchdog, fire a due grad drill
        (True if one was written into ``local_grads``)."""

    def reducing(self) -> None:
        """A reduction of this step is being launched: the watchdog counts from now."""

    def withhold(self, local_grads: torch.Tensor) -> None:
        """``local_grads`` (already checked) are about to be reduced: under ``policy="drop"``
        they become zeros if this rank's batch or loss was non-finite (drop.py)."""

    def add_grad_norm(self, norm: torch.Tensor) -> None:
        """Record one 0-d gradient norm of this rank (on the device; no host sync)."""

    def launch_exchange(self) -> None:
        """Start the health exchange now (the last reduction of the step has been launched)."""

    def diagnosed(
        self, future: torch.futures.Future, step: int, reduced_in_place: torch.Tensor
    ) -> torch.futures.Future:
        """``future`` (the in-place reduction of ``reduced_in_place`` in ``step``) resolving to
        that tensor, with a failure turned into the step's one diagnosis, the error that
        names the missing ranks and hosts."""

    def spent(self, seconds: float) -> None:
        """Add ``seconds`` of the sentinel's own work to this step's cost."""


@dataclasses.dataclass(slots=True)
class KeptNorms:
    """Per-parameter norms of one step's local gradients, taken before their reduction (a few
    hundred floats on the device): the device gate decides a step at the next sentinel call,
    after the user has zeroed (or freed) the gradients, so a detection names the poisoned
    parameters from these instead of holding a second set of gradients until then."""

    names: list[list[str]] = dataclasses.field(default_factory=list)
    norms: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """One fp32 vector per check (a bucket, a device and dtype group), beside its names."""

    def add(self, names: list[str], norms: torch.Tensor) -> None:
        self.names.append(names)
        self.norms.append(norms)

    def poisoned(self, order: dict[str, int] | None = None) -> list[str]:
        """The names whose norm is non-finite, in ``order`` (name -> place, the model's
        parameter order) where given: one host read (a detection only)."""
        if not self.norms:
            return []
        flat = torch.cat([n.detach().reshape(-1).float().cpu() for n in self.norms])
        every = [name for names in self.names for name in names]
        names = [every[i] for i in (~torch.isfinite(flat)).nonzero().flatten().tolist()]
        return sorted(names, key=order.__getitem__) if order is not None else names


PIPELINE_GATE = ("pipeline stages reach their next sentinel call at different points of the "
                 "schedule, where a detection's collectives would not pair up")
PIPELINE_DROP = ("pipeline stages make a data-parallel replica of several ranks (one per "
                 "stage), and a stage's gradients cannot be left out alone")
PIPELINE_REPLICAS = ("a pipeline or DTensor parameters without DDP or HSDP (the ranks of the "
                     "job are not replicas of each other)")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What a gradient path supports, and how, as data: the layers above ask these, never the
    path's name. A refusal is its reason in words (None: supported), so that whoever refuses
    says why. Each path declares its own at class level (``CAPS``, what the matrix test
    enumerates) and refines them for this run at construction (``caps``)."""

    label: str
    """How messages name the path (``DDP``, ``FSDP2``): words, not a key to branch on."""
    reduces: bool = True
    """Its reductions check the gradients as they leave (a hook on each reduction); False: the
    local gradients are checked at ``check_grads()`` / ``step()`` (the user reduces them, or
    nothing is reduced)."""
    steps_optimizer: bool = False
    """The engine steps its own optimizer and loss scale (``engines.steps_of`` adapts it)."""
    wraps: bool = False
    """The engine wraps the user's module (reached as its ``.module``: DDP, DeepSpeed)."""
    device_gate: str | None = None
    """Why the device gate cannot take a step of this path (None: it can)."""
    replay: str | None = None
    """Why a detection is not replayed on this path (None: it can be)."""
    drop: str | None = None
    """Why ``policy="drop"`` cannot leave a rank out on this path (None: it can)."""
    rollback: str | None = None
    """Why rollbacks (``policy="rollback"``, a spike action ``rollback``) are refused."""
    fingerprints: str | None = None
    """Why there are no replica fingerprints (None: :attr:`replica_group` holds the replicas)."""
    pipelined: bool = False
    """This rank holds pipeline stages (:meth:`staged`): their refusals come first."""
    sharded: bool = False
    """The engine shards the user's module in place (FSDP2's ``fully_shard``, an FSDP1 root):
    the module a framework hands over is the one to watch, not a wrapper still to come."""
    order_watched: bool = False
    """The parameters' own ``.grad`` hold this rank's gradients after each backward, so the
    order of the loop's calls is watched on them (step/usage.py: a backward before each
    ``step()``)."""
    loss_first: bool = False
    """Nothing reduces before ``step()``: a ``check_loss()`` after the step's first backward
    is refused there (its flag would describe a step already taken)."""
    replica_group: Any = None
    """The process group of this rank's replicas when :attr:`fingerprints` is None:
    :data:`EXCHANGE` for the exchange's own group (the user reduces by hand, so the ranks of
    the exchange are replicas)."""
    buffers_from: Any = None
    """The module whose forward broadcasts the floating buffers from one rank to the others
    before it runs (DDP's wrapper with ``broadcast_buffers``): this rank's own buffers are
    copied before it, so that a NaN that arrived is told from one made here
    (checks/buffers.py). None: nothing is broadcast."""

    def staged(self) -> Capabilities:
        """These capabilities under pipeline stages: no device gate, no drop, and the ranks
        of the exchange (every stage) are not replicas of each other."""
        fingerprints = self.fingerprints
        if fingerprints is None and self.replica_group is EXCHANGE:
            fingerprints = PIPELINE_REPLICAS
        return dataclasses.replace(self, device_gate=PIPELINE_GATE, drop=PIPELINE_DROP,
                                   fingerprints=fingerprints, pipelined=True)


#: :attr:`Capabilities.replica_group` of a path whose replicas are the exchange's ranks.
EXCHANGE = "the exchange's group"


class GradPath(Protocol):
    """One way of checking the local gradients before their reduction."""

    #: What it supports, for this run (see :class:`Capabilities`).
    caps: Capabilities
    #: Process groups the path's own collectives run on in the forward (FSDP2's parameter
    #: all-gathers): they carry no batch's NaN to another rank's loss (origins.py).
    mesh_groups: Sequence[Any]

    def check_now(self) -> None:
        """Check the local gradients now, at ``check_grads()`` (or at ``step()`` when no
        reduction checked them this step: no backward, or every micro-batch under ``no_sync``)."""

    #: Keep this step's per-parameter norms for :meth:`take_norms` (the device gate sets it:
    #: the step is decided after the user has zeroed the gradients). FSDP2 always takes its
    #: per-parameter norms and hands them over when it is set; DeepSpeed keeps the host gate.
    keep_norms: bool

    def take_norms(self) -> KeptNorms | None:
        """This step's per-parameter norms, kept when :attr:`keep_norms` is set (None
        otherwise): handed to the step's record before the path forgets the step."""

    def naming_detail(self, poisoned: bool, peers: Peers,
                      kept: KeptNorms | None = None) -> dict[str, Any]:
        """After a gradient fault, on every rank, before the gradients are discarded: this
        rank's share of the report, with ``parameters``, the fully-qualified names of its
        parameters whose local gradients were non-finite before the reduction, where this
        rank was ``poisoned`` (from ``kept`` when given: the gradients are gone by then). May
        run a collective of ``peers`` (FSDP2), the same on every rank; its size does not
        depend on the world size."""

    def reset(self) -> None:
        """Forget this step's per-parameter records (called after every decision)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Given:
    """What the user handed the Sentinel, as given: an engine that steps its own optimizer
    checks the rest against itself (DeepSpeed refuses an own optimizer, scaler, group, replay
    function, snapshots or pipeline stages beside it)."""

    model: Any
    optimizer: Any = None
    scaler: Any = None
    group: Any = None
    replay: Any = None
    snapshots: Any = None
    stages: Any = None
