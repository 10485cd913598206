"""nansentinel/files/slurm/ on a real Slurm 22.05: three namespace hosts, slurmctld, munge
(e2e/slurm.py).

The shipped batch script is submitted as a user would, with the overrides a CPU cluster needs
(``--gpus-per-node=0 --cpus-per-task=1``, ``NPROC_PER_NODE=2``), and settings that only make it
quicker (``RDZV_CONF=join_timeout=60,last_call_timeout=2``, ``METRICS_PORT=0``, a 0.5 s
monitor interval); the training script is the real Sentinel under DDP
(workers/sentinel_worker.py).
One cluster serves the whole module, and the tests run in order on it: the poisoned first
node (the batch host, which runs the store) is drained and leaves while the job completes on
the other two; with node3 excluded, the next jobs keep off it until it is cleared and resumed;
then the Epilog drains for a job user who cannot.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore

from .slurm import SlurmCluster, unavailable_reason

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "nansentinel" / "files" / "slurm" / "nansentinel.sbatch"
DRAIN = REPO / "nansentinel" / "files" / "slurm" / "nansentinel-drain"
WORKER = Path(__file__).resolve().parent / "workers" / "sentinel_worker.py"
#: What a CPU cluster needs on top of the script's directives; nothing else is overridden.
CPU_OVERRIDES = ["--gpus-per-node=0", "--cpus-per-task=1"]
#: Seconds a training job of these tests may take on a loaded 2-core machine.
JOB_TIMEOUT = 150


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"a Slurm cluster needs: {reason}")
    # Outside pytest's 0700 tmp tree: a job of user nobody must reach its folder.
    work = Path(tempfile.mkdtemp(prefix="nansentinel-slurm-"))
    try:
        work.chmod(0o755)
        (work / "shared").mkdir(mode=0o755)
        epilog = work / "epilog"
        epilog.write_text(
            "#!/bin/sh\n"
            f"exec {sys.executable} -I {DRAIN} --exclusion-file "
            f"'{work}/shared/{{user}}/excluded.jsonl'\n")
        epilog.chmod(0o755)
        with SlurmCluster(work / "cluster", epilog=epilog) as cluster:
            yield cluster
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _job_env(slurm: SlurmCluster, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANSENTINEL_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="eth0", NPROC_PER_NODE="2",
               SHARED=str(_shared(slurm)), METRICS_PORT="0", PET_MONITOR_INTERVAL="0.5",
               RDZV_CONF="join_timeout=60,last_call_timeout=2", **extra)
    return env


def _shared(slurm: SlurmCluster) -> Path:
    return slurm.workdir.parent / "shared" / "root"


def _submit(slurm: SlurmCluster, out: Path, nodes: int, full_world: int,
            inject: str | None = None, steps: int = 9, options: tuple[str, ...] = (),
            script: tuple[str, ...] | None = None) -> str:
    """Submit the shipped script on ``nodes`` nodes; returns the job id. ``script``: another
    training script and its arguments than the Sentinel worker's."""
    out.mkdir(parents=True)
    extra = {"NANSENTINEL_INJECT": inject} if inject else {}
    train = script or (str(WORKER), str(out), f"--steps={steps}", f"--full-world={full_world}")
    return slurm.sbatch([*CPU_OVERRIDES, f"--nodes={nodes}", f"--output={out}/job.out", *options,
                         str(SBATCH), *train],
                        env=_job_env(slurm, **extra))


def _train(slurm: SlurmCluster, out: Path, nodes: int, full_world: int,
           inject: str | None = None, steps: int = 9) -> tuple[dict[str, str], str]:
    """Run the shipped script to its end; returns the final job record and log."""
    job = _submit(slurm, out, nodes, full_world, inject, steps)
    info = slurm.wait_job(job, JOB_TIMEOUT)
    log = (out / "job.out").read_text(errors="replace")
    return info, log


def _receipts(out: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("done-*.json"))]


def _excluded(slurm: SlurmCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nansentinel", "excluded",
         f"--exclusion-file={_shared(slurm) / 'excluded.jsonl'}", *args],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=60, check=True)


def test_a_poisoned_first_node_is_drained_and_the_job_completes(slurm: SlurmCluster,
                                                                tmp_path: Path) -> None:
    """node1 runs the batch script and the rendezvous store (its own process). Its ranks get
    non-finite gradients at steps 5-7: three strikes exclude it at step 7; its launcher
    drains it (the job runs as root, an operator) and exits 4, and leaves; node2 and node3
    resume from the checkpoint and train all 9 steps; the job ends COMPLETED, exit 0."""
    info, log = _train(slurm, tmp_path / "out", 3, 6, "kind=grad,host=node1,steps=5-7")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    assert "node1 excluded by the sentinel and left the job (exit 4); the job completed on " \
           "node2 node3: exit 0" in log, log[-4000:]
    done = _receipts(tmp_path / "out")
    assert sorted((d["hostname"], d["rank"]) for d in done) == [
        ("node2", 0), ("node2", 1), ("node3", 2), ("node3", 3)], log[-4000:]
    assert all(d["world_size"] == 4 and d["start"] == 6 for d in done), done  # finite weights
    assert "nansentinel-drain: drained node1" in log  # the job's own hook, not the epilog
    reason = slurm.drain_reasons()
    assert set(reason) == {"node1"}
    excl = _shared(slurm) / "excluded.jsonl"
    assert reason["node1"] == (
        f"nansentinel excluded node1 at step 7 (job {info['JobId']}, ranks 0,1, kind grad): "
        "host node1 blamed 3 times within 100 steps; to return it: nansentinel excluded "
        f"--exclusion-file {excl} --clear node1, then scontrol update nodename=node1 "
        "state=resume")
    assert _excluded(slurm, "--clear", "node1").stdout.startswith("cleared 1 exclusion record")
    slurm.resume("node1")


