"""A disk that fills or turns read-only, across namespace hosts (issue 58, items 3, 4, 6).

Two hosts (tests/e2e/netns.py), one rank each, under ``nansentinel run``. Each case states
the exit code of every host's launcher and that nothing is left running in any host's
namespace once the launchers have exited (checked before the harness kills anything):

- the report disk (reports, run directory, verdicts) is a full 64 KB tmpfs: a job that trains
  every step exits 0 on both hosts, each file it could not write costs one line naming it;
  a job the sentinel aborts still exits 3 on both, its verdicts delivered by socket;
- the exclusion file turns read-only mid-run: the exclusion of the bad host is one named
  error on every rank, its launcher runs ``--on-exclude`` and exits 4, the
  other exits 3 (no restart left), and rank 0 logs the record it could not write.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nansentinel.common.exitcodes import EXIT_HOST_EXCLUDED, EXIT_NONFINITE_ABORT, EXIT_OK
from tests.unit.test_full_disk import small_tmpfs

from .netns import NetnsCluster, unavailable_reason

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "disk_worker.py"
HOOK = f"{sys.executable} {Path(__file__).resolve().parent / 'workers' / 'hook_recorder.py'}"


@pytest.fixture(autouse=True)
def _hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    for key in [k for k in os.environ if k.startswith("NANSENTINEL_")]:
        monkeypatch.delenv(key)


def fill(disk: Path) -> None:
    with contextlib.suppress(OSError), open(disk / "filler", "wb") as fh:
        while True:
            fh.write(b"\0" * 4096)
            fh.flush()


def read_only(disk: Path) -> None:
    """Turn the filesystem read-only (its superblock: every mount namespace sees it)."""
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, timeout=10)


def run(cluster: NetnsCluster, options: list[str], out: Path, env: dict[str, str],
        steps: int = 10, pause_at: int | None = None, timeout: float = 60,
        ) -> tuple[list[int | None], dict[str, str]]:
    """One launcher per host (rendezvous on the first); the exit codes and the logs. Asserts
    that no process is left in any host's namespace once the launchers have exited."""
    port = random.randrange(20000, 60000)
    argv = [sys.executable, "-m", "nansentinel", "run", "--metrics-port=0", *options,
            "--nnodes=2", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-id=disk",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={cluster.hosts[0].ip}:{port}",
            "--monitor-interval=0.5", str(WORKER), str(out), f"--steps={steps}",
            *([f"--pause-at={pause_at}"] if pause_at is not None else [])]
    env = {"PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "eth0", **env}
    procs = [cluster.start(h, argv, env=env) for h in cluster.hosts]
    codes = cluster.wait(procs, timeout=timeout)
    logs = {h.name: cluster.log(h.name) for h in cluster.hosts}
    if None not in codes:
        left = {h.name: leftovers(h.netns) for h in cluster.hosts}
        assert left == {h.name: [] for h in cluster.hosts}, left
    return codes, logs


def leftovers(netns: str) -> list[str]:
    """Processes still in ``netns`` (their command lines), after a short grace for exits
    already under way."""
    deadline = time.monotonic() + 5
    while True:
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                              timeout=10, check=False).stdout.split()
        if not pids or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["skip", "abort"], ids=["finishes", "aborts"])
def test_a_full_report_disk_costs_lines_not_the_job(tmp_path: Path, policy: str) -> None:
    """A NaN on node2 at step 2: skipped (the job trains every step) or aborted on."""
    out = tmp_path / "out"
    out.mkdir()
    with small_tmpfs(tmp_path / "disk", "64k") as disk, \
            NetnsCluster(2, tmp_path / "cluster") as cluster:
        (disk / "reports").mkdir()
        fill(disk)
        env = {"NANSENTINEL_INJECT": "kind=loss,host=node2,steps=2-2",
               "NANSENTINEL_POLICY": policy}
        codes, logs = run(cluster, [f"--report-dir={disk}/reports"], out, env)
    every = "\n".join(logs.values())
    if policy == "skip":
        assert codes == [EXIT_OK, EXIT_OK], logs
        assert sorted(p.name for p in out.iterdir()) == ["done-node1-rank0", "done-node2-rank1"]
        # Rank 0 writes the report, node2's rank its batch: one line each, naming the file.
        assert "could not write the incident report of step 2 to " \
            f"{disk}/reports/incident-disk-step00000002.json" in logs["node1"], logs
        assert "could not write the incident batch of step 2 to " \
            f"{disk}/reports/incident-disk-step00000002-rank1-batch.pt" in logs["node2"], logs
        for name, rank in (("node1", 0), ("node2", 1)):
            assert f"rank {rank} could not write its closed verdict" in logs[name], logs[name]
        assert "Traceback" not in every, logs
        return
    # The abort reached both launchers by socket: exit 3, the verdict in the summary.
    assert codes == [EXIT_NONFINITE_ABORT, EXIT_NONFINITE_ABORT], logs
    for name, rank in (("node1", 0), ("node2", 1)):
        assert f"rank {rank} could not write its aborted verdict" in logs[name]
        assert "its launcher got it by socket" in logs[name]
        assert "Root cause: the sentinel aborted the run" in logs[name]
        assert "verdict: aborted at step 2" in logs[name], logs[name]
    assert not list(out.glob("done-*"))


@pytest.mark.timeout(120)
def test_an_exclusion_file_turned_read_only_is_one_named_error_and_the_hosts_agree(
    tmp_path: Path,
) -> None:
    """node2 poisons steps 5-7; three strikes exclude it at step 7. The exclusion file's
    filesystem turns read-only at step 4, after the launchers read the file and created its
    lock file. (Read-only from the start takes the same path from rank 0's failed append on:
    tests/unit/test_full_disk.py covers both at the store and the stop path.)"""
    out = tmp_path / "out"
    out.mkdir()
    with small_tmpfs(tmp_path / "shared", "1m") as shared, \
            NetnsCluster(2, tmp_path / "cluster") as cluster:
        excl = shared / "excluded.jsonl"
        excl.write_text("")
        options = [f"--exclusion-file={excl}", f"--report-dir={tmp_path}/reports",
                   "--host-strikes=3", f"--on-exclude={HOOK} '{out}/hook-{{host}}.txt' "
                   "{host} {reason}"]
        env = {"NANSENTINEL_INJECT": "kind=grad,host=node2,steps=5-7"}

        def turn_read_only() -> None:
            deadline = time.monotonic() + 40
            while not (out / "paused").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            read_only(shared)
            (out / "go").touch()

        threading.Thread(target=turn_read_only, daemon=True).start()
        codes, logs = run(cluster, options, out, env, pause_at=4)
        assert excl.read_text() == ""  # nothing was written
    assert codes == [EXIT_NONFINITE_ABORT, EXIT_HOST_EXCLUDED], logs
    named = (f"The exclusion of host node2 could not be recorded: cannot write the exclusion "
             f"file {excl}: could not ")
    for name in ("node1", "node2"):
        assert named in logs[name], logs[name]
        assert "Read-only file system" in logs[name]
        assert "HostExcludedError" in logs[name] and "OSError" not in logs[name], logs[name]
    # The hook ran on the bad host, and only there.
    assert sorted(p.name for p in out.glob("hook-*")) == ["hook-node2.txt"]
    assert (out / "hook-node2.txt").read_text().startswith("node2|")
    # Rank 0 logged the record it could not write, as the line the file would have held.
    line = next(s for s in logs["node1"].splitlines() if "the record, to append to" in s)
    record = json.loads(line.split(" once it is writable: ", 1)[1])
    assert record["host"] == "node2" and record["step"] == 7 and record["job_id"] == "disk"
