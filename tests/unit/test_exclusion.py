"""Exclusion store, the rendezvous guard built on it, and ``nansentinel excluded``."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.common.exitcodes import EXIT_CONFIG, EXIT_OK
from nansentinel.common.verdicts import (
    STORE_GONE,
    RankVerdict,
    outcome_from_verdicts,
    read_verdicts,
    stop_cause,
    write_verdict,
)
from nansentinel.launcher.excluded_command import excluded_main
from nansentinel.launcher.rendezvous_guard import (
    ExclusionGuard,
    GuardedRendezvousHandler,
    HostExcludedExit,
    RendezvousStoreGone,
    TooFewHostsExit,
    store_failure,
)


def _record(host: str, step: int = 3, **kw: object) -> ExclusionRecord:
    return ExclusionRecord(host=host, reason=f"{host} poisoned the grads", step=step,
                           evidence={"bad_ranks": [2, 3], "strikes": 3}, job_id="job-1", **kw)


def test_add_then_read_back(tmp_path: Path) -> None:
    store = ExclusionStore(tmp_path / "sub" / "excluded.jsonl")
    assert store.records() == [] and not store.is_excluded("node3")
    rec = _record("node3")
    store.add(rec)
    store.add(_record("node7", step=9))
    first, second = store.records()
    assert first == rec  # every field survives the round trip
    assert (second.host, second.step) == ("node7", 9)
    assert store.excluded_hosts() == {"node3", "node7"}
    assert store.is_excluded("node3") and not store.is_excluded("node1")
    # One JSON object per line: greppable, tail-able.
    lines = store.path.read_text().splitlines()
    assert [json.loads(line)["host"] for line in lines] == ["node3", "node7"]


def _add_many(path: str, writer: int, count: int) -> None:
    store = ExclusionStore(path)
    for i in range(count):
        # Long reasons make a torn or interleaved write likely if the lock did not work.
        store.add(ExclusionRecord(host=f"w{writer}-{i}", reason="x" * 5000, step=i))


def test_concurrent_adds_from_processes_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "excluded.jsonl")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_add_many, args=(path, w, 20)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    hosts = ExclusionStore(path).excluded_hosts()
    assert hosts == {f"w{w}-{i}" for w in range(4) for i in range(20)}
    assert len(Path(path).read_text().splitlines()) == 80


def test_garbled_line_is_skipped_with_a_warning_naming_file_and_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = ExclusionStore(tmp_path / "excluded.jsonl")
    store.add(_record("node1"))
    with open(store.path, "a") as f:
        f.write('{"host": "node2", "reas\n')  # torn write
        f.write('["not", "an", "object"]\n')
    store.add(_record("node3"))
    with caplog.at_level(logging.WARNING, logger="nansentinel"):
        hosts = store.excluded_hosts()
    assert hosts == {"node1", "node3"}
    warnings = [r.getMessage() for r in caplog.records]
    assert any(str(store.path) in w and "line 2" in w for w in warnings)
    assert any("line 3" in w for w in warnings)


def test_record_after_a_torn_last_line_still_lands_on_its_own_line(tmp_path: Path) -> None:
    store = ExclusionStore(tmp_path / "excluded.jsonl")
    store.add(_record("node1"))
    with open(store.path, "a") as f:
        f.write('{"host": "node2", "reason": "a writer died he')  # no newline
    store.add(_record("node3"))
    assert store.excluded_hosts() == {"node1", "node3"}


def test_clear_removes_only_that_host_and_keeps_unreadable_lines(tmp_path: Path) -> None:
    store = ExclusionStore(tmp_path / "excluded.jsonl")
    store.add(_record("node3"))
    store.add(_record("node5"))
    with open(store.path, "a") as f:
        f.write("garbage that an operator may want to read\n")
    store.add(_record("node3", step=40))
    assert store.clear("node3") == 2
    assert store.excluded_hosts() == {"node5"}
    assert "garbage that an operator" in store.path.read_text()
    assert store.clear("node3") == 0
    assert ExclusionStore(tmp_path / "missing.jsonl").clear("node3") == 0
    assert not list(tmp_path.glob(".excluded.jsonl.*"))  # no temp file left behind


def test_record_rejects_a_record_without_a_host() -> None:
    with pytest.raises(ValueError, match="host"):
        ExclusionRecord.from_dict({"reason": "r", "step": 1})
    with pytest.raises(ValueError, match="evidence"):
        ExclusionRecord.from_dict({"host": "h", "evidence": [1]})


# -- the rendezvous guard -------------------------------------------------------------------


class _FakeExecutor:
    def __init__(self) -> None:
        self.ops: list[object] = []

    def run(self, op: object, deadline: float) -> None:
        self.ops.append(op)


class _FakeDynamicHandler:
    """Stands in for torch's DynamicRendezvousHandler: records what the wrapper calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._op_executor = _FakeExecutor()
        self.settings = SimpleNamespace(timeout=SimpleNamespace(close=timedelta(seconds=3)))
        self.use_agent_store = True

    def next_rendezvous(self) -> str:
        self.calls.append("next_rendezvous")
        return "rdzv-info"

    def shutdown(self) -> bool:
        self.calls.append("shutdown")
        return True

    def _stop_heartbeats(self) -> None:
        self.calls.append("stop_heartbeats")

    def num_nodes_waiting(self) -> int:
        return 2

    def get_run_id(self) -> str:
        return "job-1"


