"""``python -m torchtitan.train`` on CPU ranks: the test's launcher, run by torchrun.

Applies the CPU patches (tests/e2e/torchtitan_cpu.py) first, then runs torchtitan's own
``torchtitan.train`` module with the arguments as given (``--module REGISTRY --config FN ...``).
"""

from __future__ import annotations

import runpy

from tests.e2e import torchtitan_cpu

if __name__ == "__main__":
    torchtitan_cpu.apply()
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
