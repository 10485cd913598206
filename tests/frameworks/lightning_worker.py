"""A real Lightning fit on CPU, with faults made by the model; each rank writes what it saw.

Run as a script (Lightning's DDP launcher re-runs it for the other local ranks, or torchrun /
``nansentinel run`` starts the ranks): ``python lightning_worker.py OUT --devices 2 ...``.

``--strategy fsdp``: Lightning's ``FSDPStrategy`` (FSDP1, its defaults: the LightningModule one
unit, ``use_orig_params=True``), past Lightning's CPU refusals unless ``--cuda``
(cpu_guards.py); ``--strategy fsdp2``: ``ModelParallelStrategy`` with ``fully_shard`` in
``configure_model``, as Lightning's docs write it (the LightningModule is never the FSDP2
root); ``--strategy deepspeed_S``: ``DeepSpeedStrategy(stage=S)``, with Lightning's CUDA-only
check lifted on CPU (cpu_guards.py) unless ``--cuda``; ``--cuda``: on the GPUs
(bench/gpu_frameworks.py).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from nansentinel.lightning import SentinelCallback
from tests.frameworks.faults import fault, leave_together, local, parse_faults, weights


class Body(torch.nn.Module):
    """The network, a submodule of the LightningModule (what FSDP2 shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, kind: str | None = None) -> torch.Tensor:
        return self.out(fault(torch.tanh(self.inp(x)), kind))


