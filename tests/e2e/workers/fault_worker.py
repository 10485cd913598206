"""Worker for the cluster-fault matrix (tests/e2e/test_cluster_faults.py): a real training
loop under the real Sentinel (DDP, gloo), with the fault a test asks for on one host.

Each step starts by touching ``OUTDIR/at-<host>-<step>`` so the test can time its fault
(a link cut, a signal) against the run. ``--fsdp`` shards the model with FSDP2 instead
(its all-gathers and reduce-scatters are collectives the sentinel does not wait on).
Faults, all on ``--host`` (or on rank ``--rank``) only:
``--die-at STEP`` SIGKILLs this worker in the middle of that step (after the forward, before
the backward: its peers are then blocked in the gradient all-reduce); ``--pause SECONDS``
sleeps before the backward of every step in ``--pause-steps`` (a slow healthy step).
``--term-at STEP`` sends this worker SIGTERM in the middle of that step (as a scheduler would,
to one process). ``--step-sleep`` keeps a long run going between steps. At the end every rank
writes ``OUTDIR/done-<host>.json``.

The loop checkpoints as docs/training-loop.md shows: when a step's result says a stop was
requested (a SIGTERM or SIGINT reached some rank), every rank saves ``OUTDIR/ckpt-<rank>.pt``
(atomically: temporary file, then rename) and ``OUTDIR/stopped-<rank>.json`` with the step,
then calls ``sentinel.close()``, which ends the process with 128 + the signal (143).
"""

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel

p = argparse.ArgumentParser()
p.add_argument("outdir", type=Path)
p.add_argument("--steps", type=int, required=True)
p.add_argument("--host", default="")
p.add_argument("--rank", type=int, default=-1)
p.add_argument("--fsdp", action="store_true")
p.add_argument("--die-at", type=int, default=-1)
p.add_argument("--pause", type=float, default=0.0)
p.add_argument("--pause-steps", default="")
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--term-at", type=int, default=-1)
args = p.parse_args()

host = socket.gethostname()
paused = {int(s) for s in args.pause_steps.split(",") if s}
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
mine = host == args.host or dist.get_rank() == args.rank
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
if args.fsdp:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        fully_shard(layer)
    fully_shard(model)
else:
    model = DDP(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
sentinel = nansentinel.Sentinel(model, optimizer)
g = torch.Generator().manual_seed(dist.get_rank())
for step in range(args.steps):
    (args.outdir / f"at-{host}-{step}").touch()
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
    sentinel.check_batch(x)
    loss = torch.nn.functional.mse_loss(model(x), y)
    sentinel.check_loss(loss)
    if mine and step == args.die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    if mine and step in paused:
        time.sleep(args.pause)
    if mine and step == args.term_at:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # noted (by the signal thread) before this step's row is packed
    loss.backward()
    result = sentinel.step()
    optimizer.zero_grad()
    if result.stop_requested:  # every rank, after the same step: checkpoint, then stop
        rank = dist.get_rank()
        tmp = args.outdir / f".ckpt-{rank}.pt.tmp"
        torch.save({"step": result.step, "model": model.state_dict(),
                    "sentinel": sentinel.state_dict()}, tmp)
        os.replace(tmp, args.outdir / f"ckpt-{rank}.pt")
        (args.outdir / f"stopped-{rank}.json").write_text(json.dumps(
            {"step": result.step, "signal": result.stop_signal, "host": host}))
        sys.stdout.flush()
        sentinel.close()  # raises StopRequested: exit 128 + the signal
    time.sleep(args.step_sleep)
(args.outdir / f"done-{host}.json").write_text(json.dumps({"steps": args.steps}))
sentinel.close()
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # as sentinel_worker.py: torch's teardown now and then aborts after a clean end
