"""A real Hugging Face Trainer run on CPU, with faults made by the model; each rank writes what
it saw. Started by torchrun or ``nansentinel run`` (or plainly, for one process)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from nansentinel.transformers import SentinelCallback
from tests.frameworks.faults import fault, parse_faults


class Pairs(Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(torch.nn.Module):
    """Returns its loss, as Hugging Face models do; makes its own faults at (step, rank)."""

    def __init__(self, faults: dict[tuple[int, int], str]) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 1)
        self.faults, self.step = faults, 0  # step: set by Probe from the Trainer's state

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        kind = None
        if self.training and torch.is_grad_enabled():
            rank = dist.get_rank() if dist.is_initialized() else 0
            kind = self.faults.get((self.step, rank))
        pred = self.out(fault(torch.tanh(self.inp(x)), kind))
        return {"loss": torch.nn.functional.mse_loss(pred.float(), labels)}


class Probe(TrainerCallback):
    """Weights and optimizer state around each optimizer step; tells the model its step."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.unchanged: dict[int, bool] = {}

    @staticmethod
    def _state(model, optimizer) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        out = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            for v in optimizer.state.get(p, {}).values():
                out.append(v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v))
        return out

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):  # type: ignore[no-untyped-def]
        model.step = state.global_step
        self.before = self._state(model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):  # type: ignore[no-untyped-def]
        after = self._state(model, optimizer)
        self.unchanged[state.global_step - 1] = len(after) == len(self.before) and all(
            torch.equal(a, b) for a, b in zip(self.before, after, strict=True)
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--faults", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net(parse_faults(args.faults))
    sentinel, probe = SentinelCallback(), Probe()
    targs = TrainingArguments(
        output_dir=str(Path(args.out, "hf")), per_device_train_batch_size=4,
        gradient_accumulation_steps=args.accumulate, max_steps=args.steps, learning_rate=0.01,
        lr_scheduler_type="linear", use_cpu=True, bf16=args.bf16, report_to=[],
        save_strategy="no", logging_steps=1, remove_unused_columns=False,
        dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=Pairs(256),
                      callbacks=[sentinel, probe])
    trainer.train()
    rank = dist.get_rank() if dist.is_initialized() else 0
    payload = {
        "rank": rank,
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "global_step": trainer.state.global_step,
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "skipped": {
            str(s): {"bad_ranks": r.bad_ranks, "kinds": r.kinds, "outcome": r.outcome,
                     "report_path": r.report_path, "rolled_back_to": r.rolled_back_to,
                     "verdict": r.verdict}
            for s, r in sentinel.skipped.items()
        },
        "sentinel_steps": sentinel.sentinel.step_index if sentinel.sentinel else None,
        "sentinel_model": type(sentinel.sentinel.model).__name__ if sentinel.sentinel else None,
        "unchanged": {str(k): v for k, v in probe.unchanged.items()},
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(payload))


if __name__ == "__main__":
    main()
