"""The combination matrix's training loop (issues 26, 36): one combination of what users
combine, on one engine, run with its faults and once more without the faulty steps, on gloo
ranks.

A combination is a plain dict (``Combo``), so that the test can sample them with a printed
seed and ship them to spawned ranks. Its ``engine`` is the name of a gradient path class of
``nansentinel.engines.registry()`` (DDP, DeepSpeed, FSDP1, FSDP2, gradients reduced by hand:
checked in collective pre-hooks from torch 2.14, after ``check_grads()`` on the local path below
it);
:data:`BUILDERS` holds, per engine, a :class:`Run` subclass that builds that engine's model,
optimizer and loop on CPU gloo ranks. A new engine joins the matrix with one such subclass
(``engine = TheNewPath``), listed in :data:`BUILDERS`; the test fails until it has one.

Every rank runs the same list of combinations in one process group, one after the other:
first, per engine of the list, a probe (the engine built for the plain setup, a Sentinel on
it, its capabilities for this run read back), then each combination. A combination whose
Sentinel construction is refused returns the refusal; any other returns what the invariants
are checked on (tests/distributed/test_invariants.py, which also decides, from the
capabilities, which combinations are refused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import json
import math
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel import engines, skip_list
from nansentinel.common import torch_insides as insides
from nansentinel.config import ConfigError
from nansentinel.engines import Capabilities
from nansentinel.engines.ddp import DDPPath
from nansentinel.engines.deepspeed import DeepSpeedPath
from nansentinel.engines.fsdp import FSDPPath
from nansentinel.engines.fsdp1 import FSDP1Path
from nansentinel.engines.local import LocalGradPath
from nansentinel.engines.prehook import PreHookPath
from nansentinel.result import ResultPending, SentinelUsageError
from tests.support import full_tensor

#: The dimensions of the matrix and their values; ``engine``: every gradient path of the
#: registry, by class name.
DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "engine": tuple(path.__name__ for path in engines.registry()),
    "policy": ("skip", "rollback", "abort", "drop"),
    "gate": ("host", "device"),
    "optimizer": ("adamw_fused", "adamw_foreach", "sgd"),
    "scaler": ("none", "plain", "clip"),
    "batchnorm": (False, True),
    "accumulate": (1, 2),
    "replay": (False, True),
    "fingerprint": (False, True),
    "rank0_reads": (False, True),
    # issue 68: what the model holds, poisoned as a step begins (the state drills)
    "fault": ("batch", "loss", "activation", "backward",
              "weight", "optimizer_state", "buffer", "hyperparameter"),
    "faulty_ranks": (1, 2),
}
#: The setup every engine must take (the probe's): nothing any capability refuses.
PLAIN: dict[str, Any] = {
    "policy": "skip", "gate": "host", "optimizer": "adamw_foreach", "scaler": "none",
    "batchnorm": False, "accumulate": 1, "replay": False, "fingerprint": False,
    "rank0_reads": False, "fault": "batch", "faulty_ranks": 1,
}
STEPS = 8
#: The steps a combination's fault hits (each followed by healthy steps).
FAULT_STEPS = (3, 5)
#: The faults written into the model's own state (its weights, optimizer state, floating
#: buffers: NANSENTINEL_INJECT's state drills); ``hyperparameter`` writes param group 0's lr.
STATE_FAULTS = ("weight", "optimizer_state", "buffer")
#: Rollbacks need a snapshot before the first fault.
SNAPSHOT_EVERY = 2
#: The healthy step whose learning rate the loop's schedule blows up (x100, issue 52): held at
#: the last applied rate on every rank, in every combination (the LR rules are on in all).
JUMP_STEP = 1
#: The learning-rate rules of issue 52, on in every combination: one healthy step's jump is
#: held, and a rollback caps and ends its backoff; the references are the same rules.
LR_RULES: dict[str, Any] = {"lr_jump_ratio": 4.0, "rollback_lr_cap": True,
                            "rollback_lr_quiet_steps": 2, "rollback_clean_snapshots": True}
#: The capability fields the probe sends back (``replica_group`` is a process group,
#: ``buffers_from`` a module).
CAPS_FIELDS = tuple(f.name for f in dataclasses.fields(Capabilities)
                    if f.name not in ("replica_group", "buffers_from"))

Combo = dict[str, Any]


def every_combo(engine: str | None = None) -> list[Combo]:
    """Every combination (of one ``engine``, or of all)."""
    dims = dict(DIMENSIONS, engine=(engine,)) if engine is not None else DIMENSIONS
    names = list(dims)
    combos = (dict(zip(names, values, strict=True)) for values in itertools.product(*dims.values()))
    return [c for c in combos if BUILDERS[c["engine"]].exists(c) and meaningful(c)]


def meaningful(combo: Combo) -> bool:
    """A buffer fault needs a floating buffer (the BatchNorm): without one it hits nothing."""
    return combo["fault"] != "buffer" or combo["batchnorm"]


class _NanGrad(torch.autograd.Function):
    """Identity forward; a NaN in the gradient it sends back (a fault made in the backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class Net(nn.Module):
    """Linear -> (BatchNorm) -> ReLU -> Linear. ``fault``: ``activation`` writes NaN into the
    forward before the BatchNorm (so its running statistics take it), ``backward`` into the
    gradient flowing back through the same point."""

    def __init__(self, batchnorm: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.out = nn.Linear(16, 1)
        self.fault: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.fault == "activation":
            h = h * float("nan")
        elif self.fault == "backward":
            h = _NanGrad.apply(h)
        return self.out(torch.relu(self.norm(h)))


#: Rows of a micro-batch (DeepSpeed's ``train_micro_batch_size_per_gpu``).
ROWS = 8


def batch_for(rank: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    x = torch.randn(ROWS, 8, generator=g)
    return {"x": x, "y": x.sum(dim=1, keepdim=True)}


def sample_id(rank: int, step: int, micro: int, row: int) -> int:
    """The dataset index of a row: unique per rank, step, micro-batch and row."""
    return ((rank * 100 + step) * 10 + micro) * 10 + row


def loss_of(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(module(batch["x"]), batch["y"])


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-2, foreach=True)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def drops(combo: Combo) -> bool:
    """Under ``policy="drop"`` the faulty steps are dropped: a fault known before the
    gradients leave (batch, loss, a NaN forward: the loss), on one rank of 3 (``max_dropped``
    1/8: one rank), not GradScaler's overflow; two ranks, or a NaN made in the backward, skip."""
    return (combo["policy"] == "drop" and combo["faulty_ranks"] == 1
            and combo["fault"] in ("batch", "loss", "activation"))


def faults_of(combo: Combo, world: int) -> dict[int, list[int]]:
    """step -> the ranks its fault hits."""
    ranks = list(range(combo["faulty_ranks"]))
    ranks = [(r + 1) % world for r in ranks]  # rank 1 (and 2): not only rank 0
    return {step: ranks for step in FAULT_STEPS}


def _inject_spec(combo: Combo, faults: dict[int, list[int]]) -> str:
    if combo["fault"] not in ("batch", "loss", *STATE_FAULTS, "hyperparameter"):
        return ""
    return ";".join(f"kind={combo['fault']},rank={r},step={s}"
                    for s, ranks in faults.items() for r in ranks)


def _flat(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(dtype or t.dtype).clone() for t in tensors])


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (a collective: every rank, in the same order)."""
    return full_tensor(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t`` (a DTensor's local shard), detached."""
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).detach()


# --- the engines ---------------------------------------------------------------------------


class Run:
    """One combination's model, optimizer, GradScaler and loop on this rank, for one engine.

    The base class is the plain model stepped by the user's optimizer; each engine's subclass
    wraps it (:meth:`build`) and changes the steps of the loop its engine does differently.
    Built afresh per run (seed 0: the same initial weights on every rank), whether the
    Sentinel then takes it or refuses it.
    """

    #: The gradient path class of ``engines.registry()`` this builds a model for.
    engine: ClassVar[type]
    #: The wrapper copies rank 0's floating buffers into every replica in each forward (DDP's
    #: ``broadcast_buffers``): after an abort, only rank 0's equal the run without the fault.
    shares_buffers: ClassVar[bool] = False
    #: Combinations a CI run takes of this engine: that its capabilities let run, and that
    #: they refuse (its share of the sample, by its cost on the 2-core CI machine).
    runs: ClassVar[int] = 8
    refusals: ClassVar[int] = 2

    def __init__(self, combo: Combo, rank: int, world: int) -> None:
        self.combo, self.rank, self.world = combo, rank, world
        torch.manual_seed(0)
        self.net = Net(combo["batchnorm"])
        self.scaler = (torch.amp.GradScaler("cpu", init_scale=1024.0)
                       if combo["scaler"] != "none" else None)
        self.model, self.optimizer = self.build(self.net)

    @staticmethod
    def available() -> str | None:
        """Why this engine cannot run here (a package missing); None: it can."""
        return None

    @staticmethod
    def exists(combo: Combo) -> bool:
        """Whether users can build the combination with this engine at all, without the
        sentinel (torch itself fails otherwise): the matrix samples only those."""
        return True

    def build(self, net: Net) -> tuple[Any, torch.optim.Optimizer | None]:
        """(what the Sentinel is handed, the optimizer the user steps through it)."""
        return net, _optimizer(self.combo["optimizer"], net.parameters())

    def sentinel(self, **kwargs: Any) -> nansentinel.Sentinel:
        """The Sentinel on this engine's model, as its users construct it."""
        return nansentinel.Sentinel(self.model, self.optimizer, scaler=self.scaler, **kwargs)

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch: gradients reduced only on the last one."""
        return contextlib.nullcontext()

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss_of(self.model, batch) / self.combo["accumulate"]

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def between(self, sentinel: nansentinel.Sentinel) -> None:
        """After a micro-batch before the last."""

    def reduce(self, sentinel: nansentinel.Sentinel | None) -> None:
        """After the last micro-batch's backward, before the clipping and ``step()`` (None:
        after the run, the sentinel closed)."""

    def clip(self) -> None:
        if self.scaler is not None and self.combo["scaler"] == "clip":
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_state(self) -> torch.Tensor:
        """Every tensor of the optimizer state, whole, flat, in fp64 (collectives under FSDP2:
        every rank, in the same order)."""
        assert self.optimizer is not None
        opt = self.optimizer
        tensors = [_full(v) for group in opt.param_groups for p in group["params"]
                   for _, v in sorted(opt.state.get(p, {}).items(), key=lambda kv: str(kv[0]))
                   if isinstance(v, torch.Tensor)]
        return _flat(tensors, torch.float64)

    def state(self) -> dict[str, Any]:
        """Weights and optimizer state whole, this rank's floating buffers, the scale."""
        return {
            "params": _flat([_full(p) for p in self.net.parameters()]),
            "buffers": _flat([b for b in self.net.buffers() if b.is_floating_point()]),
            "optimizer": self.optimizer_state(),
            "scale": float(self.scaler.get_scale()) if self.scaler is not None else None,
        }

    def one_more_step(self) -> bool:
        """A plain step after the run (the sentinel closed): the optimizer and the scaler still
        work. True if the weights moved and stayed finite."""
        before = [_local(p).clone() for p in self.net.parameters()]
        self._one_more_step()
        after = [_local(p) for p in self.net.parameters()]
        changed = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        return changed and all(bool(torch.isfinite(p).all()) for p in after)

    def _one_more_step(self) -> None:
        opt, scaler = self.optimizer, self.scaler
        assert opt is not None
        self.backward(loss_of(self.model, batch_for(self.rank, 99, 0)))
        self.reduce(None)
        if scaler is not None:
            if self.combo["scaler"] == "clip":
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)


