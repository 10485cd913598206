"""Overhead of the framework callbacks: the same Lightning / Hugging Face Trainer fit with and
without ``SentinelCallback``, paired and interleaved in one run.

::

    python bench/frameworks.py                       # both frameworks, 2 CPU gloo ranks each
    python bench/frameworks.py --framework lightning --rounds 4 --steps 12   # quicker

The frameworks own the loop, so the pairs are whole fits: each round runs a fit without the
callback and one with it (the order alternates between rounds), on fresh copies of the same
model and the same batches, and times every optimizer step from the framework's own hooks
(step begin → step end: forward, backward with the DDP all-reduce, optimizer step). The first
steps of each fit are warm-up and dropped. The result is the median over rounds of the ratio of
the two fits' median step times, in wall time and in thread CPU time (which a busy machine
disturbs less). Run without torchrun, the script launches itself under torchrun per framework.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

FRAMEWORKS = ("lightning", "transformers")


class Encoder(nn.Module):
    """A small transformer encoder (3.2 M parameters by default, near bench/overhead.py's)
    and a regression head."""

    def __init__(self, d_model: int, layers: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d_model, 1)

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.body(x)).mean(dim=1), labels)


class _Clock:
    """Step begin/end timestamps (wall and thread CPU time), from a framework's hooks."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.wall, self.cpu, self._t = warmup, [], [], (0.0, 0.0)
        self.count = 0

    def begin(self) -> None:
        self._t = (time.perf_counter(), time.thread_time())

    def end(self) -> None:
        self.count += 1
        if self.count > self.warmup:
            self.wall.append(time.perf_counter() - self._t[0])
            self.cpu.append(time.thread_time() - self._t[1])


def _data(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = args.batch * args.steps * 2  # both ranks' shards
    return torch.randn(n, args.seq, args.d_model, generator=g), torch.randn(n, 1, generator=g)


def fit_lightning(args: argparse.Namespace, state: dict[str, Any], guarded: bool) -> _Clock:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from nansentinel.lightning import SentinelCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Encoder(args.d_model, args.layers)
            self.net.load_state_dict(state)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            return self.net.loss(*batch)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    clock = _Clock(args.warmup)

    class Timer(pl.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            clock.begin()

        def on_train_batch_end(self, *a: Any) -> None:
            clock.end()

    callbacks: list[Any] = [Timer()] + ([SentinelCallback(metrics_port=0)] if guarded else [])
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy="ddp",
        max_steps=args.steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    x, y = _data(args)
    trainer.fit(Module(), DataLoader(TensorDataset(x, y), batch_size=args.batch))
    return clock


def fit_transformers(args: argparse.Namespace, state: dict[str, Any], guarded: bool) -> _Clock:
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nansentinel.transformers import SentinelCallback

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Encoder(args.d_model, args.layers)
            self.net.load_state_dict(state)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.net.loss(x, labels)}

    x, y = _data(args)

    class Data(Dataset):
        def __len__(self) -> int:
            return len(x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": x[i], "labels": y[i]}

    clock = _Clock(args.warmup)

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            clock.begin()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.end()

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch, max_steps=args.steps,
            learning_rate=1e-4, use_cpu=True, report_to=[], save_strategy="no",
            logging_strategy="no", remove_unused_columns=False, disable_tqdm=True,
            dataloader_num_workers=0,
        )
        callbacks: list[Any] = [Timer()] + ([SentinelCallback(metrics_port=0)] if guarded else [])
        Trainer(model=Model(), args=targs, train_dataset=Data(), callbacks=callbacks).train()
    return clock


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    state = Encoder(args.d_model, args.layers).state_dict()
    fit = fit_lightning if args.framework == "lightning" else fit_transformers
    rounds = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        clocks = {guarded: fit(args, state, guarded) for guarded in order}
        rounds.append({
            kind: {name: statistics.median(getattr(clocks[g], kind)) for g, name in
                   ((False, "plain"), (True, "sentinel"))}
            for kind in ("wall", "cpu")
        })
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.json).write_text(json.dumps({"framework": args.framework, "rounds": rounds}))


def summarise(result: dict[str, Any]) -> dict[str, float]:
    out = {}
    for kind in ("wall", "cpu"):
        plain = [r[kind]["plain"] for r in result["rounds"]]
        guarded = [r[kind]["sentinel"] for r in result["rounds"]]
        out[f"{kind}_plain_ms"] = 1e3 * statistics.median(plain)
        out[f"{kind}_sentinel_ms"] = 1e3 * statistics.median(guarded)
        out[f"{kind}_ratio"] = statistics.median(g / p for g, p in zip(guarded, plain, strict=True))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=FRAMEWORKS, action="append")
    parser.add_argument("--rounds", type=int, default=8, help="pairs of fits (default 8)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per fit")
    parser.add_argument("--warmup", type=int, default=6, help="steps dropped per fit")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", help="write the summary and every round's medians here")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:  # a rank under torchrun
        args.framework = args.framework[0]
        worker(args)
        return 0
    table = ["| framework | step without (ms) | with callback (ms) | wall ratio | CPU ratio |",
             "|---|---|---|---|---|"]
    summary, rounds = {}, {}
    for framework in args.framework or FRAMEWORKS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "result.json")
            passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                      if k not in ("framework", "json", "timeout")]
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node=2", __file__, f"--framework={framework}",
                    f"--json={out}", *passed]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                filter(None, [str(Path(__file__).resolve().parents[1]),
                              os.environ.get("PYTHONPATH")]))}
            subprocess.run(argv, check=True, timeout=args.timeout, env=env,
                           stdout=subprocess.DEVNULL)
            rounds[framework] = json.loads(out.read_text())["rounds"]
            s = summary[framework] = summarise({"rounds": rounds[framework]})
        table.append(f"| {framework} | {s['wall_plain_ms']:.1f} | {s['wall_sentinel_ms']:.1f} | "
                     f"{s['wall_ratio']:.3f} | {s['cpu_ratio']:.3f} |")
        print(table[-1], file=sys.stderr, flush=True)
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=1))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
