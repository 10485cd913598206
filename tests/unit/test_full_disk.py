"""A full or read-only disk: training goes on, each file not written is one line naming it
(and a count), nothing already written is damaged, save_batches=False keeps the user's data
off disk; the verdicts still reach the launcher (its verdict socket), and an exclusion record
that cannot be written is one named error on every rank (issue 58, items 3 and 4)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

import nansentinel
from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore, ExclusionWriteError
from nansentinel.common.verdicts import (
    RankVerdict,
    VerdictInbox,
    archive_verdicts,
    outcome_from_verdicts,
    read_verdicts,
    send_verdict,
    write_verdict,
)
from nansentinel.config import SentinelConfig
from nansentinel.decide.policy import EXCLUDE, Decision
from nansentinel.effects.stop import stop
from nansentinel.launcher.rendezvous_guard import RECORD_WAIT_S, ExclusionGuard
from nansentinel.result import Outcome, StepResult
from nansentinel.wire.context import alone
from tests.unit.test_sentinel import one_step


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def make(report_dir: Path, registry: CollectorRegistry, **kw: object
         ) -> tuple[torch.nn.Module, nansentinel.Sentinel]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("metrics_port", 0)
    s = nansentinel.Sentinel(model, opt, report_dir=str(report_dir), env={}, registry=registry,
                             metrics_addr="127.0.0.1", **kw)
    return model, s


def nan_batch() -> torch.Tensor:
    x = torch.randn(8, 4)
    x[0, 0] = math.nan
    return x


@pytest.mark.timeout(60)
def test_full_disk_training_goes_on_and_failures_are_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, free_port: Callable[[], int]
) -> None:
    registry = CollectorRegistry()
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        # The exporter on, as in production: its counter is what the failures reach.
        model, s = make(disk / "reports", registry, metrics_port=free_port())
        first = one_step(model, s, nan_batch())  # written while there is room
        kept = {p: p.read_bytes() for p in (disk / "reports").iterdir()}
        assert first.report_path and len(kept) == 2  # the report and the batch
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as fh:  # fill it up
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="nansentinel"):
            outcomes = [one_step(model, s, nan_batch() if i % 2 == 0 else None).outcome
                        for i in range(6)]
        assert outcomes == ["skipped", "applied"] * 3  # the loop never saw an exception
        lines = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
        assert len(lines) == 6, lines  # one per failed file: 3 batches, 3 reports
        assert all("No space left on device" in line
                   for line in lines), lines
        # Each line names its file (the report's, or the poisoned rank's batch).
        assert sum(f"to {disk}/reports/incident-local-step" in line for line in lines) == 6
        sample = registry.get_sample_value
        assert sample("nansentinel_report_failures_total", {"file": "batch"}) == 3
        assert sample("nansentinel_report_failures_total", {"file": "report"}) == 3
        for p, data in kept.items():  # nothing already written was damaged
            assert p.read_bytes() == data
        assert sorted(os.listdir(disk / "reports")) == sorted(p.name for p in kept)  # no debris
        s.close()


def test_save_batches_false_keeps_the_batch_off_disk(tmp_path: Path) -> None:
    model, s = make(tmp_path / "r", CollectorRegistry(), save_batches=False)
    r = one_step(model, s, nan_batch())
    rep = json.loads(Path(r.report_path or "").read_text())
    assert rep["poisoned"][0]["batch_not_saved"] == "save_batches=False"
    assert "batch_path" not in rep["poisoned"][0]
    assert [p.suffix for p in (tmp_path / "r").iterdir()] == [".json"]
    s.close()


def read_only(disk: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, timeout=10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_close_on_a_bad_disk_is_one_line_and_the_launcher_still_hears(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    """The reproduction of issue 58: run and report directories on a full 64k tmpfs (or a
    read-only one), one step, close(). close() returns; the verdict's file is one line; the
    launcher's inbox has the ``closed`` verdict anyway."""
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        run_dir = disk / "run"
        if fault == "full":
            fill_up(disk)
        else:
            read_only(disk)
        with VerdictInbox(run_dir) as inbox:
            assert inbox.problem is None
            model, s = make(disk / "reports", CollectorRegistry(), run_dir=str(run_dir))
            assert one_step(model, s).applied
            with caplog.at_level(logging.ERROR, logger="nansentinel"):
                s.close()  # the issue: OSError [Errno 28] / [Errno 30] escaped here
            [line] = [r.getMessage() for r in caplog.records]
            assert line.startswith(f"nansentinel: rank 0 could not write its closed verdict "
                                   f"{run_dir}/verdicts/rank-0.json (")
            assert ("No space left on device" if fault == "full" else "Read-only file system"
                    ) in line and line.endswith("its launcher got it by socket")
            verdicts = read_verdicts(run_dir)
            assert list(verdicts) == [0] and verdicts[0].outcome == "closed"
        assert read_verdicts(run_dir) == {}  # closed: the socket's verdicts went with it