class DDPRun(Run):
    """DistributedDataParallel on the default group; ``no_sync`` before the last micro-batch."""

    engine = DDPPath
    shares_buffers = True
    runs = 12
    refusals = 0  # DDP's capabilities refuse nothing of the matrix

    def build(self, net: Net) -> tuple[Any, torch.optim.Optimizer | None]:
        model = DDP(net)
        return model, _optimizer(self.combo["optimizer"], model.parameters())

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return self.model.no_sync() if not last else contextlib.nullcontext()


class LocalRun(Run):
    """The plain model; the user reduces by hand: ``check_grads()``, then an all-reduce of each
    gradient and a division by the world (every rank, in the same order)."""

    engine = LocalGradPath

    @staticmethod
    def available() -> str | None:
        if insides.supported("collective_hooks"):
            return ("from torch 2.14 a plain model on several ranks takes the pre-hook path "
                    "(PreHookRun), check_grads() or not")
        return None

    def reduce(self, sentinel: nansentinel.Sentinel | None) -> None:
        if sentinel is not None:
            sentinel.check_grads()
        self.all_reduce()

    def all_reduce(self) -> None:
        for p in self.net.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world)


class PreHookRun(LocalRun):
    """The plain model; the loop all-reduces each gradient itself, with no ``check_grads()``:
    the pre-hook path checks each all-reduce's send buffer (torch >= 2.14)."""

    engine = PreHookPath

    @staticmethod
    def available() -> str | None:
        if not insides.supported("collective_hooks"):
            return (f"torch {torch.__version__} has no collective pre-hooks (from "
                    f"{insides.FEATURES['collective_hooks'].minimum}): the local path")
        return None

    def reduce(self, sentinel: nansentinel.Sentinel | None) -> None:
        self.all_reduce()


