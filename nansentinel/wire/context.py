"""What every layer of one rank's sentinel shares, in one frozen object.

The config, who this rank is, the exchange (and through it the peers every rank decides
with), the device, the job id and the deadline on collectives are the same for the whole run
and read by most collaborators: the Sentinel builds them once, in this order, and hands this
object to each, instead of threading six parameters through every constructor (as FSDP2 hands
its state and comm contexts to its parameter groups).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from nansentinel.config import SentinelConfig
from nansentinel.result import RankIdentity
from nansentinel.wire.collectives import Peers
from nansentinel.wire.exchange import HealthExchange
from nansentinel.wire.watchdog import StepDeadline


@dataclasses.dataclass(frozen=True, slots=True)
class Context:
    """One rank's run, as every layer reads it.

    Args:
        config: the validated config (the same on every rank).
        identity: this rank (host, local rank, device, GPU).
        exchange: the step's health exchange; :attr:`peers` is its process group.
        device: where this rank computes and keeps the sentinel's tensors.
        job_id: the job's id (``job_id``, else torchrun's run id), for file names.
        deadline: the deadline on collectives; :attr:`guarded` arms it around one.
        amp: a loss scale is in use (a GradScaler, DeepSpeed's fp16): non-finite gradients
            alone are its overflow, not a rank's fault.
    """

    config: SentinelConfig
    identity: RankIdentity
    exchange: HealthExchange
    device: torch.device
    job_id: str | None
    deadline: StepDeadline
    amp: bool = False

    @property
    def peers(self) -> Peers:
        return self.exchange.peers

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def world_size(self) -> int:
        return self.exchange.world_size

    @property
    def guarded(self) -> Callable[[], AbstractContextManager[None]]:
        """A context manager arming the watchdog around a collective of the rare path."""
        return self.deadline.guarded


@dataclasses.dataclass(frozen=True, slots=True)
class Watched:
    """What the sentinel watches and steps: the model as the user handed it (DDP, an FSDP2
    root, an engine, a list of pipeline stages), the module inside it, and the optimizer and
    scaler a step applies with (DeepSpeed: the engine's, adapted)."""

    model: torch.nn.Module
    module: torch.nn.Module
    optimizer: Any
    scaler: Any = None

    @property
    def unreplicated(self) -> tuple[str, ...]:
        """Parameters the data-parallel replicas do not keep identical (DDP's
        ``parameters_to_ignore``)."""
        return tuple(getattr(self.model, "parameters_to_ignore", ()))


def alone(config: SentinelConfig, identity: RankIdentity | None = None,
          job_id: str | None = None) -> Context:
    """The context of one process without a process group (every collective the identity):
    what a sentinel on one CPU builds, and what unit tests hand a collaborator."""
    cpu = torch.device("cpu")
    exchange = HealthExchange(None, cpu, config.exchange_timeout)
    identity = identity or RankIdentity(0, 0, 1, "localhost", str(cpu))
    deadline = StepDeadline(exchange, config.exchange_timeout, on_expire=lambda step: None,
                            speak=False)
    return Context(config, identity, exchange, cpu, job_id, deadline)
