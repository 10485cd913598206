"""The sentinel's host work at any world size, measured in one process on torch's fake backend.

``dist.init_process_group("fake", rank=0, world_size=W)`` makes this process rank 0 of ``W``:
every collective is a no-op, so what is timed is the sentinel's own host work (and a small
model's), not a network. A healthy step must cost the same at W = 131,072 as at W = 8.

For a detection the fake backend would leave every collective's tensor as this rank sent it,
so the benchmark writes what a real collective would return, and only that (what is simulated
is exactly the reduced values; everything the sentinel does with them is real and timed):

- the exchange's totals gain the other named ranks' contributions (their packed rows, summed);
- ``Peers.flagged``'s byte per rank comes back with a 1 at every named rank;
- ``Peers.gather_from``'s two sums come back with the other speakers' lengths and JSON bytes
  at their offsets (their rows in the detection, their details in the report's gather), so
  the real gather parses what 131,072 ranks would send.

Three detections: one bad rank (rank W-1's loss), ``min(64, W/2)`` named ranks (the last ones,
each a NaN loss, one host healthy at least), and every rank named (a global NaN: every rank's
loss, with DDP's group in every record's forward collectives, as under a forward all-reduce).
Rank 0 then runs the whole detection path (naming, weighing, the max-reduce, the decision, the
report written to disk). Writing the simulated values in costs a few memory copies; that time
is measured and subtracted.

Each world size runs in a fresh process (so that memory is its own), in rounds whose order
rotates; a step's figures are medians over every round. Memory is the growth of the process's
RSS from just before the Sentinel is built to the end of the run: the process's own RSS also
grows with W before that (torch's DDP on the fake backend: about +70 MB at 131,072), which is
not the sentinel's. Beside each detection's wall time, its CPU time in the training thread
(``time.thread_time``): on a shared box other processes stretch the first, hardly the second.

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
#: The detections timed: one bad rank, min(64, W/2) named, every rank named.
DETECTIONS = ("one", "some", "every")


def one_world(world: int, steps: int, detections: int,
              kinds: tuple[str, ...] = DETECTIONS) -> dict[str, Any]:
    """Rank 0 of ``world`` on the fake backend: construction, healthy steps, detections (of
    ``kinds``: see :data:`DETECTIONS`)."""
    import psutil
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import nansentinel
    from nansentinel.wire import exchange
    from nansentinel.wire.schema import R, T, pack

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

    # A detection: the values the collectives would return (see the module docstring).
    wire = Wire(world)
    real_launch = exchange.HealthExchange.launch

    def launch(self: Any, step: int, vector: torch.Tensor) -> None:
        real_launch(self, step, vector)
        if wire.totals is not None and self._vector is not None:
            t = time.perf_counter()
            self._vector[:T.size] += wire.totals
            wire.simulated += time.perf_counter() - t

    def reducing(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = counting(tensor, *args, **kwargs)
        wire.arrive(tensor)
        return out

    exchange.HealthExchange.launch = launch  # type: ignore[method-assign]
    dist.all_reduce = reducing  # type: ignore[assignment]

    def poisoned_totals(ranks: list[int]) -> torch.Tensor:
        """The summed totals of ``ranks`` other than 0, each with a NaN loss."""
        row = torch.zeros(R.size)
        row[[R.batch_norm, R.loss_value, R.grad_norm_value, R.has_loss, R.has_grad]] = torch.tensor(
            [1.0, float("nan"), 1.0, 1.0, 1.0])
        others = [r for r in ranks if r != 0]
        one = pack(row, torch.full((5,), float("inf")), 1, amp=False)[:T.size]
        total = one * len(others)
        total[T.flagged_rank] = float(sum(others))
        return total

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

    def one_step(nan_loss: bool = False) -> tuple[float, int, str]:
        sent[0] = 0
        own[0] = 0.0
        wire.simulated = 0.0
        cpu0 = time.thread_time()
        t0 = time.perf_counter()
        data = {"x": torch.randn(32, 64), "y": torch.randint(0, 10, (32,))}
        batch = timed(sentinel.check_batch, data)
        loss = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        if nan_loss:
            loss = loss * float("nan")
        timed(sentinel.check_loss, loss)
        loss.backward()  # the comm hook's share of the sentinel is in the step, not in own
        result = timed(sentinel.step)  # with the (small) SGD step it launches
        opt.zero_grad(set_to_none=True)
        sentinel_ms.append(own[0] * 1e3)
        cpu_ms.append((time.thread_time() - cpu0 - wire.simulated) * 1e3)
        return time.perf_counter() - t0 - wire.simulated, sent[0] - grad_bytes, result.outcome

    sentinel_ms: list[float] = []
    cpu_ms: list[float] = []  # the step's CPU time in this thread: what a busy box inflates least

    for _ in range(5):
        one_step()
    sentinel_ms.clear()
    healthy = [one_step() for _ in range(steps)]
    healthy_own = list(sentinel_ms)
    assert all(o == "applied" for _, _, o in healthy), healthy
    some = min(64, world // 2)
    scenarios = {name: ranks for name, ranks in (
        ("one", [world - 1]), ("some", list(range(world - some, world))),
        ("every", list(range(world)))) if name in kinds}
    detected: dict[str, list[tuple[float, int]]] = {}
    detected_cpu: dict[str, list[float]] = {}
    for name, ranks in scenarios.items():
        totals = poisoned_totals(ranks)
        detected[name] = []
        for _ in range(detections):
            wire.expect(ranks, totals)
            seconds, nbytes, outcome = one_step(nan_loss=0 in ranks)
            wire.expect(None, None)
            assert outcome == "skipped", outcome
            assert wire.unused() == 0, f"{name}: {wire.unused()} simulated collectives unused"
            detected[name].append((seconds, nbytes))
            detected_cpu.setdefault(name, []).append(cpu_ms[-1])
            for _ in range(3):  # healthy steps between detections
                one_step()
    rss_after = proc.memory_info().rss
    sentinel.close()
    return {
        "world": world,
        "healthy_ms": [s * 1e3 for s, _, _ in healthy],
        "healthy_own_ms": healthy_own,
        "healthy_bytes": max(b for _, b, _ in healthy),
        **{f"{name}_ms": [s * 1e3 for s, _ in runs] for name, runs in detected.items()},
        **{f"{name}_cpu_ms": runs for name, runs in detected_cpu.items()},
        "named": {name: len(ranks) for name, ranks in scenarios.items()},
        **{f"{name}_bytes": max(b for _, b in runs) for name, runs in detected.items()},
        "construction_s": construction,
        "rss_mb": rss_after / 2**20,
        "rss_growth_mb": (rss_after - rss_before) / 2**20,
    }


class Wire:
    """What the collectives of one detection return, written into the tensors the fake
    backend hands back unchanged: the totals, ``Peers.flagged``'s bytes, and the two sums of
    each ``Peers.gather_from`` (the detection's rows, then the report's details). A sum with
    this rank's own contribution is exact, so each is an addition or a copy beside it."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.totals: Any = None
        self.simulated = 0.0
        self._plan: list[tuple[str, Any]] = []

    def expect(self, ranks: list[int] | None, totals: Any) -> None:
        """The next step's detection names ``ranks`` (None: a healthy step)."""
        self.totals = totals
        self._plan = []
        if ranks is None:
            return
        named = set(ranks)
        if len(ranks) > 1:
            self._plan.append(("flagged", ranks))
        speakers = sorted({*ranks, *([] if len(ranks) == self.world else [_candidate(ranks,
                                                                                    self.world)])})
        self._plan.append(("sizes", [_encoded(r, r in named, True)
                                     for r in speakers if r != 0]))
        self._plan.append(("bytes", None))
        reported = sorted({*ranks[:64], *([] if len(ranks) == self.world else [_candidate(
            ranks, self.world)])})
        self._plan.append(("sizes", [_encoded(r, r in named, False)
                                     for r in reported if r != 0]))
        self._plan.append(("bytes", None))
        self._speakers_of = [speakers, reported]

    def unused(self) -> int:
        return len(self._plan)

    def arrive(self, tensor: Any) -> None:
        """``tensor`` after its (no-op) all-reduce: add what the other ranks would have."""
        import torch

        if not self._plan:
            return
        t = time.perf_counter()
        kind, data = self._plan[0]
        if kind == "flagged" and tensor.dtype == torch.uint8 and tensor.numel() == self.world:
            tensor[data] = 1
        elif kind == "sizes" and tensor.dtype == torch.int64:
            blobs = data
            mine = tensor.numel() - len(blobs)  # 1 when rank 0 speaks (it is the first)
            tensor[mine:] = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
            self._plan[1] = ("bytes", (int(tensor[0]) if mine else 0, b"".join(blobs)))
        elif kind == "bytes" and tensor.dtype == torch.uint8 and data is not None:
            start, blob = data
            tensor[start:] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        else:
            self.simulated += time.perf_counter() - t
            return
        self._plan.pop(0)
        self.simulated += time.perf_counter() - t