_MESHES: dict[int, Any] = {}


class FSDPRun(Run):
    """FSDP2: ``fully_shard`` on a 1-D mesh of every rank; gradient sync off before the last
    micro-batch; weights and optimizer state compared whole (``full_tensor()``)."""

    engine = FSDPPath

    def build(self, net: Net) -> tuple[Any, torch.optim.Optimizer | None]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if self.world not in _MESHES:  # one mesh (on the default group) for every run
            _MESHES[self.world] = init_device_mesh("cpu", (self.world,))
        fully_shard(net, mesh=_MESHES[self.world])
        return net, _optimizer(self.combo["optimizer"], net.parameters())

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _one_more_step(self) -> None:
        self.model.set_requires_gradient_sync(True)
        super()._one_more_step()


def _gathered(tensors: list[torch.Tensor]) -> torch.Tensor:
    """This rank's tensors flat in fp64, gathered from every rank in rank order (a
    collective): whole, where each rank holds an equal shard (FSDP1's padded flat shards)."""
    own = _flat(tensors, torch.float64)
    parts = torch.empty(own.numel() * dist.get_world_size(), dtype=own.dtype)
    dist.all_gather_into_tensor(parts, own)
    return parts


class FSDP1Run(Run):
    """FSDP1 (``FullyShardedDataParallel``) FULL_SHARD over every rank, flat parameters
    (``use_orig_params=False``: equal shards on every rank); ``no_sync`` before the last
    micro-batch; FSDP1's own ``clip_grad_norm_`` and ``ShardedGradScaler``, as FSDP1's users
    clip and scale (a plain GradScaler would find an overflow in some ranks' shards only);
    weights and optimizer state compared whole (each rank's shard gathered)."""

    engine = FSDP1Path
    refusals = 0  # FSDP1's capabilities refuse nothing of the matrix

    @staticmethod
    def exists(combo: Combo) -> bool:
        """Not ``unscale_`` (to clip) with a fused optimizer: ShardedGradScaler's explicit
        ``unscale_`` leaves a ``found_inf`` of shape [1], which torch's fused AdamW then
        rejects ("output with shape [] doesn't match the broadcast shape [1]", torch 2.13
        and 2.15, with no sentinel)."""
        return combo["scaler"] != "clip" or combo["optimizer"] != "adamw_fused"

    def __init__(self, combo: Combo, rank: int, world: int) -> None:
        super().__init__(combo, rank, world)
        if self.scaler is not None:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler("cpu", init_scale=1024.0)

    def build(self, net: Net) -> tuple[Any, torch.optim.Optimizer | None]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(net, device_id=torch.device("cpu"), use_orig_params=False)
        return model, _optimizer(self.combo["optimizer"], model.parameters())

    def sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return self.model.no_sync() if not last else contextlib.nullcontext()

    def clip(self) -> None:
        if self.scaler is not None and self.combo["scaler"] == "clip":
            self.scaler.unscale_(self.optimizer)
            self.model.clip_grad_norm_(1.0)

    def optimizer_state(self) -> torch.Tensor:
        assert self.optimizer is not None
        opt = self.optimizer
        return _gathered([v for group in opt.param_groups for p in group["params"]
                          for _, v in sorted(opt.state.get(p, {}).items(),
                                             key=lambda kv: str(kv[0]))
                          if isinstance(v, torch.Tensor)])

    def state(self) -> dict[str, Any]:
        return {
            "params": _gathered(list(self.net.parameters())),
            "buffers": _flat([b for b in self.net.buffers() if b.is_floating_point()]),
            "optimizer": self.optimizer_state(),
            "scale": float(self.scaler.get_scale()) if self.scaler is not None else None,
        }


