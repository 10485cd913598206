"""The Slurm pieces that need no cluster: hostlists, ``excluded --hostlist``, the drain
program's reading and reason, and ``nansentinel store`` (a real TCPStore on loopback).
tests/e2e/test_slurm.py runs them on a real Slurm."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.launcher import hostlist
from nansentinel.launcher.excluded_command import excluded_main

REPO = Path(__file__).resolve().parents[2]
DRAIN = REPO / "nansentinel" / "files" / "slurm" / "nansentinel-drain"


def _drain_module() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("nansentinel_drain", str(DRAIN))
    spec = importlib.util.spec_from_loader("nansentinel_drain", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


drain = _drain_module()


# -- hostlists -------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "names"), [
    ("node3", ["node3"]),
    ("node[1-3,7]", ["node1", "node2", "node3", "node7"]),
    ("gpu[08-10],login", ["gpu08", "gpu09", "gpu10", "login"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a[1-2].dc,b", ["a1.dc", "a2.dc", "b"]),
    ("", []),
])
def test_expand_reads_slurm_hostlists(text: str, names: list[str]) -> None:
    assert hostlist.expand(text) == names


@pytest.mark.parametrize("text", ["node[1-", "node]1", "node[a-b]", "node[3-1]", "no de",
                                  "node[1-99999999]", "x;y"])
def test_expand_refuses_what_is_not_a_hostlist(text: str) -> None:
    with pytest.raises(ValueError, match=r"hostlist|node name|range"):
        hostlist.expand(text)


@pytest.mark.parametrize("names", [
    ["node1", "node2", "node3", "node7"], ["gpu08", "gpu09", "gpu10"], ["login"],
    ["node3", "node1", "node3"], ["a1", "b1", "b2", "c"], [],
])
def test_compress_then_expand_gives_the_names_back(names: list[str]) -> None:
    assert sorted(hostlist.expand(hostlist.compress(names))) == sorted(set(names))


def test_compress_writes_ranges() -> None:
    assert hostlist.compress(["node3", "node1", "node2", "node7", "gpu08", "gpu09"]) == \
        "gpu[08-09],node[1-3,7]"
    with pytest.raises(ValueError, match="not a Slurm node name"):
        hostlist.compress(["node1,node2"])


# -- nansentinel excluded --hostlist ---------------------------------------------------------


def _store(tmp_path: Path, *hosts: str) -> Path:
    path = tmp_path / "excluded.jsonl"
    for host in hosts:
        ExclusionStore(path).add(ExclusionRecord(host=host, reason="r", step=7, job_id="42"))
    return path


def test_hostlist_prints_the_excluded_hosts_for_sbatch_exclude(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _store(tmp_path, "node3", "node1", "node3", "evil,node9[1]")
    assert excluded_main(["--exclusion-file", str(path), "--hostlist"]) == 0
    out, err = capsys.readouterr()
    assert out == "node[1,3]\n"
    assert "'evil,node9[1]' is not a Slurm node name; left out" in err
    assert excluded_main(["--exclusion-file", str(path), "--hostlist",
                          "--among", "node[2-3]"]) == 0
    assert capsys.readouterr().out == "node3\n"
    assert excluded_main(["--exclusion-file", str(path), "--hostlist",
                          "--among", "gpu[1-4]"]) == 0
    assert capsys.readouterr().out == "\n"  # `sbatch --exclude=` accepts an empty list


def test_hostlist_of_no_file_is_empty_and_bad_options_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "none.jsonl")
    assert excluded_main(["--exclusion-file", missing, "--hostlist"]) == 0
    assert capsys.readouterr().out == "\n"
    assert excluded_main(["--exclusion-file", missing, "--among", "node1"]) == 2
    assert "--among needs --hostlist" in capsys.readouterr().err
    assert excluded_main(["--exclusion-file", missing, "--hostlist", "--among", "n[1-"]) == 2
    assert "--among: hostlist 'n[1-'" in capsys.readouterr().err
    assert excluded_main(["--exclusion-file", missing, "--hostlist", "--json"]) == 2


# -- the drain program -----------------------------------------------------------------------


def _line(**fields: object) -> str:
    record = {"host": "node3", "reason": "host node3 blamed 3 times within 100 steps",
              "step": 7, "job_id": "42", "evidence": {"bad_ranks": [4, 5], "kinds": ["grad"]}}
    record.update(fields)
    return json.dumps(record) + "\n"


def test_the_drain_reason_names_nansentinel_step_ranks_kinds_and_both_steps_back() -> None:
    reason = drain.drain_reason(json.loads(_line()), "node3", "42", "/shared/u/x.jsonl")
    assert reason == (
        "nansentinel excluded node3 at step 7 (job 42, ranks 4,5, kind grad): host node3 "
        "blamed 3 times within 100 steps; to return it: nansentinel excluded --exclusion-file "
        "/shared/u/x.jsonl --clear node3, then scontrol update nodename=node3 state=resume")


def test_the_drain_reason_keeps_only_printable_text_of_a_hostile_record() -> None:
    record = json.loads(_line(
        reason="$(reboot)\n\x1b[31m`id`; scontrol update nodename=node1 state=down" + "z" * 999,
        step="7; rm -rf /", evidence={"bad_ranks": [1, "2; x", True], "kinds": ["grad", "$(x)"]},
    ))
    reason = drain.drain_reason(record, "node3", "42", "/f")
    assert all(" " <= c <= "~" for c in reason) and len(reason) < 400
    assert reason.startswith("nansentinel excluded node3 at step ? (job 42, rank 1, kind grad): "
                             "$(reboot) ?[31m`id`;")


def test_records_are_read_only_for_this_job_and_node(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text(_line() + _line(job_id="41") + _line(host="node1") + "{torn\n" + "[1]\n"
                    + _line(step=8))
    found = drain.records_for(str(path), "42", "node3", {os.getuid()})
    assert [r["step"] for r in found] == [7, 8]


def test_the_hook_trusts_no_final_link_no_fifo_and_no_file_of_another_owner(
    tmp_path: Path,
) -> None:
    real = tmp_path / "real.jsonl"
    real.write_text(_line())
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    with pytest.raises(OSError):
        drain.records_for(str(link), "42", "node3", {os.getuid()})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        drain.records_for(str(fifo), "42", "node3", {os.getuid()})
    with pytest.raises(ValueError, match="owned by uid"):
        drain.records_for(str(real), "42", "node3", {os.getuid() + 1})


def test_the_epilog_reads_only_the_end_of_a_huge_file(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain, "MAX_BYTES", 4096)
    path = tmp_path / "x.jsonl"
    path.write_text(_line(step=1) * 200 + _line(step=2))
    found = drain.records_for(str(path), "42", "node3", None)
    assert found and found[-1]["step"] == 2 and len(found) < 40


@pytest.fixture
def as_nobody() -> Iterator[tuple[Path, int, int, list[int]]]:
    """A folder of user nobody's (in a world-searchable folder outside pytest's 0700 tree),
    and nobody's uid, gid and groups, as the Epilog drops to them. Needs root."""
    if os.geteuid() != 0:
        pytest.skip("dropping to another user's rights needs root (CI runs as root)")
    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody here")
    top = Path(tempfile.mkdtemp(prefix="nansentinel-epilog-"))
    try:
        top.chmod(0o755)
        home = top / "nobody"
        home.mkdir()
        os.chown(home, user.pw_uid, user.pw_gid)
        yield home, user.pw_uid, user.pw_gid, os.getgrouplist("nobody", user.pw_gid)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _nobody_file(home: Path, text: str, name: str = "excluded.jsonl") -> Path:
    path = home / name
    path.write_text(text)
    os.chown(path, home.stat().st_uid, home.stat().st_gid)
    return path


