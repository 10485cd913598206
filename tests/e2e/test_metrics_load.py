"""The metrics endpoint under load: 64 concurrent scrapers during training.

Scrapers run in another process (as Prometheus does), each scraping once a second — sixty-four
times a production scrape rate of 15 s, times 15. The exporter answers them from its own server
process (see metrics.py), so all the training process pays is one render a second. Training
alternates 3 s windows with and without scrapers, and each loaded window is compared with
the quiet windows on either side of it, so that a shared machine's drift cancels out.

What is judged: no scrape reaches the training process (while the scrapers run it holds no
socket on the metrics port: the server process owns it), every scrape succeeds, and the median
paired step moves by < 5% in CPU time (the render thread included) and < 10% in wall time. On
the 2-core CI machine one 3 s window reads 0.85-1.2x its neighbours in both measures (the
machine's own noise: the scrape load is the same in every loaded window), so a few dozen
seconds cannot resolve 2%, and a 2% bound failed CI at x1.027; the regression these bounds
guard against, scrapes served under the training process's GIL, slowed the step x1.57.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
from prometheus_client import CollectorRegistry

import nansentinel

pytestmark = pytest.mark.e2e

SCRAPERS, SECONDS, WINDOW, ROUNDS, BOUND, WALL_BOUND = 64, 24.0, 3.0, 2, 1.05, 1.10


def _scrape(url: str, on: mp.Event, stop: mp.Event, ready: mp.Event,  # type: ignore[type-arg]
            out: mp.Queue) -> None:
    ok = failed = 0
    errors: list[str] = []

    def scraper() -> None:
        nonlocal ok, failed
        while not stop.is_set():
            if not on.wait(0.1):
                continue
            started = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=10) as resp:
                    body = resp.read()
                if resp.status == 200 and b"nansentinel_steps_total" in body:
                    ok += 1
                else:
                    failed += 1
            except Exception as exc:  # counted and reported by the test
                failed += 1
                errors.append(repr(exc))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

    threads = [threading.Thread(target=scraper) for _ in range(SCRAPERS)]
    for t in threads:
        t.start()
    ready.set()
    for t in threads:
        t.join()
    out.put((ok, failed, errors[:5]))


@pytest.mark.timeout(240)
def test_64_scrapers_do_not_slow_training_and_all_succeed(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    port = free_port()
    sentinel = nansentinel.Sentinel(model, opt, report_dir=str(tmp_path), env={},
                                    metrics_port=port, metrics_addr="127.0.0.1",
                                    registry=CollectorRegistry())
    ctx = mp.get_context("spawn")
    on, stop, ready, out = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_scrape,
                       args=(f"http://127.0.0.1:{port}/metrics", on, stop, ready, out))
    proc.start()
    assert ready.wait(90), "the scraper process did not start"
    x = torch.randn(64, 256)

    def step() -> None:
        batch = sentinel.check_batch(x)
        loss = model(batch).pow(2).mean()
        sentinel.check_loss(loss)
        loss.backward()
        sentinel.step()
        opt.zero_grad(set_to_none=True)

    def window(loaded: bool) -> tuple[float, float]:
        """One window, scrapers on or off: the median step's CPU time in this process (every
        thread: the render thread's share included) and its wall time."""
        (on.set if loaded else on.clear)()
        step()  # the first step of a window straddles the switch
        cpu, wall = [], []
        window_end = time.monotonic() + WINDOW
        while time.monotonic() < window_end:
            started, cpu_started = time.perf_counter(), time.process_time()
            step()
            cpu.append(time.process_time() - cpu_started)
            wall.append(time.perf_counter() - started)
        return statistics.median(cpu), statistics.median(wall)

    def paired(loaded: float, before: float, after: float) -> float:
        return loaded / ((before + after) / 2)

    # Each loaded window against the quiet windows on either side of it, so that the machine's
    # own drift (another tenant, clock changes) cancels out of the pairs. The bounds are judged
    # on the median pair after each round of SECONDS; a round that cannot tell adds another,
    # up to ROUNDS: more data can only sharpen a real slowdown.
    cpu_ratios: list[float] = []
    wall_ratios: list[float] = []
    quiet: list[float] = []
    try:
        for _ in range(ROUNDS):
            before = window(False)
            for _pair in range(int(SECONDS / WINDOW / 2)):
                loaded, after = window(True), window(False)
                cpu_ratios.append(paired(loaded[0], before[0], after[0]))
                wall_ratios.append(paired(loaded[1], before[1], after[1]))
                quiet.append(before[1])
                before = after
            if (statistics.median(cpu_ratios) < BOUND
                    and statistics.median(wall_ratios) < WALL_BOUND):
                break
        on.set()
        time.sleep(1.5)  # every scraper has connected at least once since
        ours = [c for c in psutil.Process().net_connections(kind="tcp")
                if port in (c.laddr.port if c.laddr else None, c.raddr.port if c.raddr else None)]
    finally:
        stop.set()
        on.set()
        ok, failed, errors = out.get(timeout=60)
        proc.join(30)
        sentinel.close()
    cpu_ratio, wall_ratio = statistics.median(cpu_ratios), statistics.median(wall_ratios)
    print(f"median step {statistics.median(quiet) * 1e3:.2f} ms quiet; with {SCRAPERS} scrapers "
          f"CPU x{cpu_ratio:.4f} ({min(cpu_ratios):.4f}-{max(cpu_ratios):.4f}), wall "
          f"x{wall_ratio:.4f} ({min(wall_ratios):.4f}-{max(wall_ratios):.4f}), median of "
          f"{len(cpu_ratios)} paired windows; scrapes ok {ok}, failed {failed}")
    assert not ours, f"the training process holds sockets of the metrics port: {ours}"
    assert failed == 0 and ok > SCRAPERS * WINDOW * len(cpu_ratios) * 0.5, (ok, failed, errors)
    assert cpu_ratio < BOUND, (
        f"scrapers cost the training process {100 * (cpu_ratio - 1):.1f}% more CPU a step")
    assert wall_ratio < WALL_BOUND, (
        f"scrapers slowed the median step by {100 * (wall_ratio - 1):.1f}%")
