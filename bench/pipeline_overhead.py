"""``overhead.py --pp``: what does nansentinel cost a pipeline-parallel step?

Two gloo ranks on this machine hold one stage each of the benchmark transformer, split in
halves (stage 0: the input projection and the first half of the encoder layers; stage 1: the
rest and the head, where the cross-entropy loss is computed), and run a
``torch.distributed.pipelining`` schedule (GPipe, or 1F1B) over a few micro-batches. Two
variants, each with its own stage, schedule and optimizer and the same initial weights:

- ``baseline``: the plain pipeline (``schedule.step``, ``optimizer.step()``, ``zero_grad()``);
- ``sentinel``: ``Sentinel(stage.submod, optimizer, stages=stage)`` built before the schedule,
  the schedule's loss ``sentinel.wrap_loss(loss_fn)``, ``check_batch`` on the first stage, and
  ``sentinel.step()`` in place of ``optimizer.step()``.

They take turns round by round in the balanced order of ``benchlib.run_rounds``. Both ranks
derive that order from the round index alone, so they run the same variant at the same time
and every send, receive and all-reduce pairs up. A barrier before each step lines the ranks
up, and one after it (inside the timed window, the same for both variants) makes a step's
time the pipeline's whole step: without it the last stage, which finishes its backward first,
would start waiting for the next step's activations inside its next timed window.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import nansentinel

SCHEDULES = ("gpipe", "1f1b")
VARIANTS = (benchlib.BASELINE, "sentinel")
STAGES = 2
LABELS = {
    "baseline": "baseline (plain pipeline: schedule.step, optimizer.step)",
    "sentinel": "nansentinel (stages=, wrap_loss, check_batch, step)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipeSpec(benchlib.RunSpec):
    """What a rank of the pipeline benchmark needs beyond ``RunSpec``."""

    schedule: str
    microbatches: int
    phase: str = "pipeline"

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: expected one of {SCHEDULES}")
        if self.microbatches < STAGES or self.model.batch % self.microbatches:
            raise ValueError(
                f"microbatches {self.microbatches}: must be >= {STAGES} (the stages) and divide "
                f"the batch ({self.model.batch})"
            )


class FirstHalf(nn.Module):
    """Stage 0: the input projection and the first half of the encoder layers."""

    def __init__(self, model: benchlib.BenchModel) -> None:
        super().__init__()
        layers = model.encoder.layers
        self.proj = model.proj
        self.layers = nn.ModuleList(layers[: len(layers) // 2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for layer in self.layers:
            h = layer(h)
        return h


class SecondHalf(nn.Module):
    """Stage 1: the second half of the encoder layers and the head (logits out)."""

    def __init__(self, model: benchlib.BenchModel) -> None:
        super().__init__()
        layers = model.encoder.layers
        self.layers = nn.ModuleList(layers[len(layers) // 2 :])
        self.head = model.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The benchmark's loss (``benchlib.compute_loss``) on one micro-batch's logits."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class PipeVariant:
    """One stage of the pipeline with its own schedule and optimizer; ``step`` runs one
    training step of this rank's part (the same interface as ``benchlib.Variant``)."""

    name = benchlib.BASELINE

    def __init__(self, stage: Any, schedule: Any, optimizer: torch.optim.Optimizer) -> None:
        self.stage = stage
        self.schedule = schedule
        self.optimizer = optimizer
        self.model = stage.submod

    def run_schedule(self, batch: dict[str, torch.Tensor]) -> None:
        if self.stage.is_first:
            self.schedule.step(batch["x"])
        else:
            self.schedule.step(target=batch["targets"], losses=[])

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        self.run_schedule(batch)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def close(self) -> None:
        """Nothing beyond the model to release."""


class PipeSentinelVariant(PipeVariant):
    name = "sentinel"

    def __init__(self, stage: Any, schedule: Any, optimizer: torch.optim.Optimizer,
                 sentinel: nansentinel.Sentinel) -> None:
        super().__init__(stage, schedule, optimizer)
        self.sentinel = sentinel
        self._last: Any = None

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        if self.stage.is_first:
            self.sentinel.check_batch(batch["x"])
        self._verify_last()
        self.run_schedule(batch)
        self._last = self.sentinel.step()  # read next step, as benchlib.SentinelVariant does
        self.optimizer.zero_grad()

    # The same bookkeeping as the DDP variant's: a healthy step that was skipped is an error.
    _verify_last = benchlib.SentinelVariant._verify_last
    close = benchlib.SentinelVariant.close