def test_the_epilog_reads_as_the_job_user(as_nobody: tuple[Path, int, int, list[int]]) -> None:
    home, uid, gid, groups = as_nobody
    path = _nobody_file(home, _line() + _line(step=8))
    data, cut = drain.read_as_user(str(path), uid, gid, groups)
    assert not cut and [r["step"] for r in drain.parse_records(data, cut, "42", "node3")] == [7, 8]
    with pytest.raises(FileNotFoundError):
        drain.read_as_user(str(home / "none.jsonl"), uid, gid, groups)


def test_the_epilog_follows_no_link_anywhere_on_the_way(
    as_nobody: tuple[Path, int, int, list[int]],
) -> None:
    """A link as the file, as its folder or as any folder above it is refused, not resolved,
    even where it points at a file the user owns."""
    home, uid, gid, groups = as_nobody
    (home / "real").mkdir()
    os.chown(home / "real", uid, gid)
    _nobody_file(home / "real", _line())
    (home / "dir-link").symlink_to(home / "real")
    (home / "file-link.jsonl").symlink_to(home / "real" / "excluded.jsonl")
    for path, errno_ in ((home / "dir-link" / "excluded.jsonl", 20),  # ENOTDIR
                         (home / "file-link.jsonl", 40)):  # ELOOP
        with pytest.raises(OSError) as raised:
            drain.read_as_user(str(path), uid, gid, groups)
        assert raised.value.errno == errno_, raised.value
        assert "read as uid" in str(raised.value)
    with pytest.raises(ValueError, match="absolute path without"):
        drain.read_as_user(str(home / "real" / ".." / "real" / "excluded.jsonl"), uid, gid,
                           groups)