def test_the_next_jobs_keep_off_the_excluded_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    """node3 excluded and drained as the test above leaves a node (its record written and the
    node drained here, not by a second training job): a 3-node job pends and an
    ``--exclude=$(nansentinel excluded --hostlist)`` job runs on node1 and node2. Resumed
    without ``--clear``, node3 is left out of the training by the batch script itself.
    Cleared and resumed, a 3-node control run without a fault trains on all three and drains
    nothing."""
    ExclusionStore(_shared(slurm) / "excluded.jsonl").add(ExclusionRecord(
        host="node3", reason="host node3 blamed 3 times within 100 steps", step=7,
        evidence={"bad_ranks": [4, 5], "kinds": ["grad"]}, job_id="1"))
    slurm.run(["scontrol", "update", "nodename=node3", "state=drain",
               "reason=nansentinel excluded node3 at step 7"])
    assert _excluded(slurm, "--hostlist").stdout == "node3\n"
    skip = _excluded(slurm, "--hostlist").stdout.strip()
    quiet = ["--output=/dev/null", "--wrap=true"]
    hostlist = slurm.sbatch(["--nodes=2", f"--exclude={skip}", *quiet])
    assert slurm.wait_job(hostlist, 30)["NodeList"] == "node[1-2]"
    pending = slurm.sbatch(["--nodes=3", *quiet])
    time.sleep(2)  # a scheduling pass or two
    assert slurm.job(pending)["JobState"] == "PENDING"
    slurm.run(["scancel", pending])

    slurm.resume("node3")  # an operator forgot `nansentinel excluded --clear node3`
    skip = tmp_path / "skip"  # a worker that only says where it ran (no torch to load)
    job = _submit(slurm, skip, 3, 4, script=(str(WORKER.with_name("touch_rank.py")), str(skip)))
    info = slurm.wait_job(job, JOB_TIMEOUT)
    log = (skip / "job.out").read_text(errors="replace")
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == (
        "COMPLETED", "0:0", "node[1-3]"), log[-6000:]
    assert "node3 excluded by an earlier run" in log and "--exclude=node3" in log
    seen = [json.loads(p.read_text()) for p in skip.glob("rank-*.json")]
    assert sorted((r["NANSENTINEL_HOSTNAME"], r["RANK"], r["WORLD_SIZE"]) for r in seen) == [
        ("node1", "0", "4"), ("node1", "1", "4"), ("node2", "2", "4"), ("node2", "3", "4")]
    assert slurm.drain_reasons() == {}

    assert _excluded(slurm, "--clear", "node3").stdout.startswith("cleared 1 exclusion record")
    info, log = _train(slurm, tmp_path / "control", 3, 6, steps=3)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    assert {d["hostname"] for d in _receipts(tmp_path / "control")} == {
        "node1", "node2", "node3"}
    assert slurm.drain_reasons() == {}
    assert ExclusionStore(_shared(slurm) / "excluded.jsonl").records() == []


#: A reason as hostile as a job's user can write: command substitution, backticks, quotes,
#: ``;``, a newline, an escape sequence and length.
HOSTILE = ("$(touch {pwn}/pwned1)`touch {pwn}/pwned2`'\"; touch {pwn}/pwned3\n"
           "\x1b[31m; scontrol update nodename=node3 state=down reason=x " + "y" * 400)

#: The job of user nobody: it writes three records (this node with the hostile reason,
#: node1 which is not in the job, and node3 for another job) and runs the job's own hook.
_NOBODY_JOB = """
import json, os, subprocess, sys
job, path, reason = os.environ["SLURM_JOB_ID"], sys.argv[1], sys.argv[2]
with open(path, "a") as f:
    for host, job_id in (("node2", job), ("node1", job), ("node3", "999999")):
        f.write(json.dumps({"host": host, "reason": reason, "step": 9, "job_id": job_id,
                            "evidence": {"bad_ranks": [2], "kinds": ["loss"]}}) + "\\n")
hook = subprocess.run([sys.argv[3], "--exclusion-file", path, "--job", job, "--node", "node2"])
print("hook exit", hook.returncode)
"""


