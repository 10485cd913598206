"""The cluster's ordinary faults across network-namespace hosts (issue 58): a lost host, a
partition, slow steps and SIGTERM, each with the exit code every host's launcher must give,
the time it may take, and no process left behind on any host. (A dead worker, SIGKILLed mid
step, is tests/distributed/test_dead_peer.py: its peers name it by the same path as a lost
host's, and the launcher's exit 1 for a worker lost to a signal is tests/unit/test_agent.py.)

Every run has two training hosts of one rank each (``node2``, ``node3``) under ``nansentinel
run`` with gloo, and the c10d rendezvous store on a third host that trains nothing
(``node1``), as docs/launch.md advises: the faults then hit training hosts only, and a cut-off
host is cut off from the store too. Bounds are derived from the sentinel's own deadlines
(``exchange_timeout`` :data:`TIMEOUT`), plus :data:`SLACK` for starting and ending processes
on a loaded two-core box.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nansentinel.common.exitcodes import (
    EXIT_EXCHANGE_TIMEOUT,
    EXIT_OK,
    EXIT_SIGTERM,
)
from nansentinel.launcher.rendezvous_guard import POLL_BOUND_S, SHUTDOWN_MARGIN_S
from nansentinel.launcher.signals import EXIT_MARGIN_S, WORKER_GRACE_S
from nansentinel.wire.exchange import diagnosis_grace, store_bound
from nansentinel.wire.watchdog import naming_seconds, watchdog_deadline

from .netns import Host, NetnsCluster, unavailable_reason

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "workers" / "fault_worker.py"
TIMEOUT = 4.0
#: Seconds for what the bounds do not count: a worker's exit, its launcher noticing (the
#: monitor interval), the launcher's summary.
SLACK = 10.0
#: A live rank that saw a peer die names it and exits: its wait for the check-ins, the
#: answer, and rank 0's linger for the others' diagnosis.
NAMED_WITHIN = naming_seconds(TIMEOUT) + diagnosis_grace(TIMEOUT) + SLACK
#: A rank cut off from everyone (rank 1: no linger): the watchdog's deadline, then a store
#: that never answers, given up after its bound.
CUT_OFF_WITHIN = watchdog_deadline(TIMEOUT) + store_bound(TIMEOUT) + SLACK
#: The rendezvous's close timeout in the partition test (torchrun's default: 30 s).
CLOSE_S = 5.0
#: A launcher whose worker has ended, cut off from the store: its next poll of the
#: rendezvous given up, then its close of the rendezvous.
LAUNCHER_AFTER = POLL_BOUND_S + CLOSE_S + SHUTDOWN_MARGIN_S
_STORE_SERVER = (
    "import datetime, sys, time, torch.distributed as d; "
    "s = d.TCPStore('0.0.0.0', int(sys.argv[1]), is_master=True, wait_for_workers=False, "
    "timeout=datetime.timedelta(minutes=5)); time.sleep(300)"
)


class Job:
    """One job on a fresh three-host cluster: the store on ``store``, one launcher on each
    of ``trainers``."""

    def __init__(self, cluster: NetnsCluster, out: Path) -> None:
        self.cluster, self.out = cluster, out
        self.store, *self.trainers = cluster.hosts
        self.procs: dict[str, object] = {}
        self.port = random.randrange(20000, 60000)
        cluster.start(self.store, [sys.executable, "-c", _STORE_SERVER, str(self.port)],
                      env=_env(), log_name="store")

    def start(self, *worker_args: str, rdzv_conf: str = "") -> None:
        for h in self.trainers:
            conf = [f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []
            argv = [sys.executable, "-m", "nansentinel", "run",
                    f"--report-dir={self.out}/reports-{h.name}", "--metrics-port=0",
                    f"--exchange-timeout={TIMEOUT:g}",
                    "--nnodes=2", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-id=faults",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={self.store.ip}:{self.port}",
                    "--monitor-interval=0.5", *conf, str(WORKER), str(self.out), *worker_args]
            self.procs[h.name] = self.cluster.start(h, argv, env=_env())

    def wait_for(self, name: str, timeout: float = 90) -> float:
        """Wait until ``OUT/name`` exists; the monotonic time it was seen."""
        deadline = time.monotonic() + timeout
        while not (self.out / name).exists():
            assert time.monotonic() < deadline, f"{name} never appeared: {self.logs()}"
            time.sleep(0.1)
        return time.monotonic()

    def ends(self, timeout: float) -> dict[str, tuple[int | None, float]]:
        """Each launcher's exit code and when it ended (monotonic), None if still running."""
        deadline = time.monotonic() + timeout
        ended: dict[str, tuple[int | None, float]] = {}
        while len(ended) < len(self.procs) and time.monotonic() < deadline:
            for name, proc in self.procs.items():
                code = proc.poll()  # type: ignore[attr-defined]
                if name not in ended and code is not None:
                    ended[name] = (code, time.monotonic())
            time.sleep(0.1)
        return {n: ended.get(n, (None, time.monotonic())) for n in self.procs}

    def leftovers(self) -> dict[str, list[int]]:
        """Processes still alive on each training host, a few seconds' grace given."""
        deadline = time.monotonic() + 5
        while True:
            left = {h.name: self.cluster.pids(h) for h in self.trainers}
            if not any(left.values()) or time.monotonic() > deadline:
                return {n: p for n, p in left.items() if p}
            time.sleep(0.2)

    def verdict(self, host: str) -> dict[str, object]:
        found = list((self.out / f"reports-{host}").glob("runs/*/verdicts/rank-*.json"))
        assert len(found) == 1, (host, found, self.logs())
        return dict(json.loads(found[0].read_text()))

    def logs(self) -> dict[str, str]:
        return {h.name: self.cluster.log(h.name)[-3000:] for h in self.trainers}


