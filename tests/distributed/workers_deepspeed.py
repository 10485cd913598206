"""DeepSpeed training loops run on gloo ranks by the DeepSpeed tests (importable by spawned ranks).

Real engines (``deepspeed.initialize`` on the demo transformer, ``torch.optim.AdamW``, a
WarmupLR schedule so that a scheduler step shows in the LR), the loop a DeepSpeed user writes
with the sentinel's three calls. Faults are the test's own, made in the data and the model at
``(step, rank)`` (and, for drills, by ``NANSENTINEL_INJECT`` through ``inject=``):

- ``batch``: NaN in the batch's float input (forward, loss and gradients turn non-finite);
- ``loss``: the loss times NaN;
- ``backward``: a NaN made inside the backward, by a function that is the identity forward
  (forward and loss finite: only a check of the local gradients before DeepSpeed's reduction
  sees it);
- ``aux``: NaN in a float tensor of the batch the model does not read: the gradients stay
  finite, so DeepSpeed alone would apply the step; only a forced skip keeps it out;
- ``all``: every rank's loss times Inf at that step (the reference run: DeepSpeed's own
  overflow skip, to compare the sentinel's skip with).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

import nansentinel
from nansentinel.demo import VOCAB, synthetic_batch
from tests.distributed.workers_fsdp import PoisonableTransformer

os.environ.setdefault("DS_ACCELERATOR", "cpu")

#: (step, rank) -> kind of fault (``all``: every rank, so the rank is ignored: (step, -1)).
Faults = dict[tuple[int, int], str]
#: The optimizer methods the gradient path wraps (gone again after Sentinel.close()).
SEAM_METHODS = ("reduce_ipg_grads",
                "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def config(stage: int, dtype: str = "fp32", accumulate: int = 1, **zero: Any) -> dict[str, Any]:
    """A DeepSpeed config: ZeRO ``stage``, precision, accumulation, a WarmupLR schedule."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": accumulate,
        "zero_optimization": {"stage": stage, **zero},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "scheduler": {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 50,
            "warmup_type": "linear"}},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        # A high initial scale: the first steps overflow in fp16, as real runs' first steps do.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 1000,
                       "hysteresis": 1, "min_loss_scale": 1}
    return cfg


def on_cpu_gloo() -> None:
    """Ready DeepSpeed (imported here) for ``deepspeed.initialize`` on CPU gloo ranks.

    DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce at init (a C++ toolchain
    and, on a fresh machine, a compile of a minute), used only by its inference all-reduce:
    marked not compatible, so that training talks gloo through torch.distributed as ever."""
    import deepspeed.ops

    vars(deepspeed.ops)["__compatible_ops__"] = {"deepspeed_shm_comm": False}


def engine_for(cfg: dict[str, Any]) -> Any:
    """A fresh engine on the demo model (seed 0: the same initial weights everywhere)."""
    import deepspeed

    on_cpu_gloo()
    if cfg.get("fp16", {}).get("enabled"):
        # DeepSpeed's CPU accelerator reports fp16 as unsupported unless the CPU has
        # AVX512-FP16 (a probe of mkldnn); torch computes fp16 on any CPU, slowly. The probe
        # alone is overridden, nothing of the code under test.
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(0)
    model = PoisonableTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def train_deepspeed(rank: int, world: int, *, stage: int, steps: int, report_dir: str,
                    dtype: str = "fp32", accumulate: int = 1, faults: Faults | None = None,
                    sentinel: bool = True, hosts: int = 0, zero: dict[str, Any] | None = None,
                    **overrides: Any) -> dict[str, Any]:
    """Train ``steps`` optimizer steps; return each step's result and DeepSpeed's counters.

    ``hosts``: that many hosts (``NANSENTINEL_HOSTNAME``: ``node{rank * hosts // world}``);
    ``sentinel=False``: DeepSpeed alone, the same loop without the sentinel's calls."""
    if hosts:
        os.environ["NANSENTINEL_HOSTNAME"] = f"node{rank * hosts // world}"
    faults = faults or {}
    engine = engine_for(config(stage, dtype, accumulate, **(zero or {})))
    watcher = (nansentinel.Sentinel(engine, report_dir=report_dir, **overrides)
               if sentinel else None)
    loss_fn = nn.CrossEntropyLoss()
    records: list[dict[str, Any]] = []
    error = released = None
    try:
        for step in range(steps):
            before = fingerprint(engine)
            micro_results = []
            kind = faults.get((step, rank)) or faults.get((step, -1))
            for micro in range(accumulate):
                # The fault sits in the first micro-batch: under accumulation, one before the
                # boundary, checked then and decided at the boundary.
                micro_results.append(_micro(engine, watcher, loss_fn, rank,
                                            step * accumulate + micro,
                                            kind if micro == 0 else None, dtype))
            *between, result = micro_results
            assert all(r is None for r in between), "a micro-batch before the boundary decided"
            records.append({
                **(_record(result) if result is not None else {}),
                "ds_applied": engine.was_step_applied(),
                "unchanged": fingerprint(engine) == before,
                "global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                "lr": engine.get_lr()[0], "scale": _scale(engine),
            })
        if watcher is not None:
            watcher.close()
            released = (engine.enable_backward_allreduce,
                        sorted(set(vars(engine.optimizer)) & set(SEAM_METHODS)))
    except nansentinel.NonFiniteError as exc:
        error = {"type": type(exc).__name__, "message": str(exc), "step": exc.result.step,
                 "report_path": exc.result.report_path}
    weights = full_weights(engine)
    return {"records": records, "error": error, "weights": weights,
            "hostname": watcher.identity.hostname if watcher is not None else None,
            "path": watcher.gradients.seam if watcher is not None else None,  # type: ignore[attr-defined]
            "optimizer": type(engine.optimizer).__name__, "released": released}


