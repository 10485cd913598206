"""The NCCL-only hazards of issues 20 and 35, checked on a CUDA machine in one go.

Each check prints ``PASS name: detail``, ``FAIL name: detail`` or ``SKIP name: why``; the
script exits 1 when any failed, else 0. With CUDA and NCCL it runs on an NCCL group of one rank
on cuda:0; without them (CI) on a gloo group of one rank on the CPU, where every check runs as
far as it can and the NCCL-only ones say SKIP, so that the script cannot rot between GPU loans
(``tests/e2e/test_bench_smoke.py`` runs it). The CPU unit tests cover the logic of each item;
only these need the real thing:

- ``gate_stream`` (item 5): the device gate's host copy is fenced on the vector's own
  device. With two GPUs the vector lives on cuda:1 while cuda:0 stays current (as under DDP
  with ``device_ids`` and no ``set_device``), behind a long kernel on cuda:1, so an event on
  the wrong stream would let the host read step N-1's values; with one GPU, cuda:0 with the
  current device never set (the cross-device case is then not reachable, and it says so).
- ``ddp_world1`` (item 6): NCCL world size 1, DDP with an odd-sized bucket through the
  sentinel's comm hook: the gradients equal the plain model's exactly.
- ``ddp_scale`` (issue 35, item 1): the hook's scale of a bucket by 1/world equals DDP's own
  (``mul_out`` by the scalar 1/world, or ``div_`` for gradients kept as bucket views) bit for
  bit on this device's kernels, in fp32, bf16 and fp16, at worlds NCCL's ``AVG`` would bias
  (its factor rounded to bf16: ``bf16(1/24) * 24`` printed beside).
- ``group_timeout`` (item 8): an NCCL group's timeout is read as set by
  ``init_process_group`` and by ``_set_pg_timeout``, and the deadline is clamped inside it.
- ``flight_recorder`` (item 8): the stop path's dump leaves a readable trace of the NCCL
  all-reduces where torch writes its own.
- ``nccl_future`` (item 8): a bucket's future completes at enqueue while its work has not
  (so no error can reach it), and the exchange is not settled until the collective is.
- ``state_reads`` (issue 68): the model's state is read with fused max-abs norms
  (``torch._foreach_norm(ord=inf)``) on this device's kernels: a NaN, +Inf or -Inf in any
  position of a tensor of any size and dtype (fp32, bf16, fp16 far past an L2 norm's range)
  is found, a finite tensor is not, and the floating buffers' three norms stay on the device
  (no host sync while the step is healthy); a tensor lr on the GPU is flagged on the device
  with no host sync, 0 while finite and 1 once NaN.

On the CPU: ``gate_stream`` reads the host copy path (no event), ``ddp_world1`` and
``ddp_scale`` run on gloo and the CPU's kernels, ``group_timeout`` reads gloo's timeout, and
``flight_recorder`` and ``nccl_future`` are skipped (NCCL only).

Usage (on a GPU machine ``bench/run_gpu.sh`` runs it first; anywhere else it runs on the CPU)::

    python bench/gpu_correctness.py [--only gate_stream,ddp_world1] [--json $OUT/correct.json]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
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

#: Cycles of ``torch.cuda._sleep`` that keep a GPU busy well past a host round trip.
_BUSY_CYCLES = 200_000_000
#: A check's outcome: passed (True), failed (False) or skipped here (None), and its detail.
Outcome = tuple[bool | None, str]


def _cuda() -> bool:
    """The checks run on CUDA and NCCL (else on the CPU and gloo)."""
    return torch.cuda.is_available() and dist.is_nccl_available()


def _device() -> torch.device:
    return torch.device("cuda", 0) if _cuda() else torch.device("cpu")


def _read_pending(step: int, host: torch.Tensor, event: object) -> list[float]:
    """The host values of a device-gated step's copy, read as the gate reads them at the
    decision: the one place this script builds the step's own record (step/record.py)."""
    from nansentinel.checks.health import LocalHealth
    from nansentinel.step.record import StepRecord

    record = StepRecord(step, LocalHealth(host.device), host=host, event=event)
    return record.read()