def test_the_epilog_drains_for_a_user_without_rights(slurm: SlurmCluster) -> None:
    """A job of user nobody (no operator rights) on node2 and node3: its own drain hook fails,
    and the Epilog, as root, drains node2 with the hostile reason cut to printable text; the
    record naming node1 (not in the job) and node3's record of another job drain nothing,
    and nothing in the reason runs."""
    python = _python_for("nobody")
    if python is None:
        pytest.skip("no Python that user nobody can run (tried this one and /usr/bin/python3)")
    shared = slurm.workdir.parent / "shared" / "nobody"
    shared.mkdir()
    nobody = pwd.getpwnam("nobody")
    os.chown(shared, nobody.pw_uid, nobody.pw_gid)
    pwn = shared / "pwn"
    script = shared / "job.py"
    script.write_text(_NOBODY_JOB)
    reason = HOSTILE.format(pwn=pwn)
    job = slurm.sbatch(["--uid=nobody", "--nodes=2", "--nodelist=node[2-3]", f"--chdir={shared}",
                        f"--output={shared}/job.out", "--wrap",
                        f"{python} -I {script} {shared}/excluded.jsonl "
                        f"{shlex.quote(reason)} {DRAIN}"])
    info = slurm.wait_job(job, 60)
    out = (shared / "job.out").read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", out
    assert "could not drain node2" in out and "hook exit 1" in out, out
    drained = slurm.drain_reasons()
    assert set(drained) == {"node2"}, drained
    text = drained["node2"]
    assert text.startswith(f"nansentinel excluded node2 at step 9 (job {job}, rank 2, "
                           "kind loss): $(touch "), text
    assert all(" " <= c <= "~" for c in text) and "--clear node2" in text
    assert not pwn.exists() and not list(shared.glob("pwned*"))
    assert slurm.node("node3")["State"] == "IDLE"
    slurm.resume("node2")



@pytest.mark.parametrize("how", [
    "scancel",
    # A time limit is at least a minute, and slurmctld looks for it every 30 s: 60-90 s.
    pytest.param("time-limit", marks=pytest.mark.skipif(
        os.environ.get("SLURM_TIME_LIMIT_TEST") != "1",
        reason="60-90 s; set SLURM_TIME_LIMIT_TEST=1 (run by hand, docs/launch.md)")),
])
def test_a_cancelled_or_timed_out_job_stops_whole(slurm: SlurmCluster, tmp_path: Path,
                                                  how: str) -> None:
    """SIGTERM to every process of the job (scancel, or the time limit), SIGKILL after
    KillWait: every rank stops after the same step (the stop request travels in the health
    exchange) and rank 0 checkpoints that step, every launcher exits 143 (128 + SIGTERM, the
    documented code), the batch script says so, the checkpoint and the reports on disk are
    whole, and no process of the job is left on any node."""
    out = tmp_path / "out"
    options = ("--time=1",) if how == "time-limit" else ()
    job = _submit(slurm, out, 3, 6, "kind=loss,rank=1,step=2", steps=10**6, options=options)
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (out / "ckpt.pt").exists():  # training is under way (and one report written)
        assert time.monotonic() < deadline, slurm.job(job)
        time.sleep(0.5)
    if how == "scancel":
        slurm.run(["scancel", job])
    info = slurm.wait_job(job, JOB_TIMEOUT)
    slurm.resume()  # waits for the nodes to be idle: the job's processes are gone
    log = (out / "job.out").read_text(errors="replace")
    assert info["JobState"] == ("TIMEOUT" if how == "time-limit" else "CANCELLED"), log[-4000:]
    assert "received SIGTERM (time limit or scancel)" in log, log[-4000:]
    exits = _shared(slurm) / info["JobId"] / "exit"
    codes = {p.name: p.read_text().strip() for p in exits.iterdir() if not p.name.startswith(".")}
    assert codes == dict.fromkeys(["node1", "node2", "node3"], "143"), log[-4000:]
    assert slurm.strays() == {}
    import torch

    # Every rank stopped after the same step (the stop request met in the health exchange),
    # and rank 0's checkpoint is of that step, whole.
    stopped = [json.loads(p.read_text()) for p in sorted(out.glob("stopped-*.json"))]
    assert len(stopped) == 6 and len({s["step"] for s in stopped}) == 1, (stopped, log[-4000:])
    assert {s["signal"] for s in stopped} == {15}
    state = torch.load(out / "ckpt.pt")
    assert state["step"] == stopped[0]["step"] + 1 and state["step"] >= 3
    verdicts = [json.loads(p.read_text())
                for p in (_shared(slurm) / info["JobId"] / "reports").glob("**/verdicts/*.json")]
    assert sorted((v["outcome"], v["step"]) for v in verdicts) == [
        ("stopped", stopped[0]["step"])] * 6, verdicts
    reports = list((_shared(slurm) / info["JobId"] / "reports").glob("incident-*.json"))
    assert reports and all(json.loads(p.read_text()) for p in reports)


def _python_for(user: str) -> str | None:
    """A Python interpreter ``user`` can run (the job's program is standard library only)."""
    for python in (sys.executable, "/usr/bin/python3"):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if subprocess.run(["runuser", "-u", user, "--", python, "-I", "-c", "pass"],
                              capture_output=True, timeout=30, check=False).returncode == 0:
                return python
    return None
