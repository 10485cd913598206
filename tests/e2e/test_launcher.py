"""``nansentinel run`` end to end: real torchrun agents, real worker processes.

The first tests call the launcher in-process on one node (``--standalone``), as torch's own
launcher tests do. The last ones build three "hosts" from network namespaces
(tests/e2e/netns.py) and run one launcher per host over a c10d rendezvous: six ranks on
three hostnames, then the real Sentinel excluding a host mid-run while the other two carry
on from their checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.common.exitcodes import (
    EXIT_EXCHANGE_TIMEOUT,
    EXIT_HOST_EXCLUDED,
    EXIT_NONFINITE_ABORT,
    EXIT_OK,
)
from nansentinel.common.verdicts import RankVerdict, write_verdict
from nansentinel.launcher.excluded_command import excluded_main
from nansentinel.launcher.run import main

from .netns import NetnsCluster, unavailable_reason

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
HOST = "e2e-host-a"
#: The --on-exclude hook of these tests: records its arguments, checks the environment.
HOOK = f"{sys.executable} {WORKERS / 'hook_recorder.py'}"


@pytest.fixture(autouse=True)
def _launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers import nansentinel from this checkout; the host has a known name; no
    NANSENTINEL_* from the caller's shell leaks in."""
    for key in [k for k in os.environ if k.startswith("NANSENTINEL_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("NANSENTINEL_HOSTNAME", HOST)


@pytest.mark.timeout(120)
def test_four_workers_each_touch_their_rank_across_a_restart(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env_before = dict(os.environ)
    code = main([
        "--metrics-port", "0", "--host-strikes=7", "--exclusion-file", str(tmp_path / "x.jsonl"),
        "--standalone", "--nproc-per-node=4", "--max-restarts=1", "--monitor-interval=0.2",
        str(WORKERS / "touch_rank.py"), str(out), "--fail-first",
    ])
    assert code == EXIT_OK
    seen = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    assert set(seen) == {0, 1, 2, 3}
    for rank, env in seen.items():
        assert env["WORLD_SIZE"] == "4" and env["RANK"] == str(rank)
        # torchrun's --max-restarts reached the agent, which restarted the group once.
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert env["NANSENTINEL_METRICS_PORT"] == "0"
        assert env["NANSENTINEL_HOST_STRIKES"] == "7"
        assert env["NANSENTINEL_EXCLUSION_FILE"] == str(tmp_path / "x.jsonl")
        assert env["NANSENTINEL_JOB_ID"] == env["TORCHELASTIC_RUN_ID"]
        assert env["NANSENTINEL_RUN_DIR"]
    # A clean run leaves no run directory, and the caller's environment is as it was.
    assert not Path(seen[0]["NANSENTINEL_RUN_DIR"]).exists()
    assert dict(os.environ) == env_before


@pytest.mark.timeout(60)
def test_stale_verdicts_in_a_reused_run_dir_do_not_exclude(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user-set NANSENTINEL_RUN_DIR may hold an earlier run's verdicts (this host
    excluded, since cleared by an operator); they must not keep the new run out."""
    run_dir = tmp_path / "run"
    write_verdict(run_dir, RankVerdict(rank=0, outcome="excluded", step=3, excluded_host=HOST))
    monkeypatch.setenv("NANSENTINEL_RUN_DIR", str(run_dir))
    out = tmp_path / "out"
    out.mkdir()
    code = main(["--standalone", "--nproc-per-node=2", "--monitor-interval=0.2",
                 str(WORKERS / "touch_rank.py"), str(out)])
    assert code == EXIT_OK
    assert sorted(p.name for p in out.iterdir()) == ["rank-0.json", "rank-1.json"]
    assert (run_dir / "verdicts.attempt-0" / "rank-0.json").exists()  # kept, set aside


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("outcome", "extra", "code", "root_cause"),
    [
        ("aborted", [], EXIT_NONFINITE_ABORT, "the sentinel aborted the run"),
        ("exchange_timeout", [], EXIT_EXCHANGE_TIMEOUT, "the sentinel's health exchange"),
        # No restart left (--max-restarts=0): the mapping alone says this host was excluded.
        ("excluded", ["--excluded-host", HOST], EXIT_HOST_EXCLUDED, f"this host ({HOST})"),
    ],
)
def test_verdicts_become_a_summary_and_an_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], outcome: str, extra: list[str],
    code: int, root_cause: str,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    hook_out = tmp_path / "hook.txt"
    got = main([
        "--report-dir", str(tmp_path / "reports"),
        f"--on-exclude={HOOK} {hook_out} {{host}} {{reason}}",
        "--standalone", "--nproc-per-node=2", "--monitor-interval=0.2",
        str(WORKERS / "verdict_worker.py"), str(out), outcome, *extra,
    ])
    assert got == code
    err = capsys.readouterr().err
    # Both ranks are listed; which one torchrun saw fail first (the other may be stopped
    # by the agent before its own exit) is a race, so only one exit code is certain.
    assert f"rank 0 (local_rank 0) on host {HOST}" in err
    assert f"rank 1 (local_rank 1) on host {HOST}" in err
    assert "exitcode 1" in err
    assert f"verdict: {outcome} at step 7" in err and "report_path: /reports/step-7.json" in err
    assert f"Root cause: {root_cause}" in err
    assert "Traceback" not in err.split("=" * 78)[1]  # the summary block itself is clean
    # The run directory (verdicts) is kept with the reports for the post-mortem.
    assert list((tmp_path / "reports" / "runs").glob(f"nansentinel-run-{HOST}-*/verdicts"))
    if code == EXIT_HOST_EXCLUDED:
        assert hook_out.read_text() == f"{HOST}|non-finite loss on rank 1 at step 7 (excluded)"
    else:
        assert not hook_out.exists()


@pytest.mark.timeout(120)
def test_excluded_host_is_not_restarted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The sentinel excludes this host at the first attempt; restarts are left, but the
    launcher's rendezvous guard keeps the agent from starting the workers again."""
    out = tmp_path / "out"
    out.mkdir()
    excl = tmp_path / "shared" / "excluded.jsonl"
    hook_out = tmp_path / "hook.txt"
    got = main([
        "--exclusion-file", str(excl),
        f"--on-exclude={HOOK} {hook_out} {{host}} {{reason}}",
        "--standalone", "--nproc-per-node=2", "--max-restarts=2", "--monitor-interval=0.2",
        str(WORKERS / "verdict_worker.py"), str(out), "excluded", "--excluded-host", HOST,
        "--record",
    ])
    assert got == EXIT_HOST_EXCLUDED
    # Only the first attempt ran. (Rank 1 may be stopped by the agent before it writes its
    # marker, once rank 0 has failed: which ranks got that far is a race; no restart is not.)
    started = sorted(p.name for p in out.iterdir())
    assert "attempt-0-rank0" in started and set(started) <= {"attempt-0-rank0", "attempt-0-rank1"}
    assert hook_out.read_text() == f"{HOST}|non-finite loss on rank 1 at step 7 (excluded)"
    assert [r.host for r in ExclusionStore(excl).records()] == [HOST]  # rank 0's, no copy
    err = capsys.readouterr().err
    assert f"host {HOST} is excluded" in err or f"this host ({HOST}) is excluded" in err


@pytest.mark.timeout(60)
def test_host_already_excluded_does_not_join(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    excl = tmp_path / "excluded.jsonl"
    reason = "3 non-finite grads in 100 steps on ranks 4,5 (it's 'bad')"
    ExclusionStore(excl).add(ExclusionRecord(host=HOST, reason=reason, step=41, job_id="old"))
    hook_out = tmp_path / "hook.txt"
    got = main([
        "--exclusion-file", str(excl),
        f"--on-exclude={HOOK} {hook_out} {{host}} {{reason}}",
        "--standalone", "--nproc-per-node=2", str(WORKERS / "touch_rank.py"), str(out),
    ])
    assert got == EXIT_HOST_EXCLUDED
    assert hook_out.read_text() == f"{HOST}|{reason}"
    assert not list(out.iterdir())  # no worker was started
    err = capsys.readouterr().err
    assert f"host {HOST} is excluded" in err and "--clear" in err and "step 41" in err


# -- several hosts: network namespaces -------------------------------------------------------


def _netns_or_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    # Each namespace host is named by its own hostname, not by the in-process tests' name.
    monkeypatch.delenv("NANSENTINEL_HOSTNAME")


def _run_argv(cluster: NetnsCluster, *args: str) -> list[str]:
    # Inside namespaces we just created nothing else listens, so any port is free there.
    port = random.randrange(20000, 60000)
    endpoint = f"{cluster.hosts[0].ip}:{port}"
    return [sys.executable, "-m", "nansentinel", "run", *args[:-1],
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--monitor-interval=0.5",
            args[-1]]


def _elastic_exclusion(shared: Path, rdzv_id: str) -> list[str]:
    """The options of the netns exclusion runs (the sentinel's, then torchrun's: put other
    sentinel options before them): 3 agents of 2 ranks that may go on with 2, a
    host excluded after 3 blames, and keep-alive expiry (5 s x 12 = 60 s) longer than the join
    timeout, so the survivors finish only if the excluded agent really leaves the round, not
    by timing it out."""
    return [
        f"--exclusion-file={shared}/excluded.jsonl", f"--report-dir={shared}/reports",
        "--metrics-port=0", "--host-strikes=3", "--exchange-timeout=30",
        "--nnodes=2:3", "--nproc-per-node=2", "--max-restarts=2", f"--rdzv-id={rdzv_id}",
        "--rdzv-conf=join_timeout=30,last_call_timeout=3,keep_alive_interval=5,"
        "keep_alive_max_attempt=12",
    ]


def _netns_env() -> dict[str, str]:
    return {"PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "eth0"}


@pytest.mark.timeout(90)
def test_three_hosts_six_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _netns_or_skip(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    with NetnsCluster(3, tmp_path / "cluster") as cluster:
        base = _run_argv(cluster, "--nnodes=3", "--nproc-per-node=2", "--rdzv-id=six",
                         "--rdzv-conf=join_timeout=40", str(WORKERS / "allreduce_worker.py"))
        procs = [cluster.start(h, [*base, str(out)], env=_netns_env()) for h in cluster.hosts]
        codes = cluster.wait(procs, timeout=60)
        logs = {h.name: cluster.log(h.name)[-3000:] for h in cluster.hosts}
    assert codes == [0, 0, 0], logs
    receipts = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert sorted(r["rank"] for r in receipts) == list(range(6))
    assert {r["hostname"] for r in receipts} == {"node1", "node2", "node3"}
    assert all(r["world_size"] == 6 and r["sum"] == 6.0 for r in receipts)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("names", "bad"),
    [
        # node0 sorts first, so it is the agents' group rank 0, which (with torch's shared
        # TCP store) hosted the workers' store: the survivors must move it. (The last agent
        # excluded, with the same resume checked, is the hostile host name's test below.)
        (("node1", "node2", "node0"), "node0"),
    ],
    ids=["agent-rank-0"],
)
def test_excluded_host_leaves_and_the_others_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    names: tuple[str, ...], bad: str,
) -> None:
    """The real Sentinel, with a fire drill: non-finite gradients on every rank of one host
    at steps 5-7; three strikes exclude it at step 7."""
    _netns_or_skip(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    shared = tmp_path / "shared"
    excl = shared / "excluded.jsonl"
    with NetnsCluster(3, tmp_path / "cluster", names=names) as cluster:
        base = _run_argv(
            cluster, f"--on-exclude={HOOK} '{out}/hook-{{host}}.txt' {{host}} {{reason}}",
            *_elastic_exclusion(shared, "excl"),
            str(WORKERS / "sentinel_worker.py"),
        )
        args = [str(out), "--steps=12", "--full-world=6"]
        env = {**_netns_env(), "NANSENTINEL_INJECT": f"kind=grad,host={bad},steps=5-7"}
        procs = [cluster.start(h, [*base, *args], env=env) for h in cluster.hosts]
        codes = dict(zip(names, cluster.wait(procs, timeout=90), strict=True))
        logs = {n: cluster.log(n)[-4000:] for n in names}

    assert codes == {n: EXIT_HOST_EXCLUDED if n == bad else EXIT_OK for n in names}, logs
    assert "EXIT_HOST_EXCLUDED" in logs[bad] and f"excluded_host: {bad}" in logs[bad]
    reason = f"host {bad} blamed 3 times within 100 steps"
    assert (out / f"hook-{bad}.txt").read_text() == f"{bad}|{reason}"
    assert [p.name for p in out.glob("hook-*")] == [f"hook-{bad}.txt"]
    done = [json.loads(p.read_text()) for p in out.glob("done-*.json")]
    # Two hosts x two ranks, resumed from the checkpoint taken after step 5 (steps 5 and 6
    # were skipped, step 7 excluded the host). A survivor's agent counts a restart when it
    # sees its own workers fail first; when it first sees the other survivor waiting in the
    # rendezvous it restarts for the membership change, which torchrun does not count.
    assert sorted(d["rank"] for d in done) == [0, 1, 2, 3]
    assert {d["hostname"] for d in done} == {n for n in names if n != bad}
    assert all(d["world_size"] == 4 and d["restart_count"] in (0, 1) and d["start"] == 6
               for d in done), done
    assert any(d["restart_count"] == 1 for d in done), done

    assert excluded_main(["--exclusion-file", str(excl)]) == EXIT_OK
    listing = capsys.readouterr().out
    assert listing.startswith(f"{bad}  step 7") and "job excl" in listing and reason in listing
    assert ExclusionStore(excl).excluded_hosts() == {bad}


#: A host name as hostile as an environment variable can carry: command substitution,
#: backticks, both quotes, ``;``, a newline, non-ASCII and length. It must reach the
#: --on-exclude hook as text and nothing else may run.
HOSTILE = ("evil$(touch${IFS}pwned)`touch pwned2`'\"; touch pwned3\n"
           "nœud-节点-" + "x" * 300)


@pytest.mark.timeout(150)
def test_a_hostile_host_name_reaches_the_hook_as_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three agents; the third (the last agent) calls itself HOSTILE (NANSENTINEL_HOSTNAME)
    and its ranks get non-finite gradients at steps 5-7, so the sentinel excludes it and its
    launcher runs the hook with the name (and a reason that contains it) in the operator's
    usual quoting; the other two resume from the checkpoint and train to the end."""
    _netns_or_skip(monkeypatch)
    monkeypatch.chdir(tmp_path)  # the agents and the hook run here
    out = tmp_path / "out"
    out.mkdir()
    shared = tmp_path / "shared"
    hook_out = tmp_path / "hook.txt"
    with NetnsCluster(3, tmp_path / "cluster") as cluster:
        base = _run_argv(
            cluster, f'--on-exclude={HOOK} {hook_out} "excluded-{{host}}" "{{reason}}"',
            *_elastic_exclusion(shared, "hostile"),
            str(WORKERS / "sentinel_worker.py"),
        )
        args = [str(out), "--steps=12", "--full-world=6"]
        procs = []
        for h in cluster.hosts:
            env = _netns_env()
            if h is cluster.hosts[-1]:
                env.update(NANSENTINEL_HOSTNAME=HOSTILE, NANSENTINEL_INJECT="kind=grad,steps=5-7")
            procs.append(cluster.start(h, [*base, *args], env=env))
        codes = cluster.wait(procs, timeout=120)
        logs = {h.name: cluster.log(h.name)[-4000:] for h in cluster.hosts}
    assert codes == [EXIT_OK, EXIT_OK, EXIT_HOST_EXCLUDED], logs
    reason = f"host {HOSTILE} blamed 3 times within 100 steps"
    assert hook_out.read_text(encoding="utf-8") == f"excluded-{HOSTILE}|{reason}"
    assert ExclusionStore(shared / "excluded.jsonl").excluded_hosts() == {HOSTILE}
    leftovers = {p.name for root in (tmp_path, REPO) for p in root.glob("pwned*")}
    assert not leftovers  # nothing from the name ran, wherever the hook's cwd was
    # The survivors: two hosts x two ranks, resumed from the checkpoint taken after step 5
    # (steps 5 and 6 were skipped, step 7 excluded the host); see the test above.
    done = [json.loads(p.read_text()) for p in out.glob("done-*.json")]
    assert sorted(d["rank"] for d in done) == [0, 1, 2, 3]
    assert {d["hostname"] for d in done} == {h.name for h in cluster.hosts[:2]}
    assert all(d["world_size"] == 4 and d["restart_count"] in (0, 1) and d["start"] == 6
               for d in done), done


_STORE_SERVER = (
    "import datetime, sys, time, torch.distributed as d; "
    "s = d.TCPStore('0.0.0.0', int(sys.argv[1]), is_master=True, wait_for_workers=False, "
    "timeout=datetime.timedelta(minutes=5)); time.sleep(300)"
)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("store_apart", [False, True], ids=["store-on-bad-host", "store-apart"])
def test_the_store_hosts_exclusion_ends_the_job_unless_the_store_runs_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store_apart: bool
) -> None:
    """The bad host is the first training host. When it also serves the rendezvous store, its
    exclusion ends the job: exit 4 there, exit 3 with a clear line on the others. With the
    store on a fourth host that trains nothing (as the README shows), the others go on."""
    _netns_or_skip(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    shared = tmp_path / "shared"
    with NetnsCluster(4 if store_apart else 3, tmp_path / "cluster") as cluster:
        trainers = cluster.hosts[1:] if store_apart else cluster.hosts
        bad = trainers[0]
        port = random.randrange(20000, 60000)
        store = cluster.hosts[0]
        if store_apart:
            cluster.start(store, [sys.executable, "-c", _STORE_SERVER, str(port)],
                          env=_netns_env(), log_name="store")
        base = [sys.executable, "-m", "nansentinel", "run", *_elastic_exclusion(shared, "store"),
                "--rdzv-backend=c10d", f"--rdzv-endpoint={store.ip}:{port}",
                "--monitor-interval=0.5",
                str(WORKERS / "sentinel_worker.py"), str(out), "--steps=12", "--full-world=6"]
        env = {**_netns_env(), "NANSENTINEL_INJECT": f"kind=grad,host={bad.name},steps=5-7"}
        procs = [cluster.start(h, base, env=env) for h in trainers]
        codes = dict(zip([h.name for h in trainers], cluster.wait(procs, timeout=150),
                         strict=True))
        logs = {h.name: cluster.log(h.name)[-4000:] for h in trainers}
    others = [h.name for h in trainers if h is not bad]
    if store_apart:
        assert codes == {bad.name: EXIT_HOST_EXCLUDED, **dict.fromkeys(others, EXIT_OK)}, logs
        return
    assert codes == {bad.name: EXIT_HOST_EXCLUDED, **dict.fromkeys(others, EXIT_NONFINITE_ABORT)
                     }, logs
    assert "runs the rendezvous store" in logs[bad.name]
    for name in others:
        assert f"after host(s) {bad.name} were excluded" in logs[name], logs[name]