class DeepSpeedRun(Run):
    """A DeepSpeed engine at ZeRO-1, fp32, on the combination's torch optimizer, with
    DeepSpeed's own ``gradient_accumulation_steps``: ``engine.backward`` and ``sentinel.step()``
    every micro-batch (docs/deepspeed.md). ZeRO-1 without ``overlap_comm``: the public
    ``allreduce`` seam, and the cheapest engine to build on CPU. The GradScaler of a
    combination is handed to the Sentinel beside the engine, as a user would."""

    engine = DeepSpeedPath
    runs = 2  # building an engine is the slowest part of a combination, and importing
    refusals = 2  # DeepSpeed takes seconds: a fixed few per CI run

    @staticmethod
    def available() -> str | None:
        return None if importlib.util.find_spec("deepspeed") else "deepspeed is not installed"

    def build(self, net: Net) -> tuple[Any, torch.optim.Optimizer | None]:
        import logging

        import deepspeed

        from tests.distributed.workers_deepspeed import on_cpu_gloo

        on_cpu_gloo()
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        config = {
            "train_micro_batch_size_per_gpu": ROWS,
            "gradient_accumulation_steps": self.combo["accumulate"],
            "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        opt = _optimizer(self.combo["optimizer"], net.parameters())
        engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
        return engine, None

    def sentinel(self, **kwargs: Any) -> nansentinel.Sentinel:
        return nansentinel.Sentinel(self.model, scaler=self.scaler, **kwargs)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss_of(self.model, batch)  # engine.backward divides by the accumulation

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss)

    def between(self, sentinel: nansentinel.Sentinel) -> None:
        assert sentinel.step() is None, "a micro-batch before the boundary decided"

    def zero_grad(self) -> None:
        """Nothing: ``engine.step()`` (applied or skipped) clears the gradients."""

    def optimizer_state(self) -> torch.Tensor:
        """ZeRO-1 partitions the optimizer state: every rank's partition, gathered in rank
        order (a collective)."""
        opt = self.model.basic_optimizer
        own = [v for group in opt.param_groups for p in group["params"]
               for _, v in sorted(opt.state.get(p, {}).items(), key=lambda kv: str(kv[0]))
               if isinstance(v, torch.Tensor)]
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, _flat(own, torch.float64))
        return torch.cat(parts)

    def _one_more_step(self) -> None:
        for micro in range(self.combo["accumulate"]):
            self.model.backward(loss_of(self.model, batch_for(self.rank, 99, micro)))
            self.model.step()


