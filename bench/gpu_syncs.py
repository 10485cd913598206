"""Count the host synchronisations the sentinel adds per healthy step on CUDA.

``torch.cuda.set_sync_debug_mode("warn")`` makes PyTorch warn at every operation that
synchronises the host with the GPU. This script runs the same single-rank DDP step (NCCL,
world size 1) with and without the sentinel, for a foreach and a fused AdamW, and reports the
warnings per step of each and the difference. The promises:

- fused AdamW (the device gate): **0** added syncs per healthy step. The decision's one wait is
  on a CUDA event recorded right after the health vector's copy to pinned memory, at the next
  sentinel call; it is counted apart, as the share of steps where that event was not yet done
  when the host got there (the host then waits for the end of backward, not for the
  optimizer);
- foreach AdamW (the host gate): at most 1 (reading the health vector before the optimizer).

Run it on a lent GPU machine (``bench/run_gpu.sh`` does); it exits 2 with a message where
there is no CUDA, 1 when a promise is broken.
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
from nansentinel.step import gate

STEPS = 10
PROMISE = {"foreach": 1.0, "fused": 0.0}


class EventWaits:
    """Counts decisions whose event was still pending when the host asked (a real wait)."""

    def __init__(self) -> None:
        self.waited = self.total = 0
        self._values = gate.Pending.values

    def __enter__(self) -> EventWaits:
        counter = self
        original = self._values

        def values(pending: gate.Pending) -> list[float]:
            counter.total += 1
            counter.waited += not pending.settled()
            return original(pending)

        gate.Pending.values = values  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        gate.Pending.values = self._values  # type: ignore[method-assign]


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
            sentinel.step()  # the result is not read: reading it is a sync by the user's choice
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
    torch.cuda.set_device(0)
    ok = True
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("nccl", init_method=f"file://{store.name}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=60))
        try:
            for impl in ("foreach", "fused"):
                counts, waits, gates = {}, EventWaits(), ""
                for name in ("baseline", "sentinel"):
                    torch.manual_seed(0)
                    net = torch.nn.Sequential(
                        *[torch.nn.Linear(1024, 1024) for _ in range(8)]
                    ).cuda()
                    model = DDP(net)
                    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{impl: True})
                    sentinel = (nansentinel.Sentinel(model, opt, metrics_port=0, env={})
                                if name == "sentinel" else None)
                    if sentinel is not None:
                        gates = "device" if sentinel.device_gate is not None else "host"
                    with waits:
                        counts[name] = count_syncs(model, opt, sentinel)
                    if sentinel is not None:
                        sentinel.close()
                extra = counts["sentinel"] - counts["baseline"]
                ok = ok and extra <= PROMISE[impl]
                share = f"{waits.waited}/{waits.total}" if waits.total else "none"
                print(f"{impl} AdamW ({gates} gate): host syncs per step: baseline "
                      f"{counts['baseline']:.1f}, sentinel {counts['sentinel']:.1f}, added by "
                      f"the sentinel {extra:.1f} (promise: <= {PROMISE[impl]:g}); decisions "
                      f"that waited on their event: {share}")
        finally:
            dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
