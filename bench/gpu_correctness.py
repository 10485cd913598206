"""The NCCL-only hazards of issue 20 (items 5, 6 and 8), checked on a CUDA machine in one go.

Each check prints ``PASS name: detail`` or ``FAIL name: detail``; the script exits 1 when any
failed, 0 when all passed, and 2 (with a message, measuring nothing) without CUDA or NCCL.
The CPU unit tests cover the logic of each item; only these need the real thing:

- ``gate_stream`` (item 5): the device gate's host copy is fenced on the vector's own
  device. With two GPUs the vector lives on cuda:1 while cuda:0 stays current (as under DDP
  with ``device_ids`` and no ``set_device``), behind a long kernel on cuda:1, so an event on
  the wrong stream would let the host read step N-1's values; with one GPU, cuda:0 with the
  current device never set (the cross-device case is then not reachable, and it says so).
- ``ddp_world1`` (item 6): NCCL world size 1, DDP with an odd-sized bucket through the
  sentinel's comm hook: the gradients equal the plain model's exactly.
- ``group_timeout`` (item 8): an NCCL group's timeout is read as set by
  ``init_process_group`` and by ``_set_pg_timeout``, and the deadline is clamped inside it.
- ``flight_recorder`` (item 8): the stop path's dump leaves a readable trace of the NCCL
  all-reduces where torch writes its own.
- ``nccl_future`` (item 8): a bucket's future completes at enqueue while its work has not
  (so no error can reach it), and the exchange is not settled until the collective is.

Usage (on a GPU machine; ``bench/run_gpu.sh`` runs it first)::

    python bench/gpu_correctness.py [--only gate_stream,ddp_world1] [--json $OUT/correct.json]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

# Read when NCCL's flight recorder is first built: on, as torch 2.13 has it by default.
if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")

import torch  # after the environment the flight recorder reads
import torch.distributed as dist

EXIT_NO_GPU = 2
#: Cycles of ``torch.cuda._sleep`` that keep a GPU busy well past a host round trip.
_BUSY_CYCLES = 200_000_000


def check_gate_stream(tmp: Path) -> tuple[bool, str]:
    from nansentinel.step.gate import DeviceGate, Pending
    from nansentinel.wire.schema import SIZE

    two = torch.cuda.device_count() >= 2
    device = torch.device("cuda", 1 if two else 0)
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    gate = DeviceGate(torch.optim.AdamW([param], fused=True), device)
    vector = torch.zeros(SIZE, device=device)
    stale = []
    for step in range(1, 21):
        with torch.cuda.device(device):
            torch.cuda._sleep(_BUSY_CYCLES)  # the copy lands only after this
        vector.fill_(float(step))
        host, event = gate.to_host(vector)
        pending = Pending(step=step, local=None, seconds=0.0,  # type: ignore[arg-type]
                          host=host, event=event, grads=[])
        values = pending.values()
        if any(v != float(step) for v in values):
            stale.append((step, values[0]))
    torch.cuda.synchronize(device)
    where = (f"vector on {device}, current device {torch.cuda.current_device()}" if two
             else "one GPU: cuda:0 with the current device never set (no cross-device case)")
    if stale:
        return False, f"{where}: {len(stale)}/20 steps read stale values, e.g. {stale[0]}"
    return True, f"{where}: 20/20 steps read their own values"


def check_ddp_world1(tmp: Path) -> tuple[bool, str]:
    from torch.nn.parallel import DistributedDataParallel

    import nansentinel

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    plain = torch.nn.Linear(33, 31, bias=False).to(device)  # 1023 elements: an odd bucket
    model = DistributedDataParallel(copy.deepcopy(plain), device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sentinel = nansentinel.Sentinel(model, opt, env={}, metrics_port=0,
                                    report_dir=str(tmp / "ddp"))
    try:
        x = torch.randn(8, 33, device=device)
        batch = sentinel.check_batch({"x": x})
        loss = model(batch["x"]).square().mean()
        sentinel.check_loss(loss)
        loss.backward()
        plain(x).square().mean().backward()
        equal = torch.equal(model.module.weight.grad, plain.weight.grad)
        diff = (model.module.weight.grad - plain.weight.grad).abs().max().item()
        sentinel.step()
    finally:
        sentinel.close()
    averaging = sentinel.gradients.averaging  # type: ignore[attr-defined]
    detail = f"averaging={averaging}, 1023-element bucket, max |diff| {diff:g}"
    return equal and averaging == "sum", detail


def check_group_timeout(tmp: Path) -> tuple[bool, str]:
    from nansentinel.wire.watchdog import TimeoutFit, Watchdog, group_timeout

    first = group_timeout(None)
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=40))
    later = group_timeout(None)
    dog = Watchdog(300.0, lambda step: None)
    exchange = SimpleNamespace(group=None, timeout=300.0)
    try:
        TimeoutFit(exchange, 300.0, dog, speak=False)
    finally:
        dog.close()
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=_PG_TIMEOUT_S))
    ok = first == _PG_TIMEOUT_S and later == 40.0 and exchange.timeout == 14.8
    return ok, (f"read {first} s at init, {later} s after _set_pg_timeout(40 s); exchange "
                f"timeout 300 s clamped to {exchange.timeout} s")


def check_flight_recorder(tmp: Path) -> tuple[bool, str]:
    from nansentinel.effects.stop import dump_flight_recorder

    x = torch.ones(1001, device="cuda:0")
    for _ in range(3):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    path = dump_flight_recorder("nccl", dist.get_rank(),
                                {"TORCH_FR_DUMP_TEMP_FILE": str(tmp / "fr" / "trace_")})
    if path is None or not path.exists():
        return False, f"no dump written (path {path})"
    trace = pickle.loads(path.read_bytes())
    names = [e.get("profiling_name", "") for e in trace.get("entries", [])]
    reduces = sum("all_reduce" in n or "allreduce" in n for n in names)
    return reduces >= 3, f"{path.name}: {len(names)} entries, {reduces} all-reduces"


def check_nccl_future(tmp: Path) -> tuple[bool, str]:
    from nansentinel.wire.exchange import HealthExchange
    from nansentinel.wire.schema import SIZE, T

    device = torch.device("cuda", 0)
    x = torch.ones(1001, device=device)
    torch.cuda._sleep(_BUSY_CYCLES)
    work = dist.all_reduce(x, async_op=True)
    future_done, work_done = work.get_future().done(), work.is_completed()
    exchange = HealthExchange(None, device, 30.0)
    exchange.launch(0, torch.zeros(SIZE, device=device))
    torch.cuda._sleep(_BUSY_CYCLES)
    # World size 1 launches no collective: give the exchange the one a wider world would.
    exchange._work = dist.all_reduce(torch.zeros(T.size, device=device), async_op=True)
    busy = exchange.settled()
    torch.cuda.synchronize()
    settled = exchange.settled()
    ok = exchange.nccl and future_done and not work_done and not busy and settled
    return ok, (f"future done at enqueue: {future_done}, work completed then: {work_done}; "
                f"exchange settled while busy: {busy}, after sync: {settled}")


CHECKS: dict[str, Callable[[Path], tuple[bool, str]]] = {
    "gate_stream": check_gate_stream,
    "ddp_world1": check_ddp_world1,
    "group_timeout": check_group_timeout,
    "flight_recorder": check_flight_recorder,
    "nccl_future": check_nccl_future,
}
_PG_TIMEOUT_S = 120.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/gpu_correctness.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help=f"comma-separated checks (default all: {', '.join(CHECKS)})")
    p.add_argument("--json", metavar="PATH", help="write each check's result as JSON here")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        p.error(f"--only: no check named {', '.join(unknown)} (known: {', '.join(CHECKS)})")
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        print(f"gpu_correctness: needs a CUDA device and NCCL (torch {torch.__version__}, "
              f"CUDA build {torch.version.cuda or 'none'}); nothing was checked. The CPU unit "
              "tests cover the logic of these items.", file=sys.stderr)
        return EXIT_NO_GPU
    # The default group on cuda:0 without set_device: item 5 needs the current device unset.
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=_PG_TIMEOUT_S),
                            device_id=torch.device("cuda", 0))
    results: dict[str, dict[str, object]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="nansentinel-correct-") as tmp:
            for name in names:
                try:
                    ok, detail = CHECKS[name](Path(tmp))
                except Exception as exc:  # a check that raises has failed, the others still run
                    ok, detail = False, f"raised {type(exc).__name__}: {exc}"
                results[name] = {"ok": ok, "detail": detail}
                print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    finally:
        dist.destroy_process_group()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    failed = [n for n, r in results.items() if not r["ok"]]
    print(f"gpu_correctness: {len(results) - len(failed)}/{len(results)} passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