def _candidate(ranks: list[int], world: int) -> int:
    from nansentinel.rare.detection import replay_candidate

    candidate = replay_candidate(ranks, world)
    assert candidate is not None
    return candidate


def _encoded(rank: int, bad: bool, rows: bool) -> bytes:
    """What a named rank sends: its row (the detection), or its incident detail."""
    if rows:  # the named row itself, so that the bench follows the wire's layout
        from nansentinel.result import RankIdentity
        from nansentinel.wire.view import RankHealth

        identity = RankIdentity(rank, rank % 8, 0, f"node{rank // 8:05d}", f"cuda:{rank % 8}",
                                str(rank % 8), f"GPU-{rank:08x}")
        row = RankHealth(identity, ("loss",) if bad else (), False,
                         float("nan") if bad else 2.5, 1.0, forward_groups=("0",) if bad else ())
        return json.dumps(row.to_wire()).encode()
    record: dict[str, Any]
    if bad:
        record = {"batch_path": f"/reports/incident-step-rank{rank}-batch.pt",
                  "history": {"steps": list(range(200)), "loss": [2.5] * 200,
                              "grad_norm": [1.0] * 200}}
    else:
        record = {}
    return json.dumps(record).encode()


def _summary(runs: list[dict[str, Any]], worlds: list[int]) -> list[dict[str, Any]]:
    rows = []
    for w in worlds:
        mine = [r for r in runs if r["world"] == w]
        healthy = [x for r in mine for x in r["healthy_ms"]]
        own = [x for r in mine for x in r["healthy_own_ms"]]
        row: dict[str, Any] = {
            "world": w,
            "healthy_median_ms": statistics.median(healthy),
            "healthy_max_ms": max(healthy),
            "own_median_ms": statistics.median(own),
            "construction_s": statistics.median(r["construction_s"] for r in mine),
            "rss_mb": statistics.median(r["rss_mb"] for r in mine),
            "rss_growth_mb": statistics.median(r["rss_growth_mb"] for r in mine),
            "healthy_bytes": max(r["healthy_bytes"] for r in mine),
            "named": mine[0]["named"],
        }
        for name in mine[0]["named"]:
            row[f"{name}_bytes"] = max(r[f"{name}_bytes"] for r in mine)
            times = [x for r in mine for x in r[f"{name}_ms"]]
            row[f"{name}_median_ms"] = statistics.median(times)
            row[f"{name}_max_ms"] = max(times)
            row[f"{name}_cpu_ms"] = statistics.median(x for r in mine for x in r[f"{name}_cpu_ms"])
        if "one" in row["named"]:  # the names of the figures from before the other detections
            row["detection_median_ms"], row["detection_max_ms"] = (row["one_median_ms"],
                                                                   row["one_max_ms"])
            row["detection_bytes"] = row["one_bytes"]
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["healthy_ratio"] = row["healthy_median_ms"] / base["healthy_median_ms"]
        row["own_ratio"] = row["own_median_ms"] / base["own_median_ms"]
        row["growth_vs_first_mb"] = row["rss_growth_mb"] - base["rss_growth_mb"]
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    w0 = f"{rows[0]['world']:,}"
    head = (f"| W | healthy step: median ms | max ms | ratio vs W={w0} | the sentinel's calls: "
            "median ms (ratio) | construction s | RSS growth MB from the Sentinel on "
            f"(vs W={w0}) | process RSS MB | bytes sent per step: healthy |")
    lines = [head, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['world']:,} | {r['healthy_median_ms']:.2f} | {r['healthy_max_ms']:.2f} | "
            f"{r['healthy_ratio']:.3f} | {r['own_median_ms']:.3f} ({r['own_ratio']:.3f}) | "
            f"{r['construction_s']:.3f} | "
            f"{r['rss_growth_mb']:.1f} ({r['growth_vs_first_mb']:+.1f}) | {r['rss_mb']:.0f} | "
            f"{r['healthy_bytes']} |"
        )
    kinds = [n for n in DETECTIONS if n in rows[0]["named"]]
    words = {"one": "one bad rank", "some": "some named", "every": "every rank named"}
    lines += ["", "| W | " + " | ".join(
        f"{words[n]}{' (named)' if n == 'some' else ''}: median ms (max) / CPU ms"
        for n in kinds) + " | bytes sent: " + " / ".join(words[n] for n in kinds) + " |",
        "|---:|" + "---:|" * (len(kinds) + 1)]
    for r in rows:
        cells = [f"{r[f'{n}_median_ms']:.1f} ({r[f'{n}_max_ms']:.1f}) / {r[f'{n}_cpu_ms']:.1f}"
                 + (f" ({r['named']['some']})" if n == "some" else "") for n in kinds]
        lines.append(f"| {r['world']:,} | " + " | ".join(cells) + " | "
                     + " / ".join(f"{r[f'{n}_bytes']:,}" for n in kinds) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)),
                        help="comma-separated world sizes (the first is the reference)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per world size")
    parser.add_argument("--steps", type=int, default=55, help="healthy steps per process")
    parser.add_argument("--detections", type=int, default=5, help="detections per process")
    parser.add_argument("--detect", default=",".join(DETECTIONS),
                        help="the detections to time: one (rank W-1), some (min(64, W/2) "
                             "named), every (every rank named: a global NaN)")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_world(args.one, args.steps, args.detections,
                                   tuple(args.detect.split(",")))))
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
                 "--detections", str(args.detections), "--detect", args.detect],
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
