"""Worker for the exclusion test: a real training loop under the real Sentinel.

A linear model under DDP (gloo) takes ``--steps`` steps with the three sentinel calls. The
fault is a fire drill (``NANSENTINEL_INJECT``, e.g. ``kind=grad,host=node3,steps=5-7``):
non-finite gradients on every rank of one host until the host strikes exclude it; the
Sentinel then records the exclusion (rank 0), leaves a verdict on every rank and raises
HostExcludedError, and the launcher does the rest. Rank 0 checkpoints model, optimizer and
sentinel state to ``OUTDIR/ckpt.pt`` every ``--ckpt-every`` steps; a restarted worker resumes
from it. A worker that finds fewer than ``--full-world`` ranks while the exclusion file
(``NANSENTINEL_EXCLUSION_FILE``) names no host waits: a late host's agent is about to join and
torchrun will restart it. At the end every rank writes ``OUTDIR/done-<host>-rank<R>.json``.

A SIGTERM (``scancel``, a time limit) is answered as docs/training-loop.md shows: the step whose
result says ``stop_requested`` is the last on every rank; rank 0 checkpoints it, every rank
writes ``OUTDIR/stopped-<host>-rank<R>.json`` with the step, and ``sentinel.close()`` ends the
process with 143.
"""

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
import nansentinel.common.exclusion

p = argparse.ArgumentParser()
p.add_argument("outdir", type=Path)
p.add_argument("--steps", type=int, required=True)
p.add_argument("--full-world", type=int, required=True)
p.add_argument("--ckpt-every", type=int, default=3)
p.add_argument("--step-seconds", type=float, default=0.0,
               help="sleep this long each step (paces a run a test acts on midway)")
args = p.parse_args()

host = os.environ.get("NANSENTINEL_HOSTNAME") or socket.gethostname()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
# A short world is expected once a host was excluded; before that, a host is late. Not
# TORCHELASTIC_RESTART_COUNT: an agent that restarts its workers because another agent is
# waiting in the rendezvous (a membership change) does not count a restart, so after an
# exclusion one survivor may start its workers with restart count 0.
exclusions = nansentinel.common.exclusion.ExclusionStore(os.environ["NANSENTINEL_EXCLUSION_FILE"])
deadline = time.monotonic() + 120
while world < args.full_world and not exclusions.excluded_hosts():
    if time.monotonic() > deadline:
        sys.exit(f"rank {rank}: the world never reached {args.full_world} ranks")
    time.sleep(0.5)  # torchrun restarts us when the missing host joins

torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
sentinel = nansentinel.Sentinel(model, optimizer)
ckpt = args.outdir / "ckpt.pt"
start = 0
if ckpt.exists():
    state = torch.load(ckpt)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sentinel.load_state_dict(state["sentinel"])
    start = state["step"]

g = torch.Generator().manual_seed(rank)
for step in range(start, args.steps):
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    sentinel.check_batch(x)
    loss = torch.nn.functional.mse_loss(model(x), y)
    sentinel.check_loss(loss)
    loss.backward()
    result = sentinel.step()  # raises HostExcludedError on every rank at an exclusion
    optimizer.zero_grad()
    stopping = result.stop_requested  # a SIGTERM reached some rank: the same step on all
    if rank == 0 and ((step + 1) % args.ckpt_every == 0 or stopping):
        state = {"step": step + 1, "model": model.module.state_dict(),
                 "optimizer": optimizer.state_dict(), "sentinel": sentinel.state_dict()}
        torch.save(state, ckpt.with_suffix(".tmp"))
        os.replace(ckpt.with_suffix(".tmp"), ckpt)
    if stopping:
        (args.outdir / f"stopped-{host}-rank{rank}.json").write_text(json.dumps(
            {"step": result.step, "signal": result.stop_signal}))
        sys.stdout.flush()
        sentinel.close()  # raises StopRequested on every rank: exit 143
    dist.barrier()  # nobody runs ahead of rank 0's checkpoint
    time.sleep(args.step_seconds)

assert all(torch.isfinite(q).all() for q in model.parameters()), "weights took a NaN"
receipt = {"hostname": host, "rank": rank, "world_size": world, "start": start,
           "restart_count": restart}
(args.outdir / f"done-{host}-rank{rank}.json").write_text(json.dumps(receipt))
sentinel.close()
dist.destroy_process_group()
# Skip interpreter finalization: in this test a finished rank now and then (about one
# rank-exit in thirty) aborted there, after destroy_process_group, with "terminate called
# without an active exception" (SIGABRT, exit -6: torch's teardown, cause not pinned down),
# and torchrun restarted the whole group for it: a third incarnation, start=12.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