class Net(pl.LightningModule):
    def __init__(self, faults: dict[tuple[int, int], str], shard: bool = False) -> None:
        super().__init__()
        self.body = Body()
        self.faults = faults
        self.shard = shard

    def configure_model(self) -> None:
        if self.shard:  # Lightning's FSDP2 recipe: the layers, then their parent
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.body.inp, mesh=mesh)
            fully_shard(self.body, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = None
        if self.training and self._trainer is not None:
            kind = self.faults.get((self.trainer.global_step, self.global_rank))
        return self.body(x, kind)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y)
        self.log("train_loss", loss.detach(), sync_dist=False)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Probe(pl.Callback):
    """Weights and optimizer state before and after each optimizer step (one per window)."""

    def __init__(self, accumulate: int, sentinel: SentinelCallback) -> None:
        self.accumulate = accumulate
        self.sentinel = sentinel
        self.before: list[torch.Tensor] = []
        self.unchanged: dict[int, bool] = {}
        #: Each step's outcome other than a plain apply (a dropped step is applied).
        self.outcomes: dict[str, Any] = {}

    def _state(self, trainer: pl.Trainer) -> list[torch.Tensor]:
        module = trainer.lightning_module
        engine = _engine(trainer)
        tensors = weights(module, _wrapper(trainer))  # every rank: ZeRO-3, FSDP1, FSDP2 gather
        if engine is None:  # DeepSpeed's optimizer state: tested in tests/distributed
            opt = trainer.optimizers[0]
            for p in module.parameters():
                buf = opt.state.get(p, {}).get("momentum_buffer")
                tensors.append(local(buf).clone() if buf is not None else torch.zeros(0))
        return tensors

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx % self.accumulate == 0:
            self.before = self._state(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if (batch_idx + 1) % self.accumulate == 0:
            after = self._state(trainer)
            same = all(torch.equal(a, b) for a, b in zip(self.before, after, strict=True))
            self.unchanged[trainer.global_step - 1] = same
            last = self.sentinel.last
            if last is not None and last.outcome != "applied":
                self.outcomes[str(last.step)] = {"outcome": last.outcome,
                                                 "bad_ranks": last.bad_ranks}


def _engine(trainer: pl.Trainer) -> Any:
    """The DeepSpeed engine Lightning trains, else None."""
    model = trainer.strategy.model
    return model if hasattr(model, "zero_optimization_stage") else None


def _wrapper(trainer: pl.Trainer) -> Any:
    """What gathers the weights (faults.weights): the DeepSpeed engine, or the FSDP1 root
    Lightning's ``FSDPStrategy`` built; None."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    model = trainer.strategy.model
    return model if isinstance(model, FSDP1) else _engine(trainer)


def _strategy(name: str, cuda: bool, devices: int) -> Any:
    if name == "fsdp" and not cuda:
        from tests.frameworks.cpu_guards import lightning_fsdp_on_cpu

        return lightning_fsdp_on_cpu()
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    if name.startswith("deepspeed"):
        from lightning.pytorch.strategies import DeepSpeedStrategy

        stage = int(name.split("_")[1])
        if cuda:
            return DeepSpeedStrategy(stage=stage)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from tests.frameworks.cpu_guards import (
            deepspeed_without_toolchain,
            indexed_cpus,
            lightning_deepspeed_on_cpu,
        )

        deepspeed_without_toolchain()
        lightning_deepspeed_on_cpu()
        return DeepSpeedStrategy(stage=stage, parallel_devices=indexed_cpus(devices))
    return name


#: Each phase of ``--phases``: its faults (None: ``--faults``) and the callback's keywords.
PHASES: dict[str, tuple[str | None, dict[str, Any]]] = {
    "skip": (None, {}),
    "rollback": ("3:1:grad", {"policy": "rollback", "snapshot_every": 1,
                              "rollback_skip_batches": 0}),
    "drop": ("3:1:log0", {"policy": "drop"}),  # drop withholds a non-finite batch or loss
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp", help="ddp, auto, fsdp, fsdp2, deepspeed_S")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--faults", default="")
    parser.add_argument("--no-callback", action="store_true")
    parser.add_argument("--no-replay", action="store_true")
    parser.add_argument("--cuda", action="store_true")
    parser.add_argument("--phases", default="",
                        help="fits in the same processes, each writing rank{r}-{phase}.json: "
                             + ", ".join(PHASES))
    args = parser.parse_args()
    if not args.phases:
        payload = fit(args, args.faults, {"replay": False} if args.no_replay else {})
        Path(args.out, f"rank{payload['rank']}.json").write_text(json.dumps(payload))
        return
    for phase in args.phases.split(","):
        faults, overrides = PHASES[phase]
        payload = fit(args, args.faults if faults is None else faults, overrides)
        Path(args.out, f"rank{payload['rank']}-{phase}.json").write_text(json.dumps(payload))


def fit(args: argparse.Namespace, faults: str, overrides: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    model = Net(parse_faults(faults), shard=args.strategy == "fsdp2")
    sentinel = SentinelCallback(**overrides)
    probe = Probe(args.accumulate, sentinel)
    trainer = pl.Trainer(
        accelerator="gpu" if args.cuda else "cpu", devices=args.devices,
        strategy=_strategy(args.strategy, args.cuda, args.devices), max_steps=args.steps,
        accumulate_grad_batches=args.accumulate, precision=args.precision,
        callbacks=[] if args.no_callback else [sentinel, probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=False))
    sched = trainer.lr_scheduler_configs[0].scheduler
    engine = _engine(trainer)
    watched = sentinel.sentinel
    return {
        "rank": trainer.global_rank,
        "world": trainer.world_size,
        "global_step": trainer.global_step,
        "scheduler_steps": sched.last_epoch,
        "ds_steps": [engine.global_steps, engine.skipped_steps] if engine is not None else None,
        "skipped": {
            str(s): {"bad_ranks": r.bad_ranks, "kinds": r.kinds, "outcome": r.outcome,
                     "report_path": r.report_path, "rolled_back_to": r.rolled_back_to,
                     "verdict": r.verdict}
            for s, r in sentinel.skipped.items()
        },
        "outcomes": probe.outcomes,
        "sentinel_steps": watched.step_index if watched else None,
        "unchanged": {str(k): v for k, v in probe.unchanged.items()},
        "weights": [w.flatten().tolist() for w in weights(model, _wrapper(trainer))],
        "sentinel_model": type(watched.model).__name__ if watched else None,
        "gradient_path": watched.gradients.caps.label if watched else None,
        "replays": watched.replays if watched else None,
    }


if __name__ == "__main__":
    main()
    leave_together()
