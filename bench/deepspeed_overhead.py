"""``overhead.py --deepspeed STAGE``: what does nansentinel cost a DeepSpeed step?

Two gloo ranks on this machine (DeepSpeed's CPU accelerator, ``DS_ACCELERATOR=cpu``) train the
benchmark transformer with a DeepSpeed engine at ZeRO stage ``STAGE`` (fp32, ``torch.optim.AdamW``
wrapped by DeepSpeed as it wraps any client optimizer). Two variants, each with its own engine
and the same initial weights, fed the same batches:

- ``baseline``: DeepSpeed alone: ``loss = f(engine(x)); engine.backward(loss); engine.step()``;
- ``sentinel``: ``Sentinel(engine)`` with ``check_batch``, ``check_loss`` and
  ``sentinel.step()`` in place of ``engine.step()`` (no metrics exporter).

They take turns round by round in the balanced order of ``benchlib.run_rounds``, both ranks in
the same order (derived from the round index), so they run the same variant at the same time and
DeepSpeed's collectives pair up; a barrier before and after each step (inside the timed window,
the same for both variants) makes a step's time the whole step of both ranks. Each sentinel
step's result is checked on the next round: a healthy step that was not applied fails the run,
and the final weights of the two variants are compared (the same arithmetic: identical).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import benchlib
import torch
import torch.distributed as dist

import nansentinel

VARIANTS = (benchlib.BASELINE, "sentinel")
STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSpeedSpec(benchlib.RunSpec):
    """What a rank of the DeepSpeed benchmark needs beyond ``RunSpec``."""

    stage: int
    phase: str = "deepspeed"

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage {self.stage}: expected a ZeRO stage, one of {STAGES}")


def labels(stage: int) -> dict[str, str]:
    return {
        "baseline": f"baseline (DeepSpeed alone, ZeRO-{stage}: engine.backward, engine.step)",
        "sentinel": "DeepSpeed + nansentinel (Sentinel(engine): check_batch, check_loss, step)",
    }


def _engine(spec: DeepSpeedSpec) -> Any:
    import deepspeed

    torch.manual_seed(0)
    model = benchlib.BenchModel(spec.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {
        "train_micro_batch_size_per_gpu": spec.model.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": spec.stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


class DeepSpeedVariant:
    """One engine and the loop of DeepSpeed alone (the interface of ``benchlib.Variant``)."""

    name = benchlib.BASELINE

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model = engine.module

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.engine(batch["x"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        self.engine.backward(self.loss(batch))
        self.engine.step()

    def close(self) -> None:
        """Nothing beyond the engine to release."""


class DeepSpeedSentinelVariant(DeepSpeedVariant):
    name = "sentinel"

    def __init__(self, engine: Any, report_dir: str) -> None:
        super().__init__(engine)
        # env={}: a stray NANSENTINEL_* in the caller's shell must not change what is measured.
        self.sentinel = nansentinel.Sentinel(engine, metrics_port=0, report_dir=report_dir,
                                             env={})
        self._last: Any = None

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        self.sentinel.check_batch(batch)
        self._verify_last()
        loss = self.loss(batch)
        self.sentinel.check_loss(loss)
        self.engine.backward(loss)
        self._last = self.sentinel.step()

    _verify_last = benchlib.SentinelVariant._verify_last
    close = benchlib.SentinelVariant.close


def full_weights(engine: Any) -> torch.Tensor:
    """The engine's whole weights (gathered under ZeRO-3: a collective, every rank calls it)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return torch.cat([p.detach().float().reshape(-1).clone() for p in params])


def worker(rank: int, spec: DeepSpeedSpec) -> dict[str, Any]:
    """Warm-up and measured rounds of both variants on this rank (process group initialised)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(rank))  # DeepSpeed asks it of any launcher
    report_dir = str(Path(spec.out_dir) / "reports")
    variants = [DeepSpeedVariant(_engine(spec)),
                DeepSpeedSentinelVariant(_engine(spec), report_dir)]
    batch_of = functools.partial(benchlib.make_batch, spec.model, rank, device=torch.device("cpu"))

    def barrier() -> None:
        dist.barrier()

    benchlib.run_rounds(variants, lambda r: batch_of(step=r), spec.warmup, barrier)
    rounds = benchlib.run_rounds(
        variants, lambda r: batch_of(step=r), spec.steps, barrier, first_round=spec.warmup
    )
    for v in variants:
        v.close()
    base, watched = (full_weights(v.engine) for v in variants)
    return {"times": rounds.wall, "cpu_times": rounds.cpu,
            "parameters": sum(p.numel() for p in benchlib.BenchModel(spec.model).parameters()),
            "weights_diff": {"sentinel": (watched - base).abs().max().item()},
            "optimizer": type(variants[0].engine.optimizer).__name__,
            "gradient_path": variants[1].sentinel.gradients.seam}


def report(spec: DeepSpeedSpec, ranks: list[dict[str, Any]], merge: Any) -> dict[str, Any]:
    """Both ranks' numbers as one report (``merge``: overhead.py's per-round merge)."""
    import deepspeed

    times, cpu = merge(ranks), merge(ranks, "cpu_times", sum)
    return {
        "benchmark": f"nansentinel overhead, CPU gloo, DeepSpeed {deepspeed.__version__} "
                     f"ZeRO-{spec.stage}",
        "world_size": len(ranks),
        "threads_per_rank": spec.threads,
        "model": dataclasses.asdict(spec.model),
        "stage": spec.stage,
        "deepspeed_optimizer": ranks[0]["optimizer"],
        "gradient_path": ranks[0]["gradient_path"],
        "parameters": ranks[0]["parameters"],
        "steps": spec.steps,
        "warmup": spec.warmup,
        "variants": list(VARIANTS),
        "summary": benchlib.summarize(times, None, cpu),
        "weights_max_abs_diff_vs_baseline": {
            "sentinel": max(r["weights_diff"]["sentinel"] for r in ranks)},
        "step_times_s": times,
        "step_cpu_times_s": cpu,
    }


def render(report: dict[str, Any]) -> str:
    """The markdown report: setup line, table, verdict, final-weights line."""
    m = report["model"]
    return benchlib.paired_report(report, (
        f"{report['benchmark']} ({report['deepspeed_optimizer']}, gradient path "
        f"{report['gradient_path']}), {report['world_size']} ranks x "
        f"{report['threads_per_rank']} thread(s), {report['parameters'] / 1e6:.2f} M params "
        f"(d_model {m['d_model']}, {m['layers']} layers, batch {m['batch']} x seq {m['seq']}), "
        f"fp32, {report['steps']} rounds"), labels(report["stage"]), "")
