"""FSDP2 with a fused AdamW takes the device gate (issue 46): on 2 gloo ranks, a poisoned
step is skipped on the device on every rank, named and decided in ``step()`` as the host gate
does, and the run is bit-identical to the host gate's; a healthy run to plain FSDP2's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_fsdp_gate import every_gate

STEPS = 5


@pytest.mark.timeout(200)
def test_fsdp2_fused_adamw_on_the_device_gate_matches_the_host_gate(tmp_path: Path) -> None:
    outs = values(run_ranks(every_gate, 2, tmp_path, report_dir=str(tmp_path / "r"),
                            steps=STEPS, timeout=180))

    def fields(rec: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in rec.items()
                if k not in ("local_grad_norm", "report_path")}

    for out in outs:
        host, auto = out["host"], out["auto-cuda"]
        assert host["gate"] == "host" and auto["gate"] == "device"
        assert host["error"] is None and auto["error"] is None, (host["error"], auto["error"])
        assert [r["applied"] for r in auto["records"]] == [True, False, True, False, True]
        assert [fields(r) for r in auto["records"]] == [fields(r) for r in host["records"]]
        assert auto["records"][1]["bad_ranks"] == [1]
        assert auto["records"][1]["parameters"] == {1: ["embed.weight", "pos"]}
        assert torch.equal(auto["weights"], host["weights"])
        assert torch.equal(out["auto-cuda-healthy"]["weights"], out["plain"]["weights"])
    assert torch.equal(outs[0]["auto-cuda"]["weights"], outs[1]["auto-cuda"]["weights"])
