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
then the Epilog drains for a job user who cannot, and reads nothing a user points it at that only
root may read (a folder link, a hard link, a swap while the job ends).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pwd
import shlex
import shutil
import signal
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
        # The program's lines go to a log of the test's own (slurmd keeps no Epilog output),
        # with one line per run, so that a test knows the Epilog ran and what it said.
        log = work / "epilog.log"
        epilog.write_text(
            "#!/bin/sh\n"
            f"{sys.executable} -I {DRAIN} --exclusion-file "
            f"'{work}/shared/{{user}}/nansentinel/excluded.jsonl' 2>>{log}\n"
            f'echo "epilog of job $SLURM_JOB_ID on $SLURMD_NODENAME: exit $?" >>{log}\n')
        epilog.chmod(0o755)
        with SlurmCluster(work / "cluster", epilog=epilog) as cluster:
            yield cluster
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(autouse=True)
def _put_back(slurm: SlurmCluster) -> Iterator[None]:
    """Whatever a test did or failed to do, the next one finds no job running and every node
    up: a job left running is cancelled, a drained node resumed."""
    yield
    jobs = slurm.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
    if jobs:
        slurm.run(["scancel", *jobs], check=False)
    if jobs or slurm.idle_nodes() != set(slurm.nodes):
        slurm.resume(*slurm.drain_reasons())


def _job_env(slurm: SlurmCluster, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANSENTINEL_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="eth0", NPROC_PER_NODE="2",
               SHARED=str(_shared(slurm)), METRICS_PORT="0", PET_MONITOR_INTERVAL="0.5",
               RDZV_CONF="join_timeout=60,last_call_timeout=2", **extra)
    return env


def _shared(slurm: SlurmCluster) -> Path:
    return slurm.workdir.parent / "shared" / "root" / "nansentinel"


def _epilog_log(slurm: SlurmCluster, job: str) -> list[str]:
    """What the Epilog said at the end of ``job`` (its own lines and the wrapper's)."""
    log = slurm.workdir.parent / "epilog.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return [line for line in text.splitlines() if f"job {job} " in line]


def _nobody_home(slurm: SlurmCluster) -> tuple[Path, pwd.struct_passwd]:
    """User nobody's folder on the shared filesystem and its ``nansentinel`` folder (the
    Epilog's pattern), both nobody's; made once."""
    nobody = pwd.getpwnam("nobody")
    home = slurm.workdir.parent / "shared" / "nobody"
    for folder in (home, home / "nansentinel"):
        folder.mkdir(exist_ok=True)
        os.chown(folder, nobody.pw_uid, nobody.pw_gid)
    return home, nobody


def _submit(slurm: SlurmCluster, out: Path, nodes: int, full_world: int,
            inject: str | None = None, steps: int = 9, options: tuple[str, ...] = (),
            script: tuple[str, ...] | None = None, step_seconds: float = 0.0) -> str:
    """Submit the shipped script on ``nodes`` nodes; returns the job id. ``script``: another
    training script and its arguments than the Sentinel worker's."""
    out.mkdir(parents=True)
    extra = {"NANSENTINEL_INJECT": inject} if inject else {}
    train = script or (str(WORKER), str(out), f"--steps={steps}", f"--full-world={full_world}",
                       f"--step-seconds={step_seconds}")
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


