"""A plain training loop on Accelerate, as docs/frameworks.md writes it, watched by
``AcceleratedSentinel``; started by torchrun on 2 CPU ranks (gloo). Each rank writes what it saw.

Usage: ``accelerate_worker.py OUT --engine ddp|deepspeed_S|fsdp1|fsdp2 [--cuda]``. One run, in
the same processes, one phase after the other (a new model, optimizer and sentinel each):

- ``alone`` (ddp, CPU only): ``Accelerator()`` without ``cpu=True`` on torchrun's CPU ranks: the
  error that names ``cpu=True``, recorded; Accelerate's state is then reset;
- ``skip``: a batch drill on rank 1 at step 1 (``NANSENTINEL_INJECT``), a forward log(0) on
  rank 0 at step 2, a backward-only NaN on rank 1 at step 4, under ``accelerator.accumulate``
  (2 micro-batches, the fault in the first), ``clip_grad_norm_``, an LR scheduler, bf16 on DDP;
- ``rollback``: a backward-only NaN on rank 1 at step 3; ``drop``: a forward log(0) on rank 1
  at step 3 (drop withholds a rank whose batch or loss was non-finite); on DeepSpeed the
  refusal's message is recorded instead.

``--engine fsdp1`` (Accelerate's default FSDP plugin: FSDP1) and ``--engine fsdp2`` lift
Accelerate's one CPU refusal (cpu_guards.py) unless ``--cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from nansentinel.accelerate import AcceleratedSentinel
from nansentinel.config import ConfigError
from nansentinel.result import SentinelUsageError
from tests.frameworks.faults import fault, parse_faults, weights


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.block = Block()
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, kind: str | None = None) -> torch.Tensor:
        return self.out(fault(self.block(torch.tanh(self.inp(x))), kind))


def accelerator_for(engine: str, cuda: bool, accumulate: int, precision: str) -> Any:
    from accelerate import Accelerator

    kwargs: dict[str, Any] = {"cpu": not cuda, "gradient_accumulation_steps": accumulate,
                              "mixed_precision": precision}
    if engine.startswith("deepspeed"):
        from accelerate import PartialState
        from accelerate.utils import DeepSpeedPlugin

        # As the HF Trainer does with use_cpu=True: the process state on the CPU first, then
        # the Accelerator on DeepSpeed (Accelerate turns DeepSpeed off for Accelerator(cpu=True)).
        PartialState(cpu=not cuda)
        del kwargs["cpu"]
        kwargs["mixed_precision"] = "no"
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulate,
            "zero_optimization": {"stage": int(engine.split("_")[1])},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
        })
    elif engine == "fsdp1":  # Accelerate's default FSDP plugin (fsdp_version 1)
        from accelerate.utils import FullyShardedDataParallelPlugin

        kwargs["mixed_precision"] = "no"
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])
    elif engine == "fsdp2":
        from accelerate.utils import FullyShardedDataParallelPlugin

        kwargs["mixed_precision"] = "no"
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["Block"], reshard_after_forward=True)
    return Accelerator(**kwargs)


def train(engine: str, args: argparse.Namespace, faults: dict[tuple[int, int], str],
          **overrides: Any) -> dict[str, Any]:
    """One phase: the loop of docs/frameworks.md for ``args.steps`` optimizer steps."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh Accelerator per phase
    accelerator = accelerator_for(engine, args.cuda, args.accumulate, args.precision)
    torch.manual_seed(0)
    model = Net()
    if engine == "fsdp1":
        # Accelerate's FSDP1 recipe: the model first, the optimizer on its wrapped parameters
        # (prepared together, the optimizer would keep the parameters FSDP1 replaced).
        model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s))
    data = TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
    loader = DataLoader(data, batch_size=4, shuffle=False)
    if engine == "fsdp1":
        optimizer, loader, scheduler = accelerator.prepare(optimizer, loader, scheduler)
    else:
        model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                                  scheduler)
    inner = getattr(scheduler, "scheduler", scheduler)
    sentinel = AcceleratedSentinel(accelerator, model, optimizer, **overrides)
    rank = dist.get_rank()
    ds = model if hasattr(model, "zero_optimization_stage") else None
    if engine == "fsdp1":
        ds = model  # faults.weights gathers FSDP1's flat shards through the root
    results: dict[str, Any] = {}
    unchanged: dict[str, bool] = {}
    before = weights(model, ds)
    step = micro = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            kind = faults.get((step, rank)) if micro == 0 else None
            sentinel.check_batch((x, y))
            loss = torch.nn.functional.mse_loss(model(x, kind).float(), y)
            sentinel.check_loss(loss)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            result = sentinel.step()
            scheduler.step()
            optimizer.zero_grad()
        micro += 1
        if result is None:
            continue
        after = weights(model, ds)
        unchanged[str(step)] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        before = after
        results[str(step)] = {"outcome": result.outcome, "applied": result.applied,
                              "bad_ranks": result.bad_ranks, "kinds": result.kinds,
                              "report_path": result.report_path,
                              "rolled_back_to": result.rolled_back_to}
        step, micro = step + 1, 0
        if step == args.steps:
            break
    sentinel.close()
    return {
        "rank": rank, "world": dist.get_world_size(), "engine": engine,
        "num_processes": accelerator.num_processes, "results": results, "unchanged": unchanged,
        "scheduler_steps": inner.last_epoch,
        "ds_steps": [ds.global_steps, ds.skipped_steps] if engine.startswith("deepspeed")
        else None,
        "sentinel_model": type(sentinel.sentinel.model).__name__,
        "weights": [w.flatten().tolist() for w in weights(model, ds)],
    }


