"""The metrics endpoint under load: 64 concurrent scrapers for 30 s during training.

Scrapers run in another process (as Prometheus does), each scraping once a second — sixty-four
times a production scrape rate of 15 s, times 15. The exporter answers them from its own server
process (see metrics.py), so all the training process pays is one render a second. Training
alternates 3 s windows with and without scrapers, and each loaded window is compared with
the quiet windows on either side of it, so that a shared machine's drift cancels out. Every
scrape must succeed and the median step time must move by < 2% (judged after 30 s, or after up
to 90 s when this noisy VM cannot tell within 30 s).
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

SCRAPERS, SECONDS, WINDOW, ROUNDS, BOUND = 64, 30.0, 3.0, 3, 1.02


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

    def window(loaded: bool) -> float:
        """The median step time of one window, scrapers on or off."""
        (on.set if loaded else on.clear)()
        step()  # the first step of a window straddles the switch
        times = []
        window_end = time.monotonic() + WINDOW
        while time.monotonic() < window_end:
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    # Each loaded window against the quiet windows on either side of it, so that the machine's
    # own drift (another tenant, clock changes) cancels out of the pairs. The bound is judged
    # on the median pair after each round of SECONDS; a round that cannot tell (this VM's
    # noise reaches a few percent per window) adds another, up to ROUNDS: more data can only
    # sharpen a real slowdown, which stays above the bound in every round.
    ratios: list[float] = []
    quiet: list[float] = []
    try:
        for _ in range(ROUNDS):
            before = window(False)
            for _pair in range(int(SECONDS / WINDOW / 2)):
                loaded, after = window(True), window(False)
                ratios.append(loaded / ((before + after) / 2))
                quiet.append(before)
                before = after
            if statistics.median(ratios) < BOUND:
                break
    finally:
        stop.set()
        on.set()
        ok, failed, errors = out.get(timeout=60)
        proc.join(30)
        sentinel.close()
    ratio = statistics.median(ratios)
    print(f"median step {statistics.median(quiet) * 1e3:.2f} ms quiet; with {SCRAPERS} scrapers "
          f"x{ratio:.4f} (median of {len(ratios)} paired windows, "
          f"{min(ratios):.4f}-{max(ratios):.4f}); scrapes ok {ok}, failed {failed}")
    assert failed == 0 and ok > SCRAPERS * WINDOW * len(ratios) * 0.5, (ok, failed, errors)
    assert ratio < BOUND, f"scrapers slowed the median step by {100 * (ratio - 1):.1f}%"
