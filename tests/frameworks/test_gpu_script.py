"""bench/gpu_frameworks.py, the GPU run of the framework cells, as far as a CPU machine goes: it
says clearly that it needs a GPU, plans every cell of the table, and its checks pass on a real
run of one cell on CPU ranks (``--cpu``: with the CPU patches, as the tests run it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.frameworks import runner

SCRIPT = runner.ROOT / "bench" / "gpu_frameworks.py"
SEAM_CELLS = ("hf-fsdp2", "lightning-deepspeed", "accelerate-fsdp2", "accelerate-fp16")


def _script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=runner.ROOT)


def test_without_a_gpu_it_runs_nothing_and_says_so() -> None:
    proc = _script()
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr and "nothing was run" in proc.stderr


def test_it_plans_every_seam_tested_cell_without_the_cpu_patches() -> None:
    proc = _script("--dry-run")
    assert proc.returncode == 0, proc.stderr
    planned = [line.split(":")[0] for line in proc.stdout.splitlines()]
    for cell in SEAM_CELLS:
        assert any(name.startswith(cell) for name in planned), (cell, planned)
    assert all("--cuda" in line for line in proc.stdout.splitlines())


@pytest.mark.timeout(200)
def test_its_checks_pass_on_a_real_cell_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "frameworks.json"
    proc = _script("--cpu", "--only=accelerate-ddp", f"--json={out}", timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["cells"]["accelerate-ddp"]["pass"], result