def _micro(engine: Any, watcher: Any, loss_fn: nn.Module, rank: int, index: int,
           kind: str | None, dtype: str) -> Any:
    """One micro-batch: the three calls around DeepSpeed's forward, backward and step."""
    batch = synthetic_batch(rank, index)
    batch["scale"] = batch["scale"].to(DTYPES[dtype])
    batch["aux"] = torch.ones(2)  # a float tensor of the batch the model does not read
    if kind == "batch":
        batch["scale"][0, 0, 0] = math.nan
    if kind == "aux":
        batch["aux"][0] = math.nan
    if watcher is not None:
        watcher.check_batch(batch)
    engine.module.poison = "backward" if kind == "backward" else None
    logits = engine(batch["tokens"], batch["scale"])
    loss = loss_fn(logits.float().reshape(-1, VOCAB), batch["targets"].reshape(-1))
    if kind == "loss":
        loss = loss * math.nan
    if kind == "all":
        loss = loss * math.inf
    if watcher is not None:
        watcher.check_loss(loss)
    engine.backward(loss)
    if watcher is None:
        engine.step()
        return None
    return watcher.step()


def fingerprint(engine: Any) -> tuple[float, float]:
    """This rank's weights (its partitions under ZeRO-3) and optimizer state, summed in fp64:
    whether a step moved them (a read of this rank's tensors only, no collective)."""
    weights = sum(_local(p).double().sum().item() for p in engine.module.parameters())
    state = 0.0
    for per_param in engine.basic_optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                state += value.double().sum().item()
    return weights, state


def full_weights(engine: Any) -> torch.Tensor:
    """Every parameter whole, in fp32 (under ZeRO-3 gathered: a collective, on every rank)."""
    import deepspeed

    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            return torch.cat([p.detach().float().reshape(-1).clone() for p in params])
    return torch.cat([p.detach().float().reshape(-1) for p in params])


def _local(p: torch.Tensor) -> torch.Tensor:
    return getattr(p, "ds_tensor", p).detach()


def _scale(engine: Any) -> float | None:
    if not engine.fp16_enabled():
        return None
    return float(engine._get_optimizer_loss_scale())


def _record(r: Any) -> dict[str, Any]:
    return {
        "step": r.step, "applied": r.applied, "outcome": r.outcome, "overflow": r.overflow,
        "bad_ranks": r.bad_ranks, "bad_hosts": r.bad_hosts, "kinds": r.kinds,
        "local_kinds": r.local_kinds, "injected": r.injected, "report_path": r.report_path,
        "parameters": r.parameters, "local_grad_norm": r.local_grad_norm,
    }


def run_cases(rank: int, world: int, *, cases: list[dict[str, Any]],
              report_dir: str) -> list[dict[str, Any]]:
    """:func:`train_deepspeed` for each case in turn, in these processes (one spawn and one
    import of DeepSpeed for all: a fresh engine per case); each case's reports in its own
    directory, ``report_dir/<index>``."""
    runs = {"train": train_deepspeed, "refusals": refusals}
    return [runs[case.get("run", "train")](
                rank, world, report_dir=f"{report_dir}/{i}",
                **{k: v for k, v in case.items() if k != "run"})
            for i, case in enumerate(cases)]


def refusals(rank: int, world: int, *, report_dir: str) -> dict[str, str]:
    """What each refused setup says, on real engines: ``{case: message}`` ("" if accepted)."""
    import deepspeed

    said: dict[str, str] = {}

    def attempt(case: str, engine: Any, **kwargs: Any) -> Any:
        try:
            watcher = nansentinel.Sentinel(engine, report_dir=report_dir, **kwargs)
        except nansentinel.SentinelUsageError as exc:
            said[case] = str(exc)
            return None
        said[case] = ""
        return watcher

    engine = engine_for(config(1))
    attempt("rollback", engine, policy="rollback")
    attempt("optimizer", engine, optimizer=torch.optim.SGD(engine.module.parameters(), lr=0.1))
    attempt("replay", engine, replay=lambda module, batch: module(batch))
    attempt("device gate", engine, gate="device")
    released = deepspeed.__version__
    deepspeed.__version__ = "0.20.0"
    try:
        attempt("version", engine)
    finally:
        deepspeed.__version__ = released
    watcher = attempt("accepted", engine)
    attempt("second sentinel", engine)
    try:
        watcher.step(optimizer_step=False)
    except nansentinel.SentinelUsageError as exc:
        said["optimizer_step=False"] = str(exc)
    watcher.close()
    again = attempt("after close", engine)  # close() gave the engine back: accepted again
    if again is not None:
        said["after close"] = "accepted"
        again.close()
    offload = config(2, offload_optimizer={"device": "cpu"})
    offload["zero_force_ds_cpu_optimizer"] = False
    attempt("offload", engine_for(offload))
    bf16_fp32_accumulation = {**config(1, "bf16"), "data_types": {"grad_accum_dtype": "fp32"}}
    attempt("BF16_Optimizer", engine_for(bf16_fp32_accumulation))
    return said
