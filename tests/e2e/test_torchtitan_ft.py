"""torchtitan 0.3.0's own fault-tolerant trainer (``torchtitan/experiments/torchft``) under the
sentinel, run as its users run it: a torchft lighthouse, one ``torchrun`` per replica group
(``--fault_tolerance.enable --fault_tolerance.replica_id G --fault_tolerance.group_size 2``),
FSDP2 over the group's two ranks (``--parallelism.data_parallel_shard_degree 2``), llama3's
debug model, gloo CPU ranks; the harness and CPU patches of test_torchtitan.py.

The registry (workers/torchtitan_registry.py) is ``with_sentinel(llama3_torchft_debugmodel())``
made synchronous and CPU-friendly; replica group 1's rank 1 makes its first block's output NaN
at torchtitan's step 2. With the sentinel: both groups veto that step, every rank of both
names group 1, its rank 1 and that rank's host, only that host is excluded
(``host_strikes=1``), group 1 leaves, and group 0 trains on to the last step without a
restart. Without the sentinel, the NaN reaches the weights of every rank of both groups.
The two arms share the ranks, their start-up and the lighthouse: each group's torchrun trains
first without the sentinel, then with it (torchtitan_train.py's ``TITAN_ARMS``).
"""

from __future__ import annotations

import json
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.test_torchtitan import train
from tests.e2e.torchtitan_cpu import write_assets

pytestmark = pytest.mark.e2e
pytest.importorskip("torchtitan")
pytest.importorskip("torchft")

#: torchtitan steps: 1 healthy, 2 the fault (vetoed), 3 group 0 alone.
STEPS = 3
GROUP = "torchtitan_ft_{}"  # torchtitan's replica id for the lighthouse
CULPRIT = "replica group torchtitan_ft_1 (rank 1, host node1r1)"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_assets(tmp_path_factory.mktemp("torchtitan-ft-assets"))


def _weights(out: str) -> dict[tuple[int, int, int], tuple[bool, float]]:
    """``(group, rank, step) -> (finite, sum)`` from the registry's WEIGHTS lines of ``out``."""
    found = re.findall(r"WEIGHTS \w+ group (\d) rank (\d) step (\d+) finite (\w+) "
                       r"sum (nan|-?inf|-?\d+\.\d+(?:e[-+]?\d+)?)", out)
    return {(int(g), int(r), int(s)): (f == "True", float(v)) for g, r, s, f, v in found}


def _arm(out: str, name: str) -> str:
    """The part of one group's output that one arm wrote (from its ``ARM`` line on)."""
    parts = re.split(r"^ARM (\w+)$", out, flags=re.M)
    return "".join(text for arm, text in zip(parts[1::2], parts[2::2], strict=True)
                   if arm == name)


@pytest.mark.timeout(240)
def test_torchft_trainer_vetoes_on_every_group_names_the_rank_and_the_group_leaves(
    tmp_path: Path, assets: tuple[Path, Path]
) -> None:
    """Both arms in the same two torchruns, one after the other (torchtitan_train.py's
    ``TITAN_ARMS``), on one lighthouse: first torchtitan's trainer alone (2 steps), then
    under the sentinel (3 steps)."""
    from torchft._torchft import LighthouseServer

    excluded = tmp_path / "excluded.jsonl"
    # A group that stopped heartbeating is dropped within 1 s (a live one on a loaded
    # machine is not); the first quorum waits up to 2 s for every group that heartbeats.
    house = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000,
                             heartbeat_timeout_ms=1000)
    env = {"TORCHFT_LIGHTHOUSE": house.address(), "FT_START": str(tmp_path / "start"),
           "FT_RANKS": "4", "TITAN_ARMS": f"ft_bare:2 ft_fault:{STEPS}",
           # torchft's own waits, bounded well inside the test's timeout
           "TORCHFT_TIMEOUT_SEC": "30", "TORCHFT_QUORUM_TIMEOUT_SEC": "30",
           "TORCHFT_CONNECT_TIMEOUT_SEC": "30",
           "NANSENTINEL_HOST_STRIKES": "1", "NANSENTINEL_EXCLUSION_FILE": str(excluded)}
    try:
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(
                train, tmp_path / f"g{g}", assets, 2, "ft_bare", "--fault_tolerance.enable",
                "--fault_tolerance.replica_id", str(g), "--fault_tolerance.group_size", "2",
                "--parallelism.data_parallel_shard_degree", "2", timeout=200,
                env={**env, "REPLICA_GROUP_ID": str(g)}) for g in (0, 1)]
            (g0, _), (g1, reports) = runs[0].result(), runs[1].result()
    finally:
        house.shutdown()
    for g, proc in ((0, g0), (1, g1)):  # kept for a failure's post-mortem
        (tmp_path / f"g{g}.log").write_text(proc.stdout)
    _check_bare(_arm(g0.stdout, "ft_bare"), _arm(g1.stdout, "ft_bare"))
    _check_sentinel(g0, g1, reports, excluded)


