"""Count host synchronisations per step on CUDA: the sentinel promises at most one.

``torch.cuda.set_sync_debug_mode("warn")`` makes PyTorch warn at every operation that
synchronises the host with the GPU. This script runs the same single-rank DDP step (NCCL,
world size 1) with and without the sentinel and reports the warnings per step of each, and the
difference, which must be <= 1 (reading the health vector at the decision). Run it on a lent
GPU machine (``bench/run_gpu.sh`` does); it exits 2 with a message where there is no CUDA.
"""

from __future__ import annotations

import datetime
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel

STEPS = 10


def count_syncs(model: torch.nn.Module, opt: torch.optim.Optimizer,
                sentinel: nansentinel.Sentinel | None) -> float:
    x = torch.randn(32, 1024, device="cuda")
    batch = {"x": x, "ids": torch.arange(32, device="cuda")}

    def step() -> None:
        if sentinel is not None:
            sentinel.check_batch(batch)
        loss = model(batch["x"]).float().pow(2).mean()
        if sentinel is not None:
            sentinel.check_loss(loss)
        loss.backward()
        if sentinel is not None:
            sentinel.step()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):  # warm-up: DDP rebuilds its buckets after the first step
        step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(STEPS):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught) / STEPS


def main() -> int:
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        print("gpu_syncs.py: needs a CUDA device and NCCL; nothing measured", file=sys.stderr)
        return 2
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("nccl", init_method=f"file://{store.name}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
        try:
            counts = {}
            for name in ("baseline", "sentinel"):
                torch.manual_seed(0)
                net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda()
                model = DDP(net)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
                sentinel = (nansentinel.Sentinel(model, opt, metrics_port=0, env={})
                            if name == "sentinel" else None)
                counts[name] = count_syncs(model, opt, sentinel)
                if sentinel is not None:
                    sentinel.close()
        finally:
            dist.destroy_process_group()
    extra = counts["sentinel"] - counts["baseline"]
    print(f"host syncs per step: baseline {counts['baseline']:.1f}, sentinel "
          f"{counts['sentinel']:.1f}, added by the sentinel {extra:.1f} (promise: <= 1)")
    return 0 if extra <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