def _verdict(
    host: str, excluded: str | None, outcome: str = "excluded", rank: int = 0
) -> RankVerdict:
    return RankVerdict(rank=rank, local_rank=0, hostname=host, step=12, outcome=outcome,
                       message=f"{excluded} is bad", bad_ranks=[4],
                       bad_hosts=[excluded] if excluded else [], kinds=["grad"],
                       excluded_host=excluded)


def test_guard_lets_a_healthy_host_rejoin_and_archives_the_old_verdicts(tmp_path: Path) -> None:
    inner = _FakeDynamicHandler()
    guard = ExclusionGuard("node1", tmp_path, ExclusionStore(tmp_path / "x.jsonl"), "job-1")
    handler = GuardedRendezvousHandler(inner, guard)
    assert handler.next_rendezvous() == "rdzv-info"
    write_verdict(tmp_path, _verdict("node1", "node3"))  # another host was excluded
    assert handler.next_rendezvous() == "rdzv-info"
    assert inner.calls == ["next_rendezvous", "next_rendezvous"]
    assert not (tmp_path / "verdicts").exists()
    assert (tmp_path / "verdicts.attempt-0" / "rank-0.json").exists()
    assert guard.others_excluded == {"node3"}
    # The normal end of a job still closes the rendezvous, as torchrun does.
    assert handler.shutdown() is True and inner.calls[-1] == "shutdown"
    assert handler.get_backend() == "nansentinel"
    assert handler.num_nodes_waiting() == 2 and handler.get_run_id() == "job-1"


def test_guard_keeps_the_excluded_host_out_and_leaves_without_closing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

    monkeypatch.setattr("nansentinel.launcher.rendezvous_guard.RECORD_WAIT_S", 0.1)
    store = ExclusionStore(tmp_path / "x.jsonl")
    inner = _FakeDynamicHandler()
    guard = ExclusionGuard("node3", tmp_path / "run", store, "job-1")
    handler = GuardedRendezvousHandler(inner, guard)
    handler.next_rendezvous()
    # Rank 0's record never arrived: the guard writes one from this host's own verdict.
    write_verdict(tmp_path / "run", _verdict("node3", "node3", rank=4))
    with pytest.raises(HostExcludedExit) as info:
        handler.next_rendezvous()
    assert info.value.record.host == "node3" and "node3 is bad" in info.value.record.reason
    assert store.is_excluded("node3")
    assert inner.calls == ["next_rendezvous"]  # did not join the next round
    assert handler.shutdown() is True
    assert "shutdown" not in inner.calls  # closing would end the job for every host
    assert inner.calls[-1] == "stop_heartbeats"
    assert [type(op) for op in inner._op_executor.ops] == [_RendezvousExitOp]


