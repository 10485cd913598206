"""A real Hugging Face Trainer run on CPU, with faults made by the model; each rank writes what
it saw. Started by torchrun or ``nansentinel run`` (or plainly, for one process).

``--deepspeed 1,2,3``: the Trainer on DeepSpeed (``TrainingArguments(deepspeed=...)``), one
``train()`` per ZeRO stage in the same processes, each rank writing ``rank{r}-zero{s}.json``;
``--fsdp1`` / ``--fsdp2``: the Trainer on FSDP1 / FSDP2 (``fsdp_config`` version 1 / 2), with
Accelerate's CPU refusal lifted (cpu_guards.py) unless ``--cuda``; ``--cuda``: on the GPUs
(bench/gpu_frameworks.py).
``--phases skip,rollback,drop``: train() once per phase in the same processes (``skip``: the
faults of ``--faults``, written to ``rank{r}.json``; ``rollback``: a backward-only NaN on rank 1
at step 3; ``drop``: a forward log(0) there, as drop withholds a non-finite batch or loss;
written to ``rank{r}-{phase}.json``). On DeepSpeed, which refuses both, the refusals' messages
go to ``refusals-rank{r}.json`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from nansentinel.config import ConfigError
from nansentinel.result import SentinelUsageError
from nansentinel.transformers import SentinelCallback
from tests.frameworks.faults import fault, leave_together, local, parse_faults, weights


class Pairs(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Block(torch.nn.Module):
    """The layer FSDP2 shards on its own (``transformer_layer_cls_to_wrap``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h))


class Net(torch.nn.Module):
    """Returns its loss, as Hugging Face models do; makes its own faults at (step, rank)."""

    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self, faults: dict[tuple[int, int], str]) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.block = Block()
        self.out = torch.nn.Linear(16, 1)
        self.faults, self.step = faults, 0  # step: set by Probe from the Trainer's state

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        kind = None
        if self.training and torch.is_grad_enabled():
            rank = dist.get_rank() if dist.is_initialized() else 0
            kind = self.faults.get((self.step, rank))
        pred = self.out(fault(self.block(torch.tanh(self.inp(x))), kind))
        return {"loss": torch.nn.functional.mse_loss(pred.float(), labels.to(pred.device))}


class Probe(TrainerCallback):
    """Weights and optimizer state around each optimizer step; tells the model its step."""

    def __init__(self, sentinel: SentinelCallback) -> None:
        self.sentinel = sentinel
        self.before: list[torch.Tensor] = []
        self.unchanged: dict[int, bool] = {}
        self.engine: Any = None  # DeepSpeed: its weights are gathered, its optimizer its own
        #: Each step's outcome other than a plain apply (a dropped step is applied).
        self.outcomes: dict[str, Any] = {}

    def _state(self, model, optimizer) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        out = weights(model, self.engine)  # every rank: ZeRO-3 and FSDP2 gather
        if self.engine is None:  # the optimizer's own state (DeepSpeed's: tested bit for bit
            for p in model.parameters():  # in tests/distributed/test_deepspeed.py)
                for v in optimizer.state.get(p, {}).values():
                    out.append(local(v).clone() if isinstance(v, torch.Tensor)
                               else torch.tensor(v))
        return out

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):  # type: ignore[no-untyped-def]
        # the Net itself: under FSDP1 the model handed over is the FSDP1 root around it
        inner = model.module if type(model).__name__ == "FullyShardedDataParallel" else model
        inner.step = state.global_step
        self.before = self._state(model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):  # type: ignore[no-untyped-def]
        after = self._state(model, optimizer)
        self.unchanged[state.global_step - 1] = len(after) == len(self.before) and all(
            torch.equal(a, b) for a, b in zip(self.before, after, strict=True)
        )
        last = self.sentinel.last
        if last is not None and last.outcome != "applied":
            self.outcomes[str(last.step)] = {"outcome": last.outcome,
                                             "bad_ranks": last.bad_ranks}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--faults", default="")
    parser.add_argument("--deepspeed", default="", help="ZeRO stages, one train() each: 1,2,3")
    parser.add_argument("--fsdp1", action="store_true")
    parser.add_argument("--fsdp2", action="store_true")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--phases", default="skip", help="skip, rollback, drop")
    args = parser.parse_args()
    if args.deepspeed and not args.cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from tests.frameworks.cpu_guards import deepspeed_without_toolchain

        deepspeed_without_toolchain()
    if args.fsdp1 and not args.cuda:
        # Accelerate names CPU ranks' device cpu:<local rank>, which FSDP1 rejects beside its
        # compute device "cpu": Accelerate's own device knob, as a user on CPU sets it.
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    if (args.fsdp1 or args.fsdp2) and not args.cuda:
        from tests.frameworks.cpu_guards import accelerate_fsdp_on_cpu

        accelerate_fsdp_on_cpu()
    stages = [int(s) for s in args.deepspeed.split(",") if s] or [None]
    phases = args.phases.split(",")

    def rank() -> int:  # the Trainer starts the process group: ask after it has
        return dist.get_rank() if dist.is_initialized() else 0

    for stage in stages:
        suffix = f"-zero{stage}" if stage is not None else ""
        if "skip" in phases:
            trained = train(args, stage, args.faults, {})
            Path(args.out, f"rank{rank()}{suffix}.json").write_text(json.dumps(trained))
    policies = [p for p in phases if p in POLICIES]
    if policies and stages != [None]:
        refused = {policy: refusal(args, stages[-1], policy) for policy in policies}
        Path(args.out, f"refusals-rank{rank()}.json").write_text(json.dumps(refused))
    elif policies:
        for policy in policies:
            faults, overrides = POLICIES[policy]
            trained = train(args, None, faults, overrides)
            Path(args.out, f"rank{rank()}-{policy}.json").write_text(json.dumps(trained))