def test_the_epilog_reads_nothing_only_root_may(
    as_nobody: tuple[Path, int, int, list[int]],
) -> None:
    """A root-only folder is closed to the user; a root-owned file the user could open (a
    hard link into the user's folder, a file left readable) is refused by its owner; and
    the refusal never carries the file's text."""
    home, uid, gid, groups = as_nobody
    secret = home.parent / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "excluded.jsonl").write_text(_line(reason="SECRET"))
    with pytest.raises(PermissionError, match="Permission denied"):
        drain.read_as_user(str(secret / "excluded.jsonl"), uid, gid, groups)
    readable = home.parent / "root-readable.jsonl"
    readable.write_text(_line(reason="SECRET"))
    readable.chmod(0o644)
    os.link(readable, home / "excluded.jsonl")  # what fs.protected_hardlinks=0 allows a user
    with pytest.raises(ValueError, match="owned by uid 0, not by the job's user") as raised:
        drain.read_as_user(str(home / "excluded.jsonl"), uid, gid, groups)
    assert "SECRET" not in str(raised.value)


def _run_drain(
    tmp_path: Path, args: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """The program as Slurm runs it, with a fake scontrol that records its arguments."""
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\n"
                    'if [ "$1" = show ]; then echo node2; echo node3; exit 0; fi\n'
                    f'printf "%s\\0" "$@" > {tmp_path}/called\n')
    fake.chmod(0o755)
    return subprocess.run([sys.executable, "-I", str(DRAIN), "--scontrol", str(fake), *args],
                          env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True,
                          timeout=60, check=False)


def test_as_epilog_it_drains_this_node_with_one_argument_and_always_exits_0(
    tmp_path: Path,
) -> None:
    user = pwd.getpwuid(os.getuid()).pw_name  # the job's user: this one (root in CI)
    (tmp_path / user).mkdir()
    path = tmp_path / user / "excluded.jsonl"
    path.write_text(_line() + _line(host="node1"))
    env = {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "node3", "SLURM_NODELIST": "node[2-3]",
           "SLURM_JOB_USER": user, "SLURM_JOB_UID": str(os.getuid())}
    pattern = [f"--exclusion-file={tmp_path}/{{user}}/excluded.jsonl"]
    done = _run_drain(tmp_path, pattern, env)
    assert done.returncode == 0, done.stderr
    called = (tmp_path / "called").read_text().split("\0")[:-1]
    assert called[:3] == ["update", "nodename=node3", "state=drain"]
    assert len(called) == 4 and called[3].startswith("reason=nansentinel excluded node3 at step 7")
    # node1's record: not a node of the job, so its epilog drains nothing
    (tmp_path / "called").unlink()
    done = _run_drain(tmp_path, pattern, {**env, "SLURMD_NODENAME": "node1"})
    assert done.returncode == 0 and not (tmp_path / "called").exists()
    assert "node1 is not a node of job 42" in done.stderr
    # a user name that would leave the pattern's folder
    done = _run_drain(tmp_path, pattern, {**env, "SLURM_JOB_USER": ".."})
    assert done.returncode == 0 and not (tmp_path / "called").exists()
    # a name and a uid that do not belong together
    done = _run_drain(tmp_path, pattern, {**env, "SLURM_JOB_UID": str(os.getuid() + 4242)})
    assert done.returncode == 0 and not (tmp_path / "called").exists()
    assert f"job user {user!r} has uid {os.getuid()} here" in done.stderr


