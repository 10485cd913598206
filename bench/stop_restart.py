"""What taking SIGTERM costs torchrun's restarts (issue 62, item 6), measured.

A worker a signal asked to stop no longer dies where SIGTERM finds it: it stops after a step
every rank agrees on. torchrun stops the surviving workers of a crashed one with SIGTERM before
it restarts them, so this measures what that costs, on 2 gloo ranks (CPU), ``--trials`` each:

- ``survivor``: rank 1 SIGKILLed in the middle of step 5 (a crashed worker); 0.5 s later rank 0
  gets SIGTERM, as torchrun sends it. Seconds from the SIGTERM to rank 0's end, its exit code
  and verdict (before the stop path: -15 at once; with it and without the early end, exit 5
  after the exchange timeout's naming).
- ``restart``: the same crash under ``torchrun --max-restarts=1``: seconds from the crashed
  worker's step 5 to the restarted attempt's first step.

``--repo PATH`` runs another checkout's nansentinel (e.g. main, for the before numbers)::

    python3 bench/stop_restart.py --repo /path/to/other/checkout
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
WORKER = r'''
import os, signal, sys, time, datetime
from pathlib import Path
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import nansentinel
out = Path(sys.argv[1]); restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60)); rank = dist.get_rank()
model = DDP(torch.nn.Linear(16, 1)); opt = torch.optim.SGD(model.parameters(), lr=0.01)
s = nansentinel.Sentinel(model, opt, metrics_port=0)
for step in range(40 if restart else 400):
    (out / f"at-{restart}-{rank}-{step}").write_text(str(time.time()))
    x = torch.randn(8, 16); s.check_batch(x); loss = model(x).pow(2).mean(); s.check_loss(loss)
    if restart == 0 and rank == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward(); s.step(); opt.zero_grad(); time.sleep(0.05)
s.close(); os._exit(0)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def survivor(repo: Path, work: Path, worker: Path) -> tuple[int, float, str | None]:
    out = work / "survivor"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    port, procs = _free_port(), []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(repo), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": str(rank), "NANSENTINEL_RUN_DIR": str(out / "run"),
               "OMP_NUM_THREADS": "1", "TORCHELASTIC_RESTART_COUNT": "0"}
        procs.append(subprocess.Popen([sys.executable, str(worker), str(out)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        deadline = time.monotonic() + 120
        while procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)
        sent = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        code = procs[0].wait(timeout=120)
        took = time.monotonic() - sent
    finally:
        for p in procs:
            p.kill()
    verdict = out / "run" / "verdicts" / "rank-0.json"
    outcome = json.loads(verdict.read_text())["outcome"] if verdict.exists() else None
    return code, took, outcome


def restart(repo: Path, work: Path, worker: Path) -> float:
    out = work / "restart"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.5",
                           str(worker), str(out)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    if not (out / "at-1-0-0").exists():
        sys.exit(f"no restart (torchrun exit {done.returncode}):\n{done.stderr[-3000:]}")
    return float((out / "at-1-0-0").read_text()) - float((out / "at-0-1-5").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=HERE)
    p.add_argument("--trials", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        worker = work / "worker.py"
        worker.write_text(WORKER)
        ends = [survivor(args.repo, work, worker) for _ in range(args.trials)]
        restarts = [restart(args.repo, work, worker) for _ in range(args.trials)]
    print(json.dumps({
        "repo": str(args.repo),
        "survivor_exit_codes": [c for c, _, _ in ends],
        "survivor_verdicts": [v for _, _, v in ends],
        "survivor_end_s": [round(t, 2) for _, t, _ in ends],
        "survivor_end_median_s": round(statistics.median(t for _, t, _ in ends), 2),
        "restart_s": [round(t, 2) for t in restarts],
        "restart_median_s": round(statistics.median(restarts), 2),
    }))


if __name__ == "__main__":
    main()