def check_gate_stream(tmp: Path) -> Outcome:
    from nansentinel.step.gate import GatedOptimizer
    from nansentinel.wire.schema import SIZE

    cuda = _cuda()
    two = cuda and torch.cuda.device_count() >= 2
    device = torch.device("cuda", 1 if two else 0) if cuda else torch.device("cpu")
    param = torch.nn.Parameter(torch.zeros(4, device=device))
    gate = GatedOptimizer(torch.optim.AdamW([param], fused=True), device)
    vector = torch.zeros(SIZE, device=device)
    stale = []
    for step in range(1, 21):
        if cuda:
            with torch.cuda.device(device):
                torch.cuda._sleep(_BUSY_CYCLES)  # the copy lands only after this
        vector.fill_(float(step))
        host, event = gate.to_host(vector)
        values = _read_pending(step, host, event)
        if any(v != float(step) for v in values):
            stale.append((step, values[0]))
    if cuda:
        torch.cuda.synchronize(device)
    where = (f"vector on {device}, current device {torch.cuda.current_device()}" if two
             else "one GPU: cuda:0 with the current device never set (no cross-device case)"
             if cuda else "CPU: the host copy path only (no event, no stream)")
    if stale:
        return False, f"{where}: {len(stale)}/20 steps read stale values, e.g. {stale[0]}"
    return True, f"{where}: 20/20 steps read their own values"


def check_ddp_world1(tmp: Path) -> Outcome:
    from torch.nn.parallel import DistributedDataParallel

    import nansentinel

    device = _device()
    torch.manual_seed(0)
    plain = torch.nn.Linear(33, 31, bias=False).to(device)  # 1023 elements: an odd bucket
    model = DistributedDataParallel(copy.deepcopy(plain),
                                    device_ids=[0] if device.type == "cuda" else None)
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


def check_ddp_scale(tmp: Path) -> Outcome:
    from nansentinel.engines.ddp import scale

    device = _device()
    x = torch.randn(4099, generator=torch.Generator().manual_seed(0)).to(device)
    differ = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        grads = x.to(dtype)
        for world in (3, 6, 24, 1000):
            ddp_mul = torch.empty_like(grads)
            torch.mul(grads, 1.0 / world, out=ddp_mul)  # DDP's reducer, copying into a bucket
            ddp_div = grads.clone().div_(world)  # DDP's reducer, a gradient kept as its view
            ours_mul, ours_div = grads.clone(), grads.clone()
            scale(ours_mul, world, divides=False)
            scale(ours_div, world, divides=True)
            if not (torch.equal(ours_mul, ddp_mul) and torch.equal(ours_div, ddp_div)):
                differ.append(f"{dtype} at {world}")
    bias = torch.tensor(1 / 24).bfloat16().float().item() * 24
    detail = (f"{device}: fp32/bf16/fp16 at 3, 6, 24, 1000 ranks; NCCL AVG's bf16 factor would "
              f"give {bias:.5f} of the mean at 24")
    return not differ, detail + (f"; differ: {', '.join(differ)}" if differ else "")


def check_group_timeout(tmp: Path) -> Outcome:
    from nansentinel.wire.watchdog import TimeoutFit, Watchdog, fitted_timeout, group_timeout

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
    fitted = fitted_timeout(300.0, 40.0)  # the code's own rule, not a number copied from it
    ok = first == _PG_TIMEOUT_S and later == 40.0 and exchange.timeout == fitted
    return ok, (f"{dist.get_backend()}: read {first} s at init, {later} s after "
                f"_set_pg_timeout(40 s); exchange timeout 300 s clamped to {exchange.timeout} s "
                f"(fitted_timeout(300, 40) = {fitted})")


def check_flight_recorder(tmp: Path) -> Outcome:
    from nansentinel.effects.stop import dump_flight_recorder

    if not _cuda():
        return None, "NCCL's flight recorder: needs CUDA and NCCL"

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


def check_nccl_future(tmp: Path) -> Outcome:
    from nansentinel.wire.exchange import HealthExchange
    from nansentinel.wire.schema import SIZE, T

    if not _cuda():
        return None, "an NCCL work's future completing at enqueue: needs CUDA and NCCL"
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


