"""torchtitan 0.3.0's fault-tolerant trainer under the sentinel on GPUs and NCCL: the GPU twin of
tests/e2e/test_torchtitan_ft.py (which runs on CPU ranks over gloo).

A torchft lighthouse in this process, one ``torchrun -m torchtitan.train`` per replica group
(torchtitan's own entry point, no CPU patches), 2 groups x 2 ranks, FSDP2 shard degree 2 inside
each group over NCCL, torchft's process group across the groups on NCCL
(``--fault_tolerance.process_group nccl``), llama3's debug model. The registry is the test's
(tests/e2e/workers/torchtitan_registry.py, ``ft_fault``): group 1's rank 1 makes its first
block's output NaN at torchtitan's step 2; ``host_strikes=1``.

Prints ``PASS titan_ft: ...`` when every rank of both groups vetoed that step and named group
1's rank 1 on ``node1r1`` alone, only ``node1r1`` was excluded, group 1 left and group 0
trained to the last step and exited 0; ``FAIL titan_ft: ...`` (exit 1) otherwise, the groups'
logs under ``--out``. NCCL refuses two ranks of one communicator on one GPU, so it needs 4 GPUs
(CUDA_VISIBLE_DEVICES 0,1 and 2,3); with fewer it prints ``SKIP titan_ft: ...`` and exits 0.

Usage (bench/gpu_issue46.sh runs it)::

    python bench/gpu_titan_ft.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "e2e" / "workers"
STEPS = 3
CULPRIT = "replica group torchtitan_ft_1 (rank 1, host node1r1)"


def launch(out: Path, assets: tuple[Path, Path], group: int, env: dict[str, str]
           ) -> subprocess.Popen[str]:
    tokenizer, data = assets
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "torchtitan.train", "--module", "torchtitan_registry", "--config", "ft_fault",
           "--hf-assets-path", str(tokenizer), "--dataloader.dataset-path", str(data),
           "--training.steps", str(STEPS), "--training.seq-len", "32",
           "--training.local-batch-size", "1", "--dump-folder", str(out / f"g{group}"),
           "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(group),
           "--fault_tolerance.group_size", "2", "--fault_tolerance.process_group", "nccl",
           "--parallelism.data_parallel_shard_degree", "2"]
    log = (out / f"titan_ft_g{group}.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=out,
                            env={**os.environ, **env, "REPLICA_GROUP_ID": str(group),
                                 "CUDA_VISIBLE_DEVICES": f"{2 * group},{2 * group + 1}"},
                            start_new_session=True)


def verdict(out: Path, codes: list[int | None]) -> list[str]:
    """What went wrong (empty: PASS)."""
    logs = [(out / f"titan_ft_g{g}.log").read_text() for g in (0, 1)]
    wrong = []
    if codes[0] != 0 or logs[0].count("Training completed") != 2:
        wrong.append(f"group 0 did not train to the end (exit {codes[0]})")
    if codes[1] == 0 or "HostExcludedError" not in logs[1]:
        wrong.append(f"group 1 did not leave (exit {codes[1]})")
    for g in (0, 1):
        for r in (0, 1):
            line = (f"(rank {r}, host node{g}r{r}): torchft step 1 not committed on any "
                    f"replica group: {CULPRIT}")
            if line not in logs[g]:
                wrong.append(f"group {g} rank {r} did not name {CULPRIT}")
    excluded = out / "titan_ft_excluded.jsonl"
    hosts = ([json.loads(x)["host"] for x in excluded.read_text().splitlines()]
             if excluded.exists() else [])
    if hosts != ["node1r1"]:
        wrong.append(f"excluded {hosts}, not ['node1r1']")
    return wrong


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 4:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"SKIP titan_ft: needs 4 GPUs (2 groups x 2 ranks; NCCL refuses two ranks of "
              f"one communicator on one GPU), found {found}")
        return 0
    from torchft._torchft import LighthouseServer

    sys.path.insert(0, str(ROOT))
    from tests.e2e.torchtitan_cpu import write_assets  # the tokenizer and data, no patches

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "titan_ft_start").mkdir(exist_ok=True)
    for old in (out / "titan_ft_start").iterdir():
        old.unlink()
    assets = write_assets(out / "titan_ft_assets")
    excluded = out / "titan_ft_excluded.jsonl"
    excluded.unlink(missing_ok=True)
    house = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000,
                             heartbeat_timeout_ms=500)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(WORKERS),
                                                       os.environ.get("PYTHONPATH")])),
           "TORCHFT_LIGHTHOUSE": house.address(), "FT_START": str(out / "titan_ft_start"),
           "FT_RANKS": "4", "TORCHFT_TIMEOUT_SEC": "30", "TORCHFT_QUORUM_TIMEOUT_SEC": "30",
           "TORCHFT_CONNECT_TIMEOUT_SEC": "30", "NANSENTINEL_HOST_STRIKES": "1",
           "NANSENTINEL_EXCLUSION_FILE": str(excluded), "NANSENTINEL_METRICS_PORT": "0",
           "NANSENTINEL_REPORT_DIR": str(out / "titan_ft_reports"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    started = time.monotonic()
    procs = [launch(out, assets, g, env) for g in (0, 1)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [p.poll() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        house.shutdown()
    wrong = verdict(out, codes)
    took = time.monotonic() - started
    if wrong:
        print(f"FAIL titan_ft: {'; '.join(wrong)} ({took:.0f} s; logs in {out})")
        return 1
    print(f"PASS titan_ft: NaN on group 1's rank 1 vetoed on every rank of both groups, "
          f"{CULPRIT} named alone, node1r1 excluded, group 1 left, group 0 trained to step "
          f"{STEPS} ({took:.0f} s, {torch.cuda.get_device_name(0)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
