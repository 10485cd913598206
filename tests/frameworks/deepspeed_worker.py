"""A DeepSpeed training script as a user writes it, run by ``nansentinel run`` (torchrun) in the
DeepSpeed framework test: ``deepspeed.init_distributed("gloo")``, a real engine, the sentinel's
three calls around DeepSpeed's forward, backward and step. Faults come from the environment
(``NANSENTINEL_INJECT``), the policy too (``NANSENTINEL_POLICY``).

Usage: ``deepspeed_worker.py OUT --stage S --steps N``. A rank that finishes writes
``OUT/rank{r}.json``; a rank that the sentinel aborts writes ``OUT/abort-rank{r}.json`` with
what it raised, then raises it on (the launcher turns it into exit code 3).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
from torch import nn

import nansentinel
from nansentinel.demo import VOCAB, synthetic_batch
from tests.distributed.workers_deepspeed import config, engine_for
from tests.frameworks.cpu_guards import deepspeed_without_toolchain
from tests.frameworks.faults import leave_together


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    # Before init_distributed, which JIT-compiles DeepSpeed's shared-memory all-reduce otherwise
    # (a C++ toolchain and ~2 min on a fresh machine, once per torch build).
    deepspeed_without_toolchain()
    deepspeed.init_distributed("gloo")
    engine = engine_for(config(args.stage))
    sentinel = nansentinel.Sentinel(engine)
    rank = sentinel.rank
    loss_fn = nn.CrossEntropyLoss()
    results = []
    try:
        for step in range(args.steps):
            batch = sentinel.check_batch(synthetic_batch(rank, step))
            logits = engine(batch["tokens"], batch["scale"])
            loss = loss_fn(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))
            sentinel.check_loss(loss)
            engine.backward(loss)
            results.append(sentinel.step().outcome)
    except nansentinel.NonFiniteError as exc:
        Path(args.out, f"abort-rank{rank}.json").write_text(json.dumps({
            "type": type(exc).__name__, "message": str(exc), "step": exc.result.step,
            "applied_before": results, "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps}))
        raise
    sentinel.close()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"outcomes": results}))


if __name__ == "__main__":
    main()
    leave_together()