def check_state_reads(tmp: Path) -> Outcome:
    """Issue 68: the state's max-abs reads find every non-finite value on this device."""
    from nansentinel.checks.buffers import FloatingBuffers
    from nansentinel.checks.state import any_nonfinite, poisoned

    device = _device()
    missed = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (1, 7, 4096, 1 << 20):
            for where in (0, n // 2, n - 1):
                for bad in (math.nan, math.inf, -math.inf):
                    t = torch.full((n,), 60000.0 if dtype is torch.float16 else 3.0e4,
                                   dtype=dtype, device=device)
                    clean = [("t", "weight", t.clone())]
                    t[where] = bad
                    found = poisoned([("t", "weight", t)])
                    if poisoned(clean) or [p.bad for p in found] != [1] or \
                            int(any_nonfinite([t], device)) != 1:
                        missed.append(f"{dtype} n={n} at {where} {bad}")
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).to(device)
    buffers = FloatingBuffers(net)
    net(torch.randn(4, 8, device=device))
    norms = buffers.norms()
    on_device = norms is not None and all(n.device == device for n in norms)
    lr_ok, lr_said = _tensor_lr(device)
    ok = not missed and on_device and lr_ok
    return ok, (f"{len(missed)} missed: {', '.join(missed[:4])}" if missed else
                f"every NaN/Inf found in fp32, bf16, fp16 up to 2**20 elements on {device}; "
                f"buffer norms on {norms[0].device if norms else '?'}; {lr_said}")


def _tensor_lr(device: torch.device) -> Outcome:
    """A tensor lr on the device (fused AdamW takes one) is read on the device only: its flag
    is 0 while finite and 1 once NaN, made with no host sync (CUDA's sync debug mode raises
    on one); named on the host once asked (the rare path)."""
    from nansentinel.checks.state import (
        nonfinite_flag,
        poisoned_hyperparameters,
        read_hyperparameters,
    )

    param = torch.nn.Parameter(torch.zeros(4, device=device))
    opt = torch.optim.AdamW([param], lr=torch.tensor(1e-3, device=device),
                            fused=device.type == "cuda")
    tensors = read_hyperparameters(opt)[1]
    if device.type != "cuda":
        return tensors == [], f"tensor lr on {device}: read by the host ({len(tensors)} listed)"
    flags = []
    for value in (1e-3, math.nan):
        opt.param_groups[0]["lr"].fill_(value)
        torch.cuda.set_sync_debug_mode("error")
        try:
            flag = nonfinite_flag(read_hyperparameters(opt)[1], device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        flags.append(float(flag))
    named = poisoned_hyperparameters(opt)
    ok = len(tensors) == 1 and flags == [0.0, 1.0] and [k for _, k, _ in named] == ["lr"]
    return ok, f"tensor lr on {device}: flags {flags} with no sync, named {named}"


CHECKS: dict[str, Callable[[Path], Outcome]] = {
    "gate_stream": check_gate_stream,
    "ddp_world1": check_ddp_world1,
    "ddp_scale": check_ddp_scale,
    "group_timeout": check_group_timeout,
    "flight_recorder": check_flight_recorder,
    "nccl_future": check_nccl_future,
    "state_reads": check_state_reads,
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
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    timeout = datetime.timedelta(seconds=_PG_TIMEOUT_S)
    if _cuda():
        # The default group on cuda:0 without set_device: item 5 needs the current device
        # unset.
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timeout,
                                device_id=torch.device("cuda", 0))
    else:
        print(f"gpu_correctness: no CUDA device or NCCL (torch {torch.__version__}, CUDA build "
              f"{torch.version.cuda or 'none'}): on the CPU with gloo, the NCCL-only checks "
              "skipped", file=sys.stderr)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)
    results: dict[str, dict[str, object]] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="nansentinel-correct-") as tmp:
            for name in names:
                try:
                    ok, detail = CHECKS[name](Path(tmp))
                except Exception as exc:  # a check that raises has failed, the others still run
                    ok, detail = False, f"raised {type(exc).__name__}: {exc}"
                results[name] = {"ok": ok, "detail": detail}
                word = "SKIP" if ok is None else "PASS" if ok else "FAIL"
                print(f"{word} {name}: {detail}", flush=True)
    finally:
        dist.destroy_process_group()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    failed = [n for n, r in results.items() if r["ok"] is False]
    skipped = [n for n, r in results.items() if r["ok"] is None]
    ran = len(results) - len(skipped)
    print(f"gpu_correctness: {ran - len(failed)}/{ran} passed"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; skipped here: {', '.join(skipped)}" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
