"""FSDP2 with a fused AdamW under each gate (issue 46), run by test_fsdp_device_gate.py."""

from __future__ import annotations

from typing import Any

import nansentinel.step.assembly as sentinel_module
from nansentinel.step.gate import GateChoice
from tests.distributed.workers_fsdp import train_fsdp

#: A backward-only poison (only the check before the reduce-scatter sees it), a NaN loss on
#: the other rank, healthy steps between them.
FAULTS = {(1, 1): "backward", (3, 0): "loss"}


def every_gate(rank: int, world: int, *, report_dir: str, steps: int) -> dict[str, Any]:
    """The same faults under the host gate, the device gate deferred (``gate="device"``),
    and the default on CUDA (``auto``: the device gate decided in ``step()``), forced here on
    the CPU; and plain FSDP2 with the fused AdamW, for the healthy steps' bits."""
    runs: dict[str, Any] = {
        "plain": train_fsdp(rank, world, steps=steps, sentinel=False, fused=True,
                            report_dir=report_dir),
        "host": train_fsdp(rank, world, steps=steps, faults=FAULTS, fused=True, gate="host",
                           report_dir=f"{report_dir}/host"),
    }
    choose = sentinel_module.choose_gate
    sentinel_module.choose_gate = lambda *a, **k: GateChoice(True, False, "as on CUDA")
    try:
        runs["auto-cuda"] = train_fsdp(rank, world, steps=steps, faults=FAULTS, fused=True,
                                       report_dir=f"{report_dir}/auto")
        runs["auto-cuda-healthy"] = train_fsdp(rank, world, steps=steps, fused=True,
                                               report_dir=f"{report_dir}/healthy")
    finally:
        sentinel_module.choose_gate = choose
    return runs
