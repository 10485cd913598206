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
import sys
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


# --- torchtitan's fault-tolerant trainer (torchtitan/experiments/torchft) ----------------------

def _ft_base() -> Any:
    """torchft's own registry function as a user starts from it, trained synchronously (no
    DiLoCo), on gloo, without the profiler; the fault: replica group 1's rank 1 at
    FAULT_STEP. The test gives each group's torchrun its ``REPLICA_GROUP_ID``."""
    import dataclasses

    from torchtitan.experiments.torchft.llama3.config_registry import (
        llama3_torchft_debugmodel,
    )

    config = llama3_torchft_debugmodel()
    config.fault_tolerance = dataclasses.replace(
        config.fault_tolerance, process_group="gloo", semi_sync_method=None)
    config.profiler = dataclasses.replace(config.profiler, enable_profiling=False)
    # torchft heals through the checkpointer's state dict functions, registered only with
    # checkpointing on (torchtitan's own FT test runs with --checkpoint.enable); nothing is
    # written to disk here.
    config.checkpoint = dataclasses.replace(
        config.checkpoint, enable=True, load_only=True, enable_ft_dataloader_checkpoints=False)
    # torchtitan's base timeout: this config's 15 s would leave the sentinel 2 s a step.
    config.comm = dataclasses.replace(config.comm, train_timeout_seconds=100)
    config.debug = dataclasses.replace(config.debug, seed=0)  # every group starts alike
    group = int(os.environ["REPLICA_GROUP_ID"])
    if group == 1:
        _poison_first_block(1)
    _start_together()
    if not _hooked:  # once a process: the test's arms share it (torchtitan_train.py)
        _hooked.append(True)
        _report_weights(group)
    return config


_hooked: list[bool] = []


def say(line: str) -> None:
    """``line`` on stdout in one write, on a line of its own: the ranks share torchrun's
    stdout, and a print is two writes (the text, then its newline) that another rank's output
    can come between; the leading newline ends another rank's unfinished line."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"\n{line}\n".encode())


def _report_weights(group: int) -> None:
    """After each step of torchtitan's optimizers container, one line: whether this rank's
    shards are finite, and their sum (unchanged by a vetoed step). torchft's container
    steps itself again through its wrapper: the outer call counts."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from torchtitan.components.optimizer import OptimizersContainer

    state = {"depth": 0, "step": 0, "arm": ""}

    def enter(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if isinstance(optimizer, OptimizersContainer):
            state["depth"] += 1

    def report(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not isinstance(optimizer, OptimizersContainer):
            return
        state["depth"] -= 1
        if state["depth"]:
            return
        if state["arm"] != os.environ.get("FT_ARM", ""):  # a new arm counts from 1
            state["arm"], state["step"] = os.environ.get("FT_ARM", ""), 0
        state["step"] += 1
        shards = [p.to_local() if hasattr(p, "to_local") else p
                  for g in optimizer.param_groups for p in g["params"]]
        finite = all(bool(torch.isfinite(s).all()) for s in shards)
        total = sum(float(s.double().sum()) for s in shards)
        say(f"WEIGHTS {os.environ.get('FT_ARM', '')} group {group} rank {os.environ['RANK']} "
            f"step {state['step']} finite {finite} sum {total!r}")

    register_optimizer_step_pre_hook(enter)
    register_optimizer_step_post_hook(report)


def _start_together() -> None:
    """Every rank asks for its first quorum once every rank of every group has built its
    manager (a file each in ``FT_START``, ``FT_RANKS`` in all): a group that asked alone
    would form a quorum of its own and run ahead (the lighthouse waits only for replicas
    that heartbeat already)."""
    import time
    from pathlib import Path

    from torchft import Manager

    folder, ranks = Path(os.environ["FT_START"]), int(os.environ["FT_RANKS"])
    start = Manager.start_quorum

    def together(self: Any, *args: Any, **kwargs: Any) -> Any:
        if Manager.start_quorum is together:
            Manager.start_quorum = start  # type: ignore[method-assign]
            (folder / f"{os.environ['REPLICA_GROUP_ID']}-{os.environ['RANK']}").touch()
            deadline = time.monotonic() + 120
            while len(list(folder.iterdir())) < ranks:
                assert time.monotonic() < deadline, "the other replica groups never started"
                time.sleep(0.05)
        return start(self, *args, **kwargs)

    Manager.start_quorum = together  # type: ignore[method-assign]


def _step0_sync(on: bool) -> None:
    """torchft syncs step 0 by healing every group from one (``init_sync``, its default): the
    healthy group's state dict is taken in torchft's quorum thread while that group's own
    first forward runs, and FSDP2's state_dict pre-hook reshards the parameters under it
    ("aten.mm got mixed torch.Tensor and DTensor", seen here on CPU with and without the
    sentinel). torchtitan's own trainer has no setting for it: the bare arm turns it off
    here (``on=False``); the sentinel's arm puts torchft's own back and turns it off with
    the setting SentinelFTTrainer adds (``fault_tolerance.init_sync``). The groups start
    alike from the same seed (``debug.seed``)."""
    from torchft import Manager

    init = _MANAGER_INIT.setdefault("init", Manager.__init__)

    def no_sync(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "init_sync": False})

    Manager.__init__ = init if on else no_sync  # type: ignore[method-assign]


#: torchft's own ``Manager.__init__``, kept while the bare arm replaces it.
_MANAGER_INIT: dict[str, Any] = {}


def ft_bare() -> Any:
    """torchtitan's fault-tolerant trainer alone: group 1's NaN reaches every group."""
    _step0_sync(False)
    return _ft_base()


def ft_fault() -> Any:
    """The same under the sentinel, a host name per rank (``node{group}r{rank}``)."""
    import dataclasses

    group, rank = os.environ["REPLICA_GROUP_ID"], os.environ["RANK"]
    _step0_sync(True)
    config = with_sentinel(_ft_base(), hostname=f"node{group}r{rank}")
    # docs/torchft.md's --fault_tolerance.no-init-sync, set in the registry here because the
    # bare arm's config (torchtitan's own) has no such field and both arms share the argv.
    config.fault_tolerance = dataclasses.replace(config.fault_tolerance, init_sync=False)
    return config


def sentinel_ft_debugmodel() -> Any:
    """docs/torchft.md's registry function for torchtitan's fault-tolerant trainer."""
    import dataclasses

    from torchtitan.experiments.torchft.llama3.config_registry import (
        llama3_torchft_debugmodel,
    )

    config = llama3_torchft_debugmodel()
    config.fault_tolerance = dataclasses.replace(config.fault_tolerance, semi_sync_method=None)
    return with_sentinel(config)