def alone() -> str | None:
    """``Accelerator()`` without ``cpu=True`` on torchrun's CPU ranks: the sentinel's error."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    model, optimizer = accelerator.prepare(Net(), torch.optim.SGD(Net().parameters(), lr=0.1))
    try:
        AcceleratedSentinel(accelerator, model, optimizer)
    except SentinelUsageError as exc:
        return str(exc)
    return None


def refused(engine: str, args: argparse.Namespace, policy: str) -> str | None:
    try:
        train(engine, args, {}, policy=policy)
    except (SentinelUsageError, ConfigError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--engine", default="ddp", help="ddp, deepspeed_S, fsdp1, fsdp2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--precision", default="bf16", help="Accelerate's mixed_precision (DDP)")
    p.add_argument("--phases", default="alone,skip,rollback,drop")
    p.add_argument("--faults", default="2:0:log0,4:1:grad", help="the skip phase's, step:rank:kind")
    p.add_argument("--inject", default="kind=batch,rank=1,step=1", help="the skip phase's drill")
    p.add_argument("--cuda", action="store_true")
    args = p.parse_args()
    engine = args.engine
    if engine.startswith("deepspeed") and not args.cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from tests.frameworks.cpu_guards import deepspeed_without_toolchain

        deepspeed_without_toolchain()
    if engine == "fsdp1" and not args.cuda:
        # Accelerate's own device knob: on CPU ranks its state names the device cpu:<local
        # rank>, which FSDP1 rejects beside its compute device "cpu" ("Inconsistent compute
        # device and `device_id`"); a user on CPU sets the same.
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    if engine in ("fsdp1", "fsdp2") and not args.cuda:
        from tests.frameworks.cpu_guards import accelerate_fsdp_on_cpu

        accelerate_fsdp_on_cpu()
    phases = args.phases.split(",")
    out: dict[str, Any] = {}
    if "alone" in phases and engine == "ddp" and not args.cuda:
        out["alone"] = alone()
    if "skip" in phases:
        out["skip"] = train(engine, args, parse_faults(args.faults), inject=args.inject)
    for policy in ("rollback", "drop"):
        if policy not in phases:
            continue
        if engine.startswith("deepspeed"):
            out[policy] = {"refused": refused(engine, args, policy)}
        else:
            extra = {"snapshot_every": 1, "rollback_skip_batches": 0} if policy == "rollback" \
                else {}
            # drop withholds a rank whose batch or loss was non-finite (a forward fault)
            kind = "grad" if policy == "rollback" else "log0"
            out[policy] = train(engine, args, {(3, 1): kind}, policy=policy, **extra)
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    # Torn down before exit: a gloo group left to the interpreter's exit can abort a rank
    # ("terminate called without an active exception", seen once on a loaded 2-core machine).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
