"""Run a function on N gloo ranks in fresh processes, bounded in time.

Every rank runs under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``. Every rank's return value comes back
through a file; a rank that raises, hangs or dies fails
the test with its traceback, and every process is killed before returning: nothing hangs CI.

Ranks are forked from a forkserver that has imported torch and nansentinel once (as a
DataLoader's workers are forked from a process that imported torch): a spawned rank spent ~2 s
importing them, ~5 s for four ranks on the 2-core CI machine, and the suite starts ~100 groups;
a forked one starts in ~0.05 s. What spawn gave a rank is kept: the test process's environment
as it is at the call (the forkserver's own is the one it started with), the test's module
imported afresh, nothing else of the test process.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from tests.support import free_port

#: Imported once by the forkserver, before it forks a rank (nothing here starts a thread that
#: a fork could catch holding a lock: importing torch starts none that runs Python).
#: ``torch._dynamo``: DDP's constructor imports it (~1.5 s a rank).
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
           "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.pipelining",
           "nansentinel", "nansentinel.step.sentinel", __name__]


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out: str,
           env: dict[str, str], kwargs: dict[str, Any]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment at the call, as a spawned rank had it
    os.environ.update(env)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    # OMP_NUM_THREADS is read when torch loads, in the forkserver: apply it to this rank.
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # torch reads TORCH_DISTRIBUTED_DEBUG when it is imported, and this process imported it
    # before the variable was set: read it again, so that the groups made below are checked.
    dist.set_debug_level_from_env()
    if dist.get_debug_level() == dist.DebugLevel.DETAIL:
        _spare_ddp_construction_log()
    path = Path(out) / f"rank{rank}.pkl"
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        value = fn(rank, world, **kwargs)
        payload = {"ok": True, "value": value}
    except BaseException as exc:  # reported to the test, whatever it was
        payload = {"ok": False, "error": repr(exc), "type": type(exc).__name__,
                   "message": str(exc), "traceback": traceback.format_exc()}
    path.write_bytes(pickle.dumps(payload))
    with contextlib.suppress(Exception):  # a failed group may not tear down cleanly
        dist.destroy_process_group()


def _spare_ddp_construction_log() -> None:
    """torch 2.13.0+cpu segfaults in ``Logger.set_construction_data_and_log`` when DDP is built
    on a gloo group under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (reproduced with a bare
    ``DDP(nn.Linear(4, 4))``, no nansentinel). That call only records DDP's construction data
    for torch's usage logging; the tests skip it, and DDP, its reducer and DETAIL's checks of
    every collective are as they are."""
    import torch.distributed as dist

    class _Logger(dist.Logger):  # type: ignore[misc]
        def set_construction_data_and_log(self, *args: Any, **kwargs: Any) -> None:
            return None

    dist.Logger = _Logger  # type: ignore[misc]


def run_ranks(fn: Callable[..., Any], world: int, tmp: Path, *, timeout: float = 90,
              env: dict[str, str] | None = None, expect_all: bool = True,
              wait_for: list[int] | None = None, **kwargs: Any) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, **kwargs)`` on ``world`` gloo ranks; return each rank's payload
    (``{"ok": True, "value": ...}`` or ``{"ok": False, "type", "message", "traceback"}``),
    with its ``exitcode``. A rank that left no result fails the test unless ``expect_all`` is
    False, when its payload is ``{"ok": False, "missing": True, "exitcode": ...}``.
    ``wait_for``: the ranks whose end is awaited (default all); the rest are killed then."""
    out = tmp / f"ranks-{time.monotonic_ns()}"
    out.mkdir()
    # DETAIL: torch checks every collective's op and shapes across ranks and names a mismatch
    # at once, where a collective issued on some ranks only would otherwise hang or pair
    # with the wrong one (DESIGN.md, "Collectives: the one rule").
    env = {**os.environ, "NANSENTINEL_METRICS_PORT": "0", "OMP_NUM_THREADS": "1",
           "TORCH_DISTRIBUTED_DEBUG": "DETAIL", **(env or {})}
    multiprocessing.set_forkserver_preload(PRELOAD)  # read once, when the server starts
    ctx = mp.start_processes(
        _entry, args=(fn, world, free_port(), str(out), env, kwargs), nprocs=world,
        join=False, start_method="forkserver",
    )
    deadline = time.monotonic() + timeout
    awaited = [ctx.processes[r] for r in (range(world) if wait_for is None else wait_for)]
    try:
        while any(p.is_alive() for p in awaited):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout} s")
            time.sleep(0.05)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    results = []
    for rank in range(world):
        path = out / f"rank{rank}.pkl"
        code = ctx.processes[rank].exitcode
        if path.exists():
            results.append({**pickle.loads(path.read_bytes()), "exitcode": code})
        elif expect_all:
            raise AssertionError(f"rank {rank} left no result (exit code {code})")
        else:
            results.append({"ok": False, "missing": True, "exitcode": code})
    return results


def values(results: list[dict[str, Any]]) -> list[Any]:
    """The ranks' return values; fails with the first rank's traceback if any raised."""
    for rank, r in enumerate(results):
        if not r["ok"]:
            raise AssertionError(f"rank {rank} raised:\n{r['traceback']}")
    return [r["value"] for r in results]


def start_by_hand(script: Path, args: list[str], world: int, run_dir: Path,
                  **env: str) -> list[subprocess.Popen[str]]:
    """``world`` ranks of ``script`` started as a user starts them without a launcher
    (env://, one process each, a free port), host ``host{rank}`` each, the exporter off, this
    checkout on the path; ``env``: more environment for every rank. Output: stdout and stderr
    together, as text."""
    repo = Path(__file__).resolve().parents[2]
    port = free_port()
    procs = []
    for rank in range(world):
        environ = {**os.environ, "PYTHONPATH": str(repo), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_RANK": str(rank), "NANSENTINEL_RUN_DIR": str(run_dir),
                   "NANSENTINEL_HOSTNAME": f"host{rank}", "NANSENTINEL_METRICS_PORT": "0",
                   "OMP_NUM_THREADS": "1", **env}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=environ,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs
