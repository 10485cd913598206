"""Worker for the exclusion test: trains (an all_reduce per step), checkpoints, and at one
step simulates the sentinel excluding a host.

It does what the sentinel does when the cluster decides to exclude a host, without the
sentinel: every rank learns which ranks are bad through one all_reduce of a per-rank flag
vector, global rank 0 appends an ExclusionRecord to ``$NANSENTINEL_EXCLUSION_FILE``, every
rank writes its verdict to ``$NANSENTINEL_RUN_DIR`` and exits 1.

Usage: ``exclusion_worker.py OUTDIR --bad-host H --bad-step K --steps N --full-world W``.
Rank 0 checkpoints ``OUTDIR/ckpt.json`` every ``--ckpt-every`` steps; a restarted worker
resumes from it. In the first incarnation a worker that finds fewer than ``--full-world``
ranks waits: a late host's agent is about to join and torchrun will restart it. At the end
every rank writes ``OUTDIR/done-<host>-rank<R>.json``.
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

from nansentinel.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.verdicts import write_verdict

p = argparse.ArgumentParser()
p.add_argument("outdir", type=Path)
p.add_argument("--bad-host", required=True)
p.add_argument("--bad-step", type=int, required=True)
p.add_argument("--steps", type=int, required=True)
p.add_argument("--full-world", type=int, required=True)
p.add_argument("--ckpt-every", type=int, default=3)
args = p.parse_args()

host = os.environ.get("NANSENTINEL_HOSTNAME") or socket.gethostname()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
if restart == 0 and world < args.full_world:
    time.sleep(120)  # torchrun restarts us when the missing host joins
    sys.exit(f"rank {rank}: the world never reached {args.full_world} ranks")

ckpt = args.outdir / "ckpt.json"
start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
for step in range(start, args.steps):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world, (t.item(), world)
    flags = torch.zeros(world, dtype=torch.int32)
    flags[rank] = int(host == args.bad_host and step == args.bad_step)
    dist.all_reduce(flags)
    bad_ranks = flags.nonzero().flatten().tolist()
    if bad_ranks:
        message = (f"non-finite grad on ranks {bad_ranks} (host {args.bad_host}) at step "
                   f"{step}; host {args.bad_host} excluded")
        if rank == 0:
            ExclusionStore(os.environ["NANSENTINEL_EXCLUSION_FILE"]).add(ExclusionRecord(
                host=args.bad_host, reason=message, step=step,
                evidence={"bad_ranks": bad_ranks, "kinds": ["grad"], "strikes": 3},
                job_id=os.environ.get("NANSENTINEL_JOB_ID"),
            ))
        write_verdict(os.environ["NANSENTINEL_RUN_DIR"], rank, {
            "rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "hostname": host,
            "step": step, "outcome": "excluded", "message": message, "bad_ranks": bad_ranks,
            "bad_hosts": [args.bad_host], "kinds": ["grad"], "excluded_host": args.bad_host,
            "report_path": None,
        })
        sys.exit(1)
    if rank == 0 and (step + 1) % args.ckpt_every == 0:
        tmp = ckpt.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step + 1}))
        os.replace(tmp, ckpt)
    dist.barrier()  # nobody runs ahead of rank 0's checkpoint

receipt = {"hostname": host, "rank": rank, "world_size": world, "start": start,
           "restart_count": restart}
(args.outdir / f"done-{host}-rank{rank}.json").write_text(json.dumps(receipt))
dist.destroy_process_group()
