"""The docs' command blocks that run on CPU, run as written.

Each test runs the blocks whose marker names it (``<!-- ci: tests/e2e/test_doc_commands.py::
TEST -->`` on the line before the block, read by tests/unit/test_docs.py's reader) with bash,
line by line as a user pastes them, in a fresh folder where the placeholders are real:
``train.py`` is the README's three calls around a small DDP model (:data:`TRAIN`, 25 steps on
gloo), and ``/shared/`` is a folder of the test's (the one rewrite made to a block). The
exporters are off (``NANSENTINEL_METRICS_PORT=0``), so that a run beside other tests never
meets a port taken. About 90 s in all (seven ``nansentinel run``/``torchrun`` launches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_docs import BLOCKS, Block, _tests_named

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests/e2e/test_doc_commands.py"

#: The user's ``train.py`` the docs launch: the README's three calls, made whole.
TRAIN = '''
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
sentinel = nansentinel.Sentinel(model, optimizer)
data = torch.Generator().manual_seed(dist.get_rank())
for step in range(int(os.environ.get("TRAIN_STEPS", "25"))):
    batch = {"x": torch.randn(16, 8, generator=data), "y": torch.randn(16, 1, generator=data)}
    sentinel.check_batch(batch)
    loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    sentinel.check_loss(loss)
    loss.backward()
    result = sentinel.step()
    optimizer.zero_grad()
    if dist.get_rank() == 0 and not result.applied:
        print(f"train.py: step {result.step} {result.outcome}, ranks {result.bad_ranks}",
              flush=True)
sentinel.close()
dist.destroy_process_group()
'''


def blocks(test: str) -> list[Block]:
    """The command blocks whose marker names ``test`` of this file, in page order."""
    found = [b for b in BLOCKS if b.lang in ("bash", "console")
             and f"{HERE}::{test}" in (_tests_named(b) or [])]
    assert found, f"no docs block names {HERE}::{test}"
    return found


def commands(block: Block, shared: Path) -> list[str]:
    """A block's commands as a user pastes them: continuation lines joined, comments and
    (in a console block) output left out, ``/shared/`` rewritten to the test's folder."""
    text = block.code.replace("\\\n", " ").replace("/shared/", f"{shared}/")
    lines = text.splitlines()
    if block.lang == "console":
        lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
    return [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def run(folder: Path, line: str) -> subprocess.CompletedProcess[str]:
    """One command line in bash, in ``folder``, as a user's shell with the package installed
    (this interpreter's ``nansentinel`` and ``torchrun`` first on the PATH)."""
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANSENTINEL_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", NANSENTINEL_METRICS_PORT="0",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
                   filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(["bash", "-c", line], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=200, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "shared" / "job").mkdir(parents=True)
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


def _run_blocks(folder: Path, found: list[Block]) -> dict[str, str]:
    """Every command of ``found``; those that read what a run left (``incidents``,
    ``excluded``) after those that launch. Output by command."""
    lines = [ln for b in found for ln in commands(b, folder / "shared")]
    reading = [ln for ln in lines if " incidents" in ln or " excluded" in ln]
    out = {}
    for line in [ln for ln in lines if ln not in reading] + reading:
        done = run(folder, line)
        out[line] = done.stdout + done.stderr
    return out


def test_the_readme_commands_run(folder: Path) -> None:
    out = _run_blocks(folder, blocks("test_the_readme_commands_run"))
    drill = next(v for k, v in out.items() if "NANSENTINEL_INJECT" in k)
    assert "train.py: step 5 skipped, ranks [2]" in drill, drill
    shown = next(v for k, v in out.items() if "incidents show 5" in k)
    assert "rank 2" in shown and "grad" in shown, shown
    listed = next(v for k, v in out.items() if k.startswith("nansentinel incidents "))
    assert "skipped" in listed, listed


def test_the_incident_commands_run(folder: Path) -> None:
    """The page's opening block and its console listing in one folder (one step-5 incident,
    as a reader who ran that block has), the drill specs' block in another."""
    pytest.importorskip("matplotlib")  # show 5 --html draws the curves (nansentinel[report])
    opening, drills, listing = blocks("test_the_incident_commands_run")
    out = _run_blocks(folder, [opening, listing])
    assert (folder / "incident.html").stat().st_size > 0
    listed = [v for k, v in out.items() if k.strip() == "nansentinel incidents"]
    assert listed and all("grad" in v and "skipped" in v for v in listed), listed
    other = folder / "drills"
    other.mkdir()
    (other / "train.py").write_text(TRAIN)
    _run_blocks(other, [drills])
    reports = [json.loads(p.read_text()) for p in (other / "nansentinel_reports").glob(
        "incident-*.json")]
    # grad at 5, loss at 7, then the state drill: rank 1's weight at 4, repaired from rank 0
    assert sorted(r["step"] for r in reports) == [4, 5, 7], sorted(r["step"] for r in reports)
    state = next(r for r in reports if r["step"] == 4)
    assert state["verdict"] == "state" and state["state_action"] == "repaired", state
    assert list(state["poisoned_state"]) == ["1"], state["poisoned_state"]


def test_the_replica_drill_runs(folder: Path) -> None:
    out = _run_blocks(folder, blocks("test_the_replica_drill_runs"))
    text = "\n".join(out.values())
    assert "replica" in text, text[-3000:]
    reports = list((folder / "nansentinel_reports").glob("incident-*.json"))
    assert reports, text[-3000:]


def test_the_launch_commands_run(folder: Path) -> None:
    """launch.md's exclusion commands, on a file holding two hosts' records."""
    from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore

    store = ExclusionStore(folder / "shared" / "job" / "excluded.jsonl")
    for host in ("node3", "node7"):
        store.add(ExclusionRecord(host=host, reason=f"{host} poisoned the grads", step=5))
    out = _run_blocks(folder, blocks("test_the_launch_commands_run"))
    listed = next(v for k, v in out.items() if k.rstrip().endswith("excluded.jsonl"))
    assert "node3" in listed and "node7" in listed, listed
    hostlist = next(v for k, v in out.items() if "--hostlist" in k)
    assert hostlist.strip() == "node7", hostlist  # node3 cleared by the line before it


def test_the_files_commands_run(folder: Path) -> None:
    out = _run_blocks(folder, blocks("test_the_files_commands_run"))
    assert (folder / "monitoring" / "prometheus" / "rules" / "nansentinel.rules.yml").is_file()
    assert (folder / "kubernetes" / "podmonitor.yaml").is_file()
    assert any("monitoring" in v and "runbook.md" in v for v in out.values())
