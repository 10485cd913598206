"""The metrics endpoint under load: 64 concurrent scrapers during training.

Scrapers run in another process (as Prometheus does), each scraping once a second — sixty-four
times a production scrape rate of 15 s, times 15. The exporter answers them from its own server
process (see exporter.py), so all the training process pays is one render a second. Training
alternates 3 s windows with and without scrapers, and each loaded window is compared with
the quiet windows on either side of it, so that a shared machine's drift cancels out.

What is judged, exactly first: no scrape reaches the training process (while the scrapers run
it holds no socket on the metrics port: the server process owns it, and it renders the registry
once a refresh interval whether 0 or 64 scrapers ask), and every scrape succeeds. Then, as
timing: the median paired step moves by < 15% in CPU time (the render thread included) and
< 20% in wall time. The timing bounds are set by what the 2-core CI machine reads, not by what
we would like: the 64 scraper threads and the server process take the second core, so the
training process shares caches and the scheduler with them; one 3 s window reads 0.85-1.2x its
neighbours in both measures, a 2% bound failed CI at x1.027 and a 5% bound at x1.058 (range
0.98-1.14 over 8 pairs). The regression these bounds guard against, scrapes served under the
training process's GIL, slowed the step x1.57 and rendered once per scrape; the render count
catches it whatever the machine's noise.
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
from nansentinel.effects import exporter

pytestmark = pytest.mark.e2e

SCRAPERS, SECONDS, WINDOW, ROUNDS, BOUND, WALL_BOUND = 64, 24.0, 3.0, 2, 1.15, 1.20


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
    tmp_path: Path, free_port: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every render of the registry in this (the training) process, and whether scrapers ran.
    renders: list[bool] = []
    scraping = [False]
    render = exporter.generate_latest

    def counted(registry: CollectorRegistry) -> bytes:
        renders.append(scraping[0])
        return render(registry)

    monkeypatch.setattr(exporter, "generate_latest", counted)
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
        scraping[0] = loaded
        seconds[loaded] += WINDOW
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
    seconds = {True: 0.0, False: 0.0}
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
    # One render a refresh interval, loaded or not (+1 a window for a render in flight at the
    # switch): a render per scrape would be ~64 a second here.
    loaded_renders = sum(renders)
    allowed = seconds[True] / exporter.REFRESH_SECONDS + len(cpu_ratios) + 2
    print(f"renders in the training process: {loaded_renders} in {seconds[True]:.0f} s loaded, "
          f"{len(renders) - loaded_renders} in {seconds[False]:.0f} s quiet")
    assert loaded_renders <= allowed, (
        f"{loaded_renders} renders in {seconds[True]:.0f} s with scrapers: scrapes reach the "
        f"training process")
    assert failed == 0 and ok > SCRAPERS * WINDOW * len(cpu_ratios) * 0.5, (ok, failed, errors)
    assert cpu_ratio < BOUND, (
        f"scrapers cost the training process {100 * (cpu_ratio - 1):.1f}% more CPU a step")
    assert wall_ratio < WALL_BOUND, (
        f"scrapers slowed the median step by {100 * (wall_ratio - 1):.1f}%")