def _check_sentinel(g0: subprocess.CompletedProcess[str], g1: subprocess.CompletedProcess[str],
                    reports: Path, excluded: Path) -> None:
    out0, out1 = _arm(g0.stdout, "ft_fault"), _arm(g1.stdout, "ft_fault")
    # Group 0 trained every step, the vetoed one included, and finished.
    assert g0.returncode == 0, out0[-8000:]
    assert out0.count("Training completed") == 2, out0[-8000:]
    # Every rank of both groups vetoed torchft step 1 (torchtitan's step 2) and named
    # group 1's rank 1 on node1r1, struck out.
    for g, out in ((0, out0), (1, out1)):
        for r in (0, 1):
            line = (f"replica group {GROUP.format(g)} (rank {r}, host node{g}r{r}): torchft "
                    f"step 1 not committed on any replica group: {CULPRIT}")
            assert line in out, (g, r, out[-8000:])
    # Named alone: every such line blames group 1's rank 1 on node1r1, and no one else.
    blamed = set(re.findall(r"not committed on any replica group: (.*?)(?:; gradients|$)",
                            out0 + out1, re.M))
    assert blamed == {f"{CULPRIT}: loss, grad, struck out: leaves the quorum"}, blamed
    # Group 1 left: its culprit's rank and its healthy rank raise HostExcludedError naming
    # node1r1 (not node1r0); its torchrun ends with that failure.
    assert g1.returncode != 0, out1[-8000:]
    assert "HostExcludedError: nansentinel: host node1r1 (replica group torchtitan_ft_1, " \
        "rank 1) blamed 1 times" in out1, out1[-8000:]
    assert out1.count("HostExcludedError") >= 2, out1[-8000:]
    assert "Training completed" not in out1
    hosts = [json.loads(line)["host"] for line in excluded.read_text().splitlines()]
    assert hosts == ["node1r1"], hosts
    report = json.loads(next(reports.glob("incident-*.json")).read_text())
    assert report["bad_ranks"] == [1] and report["bad_hosts"] == ["node1r1"], report
    assert report["step"] == 1 and report["outcome"] in ("skipped", "excluded"), report
    # Weights: finite on every rank at every step, unchanged by the vetoed step on group 0,
    # which then trains on alone (step 3 changes them).
    weights = _weights(out0 + out1)
    assert all(finite for finite, _ in weights.values()), weights
    for r in (0, 1):
        assert weights[(0, r, 2)][1] == weights[(0, r, 1)][1], weights
        assert weights[(0, r, 3)][1] != weights[(0, r, 2)][1], weights
    assert not any(s == 3 for g, _, s in weights if g == 1), weights
    logged = [line for line in out0.splitlines() if "step:" in line and "loss:" in line]
    assert sum("step:  3 " in line for line in logged) == 2, logged


def _check_bare(out0: str, out1: str) -> None:
    """Without the sentinel torchft commits step 2 on both groups: every rank's weights,
    finite after step 1, are NaN after step 2."""
    assert out0.count("Training completed") == 2 and out1.count("Training completed") == 2, \
        out0[-4000:] + out1[-4000:]
    weights = _weights(out0 + out1)
    for g in (0, 1):
        for r in (0, 1):
            assert weights[(g, r, 1)][0], (g, r, weights)
            assert not weights[(g, r, 2)][0], f"group {g} rank {r} kept finite weights"