def fill_up(disk: Path) -> None:
    with contextlib.suppress(OSError), open(disk / "filler", "wb") as fh:
        while True:
            fh.write(b"\0" * 4096)
            fh.flush()


def verdict(rank: int, outcome: str = "aborted", **kw: object) -> RankVerdict:
    return RankVerdict(rank=rank, outcome=outcome, step=3, hostname="h", **kw)  # type: ignore[arg-type]


def test_the_inbox_takes_socket_verdicts_by_attempt(tmp_path: Path) -> None:
    """Files and datagrams merge by rank; archiving sets both aside; without an open inbox a
    send is refused quietly; a second launcher on the same run directory keeps to files."""
    run_dir = tmp_path / "run"
    assert not send_verdict(run_dir, verdict(0))  # nobody listens: False, no error
    with VerdictInbox(run_dir) as inbox:
        write_verdict(run_dir, verdict(0))
        assert send_verdict(run_dir, verdict(1, "excluded", excluded_host="h"))
        assert {r: v.outcome for r, v in read_verdicts(run_dir).items()} == {
            0: "aborted", 1: "excluded"}
        assert archive_verdicts(run_dir) == run_dir / "verdicts.attempt-0"
        assert read_verdicts(run_dir) == {}  # the next attempt starts empty
        # A rank that closed (no file: say a full disk) and then died at exit is told apart.
        assert send_verdict(run_dir, verdict(0, "closed"))
        told = outcome_from_verdicts(read_verdicts(run_dir), "h", failed=[0])
        assert told.exit_code == 1 and "failed at exit, after the sentinel had closed" in \
            told.explanation
        # More ranks than the kernel queues (10 datagrams): the inbox drains as they come.
        for rank in range(40):
            assert send_verdict(run_dir, verdict(rank, message="x" * 100_000))
        got = read_verdicts(run_dir)
        assert sorted(got) == list(range(40)) and len(got[7].message) < 100_000
        with VerdictInbox(run_dir) as twin:
            assert twin.problem == "Address already in use"
        assert inbox.problem is None and sorted(read_verdicts(run_dir)) == list(range(40))


@pytest.mark.skipif(os.geteuid() != 0, reason="sending as another user needs root")
def test_the_inbox_ignores_another_users_verdicts(tmp_path: Path) -> None:
    """Another user on the host cannot make a launcher exit 4 (or run its hook)."""
    run_dir = tmp_path / "run"
    message = verdict(0, "excluded", excluded_host="h").to_json().encode()
    code = ("import os, socket, sys; os.setuid(65534); "
            "socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(bytes.fromhex(sys.argv[1]),"
            " bytes.fromhex(sys.argv[2]))")
    with VerdictInbox(run_dir) as inbox:
        assert inbox.address is not None
        done = subprocess.run([sys.executable, "-c", code, message.hex(), inbox.address.hex()],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr  # delivered, and dropped on arrival
        assert read_verdicts(run_dir) == {}
        assert send_verdict(run_dir, verdict(0))
        assert list(read_verdicts(run_dir)) == [0]


@pytest.mark.timeout(60)
def test_verdicts_a_read_only_run_dir_cannot_move_aside_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The run directory turned read-only between attempts: the old files stay where they
    are, and the next attempt's verdicts (by socket) are not mixed with them."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk, VerdictInbox(disk / "run"):
        write_verdict(disk / "run", verdict(0, "excluded", excluded_host="h"))
        read_only(disk)
        with caplog.at_level(logging.WARNING, logger="nansentinel"):
            assert archive_verdicts(disk / "run") is None
        assert "could not move the verdicts of the last attempt aside" in caplog.text
        assert read_verdicts(disk / "run") == {}
        assert send_verdict(disk / "run", verdict(1))
        assert list(read_verdicts(disk / "run")) == [1]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["from-start", "mid-run", "full"])
