"""The metrics endpoint under load: 64 concurrent scrapers for 30 s during training.

Scrapers run in another process (as Prometheus does), each scraping once a second — sixty-four
times a production scrape rate of 15 s, times 15. The exporter answers them from its own server
process (see metrics.py), so all the training process pays is one render a second. Training
alternates 3 s windows with and without scrapers, so that the comparison pairs neighbouring
windows and a shared machine's drift cancels out. Every scrape must succeed and the median step
time must move by < 2%.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

import nansentinel

pytestmark = pytest.mark.e2e

SCRAPERS, SECONDS, WINDOW = 64, 30.0, 3.0


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


@pytest.mark.timeout(180)
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
    times: dict[bool, list[float]] = {True: [], False: []}
    x = torch.randn(64, 256)
    try:
        end = time.monotonic() + SECONDS
        window = 0
        while time.monotonic() < end:
            loaded = window % 2 == 1
            (on.set if loaded else on.clear)()
            window_end = time.monotonic() + WINDOW
            first = True
            while time.monotonic() < window_end:
                started = time.perf_counter()
                batch = sentinel.check_batch(x)
                loss = model(batch).pow(2).mean()
                sentinel.check_loss(loss)
                loss.backward()
                sentinel.step()
                opt.zero_grad(set_to_none=True)
                if not first:  # the first step of a window straddles the switch
                    times[loaded].append(time.perf_counter() - started)
                first = False
            window += 1
    finally:
        stop.set()
        on.set()
        ok, failed, errors = out.get(timeout=60)
        proc.join(30)
        sentinel.close()
    quiet, busy = statistics.median(times[False]), statistics.median(times[True])
    ratio = busy / quiet
    print(f"median step {quiet * 1e3:.2f} ms quiet, {busy * 1e3:.2f} ms with {SCRAPERS} "
          f"scrapers: x{ratio:.4f}; scrapes ok {ok}, failed {failed}")
    assert failed == 0 and ok > SCRAPERS * SECONDS / 2 * 0.5, (ok, failed, errors)
    assert ratio < 1.02, f"scrapers slowed the median step by {100 * (ratio - 1):.1f}%"