def test_hosts_excluded_together_below_the_minimum_end_the_job_at_once(tmp_path: Path) -> None:
    """Three hosts, --nnodes=2:3: node1 and node3 excluded at one step leave node2 alone, so
    node2's agent does not wait out the join timeout in the next round: it stops, naming the
    hosts, the step and the minimum. One excluded host leaves two: the next round goes on."""
    class Info:  # torch's RendezvousInfo: what the guard reads of a round
        world_size = 3

    inner = _FakeDynamicHandler()
    inner.next_rendezvous = lambda: Info()  # type: ignore[method-assign]
    guard = ExclusionGuard("node2", tmp_path, None, "job-1", min_nodes=2)
    handler = GuardedRendezvousHandler(inner, guard)
    handler.next_rendezvous()
    assert guard.nodes == 3
    one = dataclasses.replace(_verdict("node2", "node3"), excluded_hosts=["node3"])
    write_verdict(tmp_path, one)
    handler.next_rendezvous()  # 2 hosts left: enough
    two = dataclasses.replace(_verdict("node2", "node1"), excluded_hosts=["node1", "node3"])
    write_verdict(tmp_path, two)
    with pytest.raises(TooFewHostsExit) as raised:
        handler.next_rendezvous()
    assert str(raised.value).startswith(
        "host(s) node1, node3 excluded by the sentinel at step 12 leave 1 of the 3 host(s), "
        "fewer than --nnodes's minimum of 2: the job cannot go on")
    assert guard.others_excluded == {"node1", "node3"}


def test_two_hosts_excluded_at_one_step_get_a_record_each(tmp_path: Path) -> None:
    """The stop path (one process) of a step that excludes node1 and node3: rank 0 writes one
    record per host, each with that host's strikes and ranks; the verdict names both."""
    import nansentinel
    from nansentinel.config import SentinelConfig
    from nansentinel.decide.policy import EXCLUDE, Decision
    from nansentinel.effects.stop import stop
    from nansentinel.result import Outcome, RankIdentity, StepResult
    from nansentinel.wire.context import alone
    from nansentinel.wire.view import RankHealth

    store = ExclusionStore(tmp_path / "excluded.jsonl")
    ctx = alone(SentinelConfig(exclusion_file=str(store.path), run_dir=str(tmp_path / "run")),
                job_id="job")
    bad = tuple(RankHealth(RankIdentity(r, 0, 1, host, "cpu"), ("grad",), False, 1.0, 1.0)
                for r, host in ((0, "node1"), (4, "node3")))
    decision = Decision(EXCLUDE, bad, reason="host node1 blamed 3 times within 100 steps; "
                        "host node3 blamed 4 times within 100 steps", exclude_host="node1",
                        strikes=3, also_exclude=(("node3", 4),))
    result = StepResult(step=7, applied=False, outcome=Outcome.EXCLUDED, bad_ranks=[0, 4],
                        bad_hosts=["node1", "node3"], kinds=["grad"], local_kinds=[],
                        local_loss=None, local_grad_norm=None, consecutive_skips=0)
    with pytest.raises(nansentinel.HostExcludedError):
        stop(ctx, decision, result, "nansentinel: excluding hosts node1, node3 at step 7.",
             lingering=False)
    records = {r.host: r for r in store.records()}
    assert {h: (r.reason, r.evidence["strikes"], r.evidence["bad_ranks"], r.step)
            for h, r in records.items()} == {
        "node1": ("host node1 blamed 3 times within 100 steps", 3, [0], 7),
        "node3": ("host node3 blamed 4 times within 100 steps", 4, [4], 7)}
    [left] = read_verdicts(tmp_path / "run").values()
    assert left.excludes == ["node1", "node3"] and left.excluded_host == "node1"