#: Engine (its class name in ``engines.registry()``) -> how to build and drive it.
BUILDERS: dict[str, type[Run]] = {
    run.engine.__name__: run
    for run in (DDPRun, DeepSpeedRun, FSDP1Run, FSDPRun, PreHookRun, LocalRun)
}


# --- one combination -----------------------------------------------------------------------


def _outcome(result: Any) -> dict[str, Any]:
    return {"step": result.step, "outcome": str(result.outcome), "applied": result.applied,
            "bad_ranks": list(result.bad_ranks), "buffers_restored": result.buffers_restored,
            "report_path": result.report_path, "reason": result.reason,
            "rolled_back_to": result.rolled_back_to, "lr_held": result.lr_held,
            "kinds": list(result.kinds), "verdict": result.verdict,
            "poisoned": sorted(int(r) for r in result.poisoned_state),
            "state_action": result.state_action}


def _anywhere(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on some rank."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _constructed(run: Run, **kwargs: Any) -> tuple[nansentinel.Sentinel | None, Any]:
    """``(sentinel, None)``, or ``(None, the refusal)`` where this rank's construction raised
    one of the documented errors (any other error fails the rank). Every rank learns whether
    some rank refused, so that none trains alone: the one that built its sentinel abandons it
    and reports that it was not refused."""
    try:
        sentinel, refused = run.sentinel(**kwargs), None
    except (SentinelUsageError, ConfigError) as exc:
        sentinel, refused = None, {"type": type(exc).__name__, "message": str(exc),
                                   "field": getattr(exc, "field", None)}
    if _anywhere(refused is not None) and sentinel is not None:
        sentinel.abandon()
        return None, {"type": None, "message": "this rank was not refused", "field": None}
    return sentinel, refused


def run_one(rank: int, world: int, combo: Combo, report_dir: Path, *, faulty: bool,
            stop_before: int | None = None) -> dict[str, Any]:
    """Train one combination: with its faults (``faulty``), or as the reference that never
    saw the faulty steps (and, after an abort, stops before the aborted step). A refused
    construction returns ``{"refused": ...}``."""
    run = BUILDERS[combo["engine"]](combo, rank, world)
    faults = faults_of(combo, world)
    sentinel, refused = _constructed(
        run, report_dir=str(report_dir), env={},
        policy=combo["policy"], gate=combo["gate"],
        replay=loss_of if combo["replay"] else None,
        fingerprint_every=1 if combo["fingerprint"] else 0,
        snapshot_every=SNAPSHOT_EVERY, hostname=f"host{rank}", metrics_port=0,
        inject=(_inject_spec(combo, faults) or None) if faulty else None,
        max_consecutive_skips=10, rollback_skip_batches=1, **LR_RULES,
    )
    if sentinel is None:
        return {"refused": refused}
    results: list[Any] = []
    reads: list[str] = []
    error = None
    steps = [s for s in range(STEPS) if faulty or s not in faults]
    if stop_before is not None:
        steps = [s for s in steps if s < stop_before]
    base = [g["lr"] for g in sentinel.optimizer.param_groups]
    planned: list[Any] = []
    try:
        for step in steps:
            # The loop's schedule, and its jump, into the optimizer's groups as they are now (a
            # rollback's optimizer.load_state_dict gives it new ones, as a scheduler reads).
            for g, lr in zip(sentinel.optimizer.param_groups, base, strict=True):
                g["lr"] = lr * 100 if step == JUMP_STEP else lr
            hit = faulty and rank in faults.get(step, ()) and combo["fault"] in (
                "activation", "backward")
            run.net.fault = combo["fault"] if hit else None
            for micro in range(combo["accumulate"]):
                last = micro == combo["accumulate"] - 1
                batch = sentinel.check_batch(batch_for(rank, step, micro),
                                             ids=[sample_id(rank, step, micro, i)
                                                  for i in range(ROWS)])
                with run.sync(last):
                    loss = run.loss(batch)
                    sentinel.check_loss(loss)
                    run.backward(loss)
                if not last:
                    run.between(sentinel)
            run.reduce(sentinel)
            run.clip()
            result = sentinel.step()
            run.net.fault = None
            results.append(result)
            plan = sentinel.lr_guard.last_plan
            planned.append(list(plan.lrs) if plan is not None else None)
            if rank == 0 and combo["rank0_reads"]:  # a loop that logs on rank 0 alone
                try:
                    reads.append(str(result.outcome))
                except ResultPending:
                    reads.append("pending")
                sentinel.state_dict()
            run.zero_grad()
        sentinel.close()
    except nansentinel.NonFiniteError as exc:
        error = {"type": type(exc).__name__, "step": exc.result.step,
                 **{k: v for k, v in _outcome(exc.result).items() if k != "report_path"}}
        sentinel.close()
    outcomes = []
    for step, r in zip(steps, results, strict=False):
        try:
            outcomes.append(_outcome(r))
        except nansentinel.NonFiniteError:  # a device-gated step whose decision aborted
            outcomes.append({"step": step, "outcome": "aborted", "applied": False,
                             "bad_ranks": None, "buffers_restored": None,
                             "report_path": None})
    out = {"refused": None, "outcomes": outcomes, "error": error, "state": run.state(),
           "path": type(sentinel.gradients).__name__,
           "gate": "device" if sentinel.device_gate is not None else "host",
           "replay": sentinel.replays,
           "fingerprints": sentinel.replicas is not None, "reads": reads,
           "planned_lrs": planned, "base_lrs": base}
    # Usable the next step: one more healthy step on the same optimizer and scaler.
    if error is None:
        out["next"] = run.one_more_step()
    if rank == 0:
        out["reports"] = _reports(report_dir)
        skip_list = next(report_dir.glob("*skip*"), None)
        out["skip_list"] = ([json.loads(line) for line in skip_list.read_text().splitlines()]
                            if skip_list is not None else [])
    return out


def probe(rank: int, world: int, engine: str, report_dir: Path) -> dict[str, Any]:
    """The engine built for :data:`PLAIN`, a Sentinel on it: the class of the gradient path
    that took it (``path``) and its capabilities for this run (``CAPS`` refined at
    construction: the local path refuses a drop on more than one rank, for instance)."""
    run = BUILDERS[engine](dict(PLAIN, engine=engine), rank, world)
    sentinel = run.sentinel(report_dir=str(report_dir), env={}, hostname=f"host{rank}",
                            metrics_port=0, **{k: PLAIN[k] for k in ("policy", "gate")})
    caps = sentinel.gradients.caps
    out = {"path": type(sentinel.gradients).__name__,
           "caps": {name: getattr(caps, name) for name in CAPS_FIELDS}}
    sentinel.close()
    return out


def _reports(directory: Path) -> list[dict[str, Any]]:
    """Rank 0's incident reports of one combination, parsed (``None`` for one that is not
    valid JSON)."""
    out = []
    for path in sorted(directory.glob("incident-*.json")):
        try:
            content = json.loads(path.read_text())
        except ValueError:
            content = None
        out.append({"name": path.name, "content": content})
    return out


def run_combos(rank: int, world: int, *, combos: list[Combo], report_dir: str
               ) -> dict[str, Any]:
    """Per engine of ``combos`` its :func:`probe`, then every combination with its faults and
    its reference; in one process group. ``{"probes": {engine: probe}, "outs": [...]}``."""
    probes = {engine: probe(rank, world, engine, Path(report_dir) / f"probe-{engine}")
              for engine in dict.fromkeys(c["engine"] for c in combos)}
    outs = []
    for i, combo in enumerate(combos):
        base = Path(report_dir) / f"c{i}"
        faulty = run_one(rank, world, combo, base / "faulty", faulty=True)
        if faulty["refused"] is None:
            stop = faulty["error"]["step"] if faulty["error"] else None
            reference = run_one(rank, world, combo, base / "reference", faulty=False,
                                stop_before=stop)
        else:
            reference = None
        outs.append({"faulty": faulty, "reference": reference})
        dist.barrier()
    return {"probes": probes, "outs": outs}


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) if t.numel() else True


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))