def _env() -> dict[str, str]:
    return {"PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "eth0"}


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    for key in [k for k in os.environ if k.startswith("NANSENTINEL_")]:
        monkeypatch.delenv(key)
    out = tmp_path / "out"
    out.mkdir()
    with NetnsCluster(3, tmp_path / "cluster") as cluster:
        yield Job(cluster, out)


@pytest.mark.timeout(150)
def test_a_lost_host_takes_its_worker_along_and_the_live_host_exits_5(job: Job) -> None:
    """node3's launcher is SIGKILLed at step 5 (a lost host: nothing of it runs any more
    code). Its worker must not outlive it: the kernel kills it (orphan_guard.py), so the
    namespace is empty at once, and node2's rank names rank 1 on node3 and exits 5."""
    job.start("--steps=400", "--step-sleep=0.05")
    begun = job.wait_for("at-node3-5")
    os.kill(job.procs["node3"].pid, signal.SIGKILL)  # type: ignore[attr-defined]
    gone = time.monotonic() + 3
    while job.cluster.pids(job.cluster.host("node3")) and time.monotonic() < gone:
        time.sleep(0.1)
    assert not job.cluster.pids(job.cluster.host("node3")), "the worker outlived its launcher"
    ends = job.ends(NAMED_WITHIN)
    logs = job.logs()
    assert {n: c for n, (c, _) in ends.items()} == {
        "node2": EXIT_EXCHANGE_TIMEOUT, "node3": -signal.SIGKILL}, logs
    assert ends["node2"][1] - begun < NAMED_WITHIN
    verdict = job.verdict("node2")
    assert verdict["missing"] == [1] and "no answer from rank 1 (node3)" in str(
        verdict["message"]), verdict
    assert not job.leftovers()


@pytest.mark.timeout(200)
def test_a_partition_ends_both_sides_within_their_bounds(job: Job) -> None:
    """node3's link goes down after step 4: no reset, packets just stop, and node3 loses
    the workers' store (served by node2's agent) too. node2's rank names rank 1 on node3 and
    exits 5. node3's rank, whose all-reduce never returns, is ended by its watchdog from
    outside the stuck thread, exit 5, its verdict naming the store it could not reach; its
    launcher, whose polls and close of the rendezvous cannot reach the store either, gives
    them up within their bounds and exits 5 too. (The rendezvous's close timeout is 5 s
    here, against torchrun's 30 s default, to keep the test short.)"""
    job.start("--steps=400", "--step-sleep=0.05", rdzv_conf=f"close_timeout={CLOSE_S:g}")
    job.wait_for("at-node3-4")
    job.cluster.cut(job.cluster.host("node3"))
    cut = time.monotonic()
    ends = job.ends(CUT_OFF_WITHIN + LAUNCHER_AFTER)
    logs = job.logs()
    print({n: (c, round(t - cut, 1)) for n, (c, t) in ends.items()})  # seconds after the cut
    assert {n: c for n, (c, _) in ends.items()} == {
        "node2": EXIT_EXCHANGE_TIMEOUT, "node3": EXIT_EXCHANGE_TIMEOUT}, logs
    assert ends["node2"][1] - cut < NAMED_WITHIN + TIMEOUT
    assert ends["node3"][1] - cut < CUT_OFF_WITHIN + LAUNCHER_AFTER
    assert "no answer from rank 1 (node3)" in str(job.verdict("node2")["message"])
    verdict = job.verdict("node3")
    assert verdict["outcome"] == "exchange_timeout", verdict
    # The workers' store is the one torchrun's agent of group rank 0 serves (node2's).
    assert "could not reach the rendezvous store at node2:" in str(verdict["message"]), verdict
    assert "EXIT_EXCHANGE_TIMEOUT" in logs["node3"], logs["node3"]
    assert not job.leftovers()


def _worker_alive(job: Job, host: Host) -> bool:
    """A process other than the launcher lives on ``host``."""
    return bool(set(job.cluster.pids(host)) - {job.procs[host.name].pid})  # type: ignore[attr-defined]


@pytest.mark.timeout(150)
def test_slow_healthy_steps_raise_no_alarm(job: Job) -> None:
    """node3 pauses 3/4 of the exchange timeout before the backward of two steps, while
    node2 waits for it in the gradient all-reduce: both finish, both exit 0."""
    job.start("--steps=6", "--host=node3", f"--pause={0.75 * TIMEOUT:g}", "--pause-steps=2,4")
    ends = job.ends(90)
    logs = job.logs()
    assert {n: c for n, (c, _) in ends.items()} == {"node2": EXIT_OK, "node3": EXIT_OK}, logs
    assert sorted(p.name for p in job.out.glob("done-*")) == ["done-node2.json",
                                                               "done-node3.json"]
    verdicts = [json.loads(v.read_text()) for v in job.out.glob("reports-*/runs/*/verdicts/*")]
    assert [v["outcome"] for v in verdicts] == ["closed", "closed"], verdicts
    assert not job.leftovers()


@pytest.mark.timeout(150)
def test_sigterm_stops_every_host_with_143_and_leaves_nothing(job: Job) -> None:
    """A scheduler's time limit: SIGTERM to both launchers mid-run. Each passes it on to its
    worker at once; the workers' stop requests meet in the health exchange, so both stop
    after the same step, each with a whole checkpoint of that step and a ``stopped`` verdict;
    each launcher exits 143 within its bound (here at once: the workers stop at the next step
    boundary, well inside WORKER_GRACE_S), and no process is left on any host."""
    job.start("--steps=400", "--step-sleep=0.05")
    job.wait_for("at-node2-3")
    job.wait_for("at-node3-3")
    for proc in job.procs.values():
        os.kill(proc.pid, signal.SIGTERM)  # type: ignore[attr-defined]
    sent = time.monotonic()
    ends = job.ends(WORKER_GRACE_S + EXIT_MARGIN_S + SLACK)
    logs = job.logs()
    assert {n: c for n, (c, _) in ends.items()} == {
        "node2": EXIT_SIGTERM, "node3": EXIT_SIGTERM}, logs
    assert all(when - sent < WORKER_GRACE_S + EXIT_MARGIN_S for _, when in ends.values())
    assert not job.leftovers()
    stopped = [json.loads(p.read_text()) for p in sorted(job.out.glob("stopped-*.json"))]
    assert len(stopped) == 2 and len({s["step"] for s in stopped}) == 1, (stopped, logs)
    assert {s["signal"] for s in stopped} == {signal.SIGTERM}
    import torch

    assert not list(job.out.glob(".ckpt-*"))  # nothing torn beside the whole checkpoints
    states = [torch.load(p) for p in sorted(job.out.glob("ckpt-*.pt"))]
    assert [s["step"] for s in states] == [stopped[0]["step"]] * 2
    verdicts = [json.loads(v.read_text()) for v in job.out.glob("reports-*/runs/*/verdicts/*")]
    assert [(v["outcome"], v["step"]) for v in verdicts] == [
        ("stopped", stopped[0]["step"])] * 2, verdicts
