"""A real Lightning fit on CPU, with faults made by the model; each rank writes what it saw.

Run as a script (Lightning's DDP launcher re-runs it for the other local ranks, or torchrun /
``nansentinel run`` starts the ranks): ``python lightning_worker.py OUT --devices 2 ...``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from nansentinel.lightning import SentinelCallback
from tests.frameworks.faults import fault, parse_faults


class Net(pl.LightningModule):
    def __init__(self, faults: dict[tuple[int, int], str]) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)
        self.faults = faults

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = None
        if self.training and self._trainer is not None:
            kind = self.faults.get((self.trainer.global_step, self.global_rank))
        return self.out(fault(torch.tanh(self.inp(x)), kind))

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

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.before: list[torch.Tensor] = []
        self.unchanged: dict[int, bool] = {}

    def _state(self, trainer: pl.Trainer) -> list[torch.Tensor]:
        module = trainer.lightning_module
        opt = trainer.optimizers[0]
        tensors = [p.detach().clone() for p in module.parameters()]
        for p in module.parameters():
            buf = opt.state.get(p, {}).get("momentum_buffer")
            tensors.append(buf.clone() if buf is not None else torch.zeros(0))
        return tensors

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
        if batch_idx % self.accumulate == 0:
            self.before = self._state(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        if (batch_idx + 1) % self.accumulate == 0:
            after = self._state(trainer)
            same = all(torch.equal(a, b) for a, b in zip(self.before, after, strict=True))
            self.unchanged[trainer.global_step - 1] = same


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--faults", default="")
    parser.add_argument("--no-callback", action="store_true")
    parser.add_argument("--no-replay", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    model = Net(parse_faults(args.faults))
    sentinel = SentinelCallback(**({"replay": False} if args.no_replay else {}))
    probe = Probe(args.accumulate)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=args.strategy, max_steps=args.steps,
        accumulate_grad_batches=args.accumulate, precision=args.precision,
        callbacks=[] if args.no_callback else [sentinel, probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=False))
    rank = trainer.global_rank
    sched = trainer.lr_scheduler_configs[0].scheduler
    payload = {
        "rank": rank,
        "world": trainer.world_size,
        "global_step": trainer.global_step,
        "scheduler_steps": sched.last_epoch,
        "skipped": {
            str(s): {"bad_ranks": r.bad_ranks, "kinds": r.kinds, "outcome": r.outcome,
                     "report_path": r.report_path, "rolled_back_to": r.rolled_back_to,
                     "verdict": r.verdict}
            for s, r in sentinel.skipped.items()
        },
        "sentinel_steps": sentinel.sentinel.step_index if sentinel.sentinel else None,
        "unchanged": {str(k): v for k, v in probe.unchanged.items()},
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        "sentinel_model": type(sentinel.sentinel.model).__name__ if sentinel.sentinel else None,
        "replays": sentinel.sentinel.replays if sentinel.sentinel else None,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(payload))


if __name__ == "__main__":
    main()