def test_a_verdict_names_every_host_excluded_at_its_step() -> None:
    both = dataclasses.replace(_verdict("node2", "node1"), excluded_hosts=["node1", "node3"])
    back = RankVerdict.from_json(both.to_json())
    assert back.excludes == ["node1", "node3"]
    assert outcome_from_verdicts({0: back}, "node3").exit_code == 4
    other = outcome_from_verdicts({0: back}, "node2")
    assert other.exit_code == 3 and other.explanation.startswith(
        "host(s) node1, node3 excluded by the sentinel and no restart is left")
    # A verdict of a version that knew one host only
    assert RankVerdict.from_json(_verdict("node2", "node1").to_json()).excludes == ["node1"]
    assert _verdict("node2", None, outcome="aborted").excludes == []


def _store_error(words: str) -> Exception:
    """What torch's c10d rendezvous raises when its store fails: a RendezvousConnectionError
    whose cause is the store's own error, C++ stack included."""
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    inner = DistNetworkError(f"{words}\nException raised from recvBytes at Utils.hpp:784 "
                             "(most recent call first):\nframe #0: c10::Error::Error(...)")
    outer = RendezvousConnectionError("The connection to the C10d store has failed. See inner "
                                      "exception for details.")
    outer.__cause__ = inner
    return outer


def test_store_failure_names_the_store_in_one_line_and_nothing_else() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError

    assert store_failure(_store_error("Connection reset by peer")) == "Connection reset by peer"
    assert store_failure(_store_error("")) == "DistNetworkError"
    assert store_failure(RendezvousClosedError()) is None
    assert store_failure(RendezvousTimeoutError("join timeout")) is None
    assert store_failure(RuntimeError("the agent's own")) is None


def test_a_store_gone_mid_run_is_named_told_to_the_workers_and_never_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's poll finds the store gone: the wrapper leaves the workers the cause (their
    verdicts name it, not the signal that stops them), waits the grace, and raises one error
    naming the store's address; shutdown() then asks nothing of the dead store."""
    slept: list[float] = []
    monkeypatch.setattr("nansentinel.launcher.rendezvous_guard.time.sleep", slept.append)
    inner = _FakeDynamicHandler()

    def dead() -> int:
        raise _store_error("Connection reset by peer")

    inner.num_nodes_waiting = dead  # type: ignore[method-assign]
    guard = ExclusionGuard("node2", tmp_path, None, "job-1")
    handler = GuardedRendezvousHandler(inner, guard, endpoint="node1:29400")
    with pytest.raises(RendezvousStoreGone) as raised:
        handler.num_nodes_waiting()
    text = str(raised.value)
    assert text.startswith("the rendezvous store at node1:29400 is gone (its process died or "
                           "was killed): Connection reset by peer. Without it no host can "
                           "restart, leave or join"), text
    assert "frame #" not in text and "Exception raised" not in text
    assert slept == [guard.store_grace]
    assert stop_cause(tmp_path) == (STORE_GONE, text)
    assert handler.shutdown() is False and "shutdown" not in inner.calls
    # A store that stopped answering (its requests time out): said so, with a longer grace.
    inner2 = _FakeDynamicHandler()
    inner2.next_rendezvous = lambda: (_ for _ in ()).throw(  # type: ignore[method-assign]
        _store_error("wait timeout after 60000ms, keys: /torch.rendezvous.job-1"))
    handler2 = GuardedRendezvousHandler(inner2, ExclusionGuard("node2", tmp_path / "b", None,
                                                               None), endpoint="node1:29400")
    with pytest.raises(RendezvousStoreGone, match=r"node1:29400 stopped answering \(its "
                       r"process is frozen, or this host is cut off from it\): wait timeout"):
        handler2.next_rendezvous()
    assert stop_cause(tmp_path / "b") is None  # no workers ran: nobody to tell