def test_an_unwritable_exclusion_file_is_one_named_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """The store names the file and what failed, as an OSError; the stop path (one process)
    still raises HostExcludedError, naming it, and logs the record it could not write.
    Read-only from the start (no lock file yet), turned read-only mid-run (the file and its
    lock exist), or full (the record needs a new block: a first one)."""
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        store = ExclusionStore(disk / "excluded.jsonl")
        if when == "mid-run":
            store.add(ExclusionRecord(host="old", reason="earlier", step=1))
        if when == "full":
            fill_up(disk)
        else:
            read_only(disk)
        with pytest.raises(ExclusionWriteError) as caught:
            store.add(ExclusionRecord(host="h", reason="r", step=2))
        assert isinstance(caught.value, OSError)
        failed = ("append the record (No space left on device)" if when == "full" else
                  f"take its lock {store.lock_path} (Read-only file system)")
        assert str(caught.value) == (f"cannot write the exclusion file {store.path}: could not "
                                     f"{failed}")
        assert caught.value.errno == (28 if when == "full" else 30)
        assert store.excluded_hosts() == ({"old"} if when == "mid-run" else set())

        # The stop path of a run that excludes host "bad" (one process: every collective the
        # identity; test_disk_faults.py runs it across hosts).
        ctx = alone(SentinelConfig(exclusion_file=str(store.path), run_dir=str(tmp_path / "run")),
                    job_id="job")
        decision = Decision(EXCLUDE, (), reason="host bad blamed 3 times within 100 steps",
                            exclude_host="bad", strikes=3)
        result = StepResult(step=7, applied=False, outcome=Outcome.EXCLUDED, bad_ranks=[1],
                            bad_hosts=["bad"], kinds=["grad"], local_kinds=[], local_loss=None,
                            local_grad_norm=None, consecutive_skips=0)
        with caplog.at_level(logging.ERROR, logger="nansentinel"), \
                pytest.raises(nansentinel.HostExcludedError) as excluded:
            stop(ctx, decision, result, "nansentinel: excluding host bad at step 7.",
                 lingering=False)
        assert str(excluded.value).startswith(
            "nansentinel: excluding host bad at step 7. The exclusion of host bad could not be "
            f"recorded: cannot write the exclusion file {store.path}: could not {failed}; it "
            "holds for this launch only (its launcher runs --on-exclude and exits 4)")
        [left] = read_verdicts(tmp_path / "run").values()
        assert left.message == str(excluded.value) and left.excludes == ["bad"]
        assert (left.record_error or "").startswith(f"cannot write the exclusion file {store.path}")
        # The bad host's launcher does not wait for a record rank 0 said it could not write;
        # its own attempt fails too, in one line, and it leaves all the same.
        guard = ExclusionGuard("bad", tmp_path / "run", store, "job")
        began = time.monotonic()
        kept_out = guard.check()
        assert time.monotonic() - began < RECORD_WAIT_S / 2
        assert kept_out is not None and kept_out.host == "bad"
        [line] = [r.getMessage() for r in caplog.records]
        assert line.startswith("nansentinel: rank 0 could not record the exclusion of host bad")
        record = ExclusionRecord.from_dict(json.loads(line.split("writable: ", 1)[1]))
        assert (record.host, record.step, record.job_id) == ("bad", 7, "job")
        assert record.evidence["bad_ranks"] == [1]


@pytest.mark.timeout(60)
def test_a_torchft_group_struck_out_leaves_though_its_record_cannot_be_written(
    tmp_path: Path,
) -> None:
    """The torchft path's own exclusion record (each replica group writes its own): a
    read-only file is named in the HostExcludedError the group raises, never an OSError."""
    from types import SimpleNamespace

    from nansentinel.result import FTStepResult
    from tests.unit.test_assembly import _groups

    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        read_only(disk)
        groups = _groups()
        config = SentinelConfig(exclusion_file=str(disk / "excluded.jsonl"), host_strikes=2)
        groups._parts = SimpleNamespace(ctx=alone(config, job_id="torchft-g1"))  # type: ignore[assignment]
        result = FTStepResult(step=4, applied=False, outcome=Outcome.SKIPPED, bad_ranks=[0],
                              bad_hosts=["localhost"], kinds=["grad"], local_kinds=["grad"],
                              local_loss=None, local_grad_norm=None, consecutive_skips=1,
                              torchft_step=9)
        error = groups._struck_out(result, 2, recorded=False)
    assert isinstance(error, nansentinel.HostExcludedError)
    text = str(error)
    assert "this replica group leaves the quorum" in text
    assert (f"Its exclusion could not be recorded (cannot write the exclusion file "
            f"{disk}/excluded.jsonl: could not take its lock") in text
    record = ExclusionRecord.from_dict(json.loads(text.split("writable: ", 1)[1]))
    assert (record.host, record.step, record.job_id) == ("localhost", 9, "torchft-g1")