# -- nansentinel store -----------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_the_store_serves_until_its_parent_is_gone(tmp_path: Path) -> None:
    """The batch script's shape: a parent starts the store with --parent=$$ and reads the
    port file; a client uses the store; SIGTERM alone does not stop it while the parent lives
    (the launchers still use it as they stop); the parent's exit does."""
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        ["sh", "-c", f'{sys.executable} -m nansentinel store --port-file={port_file} '
         '--parent=$$ & echo $! > ' + str(tmp_path / "pid") + '; read _'],
        stdin=subprocess.PIPE, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.2)
        import datetime

        import torch.distributed as dist

        client = dist.TCPStore("127.0.0.1", int(port_file.read_text()), is_master=False,
                               timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
        store_pid = int((tmp_path / "pid").read_text())
        os.kill(store_pid, signal.SIGTERM)
        time.sleep(1.5)
        assert client.get("k") == b"v"  # still serving while the parent lives
        assert parent.stdin is not None
        parent.stdin.close()  # the batch script ends
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(store_pid):
            assert time.monotonic() < deadline, "the store outlived its parent"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_the_store_names_a_bad_port(capsys: pytest.CaptureFixture[str]) -> None:
    from nansentinel.launcher.store_server import store_main

    assert store_main(["--port", "70000"]) == 2
    assert "--port 70000 is not a TCP port" in capsys.readouterr().err


# -- the batch script's exit code ------------------------------------------------------------

SBATCH = REPO / "nansentinel" / "files" / "slurm" / "nansentinel.sbatch"
#: Stand-ins for the tools the script calls: `srun` leaves each node's launcher code as the
#: real per-node wrapper does (FAKE_CODES, one per node; "-" leaves none, as a killed one).
_FAKES = {
    "nansentinel": """#!/bin/bash
case $1 in
  excluded) echo "${FAKE_SKIP:-}" ;;
  store) for a in "$@"; do case $a in --port-file=*) echo 29400 > "${a#--port-file=}";; esac
         done; echo $$ > "$FAKE_DIR/store.pid"; trap '' TERM; exec sleep 60 ;;
esac
""",
    "scontrol": """#!/bin/bash
case "$1 $2" in
  "show job") echo "JobId=$4 JobState=${FAKE_STATE:-RUNNING}" \\
                   "Command=$FAKE_DIR/nansentinel.sbatch" ;;
  "show hostnames") echo "$3" | tr ',' '\\n' ;;
esac
""",
    "squeue": """#!/bin/bash
case "$*" in
  *-s*) printf '%s.batch\\n%s.0\\n' "$SLURM_JOB_ID" "$SLURM_JOB_ID" ;;
  *) echo 1:59 ;;
esac
""",
    "scancel": """#!/bin/bash
echo "$*" >> "$FAKE_DIR/scancel-args"
touch "$FAKE_DIR/stop"
""",
    "srun": """#!/bin/bash
if [ -n "${FAKE_SRUN_WAITS:-}" ]; then  # trains until the step is signalled, or 3 s
  trap 'touch "$FAKE_DIR/stop"' TERM
  touch "$FAKE_DIR/srun-started"
  for _ in $(seq 30); do [ -e "$FAKE_DIR/stop" ] && break; sleep 0.1; done
fi
i=0; worst=0; codes=$FAKE_CODES
if [ -n "${FAKE_KILL_STORE:-}" ]; then  # the store dies mid-run, in the first attempt only
  if [ -e "$FAKE_DIR/killed" ]; then codes=$FAKE_CODES_AFTER
  else kill -9 "$(<"$FAKE_DIR/store.pid")"; touch "$FAKE_DIR/killed"; fi
fi
for code in $codes; do
  i=$((i + 1))
  [ "$code" = - ] && continue
  echo "$code" > "$LAUNCHER_EXIT_DIR/node$i"
  ((code > worst)) && worst=$code
done
echo "srun $*" > "$FAKE_DIR/srun-args"
exit $worst
""",
}


def _fake_tools(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in _FAKES.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(("codes", "job_exit", "says"), [
    ("0 0 0", 0, ""),
    ("0 0 4", 0, "node3 excluded by the sentinel and left the job (exit 4); the job completed "
                 "on node1 node2: exit 0"),
    ("4 4 4", 4, "every node was excluded"),
    ("0 3 4", 3, "launcher(s) failed: node2 (exit 3); job exit 3"),
    ("0 1 5", 5, "node2 (exit 1) node3 (exit 5)"),
    ("143 143 143", 143, "job exit 143"),
    ("0 0 -", 1, "1 of 3 launcher(s) left no exit code (killed?); srun exited 0"),
], ids=["ok", "excluded", "all-excluded", "abort", "worst", "sigterm", "killed"])
def test_the_job_exit_code_is_derived_from_each_launcher(
    tmp_path: Path, codes: str, job_exit: int, says: str
) -> None:
    bin_dir = _fake_tools(tmp_path)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_DIR": str(tmp_path), "FAKE_CODES": codes,
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1,node2,node3", "SLURM_NNODES": "3",
           "NPROC_PER_NODE": "1", "SHARED": str(tmp_path / "shared"), "USER": "u"}
    done = subprocess.run(["bash", str(SBATCH), "train.py"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == job_exit, done.stderr
    assert says in done.stderr
    assert "--rdzv-conf=is_host=0" in (tmp_path / "srun-args").read_text()


@pytest.mark.parametrize("restarts", ["1", "0"])
def test_a_store_that_died_mid_run_is_started_again_or_the_log_says_how(
    tmp_path: Path, restarts: str
) -> None:
    bin_dir = _fake_tools(tmp_path)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_DIR": str(tmp_path), "FAKE_CODES": "5 5 5",
           "FAKE_CODES_AFTER": "0 0 0", "FAKE_KILL_STORE": "1", "STORE_RESTARTS": restarts,
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1,node2,node3", "SLURM_NNODES": "3",
           "NPROC_PER_NODE": "1", "SHARED": str(tmp_path / "shared"), "USER": "u"}
    done = subprocess.run(["bash", str(SBATCH), "train.py"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    pid = (tmp_path / "killed").exists() and done.stderr.split("(pid ", 1)[1].split(")")[0]
    gone = f"the rendezvous store at {os.uname().nodename}:29400 (pid {pid}) died during the run"
    if restarts == "1":
        assert done.returncode == 0, done.stderr
        assert (f"{gone} (killed by signal 9) and the launchers stopped the run; starting the "
                "store and the training again (1 of STORE_RESTARTS=1): it resumes from its last "
                "checkpoint") in done.stderr
        first = tmp_path / "shared" / "7" / "exit.store-restart-1"
        assert sorted(p.read_text() for p in first.iterdir()) == ["5\n"] * 3
    else:
        assert done.returncode == 5, done.stderr
        assert (f"{gone} (killed by signal 9) and the launchers stopped the run "
                "(STORE_RESTARTS=0 spent); to go on from the last checkpoint, submit the job "
                "again") in done.stderr


@pytest.mark.parametrize("to", ["script", "job"])
def test_sigterm_to_the_script_alone_is_passed_once_to_the_training(
    tmp_path: Path, to: str
) -> None:
    """Slurm's early warning (--signal=B:TERM) reaches the script alone: it signals the
    training's step (not the batch step) once. At a time limit or scancel every process of
    the job gets SIGTERM (here: the script's process group), the script's canary too, and
    the script sends nothing more."""
    bin_dir = _fake_tools(tmp_path)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_DIR": str(tmp_path), "FAKE_CODES": "143 143",
           "FAKE_SRUN_WAITS": "1", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node1,node2",
           "SLURM_NNODES": "2", "NPROC_PER_NODE": "1", "SHARED": str(tmp_path / "shared"),
           "USER": "u"}
    script = subprocess.Popen(["bash", str(SBATCH), "train.py"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "srun-started").exists():
            assert time.monotonic() < deadline and script.poll() is None
            time.sleep(0.05)
        if to == "script":
            script.send_signal(signal.SIGTERM)
        else:
            os.killpg(script.pid, signal.SIGTERM)
        _, err = script.communicate(timeout=30)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
    assert script.returncode == 143, err
    if to == "script":
        assert (tmp_path / "scancel-args").read_text() == "--signal=TERM 7.0\n"
        assert ("received SIGTERM with 1:59 left (Slurm's early warning, --signal=B:TERM@SECONDS)"
                in err), err
        assert ("stopped before the time limit on Slurm's early warning: the launchers on node1 "
                "node2 exited 143 after their ranks' common step; job exit 143") in err
    else:
        assert not (tmp_path / "scancel-args").exists()
        assert "received SIGTERM (time limit or scancel)" in err
        assert "launcher(s) failed: node1 (exit 143) node2 (exit 143); job exit 143" in err


def test_the_batch_script_leaves_out_nodes_already_excluded(tmp_path: Path) -> None:
    """An operator resumed node2 without clearing it: the script trains on two nodes."""
    bin_dir = _fake_tools(tmp_path)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_DIR": str(tmp_path), "FAKE_CODES": "0 0",
           "FAKE_SKIP": "node2", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]",
           "SLURM_NNODES": "3", "NPROC_PER_NODE": "1", "SHARED": str(tmp_path / "s"),
           "USER": "u"}
    done = subprocess.run(["bash", str(SBATCH), "train.py"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "node2 excluded by an earlier run" in done.stderr
    args = (tmp_path / "srun-args").read_text()
    assert "--nodes=2" in args and "--exclude=node2" in args and "--nnodes=1:2" in args


def test_the_batch_script_without_gpus_or_workers_per_node_says_what_to_set(
    tmp_path: Path,
) -> None:
    bin_dir = _fake_tools(tmp_path)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1",
           "SLURM_NNODES": "1", "SLURM_GPUS_PER_NODE": "0", "SHARED": str(tmp_path / "s"),
           "USER": "u"}
    done = subprocess.run(["bash", str(SBATCH), "train.py"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2 and "set NPROC_PER_NODE" in done.stderr, done.stderr