def test_guard_refuses_a_host_already_in_the_store(tmp_path: Path) -> None:
    store = ExclusionStore(tmp_path / "x.jsonl")
    store.add(_record("node3"))
    handler = GuardedRendezvousHandler(
        _FakeDynamicHandler(), ExclusionGuard("node3", tmp_path, store, None)
    )
    with pytest.raises(HostExcludedExit, match="node3 poisoned"):
        handler.next_rendezvous()
    other = GuardedRendezvousHandler(
        _FakeDynamicHandler(), ExclusionGuard("node1", tmp_path, store, None)
    )
    assert other.next_rendezvous() == "rdzv-info"


# -- nansentinel excluded ---------------------------------------------------------------------


def test_excluded_lists_clears_and_prints_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.jsonl"
    assert excluded_main(["--exclusion-file", str(path)]) == EXIT_OK
    assert "no excluded hosts" in capsys.readouterr().out
    ExclusionStore(path).add(_record("node3", step=12))
    assert excluded_main(["--exclusion-file", str(path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "node3" in out and "step 12" in out and "job job-1" in out
    assert "node3 poisoned the grads" in out and "strikes=3" in out
    assert excluded_main(["--exclusion-file", str(path), "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)[0]["host"] == "node3"
    assert excluded_main(["--exclusion-file", str(path), "--clear", "node3"]) == EXIT_OK
    assert "cleared 1 exclusion record(s) of host node3" in capsys.readouterr().out
    assert not ExclusionStore(path).records()


def test_excluded_reads_the_file_from_the_environment_or_says_it_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("NANSENTINEL_EXCLUSION_FILE", raising=False)
    assert excluded_main([]) == EXIT_CONFIG
    assert "--exclusion-file" in capsys.readouterr().err
    path = tmp_path / "x.jsonl"
    ExclusionStore(path).add(_record("node9"))
    monkeypatch.setenv("NANSENTINEL_EXCLUSION_FILE", str(path))
    assert excluded_main([]) == EXIT_OK
    assert "node9" in capsys.readouterr().out


def test_a_store_that_never_answers_costs_the_agent_bounded_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host cut off from the rendezvous store (issue 58): the agent's poll counts as
    "nobody waiting" after its bound, with one blocked request however often it polls, and
    the close of the rendezvous is given up after its timeout, so the launcher can exit."""
    import threading
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    from nansentinel.launcher import rendezvous_guard as module

    release = threading.Event()

    class Deaf(_FakeDynamicHandler):
        def num_nodes_waiting(self) -> int:
            self.calls.append("num_nodes_waiting")
            release.wait(30)
            return 3

        def shutdown(self) -> bool:
            self.calls.append("shutdown")
            release.wait(30)
            return True

    monkeypatch.setattr(module, "POLL_BOUND_S", 0.2)
    monkeypatch.setattr(module, "SHUTDOWN_MARGIN_S", 0.3)
    inner = Deaf()
    inner.settings = SimpleNamespace(timeout=SimpleNamespace(close=timedelta(seconds=0.2)))
    handler = GuardedRendezvousHandler(inner, ExclusionGuard("node3", tmp_path, None, "job-1"))
    started = time.monotonic()
    try:
        assert [handler.num_nodes_waiting() for _ in range(3)] == [0, 0, 0]
        assert inner.calls == ["num_nodes_waiting"]  # one request in flight, not three
        assert handler.shutdown() is False  # the close timeout and the margin, then given up
    finally:
        release.set()
    assert time.monotonic() - started < 3 * 0.2 + 0.5 + 2
    assert handler.num_nodes_waiting() == 3  # the store answered at last: its answer is used
