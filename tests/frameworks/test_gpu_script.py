"""bench/gpu_frameworks.py, the GPU run of the framework cells, as far as a CPU machine goes: it
says clearly that it needs a GPU and plans every cell of the table without the CPU patches; its
checks pass on the real run of the Accelerate DDP cell (test_accelerate.py applies them to the
files that run wrote, as the script would)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType

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


def load() -> ModuleType:
    """The script as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_frameworks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return module