def close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b))



# --- the recovery's states (issue 60) ------------------------------------------------------

#: The loss the loop hands the sentinel, per step (:func:`level_loss`): a collapse (degenerate
#: data) from COLLAPSE, real data back at SPIKE twice as high for two steps (a rollback), then
#: out of its band without spiking (no snapshot brings it back: the older one is tried), then
#: spiking again from RESPIKE on with no snapshot left (the recovery ends).
COLLAPSE, SPIKE, RESPIKE, RECOVERY_STEPS = range(20, 25), 25, 38, 50


def level_loss(loss: torch.Tensor, level: float) -> torch.Tensor:
    """``loss`` rescaled to the value ``level`` on every rank (its gradients with it): the
    cluster's loss is then exactly the schedule's, whatever the batch, so the sentinel's
    thresholds (1.22x, 1.5x, 0.82x, 0.67x of a level under ``recover``) are met or not by
    the schedule alone."""
    return loss / loss.detach() * level


def run_recovery_states(rank: int, world: int, *, runs: list[tuple[str, str]], report_dir: str
                        ) -> list[dict[str, Any]]:
    """:func:`recovery_states` for each ``(engine, policy)`` of ``runs``, in one process group."""
    outs = []
    for i, (engine, policy) in enumerate(runs):
        outs.append(recovery_states(rank, world, engine=engine, policy=policy,
                                    report_dir=str(Path(report_dir) / f"r{i}")))
        dist.barrier()
    return outs


