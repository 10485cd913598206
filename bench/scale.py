"""The sentinel's host work at any world size, measured in one process on torch's fake backend.

``dist.init_process_group("fake", rank=0, world_size=W)`` makes this process rank 0 of ``W``:
every collective is a no-op, so what is timed is the sentinel's own host work (and a small
model's), not a network. A healthy step must cost the same at W = 131,072 as at W = 8.

For a detection the fake backend would leave the exchange's sums as this rank sent them, so
the benchmark writes what a real collective would produce: the totals gain the contribution of
one poisoned rank (rank W-1, a NaN loss), and the flagged ranks' rows and details, which only
they send, are filled in as they would arrive. Rank 0 then runs the whole detection path
(naming, the max-reduce, the report written to disk).

Each world size runs in a fresh process (so that memory is its own), in rounds whose order
rotates; a step's figures are medians over every round. Memory is the growth of the process's
RSS from just before the Sentinel is built to the end of the run: the process's own RSS also
grows with W before that (torch's DDP on the fake backend: about +70 MB at 131,072), which is
not the sentinel's.

    python bench/scale.py                      # W = 8, 1,024, 16,384, 131,072; 3 rounds
    python bench/scale.py --worlds 8,131072 --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORLDS = (8, 1_024, 16_384, 131_072)


def one_world(world: int, steps: int, detections: int) -> dict[str, Any]:
    """Rank 0 of ``world`` on the fake backend: construction, healthy steps, detections."""
    import psutil
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import nansentinel
    from nansentinel import collectives, exchange
    from nansentinel.view import (
        R_BATCH,
        R_GRAD,
        R_HAS_GRAD,
        R_HAS_LOSS,
        R_LOSS,
        ROW,
        TOTALS,
        pack,
    )

    torch.set_num_threads(1)
    proc = psutil.Process()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())

    sent = [0]
    real_all_reduce = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent[0] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]

    # A detection: the exchange's sums as a real all-reduce would return them with rank W-1
    # poisoned, and the named ranks' rows and details as they would arrive from them.
    poison = {"on": False}
    real_launch = exchange.HealthExchange.launch

    def launch(self: Any, step: int, vector: torch.Tensor) -> None:
        real_launch(self, step, vector)
        if poison["on"] and self._vector is not None:
            row = torch.zeros(ROW)
            row[[R_BATCH, R_LOSS, R_GRAD, R_HAS_LOSS, R_HAS_GRAD]] = torch.tensor(
                [1.0, float("nan"), 1.0, 1.0, 1.0])
            other = pack(row, torch.full((4,), float("inf")), world - 1, amp=False)
            self._vector[:TOTALS] += other[:TOTALS]

    real_gather = collectives.Peers.gather_from

    def gather_from(self: Any, speakers: list[int], payload: Any) -> dict[int, Any]:
        out = real_gather(self, speakers, payload)
        rows = payload is None or "identity" in payload  # the detection's, not the report's
        for rank in speakers:
            if out.get(rank) is None and rank != self.rank:
                text = json.dumps(_arrived(rank, world, rows))
                sent[0] += len(text)  # what the real sum all-reduce of their bytes carries
                out[rank] = json.loads(text)
        return out

    exchange.HealthExchange.launch = launch  # type: ignore[method-assign]
    collectives.Peers.gather_from = gather_from  # type: ignore[method-assign]

    rss_before = proc.memory_info().rss
    started = time.perf_counter()
    reports = tempfile.mkdtemp(prefix="scale-reports-")
    sentinel = nansentinel.Sentinel(model, opt, metrics_port=0, env={}, report_dir=reports,
                                    host_strikes=10**6)  # the same host, detection after detection
    construction = time.perf_counter() - started

    own = [0.0]

    def timed(call: Any, *args: Any) -> Any:
        t = time.perf_counter()
        out = call(*args)
        own[0] += time.perf_counter() - t
        return out

    def one_step() -> tuple[float, int, str]:
        sent[0] = 0
        own[0] = 0.0
        t0 = time.perf_counter()
        data = {"x": torch.randn(32, 64), "y": torch.randint(0, 10, (32,))}
        batch = timed(sentinel.check_batch, data)
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        timed(sentinel.check_loss, loss)
        loss.backward()  # the comm hook's share of the sentinel is in the step, not in own
        result = timed(sentinel.step)  # with the (small) SGD step it launches
        opt.zero_grad(set_to_none=True)
        sentinel_ms.append(own[0] * 1e3)
        return time.perf_counter() - t0, sent[0] - grad_bytes, result.outcome

    sentinel_ms: list[float] = []

    for _ in range(5):
        one_step()
    sentinel_ms.clear()
    healthy = [one_step() for _ in range(steps)]
    healthy_own = list(sentinel_ms)
    assert all(o == "applied" for _, _, o in healthy), healthy
    detected = []
    for _ in range(detections):
        poison["on"] = True
        seconds, nbytes, outcome = one_step()
        poison["on"] = False
        assert outcome == "skipped", outcome
        detected.append((seconds, nbytes))
        for _ in range(3):  # healthy steps between detections
            one_step()
    rss_after = proc.memory_info().rss
    sentinel.close()
    return {
        "world": world,
        "healthy_ms": [s * 1e3 for s, _, _ in healthy],
        "healthy_own_ms": healthy_own,
        "healthy_bytes": max(b for _, b, _ in healthy),
        "detection_ms": [s * 1e3 for s, _ in detected],
        "detection_bytes": max(b for _, b in detected),
        "construction_s": construction,
        "rss_mb": rss_after / 2**20,
        "rss_growth_mb": (rss_after - rss_before) / 2**20,
    }


def _arrived(rank: int, world: int, rows: bool) -> dict[str, Any]:
    """What a named rank would send: its row (the detection), or its incident detail."""
    if rows:
        bad = rank == world - 1
        return {
            "identity": {"rank": rank, "local_rank": rank % 8, "world_size": world,
                         "hostname": f"node{rank // 8:05d}", "device": f"cuda:{rank % 8}",
                         "gpu": str(rank % 8), "gpu_uuid": f"GPU-{rank:08x}"},
            "kinds": ["loss"] if bad else [], "injected": False,
            "loss": float("nan") if bad else 2.5, "grad_norm": 1.0, "quarantined": False,
            "spikes": {},
        }
    if rank == world - 1:
        return {"batch_path": f"/reports/incident-step-rank{rank}-batch.pt"}
    return {}


def _summary(runs: list[dict[str, Any]], worlds: list[int]) -> list[dict[str, Any]]:
    rows = []
    for w in worlds:
        mine = [r for r in runs if r["world"] == w]
        healthy = [x for r in mine for x in r["healthy_ms"]]
        own = [x for r in mine for x in r["healthy_own_ms"]]
        detection = [x for r in mine for x in r["detection_ms"]]
        rows.append({
            "world": w,
            "healthy_median_ms": statistics.median(healthy),
            "healthy_max_ms": max(healthy),
            "own_median_ms": statistics.median(own),
            "detection_median_ms": statistics.median(detection),
            "detection_max_ms": max(detection),
            "construction_s": statistics.median(r["construction_s"] for r in mine),
            "rss_mb": statistics.median(r["rss_mb"] for r in mine),
            "rss_growth_mb": statistics.median(r["rss_growth_mb"] for r in mine),
            "healthy_bytes": max(r["healthy_bytes"] for r in mine),
            "detection_bytes": max(r["detection_bytes"] for r in mine),
        })
    base = rows[0]
    for row in rows:
        row["healthy_ratio"] = row["healthy_median_ms"] / base["healthy_median_ms"]
        row["own_ratio"] = row["own_median_ms"] / base["own_median_ms"]
        row["growth_vs_first_mb"] = row["rss_growth_mb"] - base["rss_growth_mb"]
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("| W | healthy step: median ms | max ms | ratio vs W={w0} | the sentinel's calls: "
            "median ms (ratio) | one bad rank: median ms "
            "| max ms | construction s | RSS growth MB from the Sentinel on (vs W={w0}) "
            "| process RSS MB | bytes sent per step: healthy / detection |"
            ).format(w0=f"{rows[0]['world']:,}")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['world']:,} | {r['healthy_median_ms']:.2f} | {r['healthy_max_ms']:.2f} | "
            f"{r['healthy_ratio']:.3f} | {r['own_median_ms']:.3f} ({r['own_ratio']:.3f}) | "
            f"{r['detection_median_ms']:.2f} | "
            f"{r['detection_max_ms']:.2f} | {r['construction_s']:.3f} | "
            f"{r['rss_growth_mb']:.1f} ({r['growth_vs_first_mb']:+.1f}) | {r['rss_mb']:.0f} | "
            f"{r['healthy_bytes']} / {r['detection_bytes']:,} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)),
                        help="comma-separated world sizes (the first is the reference)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per world size")
    parser.add_argument("--steps", type=int, default=55, help="healthy steps per process")
    parser.add_argument("--detections", type=int, default=5, help="detections per process")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_world(args.one, args.steps, args.detections)))
        return 0
    worlds = [int(w) for w in args.worlds.split(",")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    runs = []
    for i in range(args.rounds):
        order = worlds[i % len(worlds):] + worlds[: i % len(worlds)]
        for w in order:
            out = subprocess.run(
                [sys.executable, __file__, "--one", str(w), "--steps", str(args.steps),
                 "--detections", str(args.detections)],
                capture_output=True, text=True, env=env, check=False, timeout=600,
            )
            if out.returncode != 0:
                print(out.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"bench/scale.py: world size {w} failed ({out.returncode})")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {i + 1}/{args.rounds}: W={w:,} done", file=sys.stderr, flush=True)
    rows = _summary(runs, worlds)
    print(_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
