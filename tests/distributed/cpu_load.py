"""Bounded CPU load for the stall loops: one busy process per core (or N) for SECONDS.

Usage: python3 tests/distributed/cpu_load.py SECONDS [N]
"""

import multiprocessing as mp
import os
import sys
import time


def burn(until: float) -> None:
    x = 0
    while time.monotonic() < until:
        for i in range(100_000):
            x += i * i


if __name__ == "__main__":
    seconds = float(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else os.cpu_count() or 1
    end = time.monotonic() + seconds
    procs = [mp.Process(target=burn, args=(end,)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