def recovery_states(rank: int, world: int, *, engine: str, policy: str, report_dir: str
                    ) -> dict[str, Any]:
    """One engine under ``spikes="recover"`` and issue 60's ``collapse_action="warn"``
    (issue 70's stretch rule: :func:`stretch_states`) through the states of issue 60: a
    collapse (reported, no snapshot), a rollback when real data returns (re-anchored to the
    snapshot's references), a rollback that does not help (the older snapshot), and the
    recovery's end (applied, or aborted under ``policy="abort"``). The learning rate is tiny
    and the loss rescaled to the schedule (:func:`level_loss`). Per step: the decision, the
    recovery's account, and the cluster's loss reference after it (the same on every
    rank)."""
    run = BUILDERS[engine](dict(PLAIN, engine=engine), rank, world)
    for group in (run.optimizer.param_groups if run.optimizer is not None else ()):
        group["lr"] = 1e-5
    sentinel = run.sentinel(report_dir=report_dir, env={}, hostname=f"host{rank}",
                            metrics_port=0, spikes="recover", policy=policy, spike_window=20,
                            spike_warmup=6, snapshot_every=2, lr_jump_ratio=0,
                            collapse_action="warn")
    judge = sentinel._parts.judge
    steps: list[dict[str, Any]] = []
    error = None
    try:
        for step in range(RECOVERY_STEPS):
            scale = (1e-3 if step in COLLAPSE else 2.0 if step in (SPIKE, SPIKE + 1) else
                     1.35 if SPIKE < step < RESPIKE else 20.0 if step >= RESPIKE else 1.0)
            batch = sentinel.check_batch(batch_for(rank, step, 0))
            loss = level_loss(run.loss(batch), scale)
            sentinel.check_loss(loss)
            run.backward(loss)
            run.reduce(sentinel)
            result = sentinel.step()
            steps.append({"step": step, "outcome": str(result.outcome),
                          "applied": result.applied, "collapsed": sorted(result.collapsed),
                          "rolled_back_to": result.rolled_back_to, "reason": result.reason,
                          "recovery": result.recovery,
                          "reference": judge.spikes.state_dict()["cluster"]["loss"]})
            run.zero_grad()
        sentinel.close()
    except nansentinel.NonFiniteError as exc:
        error = {"step": exc.result.step, "reason": exc.result.reason}
        sentinel.close()
    return {"steps": steps, "error": error, "params": run.state()["params"],
            "reports": _reports(Path(report_dir)) if rank == 0 else None}