#: The faults and the callback's keywords of the rollback and drop phases.
POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "rollback": ("3:1:grad", {"policy": "rollback", "snapshot_every": 1,
                              "rollback_skip_batches": 0}),
    "drop": ("3:1:log0", {"policy": "drop"}),
}


def training_args(args: argparse.Namespace, stage: int | None, steps: int) -> TrainingArguments:
    extra: dict[str, Any] = {}
    if stage is not None:
        extra["deepspeed"] = {
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
            **({"bf16": {"enabled": True}} if args.bf16 else {}),
        }
    if args.fsdp1:
        extra["fsdp"] = True
        # The Trainer turns on CPU-RAM-efficient loading (and with it sync_module_states, whose
        # parameter init Accelerate places on an accelerator only): off on CPU ranks.
        extra["fsdp_config"] = {"version": 1, "transformer_layer_cls_to_wrap": ["Block"],
                                **({} if args.cuda else {"cpu_ram_efficient_loading": False,
                                                         "sync_module_states": False})}
    if args.fsdp2:
        extra["fsdp"] = True
        extra["fsdp_config"] = {"version": 2, "transformer_layer_cls_to_wrap": ["Block"],
                                "reshard_after_forward": True}
    return TrainingArguments(
        output_dir=str(Path(args.out, "hf")), per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accumulate, max_steps=steps, learning_rate=0.01,
        lr_scheduler_type="linear", use_cpu=not args.cuda, bf16=args.bf16, report_to=[],
        save_strategy="no", logging_steps=1, remove_unused_columns=False,
        dataloader_num_workers=0, disable_tqdm=True, seed=0, **extra,
    )


def train(args: argparse.Namespace, stage: int | None, faults: str,
          overrides: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net(parse_faults(faults))
    sentinel = SentinelCallback(**overrides)
    probe = Probe(sentinel)
    trainer = Trainer(model=model, args=training_args(args, stage, args.steps),
                      train_dataset=Pairs(256), callbacks=[sentinel, probe])
    if stage is not None or args.fsdp1:  # ZeRO-3's and FSDP1's weights gather through it
        trainer.add_callback(_EngineOf(probe, trainer))
    trainer.train()
    engine = probe.engine
    rank = dist.get_rank() if dist.is_initialized() else 0
    watched = sentinel.sentinel
    return {
        "rank": rank,
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "stage": stage,
        "global_step": trainer.state.global_step,
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "ds_steps": [engine.global_steps, engine.skipped_steps] if stage is not None else None,
        "skipped": {
            str(s): {"bad_ranks": r.bad_ranks, "kinds": r.kinds, "outcome": r.outcome,
                     "report_path": r.report_path, "rolled_back_to": r.rolled_back_to,
                     "verdict": r.verdict}
            for s, r in sentinel.skipped.items()
        },
        "sentinel_steps": watched.step_index if watched else None,
        "sentinel_model": type(watched.model).__name__ if watched else None,
        "gradient_path": watched.gradients.caps.label if watched else None,
        "replays": watched.replays if watched else None,
        "unchanged": {str(k): v for k, v in probe.unchanged.items()},
        "outcomes": probe.outcomes,
        "weights": [w.flatten().tolist() for w in weights(trainer.model, engine)],
    }


class _EngineOf(TrainerCallback):
    """Hands the probe the Trainer's DeepSpeed engine, or its FSDP1 root, once it exists
    (train begin)."""

    def __init__(self, probe: Probe, trainer: Trainer) -> None:
        self.probe, self.trainer = probe, trainer

    def on_train_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        self.probe.engine = self.trainer.model_wrapped


def refusal(args: argparse.Namespace, stage: int | None, policy: str) -> str | None:
    """A train() with ``policy`` on this engine: the refusal's message (None: it trained)."""
    torch.manual_seed(0)
    trainer = Trainer(model=Net({}), args=training_args(args, stage, 1),
                      train_dataset=Pairs(64), callbacks=[SentinelCallback(policy=policy)])
    try:
        trainer.train()
    except (SentinelUsageError, ConfigError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


if __name__ == "__main__":
    main()
    leave_together()