def test_two_hosts_poisoned_at_once_leave_together_and_the_last_one_stops(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    """node2's and node3's ranks get non-finite gradients at steps 5-7: both reach their
    three strikes at step 7 and leave at that step, each drained with its own reason (its
    ranks, its strikes); node1 alone is below the job's minimum (MIN_NODES: 2 of 3), so its
    launcher exits 3 at once with a line naming both hosts and the minimum, instead of
    waiting out the rendezvous's join timeout (60 s here); the job is FAILED, exit 3."""
    inject = "kind=grad,host=node2,steps=5-7;kind=grad,host=node3,steps=5-7"
    try:
        info, log = _train(slurm, tmp_path / "out", 3, 6, inject)
        assert (info["JobState"], info["ExitCode"]) == ("FAILED", "3:0"), log[-6000:]
        exits = _shared(slurm) / info["JobId"] / "exit"
        codes = {p.name: p.read_text().strip() for p in exits.iterdir()
                 if not p.name.startswith(".")}
        assert codes == {"node1": "3", "node2": "4", "node3": "4"}, log[-6000:]
        assert ("host(s) node2, node3 excluded by the sentinel at step 7 leave 1 of the 3 "
                "host(s), fewer than --nnodes's minimum of 2: the job cannot go on") in log
        records = ExclusionStore(_shared(slurm) / "excluded.jsonl").records()
        assert sorted((r.host, r.step) for r in records) == [("node2", 7), ("node3", 7)]
        # promptly: node1's launcher ended within seconds of the exclusion, not at the join
        # timeout
        waited = (exits / "node1").stat().st_mtime - max(r.time for r in records)
        assert waited < 20, waited
        excl = _shared(slurm) / "excluded.jsonl"
        assert slurm.drain_reasons() == {
            host: (f"nansentinel excluded {host} at step 7 (job {info['JobId']}, ranks "
                   f"{ranks}, kind grad): host {host} blamed 3 times within 100 steps; to "
                   f"return it: nansentinel excluded --exclusion-file {excl} --clear {host}, "
                   f"then scontrol update nodename={host} state=resume")
            for host, ranks in (("node2", "2,3"), ("node3", "4,5"))}
        assert slurm.strays() == {}
    finally:
        for host in ("node2", "node3"):
            _excluded(slurm, "--clear", host)
        slurm.resume(*slurm.drain_reasons())


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
    shared, _ = _nobody_home(slurm)
    pwn = shared / "pwn"
    script = shared / "job.py"
    script.write_text(_NOBODY_JOB)
    reason = HOSTILE.format(pwn=pwn)
    job = slurm.sbatch(["--uid=nobody", "--nodes=2", "--nodelist=node[2-3]", f"--chdir={shared}",
                        f"--output={shared}/job.out", "--wrap",
                        f"{python} -I {script} {shared}/nansentinel/excluded.jsonl "
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


#: A user's process racing the Epilog (run as nobody, outside the job, as from a login node):
#: it swaps two names atomically (renameat2's RENAME_EXCHANGE) until told to stop.
_RACER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
first, second, stop = (a.encode() for a in sys.argv[1:4])
swaps = 0
while not os.path.exists(stop):
    if libc.renameat2(-100, first, -100, second, 2) != 0:
        sys.exit(f"renameat2: errno {ctypes.get_errno()}")
    swaps += 1
print(swaps)
"""


@pytest.mark.parametrize("attack", ["folder-link", "hard-link", "swap"])
def test_the_epilog_reads_nothing_only_root_can(slurm: SlurmCluster, attack: str) -> None:
    """A root-only folder holds a root-owned 0600 exclusion file whose record names node2 and
    the job, with a secret reason. User nobody's job points the Epilog at it: its
    ``nansentinel`` folder (the Epilog's pattern) made a link to that folder; the exclusion
    file a hard link to the root-owned file (which fs.protected_hardlinks keeps a user from
    making here, so root makes it, as a site without that protection would let the user);
    or, while the job ends, a process of the user's swapping the folder for the link and
    back as fast as it can. The Epilog, reading as nobody without following a link, drains
    nothing and its words hold nothing of the file (it ran: its log says so); the job
    completes and leaves nothing running."""
    python = _python_for("nobody")
    if python is None:
        pytest.skip("no Python that user nobody can run (tried this one and /usr/bin/python3)")
    home, nobody = _nobody_home(slurm)
    secret = slurm.workdir.parent / f"root-only-{attack}"
    secret.mkdir(mode=0o700)
    target = home / "nansentinel"
    moved = home / "nansentinel.real"
    stop = home / "stop-racer"
    racer = None
    job = slurm.sbatch(["--uid=nobody", "--hold", "--nodes=1", "--nodelist=node2",
                        f"--chdir={home}", f"--output={home}/attack-%j.out", "--wrap=true"])
    word = f"SECRET{os.urandom(6).hex()}"
    try:
        (secret / "excluded.jsonl").write_text(json.dumps({
            "host": "node2", "reason": word, "step": 9, "job_id": job,
            "evidence": {"bad_ranks": [0], "kinds": [word.lower()[:32]]}}) + "\n")
        (secret / "excluded.jsonl").chmod(0o600)
        (target / "excluded.jsonl").unlink(missing_ok=True)  # an earlier test's
        if attack == "hard-link":
            os.link(secret / "excluded.jsonl", target / "excluded.jsonl")
        else:
            target.rename(moved)
            target.symlink_to(secret, target_is_directory=True)
            os.lchown(target, nobody.pw_uid, nobody.pw_gid)
        if attack == "swap":  # the real folder, with a file of the user's and no record
            moved.joinpath("excluded.jsonl").write_text("")
            os.chown(moved / "excluded.jsonl", nobody.pw_uid, nobody.pw_gid)
            racer = subprocess.Popen(
                ["runuser", "-u", "nobody", "--", python, "-I", "-c", _RACER, str(target),
                 str(moved), str(stop)], stdout=subprocess.PIPE, text=True)
        slurm.run(["scontrol", "release", job])
        info = slurm.wait_job(job, 60)
        if racer is not None:
            stop.touch()
            swaps = int(racer.communicate(timeout=30)[0])
            assert racer.returncode == 0 and swaps > 100, swaps
        said = _epilog_log(slurm, job)
        out = (home / f"attack-{job}.out").read_text(errors="replace")
        assert info["JobState"] == "COMPLETED", (info, out)
        assert slurm.drain_reasons() == {}, said
        assert said[-1] == f"epilog of job {job} on node2: exit 0", said
        assert not any(word in line or word.lower() in line for line in [*said, out]), said
        if attack != "swap":  # a swap may find the user's own empty file: nothing to say
            assert any("nothing drained" in line for line in said), said
        assert slurm.strays() == {}
    finally:
        if racer is not None and racer.poll() is None:
            racer.kill()
            racer.wait(timeout=10)
        stop.unlink(missing_ok=True)
        if target.is_symlink() or moved.is_symlink():  # the racer may have left them swapped
            link, real = (target, moved) if target.is_symlink() else (moved, target)
            link.unlink()
            real.rename(target)
        (target / "excluded.jsonl").unlink(missing_ok=True)
        shutil.rmtree(secret, ignore_errors=True)
        for node in slurm.drain_reasons():
            slurm.resume(node)


#: How each way of stopping a job is asked for: the sbatch options, and what the job ends as.
_STOPS = {
    "scancel": ((), "CANCELLED", "received SIGTERM (time limit or scancel)"),
    # No early warning (the script's own would come first): SIGCONT to the script is nothing.
    "time-limit": (("--time=1", "--signal=B:CONT@1"), "TIMEOUT",
                   "received SIGTERM (time limit or scancel)"),
    # A 30-minute job warned 600 s ahead; its limit cut to 10 minutes once it trains, so the
    # warning is due at slurmctld's next look (every 30 s), 10 minutes before the limit.
    "early-warning": (("--time=30", "--signal=B:TERM@600"), "FAILED",
                      "left (Slurm's early warning, --signal=B:TERM@SECONDS): every rank stops "
                      "after a common step, with its checkpoint, before the time limit"),
}


@pytest.mark.parametrize("how", [
    "scancel",
    "early-warning",
    # A time limit is at least a minute, and slurmctld looks for it every 30 s: 60-90 s.
    pytest.param("time-limit", marks=pytest.mark.skipif(
        os.environ.get("SLURM_TIME_LIMIT_TEST") != "1",
        reason="60-90 s; set SLURM_TIME_LIMIT_TEST=1 (run by hand, docs/launch.md)")),
])
def test_a_cancelled_or_timed_out_job_stops_whole(slurm: SlurmCluster, tmp_path: Path,
                                                  how: str) -> None:
    """SIGTERM to every process of the job (scancel, or the time limit), SIGKILL after
    KillWait; or Slurm's early warning to the batch script alone (``--signal=B:TERM@N``),
    which passes it to the training's processes: every rank stops after the same step (the
    stop request travels in the health exchange) and rank 0 checkpoints that step, every
    launcher exits 143 (128 + SIGTERM, the documented code), the batch script says so, the
    checkpoint and the reports on disk are whole, and no process of the job is left on any
    node. The warned job ends before its limit, as FAILED with the script's 143."""
    out = tmp_path / "out"
    options, state, said = _STOPS[how]
    job = _submit(slurm, out, 3, 6, "kind=loss,rank=1,step=2", steps=10**6, options=options)
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (out / "ckpt.pt").exists():  # training is under way (and one report written)
        assert time.monotonic() < deadline, slurm.job(job)
        time.sleep(0.5)
    if how == "scancel":
        slurm.run(["scancel", job])
    if how == "early-warning":
        slurm.run(["scontrol", "update", f"jobid={job}", "timelimit=10"])
    info = slurm.wait_job(job, JOB_TIMEOUT)
    assert slurm.drain_reasons() == {}
    slurm.resume()  # waits for the nodes to be idle: the job's processes are gone
    log = (out / "job.out").read_text(errors="replace")
    assert info["JobState"] == state, log[-4000:]
    assert said in log, log[-4000:]
    if how == "early-warning":  # and well before its 10-minute limit
        ran = (datetime.datetime.fromisoformat(info["EndTime"])
               - datetime.datetime.fromisoformat(info["StartTime"])).total_seconds()
        assert info["ExitCode"] == "143:0" and ran < 300, info
        assert "stopped before the time limit on Slurm's early warning: the launchers on " \
               "node1 node2 node3 exited 143" in log, log[-4000:]
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


def test_a_killed_store_is_named_and_started_again(slurm: SlurmCluster, tmp_path: Path) -> None:
    """``nansentinel store`` (on node1, the batch host) SIGKILLed mid-run: every launcher
    finds it gone within a poll, tells its ranks why, and stops them after a common step
    with a checkpoint; every rank's verdict and every launcher's summary name the store's
    host and port and say it is gone (no ``stopped`` verdict: the user sent no signal), each
    launcher exits 5; the batch script says the store died and starts it again with the
    training (STORE_RESTARTS=1), which resumes from the checkpoint and completes: COMPLETED,
    exit 0, nothing drained, nothing left running."""
    out = tmp_path / "out"
    job = _submit(slurm, out, 3, 6, steps=60, step_seconds=0.1)  # 6 s at the least
    deadline = time.monotonic() + JOB_TIMEOUT
    while not (out / "ckpt.pt").exists():  # training is under way
        assert time.monotonic() < deadline, slurm.job(job)
        time.sleep(0.2)
    [store] = [pid for pid, cmd in slurm.processes("node1").items()  # this job's store
               if "nansentinel store" in cmd and f"/{job}/rendezvous.port" in cmd]
    os.kill(store, signal.SIGKILL)
    info = slurm.wait_job(job, JOB_TIMEOUT)
    log = (out / "job.out").read_text(errors="replace")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-6000:]
    job_dir = _shared(slurm) / info["JobId"]
    first = {p.name: p.read_text().strip() for p in (job_dir / "exit.store-restart-1").iterdir()
             if not p.name.startswith(".")}
    assert first == dict.fromkeys(["node1", "node2", "node3"], "5"), log[-6000:]
    last = {p.name: p.read_text().strip() for p in (job_dir / "exit").iterdir()
            if not p.name.startswith(".")}
    assert last == dict.fromkeys(["node1", "node2", "node3"], "0"), log[-6000:]
    [said] = [line for line in log.splitlines() if "died during the run" in line]
    endpoint = said.split("the rendezvous store at ", 1)[1].split(" ", 1)[0]
    assert said == (f"nansentinel.sbatch: the rendezvous store at {endpoint} (pid {store}) died "
                    "during the run (killed by signal 9) and the launchers stopped the run; "
                    "starting the store and the training again (1 of STORE_RESTARTS=1): it "
                    "resumes from its last checkpoint"), said
    gone = f"the rendezvous store at {endpoint} is gone (its process died or was killed)"
    assert log.count(f"Root cause: {gone}") == 3, log[-6000:]
    verdicts = [json.loads(p.read_text())
                for p in (job_dir / "reports").glob("runs/*/verdicts/rank-*.json")]
    stopped = [v for v in verdicts if v["outcome"] != "closed"]
    told = [line for line in log.splitlines() if "verdict:" in line or "stops after" in line
            or "Root cause" in line or "closing signal" in line]
    assert len(stopped) == 6 and {v["outcome"] for v in stopped} == {"store_gone"}, told
    assert len({v["step"] for v in stopped}) == 1 and all(
        v["message"].startswith(gone) for v in stopped), stopped
    assert "asked the run to stop" not in log
    done = _receipts(out)
    assert len(done) == 6 and {d["start"] for d in done} == {stopped[0]["step"] + 1}, done
    assert slurm.drain_reasons() == {}
    assert slurm.strays() == {}