def build_variant(name: str, spec: PipeSpec, rank: int, report_dir: str) -> PipeVariant:
    """This rank's stage of a fresh model (seed 0: the same weights in every variant), its
    schedule and AdamW; for ``sentinel``, the sentinel built before the schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    full = benchlib.BenchModel(spec.model)
    submod = FirstHalf(full) if rank == 0 else SecondHalf(full)
    optimizer = torch.optim.AdamW(submod.parameters(), lr=1e-4)
    stage = PipelineStage(submod, rank, STAGES, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[spec.schedule]
    if name == benchlib.BASELINE:
        return PipeVariant(stage, kind(stage, spec.microbatches, loss_fn=loss_fn), optimizer)
    if name == "sentinel":
        # env={}: a stray NANSENTINEL_* in the caller's shell must not change what is measured.
        sentinel = nansentinel.Sentinel(
            stage.submod, optimizer, stages=stage, metrics_port=0, report_dir=report_dir, env={}
        )
        schedule = kind(stage, spec.microbatches, loss_fn=sentinel.wrap_loss(loss_fn))
        return PipeSentinelVariant(stage, schedule, optimizer, sentinel)
    raise ValueError(f"unknown pipeline variant {name!r}; expected one of {VARIANTS}")


def worker(rank: int, spec: PipeSpec) -> dict[str, Any]:
    """Warm-up and measured rounds of both variants on this rank (process group initialised)."""
    report_dir = str(Path(spec.out_dir) / "reports")
    variants = [build_variant(v, spec, rank, report_dir) for v in VARIANTS]
    # Stage 1 needs the targets of the batch stage 0 received: every rank builds rank 0's.
    batch_of = functools.partial(benchlib.make_batch, spec.model, 0, device=torch.device("cpu"))

    def barrier() -> None:
        dist.barrier()

    benchlib.run_rounds(variants, lambda r: batch_of(step=r), spec.warmup, barrier)
    rounds = benchlib.run_rounds(
        variants, lambda r: batch_of(step=r), spec.steps, barrier, first_round=spec.warmup
    )
    base = variants[0].model.state_dict()
    diff = {
        v.name: max((p - base[k]).abs().max().item() for k, p in v.model.state_dict().items())
        for v in variants[1:]
    }
    params = sum(p.numel() for p in variants[0].model.parameters())
    for v in variants:
        v.close()
    return {"times": rounds.wall, "cpu_times": rounds.cpu, "parameters": params,
            "weights_diff": diff}


def report(spec: PipeSpec, ranks: list[dict[str, Any]],
           merge: Callable[..., dict[str, list[float]]]) -> dict[str, Any]:
    """The numbers of both ranks as one report (``merge``: overhead.py's per-round merge)."""
    times, cpu = merge(ranks), merge(ranks, "cpu_times", sum)
    return {
        "benchmark": f"nansentinel overhead, CPU gloo, pipeline parallel ({spec.schedule})",
        "world_size": STAGES,
        "threads_per_rank": spec.threads,
        "model": dataclasses.asdict(spec.model),
        "schedule": spec.schedule,
        "microbatches": spec.microbatches,
        "parameters_per_stage": [r["parameters"] for r in ranks],
        "steps": spec.steps,
        "warmup": spec.warmup,
        "variants": list(VARIANTS),
        "summary": benchlib.summarize(times, None, cpu),
        "weights_max_abs_diff_vs_baseline": {
            v: max(r["weights_diff"][v] for r in ranks) for v in VARIANTS[1:]
        },
        "step_times_s": times,
        "step_cpu_times_s": cpu,
    }


def render(report: dict[str, Any]) -> str:
    """The markdown report: setup line, table, verdict, final-weights line."""
    m = report["model"]
    params = " + ".join(f"{p / 1e6:.2f}" for p in report["parameters_per_stage"])
    return benchlib.paired_report(report, (
        f"{report['benchmark']}, {report['world_size']} stages on {report['world_size']} ranks "
        f"x {report['threads_per_rank']} thread(s), {params} M params (d_model {m['d_model']}, "
        f"{m['layers']} layers split in halves, batch {m['batch']} x seq {m['seq']} in "
        f"{report['microbatches']} micro-batches), {report['steps']} rounds"), LABELS,
        " over both stages")