# --- a degenerate stretch judged at its end (issue 70) -------------------------------------

#: The loss per step (:func:`level_loss`): at its level, then a stretch that leaves the band
#: at STRETCH[0] and collapses after it, real data back at RETURN twice as high (rolled back
#: over), at its level again, then batches that spike (SPIKING: skipped, rolled back at the
#: second, and spiking on against the restored state in the window discarded after it) until
#: the data is back at its level (DATA_BACK: the window ends there), then a collapse from
#: LONG[0] that lasts past max_lost_steps (LOST_BOUND): the recovery ends instead.
STRETCH, RETURN, LONG, STRETCH_STEPS, LOST_BOUND = range(21, 26), 26, range(40, 58), 58, 10
SPIKING, DATA_BACK = range(31, 35), 35


def stretch_level(step: int) -> float:
    """The schedule of :func:`stretch_states`."""
    if step == STRETCH[0]:
        return 0.75  # below the band (0.82x), not collapsed (0.67x): the stretch's first step
    if step in STRETCH:
        return 0.6 if step == STRETCH[1] else 0.05
    return (2.0 if step == RETURN else 3.0 if step in SPIKING else 0.05 if step in LONG
            else 1.0)


def run_stretch_states(rank: int, world: int, *, runs: list[tuple[str, str]], report_dir: str
                       ) -> list[dict[str, Any]]:
    """:func:`stretch_states` for each ``(engine, policy)`` of ``runs``, in one process group."""
    outs = []
    for i, (engine, policy) in enumerate(runs):
        outs.append(stretch_states(rank, world, engine=engine, policy=policy,
                                   report_dir=str(Path(report_dir) / f"s{i}")))
        dist.barrier()
    return outs


def stretch_states(rank: int, world: int, *, engine: str, policy: str, report_dir: str
                   ) -> dict[str, Any]:
    """One engine under ``spikes="recover"`` through the states of issue 70: a stretch
    dated from the step its loss left the band, judged when real data returns (worse: rolled
    back over, to the snapshot before it, each rank's ids of its batches in the skip list),
    and a stretch that runs past ``max_lost_steps`` (the recovery ends; ``policy="abort"``:
    aborts). Per step: the decision, its reason and the recovery's account."""
    run = BUILDERS[engine](dict(PLAIN, engine=engine), rank, world)
    for group in (run.optimizer.param_groups if run.optimizer is not None else ()):
        group["lr"] = 1e-5
    sentinel = run.sentinel(report_dir=report_dir, env={}, hostname=f"host{rank}",
                            metrics_port=0, spikes="recover", policy=policy, spike_window=40,
                            spike_warmup=6, snapshot_every=2, lr_jump_ratio=0,
                            max_lost_steps=LOST_BOUND)
    steps: list[dict[str, Any]] = []
    error = None
    try:
        for step in range(STRETCH_STEPS):
            batch = sentinel.check_batch(batch_for(rank, step, 0),
                                         ids=[sample_id(rank, step, 0, i) for i in range(ROWS)])
            loss = level_loss(run.loss(batch), stretch_level(step))
            sentinel.check_loss(loss)
            run.backward(loss)
            run.reduce(sentinel)
            result = sentinel.step()
            steps.append({"step": step, "outcome": str(result.outcome),
                          "applied": result.applied, "collapsed": sorted(result.collapsed),
                          "rolled_back_to": result.rolled_back_to, "reason": result.reason,
                          "lr_factor": result.lr_factor, "recovery": result.recovery})
            run.zero_grad()
        sentinel.close()
    except nansentinel.NonFiniteError as exc:
        error = {"step": exc.result.step, "reason": exc.result.reason}
        sentinel.close()
    lists = sorted(Path(report_dir).glob("skip-list-*.jsonl"))
    return {"steps": steps, "error": error, "params": run.state()["params"],
            "skipped": sorted(skip_list.load(lists[0])) if lists else [],
            "reports": _reports(Path(report_dir)) if rank == 0 else None}
