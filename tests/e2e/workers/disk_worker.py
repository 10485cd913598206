"""Worker for the disk-fault tests: a short DDP loop under the real Sentinel, with a pause.

Usage: ``disk_worker.py OUTDIR --steps N [--pause-at STEP]``. Each rank takes ``--steps``
steps of a linear model (faults come from ``NANSENTINEL_INJECT``, the policy from
``NANSENTINEL_POLICY``). With ``--pause-at``, rank 0 touches ``OUTDIR/paused`` before that
step and waits for ``OUTDIR/go`` (the test turns a disk read-only meanwhile); the others wait
for it at a barrier. A rank that trained every step writes ``OUTDIR/done-<host>-rank<R>``,
closes its sentinel and exits 0.
"""

import argparse
import datetime
import os
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
p.add_argument("--pause-at", type=int, default=-1)
args = p.parse_args()

host = os.environ.get("NANSENTINEL_HOSTNAME") or socket.gethostname()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
sentinel = nansentinel.Sentinel(model, optimizer)
g = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    if step == args.pause_at:
        if rank == 0:
            (args.outdir / "paused").touch()
            deadline = time.monotonic() + 30
            while not (args.outdir / "go").exists():
                if time.monotonic() > deadline:
                    sys.exit("rank 0: no go within 30 s")
                time.sleep(0.05)
        dist.barrier()
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    sentinel.check_batch(x)
    loss = torch.nn.functional.mse_loss(model(x), y)
    sentinel.check_loss(loss)
    loss.backward()
    sentinel.step()  # raises NonFiniteError / HostExcludedError on every rank when told
    optimizer.zero_grad()

(args.outdir / f"done-{host}-rank{rank}").touch()
sentinel.close()
dist.destroy_process_group()
# As sentinel_worker.py: skip interpreter finalization (torch 2.13's teardown now and then
# aborts a finished rank there).
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
