"""Worker for launcher tests: leave a sentinel verdict, as the sentinel does, and fail.

Usage: ``verdict_worker.py OUTDIR OUTCOME [--excluded-host H] [--record]``. Every rank
touches ``OUTDIR/attempt-<restart>-rank<R>`` (so a test can count attempts), writes its
verdict to ``$NANSENTINEL_RUN_DIR`` and exits 1, the way ranks die after the sentinel
raises. With ``--record``, global rank 0 first appends the exclusion record to
``$NANSENTINEL_EXCLUSION_FILE``, as the sentinel on rank 0 does.
"""

import argparse
import os
import socket
import sys
import time
from pathlib import Path

from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.common.verdicts import RankVerdict, write_verdict

p = argparse.ArgumentParser()
p.add_argument("outdir", type=Path)
p.add_argument("outcome")
p.add_argument("--excluded-host")
p.add_argument("--record", action="store_true")
args = p.parse_args()

rank = int(os.environ["RANK"])
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
message = f"non-finite loss on rank 1 at step 7 ({args.outcome})"
if args.record and rank == 0:
    ExclusionStore(os.environ["NANSENTINEL_EXCLUSION_FILE"]).add(ExclusionRecord(
        host=args.excluded_host, reason=message, step=7, evidence={"bad_ranks": [1]},
        job_id=os.environ.get("NANSENTINEL_JOB_ID"),
    ))
(args.outdir / f"attempt-{restart}-rank{rank}").touch()
if rank != 0:
    # Rank 0 records the exclusion before the others fail, as the sentinel's barrier makes it
    # do; otherwise a fast rank's exit lets the agent stop rank 0 first (a race of imports).
    first = args.outdir / f"attempt-{restart}-rank0"
    deadline = time.monotonic() + 30
    while not first.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
write_verdict(
    os.environ["NANSENTINEL_RUN_DIR"],
    RankVerdict(
        rank=rank,
        local_rank=int(os.environ["LOCAL_RANK"]),
        hostname=os.environ.get("NANSENTINEL_HOSTNAME") or socket.gethostname(),
        step=7,
        outcome=args.outcome,
        message=message,
        bad_ranks=[1],
        bad_hosts=[args.excluded_host] if args.excluded_host else [],
        kinds=["loss"],
        excluded_host=args.excluded_host,
        report_path="/reports/step-7.json",
    ),
)
sys.exit(1)
