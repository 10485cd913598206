"""Registry functions for the torchtitan end-to-end test (``--module torchtitan_registry``).

llama3's debug model under the sentinel, exactly as a user writes it
(``with_sentinel(llama3_debugmodel())``), plus a fault made by the model itself: the first
transformer block's output turns NaN on one rank at one step (a forward hook), so that rank's
loss and gradients are non-finite and a TP peer is reached through TP's collectives; under
pipeline parallelism, the first block of one stage's model part.
Host names are given per rank, as on separate machines: ``node{rank // ranks_per_host}``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from nansentinel.torchtitan import SentinelTrainer, with_sentinel

#: torchtitan's step (counted from 1) at which the fault is made.
FAULT_STEP = 2


def _poison_first_block(rank: int) -> None:
    """On ``rank``, make the first block's output NaN in the FAULT_STEP-th training forward
    (counted on the root model: a block's forward may run again to recompute activations)."""
    if int(os.environ["RANK"]) != rank:
        return
    forwards = [0]

    def count(module: torch.nn.Module, args: Any) -> None:
        forwards[0] += 1

    def poison(module: torch.nn.Module, args: Any, output: Any) -> Any:
        return output * math.nan if forwards[0] == FAULT_STEP else output

    def attach(module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, Decoder) and not forwards[0]:
            handle.remove()
            module.register_forward_pre_hook(count)
            next(iter(module.layers.values())).register_forward_hook(poison)
            forwards[0] = 1  # this first forward is step 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(attach)


def _poison_stage(rank: int) -> None:
    """On ``rank``, make its model part's first block output NaN in every forward of
    torchtitan's FAULT_STEP-th step (every micro-batch of it). The step is counted by the
    optimizer steps taken (one optimizer's, a global post-hook): a pipeline stage runs one
    forward per micro-batch, and the schedule's shape inference runs more at step 1."""
    if int(os.environ["RANK"]) != rank:
        return
    state: dict[str, Any] = {"step": 1, "counted": None}

    def stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if state["counted"] is None:
            state["counted"] = optimizer
        if optimizer is state["counted"]:
            state["step"] += 1

    def poison(module: torch.nn.Module, args: Any, output: Any) -> Any:
        return output * math.nan if state["step"] == FAULT_STEP else output

    def attach(module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, Decoder):
            handle.remove()
            next(iter(module.layers.values())).register_forward_hook(poison)

    register_optimizer_step_post_hook(stepped)
    handle = torch.nn.modules.module.register_module_forward_pre_hook(attach)


def _config(bad_rank: int, ranks_per_host: int, *, staged: bool = False
            ) -> SentinelTrainer.Config:
    (_poison_stage if staged else _poison_first_block)(bad_rank)
    host = f"node{int(os.environ['RANK']) // ranks_per_host}"
    return with_sentinel(llama3_debugmodel(), hostname=host)


def fsdp_fault() -> SentinelTrainer.Config:
    """FSDP on 2 ranks, one per host: rank 1's block turns NaN."""
    return _config(bad_rank=1, ranks_per_host=1)


def tp_fault() -> SentinelTrainer.Config:
    """FSDP x TP on 4 ranks, a TP pair per host: rank 0's block turns NaN (TP reaches rank 1,
    its peer on node0; node1 stays clean)."""
    return _config(bad_rank=0, ranks_per_host=2)


def pp_fault() -> SentinelTrainer.Config:
    """Two pipeline stages on 2 ranks, one per host: stage 0's first block turns NaN on
    rank 0 (the NaN travels forward into stage 1's loss and back into stage 0)."""
    return _config(bad_rank=0, ranks_per_host=1, staged=True)


def sentinel_debugmodel() -> SentinelTrainer.Config:
    """The README's registry function, as it stands there."""
    return with_sentinel(llama3_debugmodel())
