"""How a launch ends: launch's exit codes, refuse_excluded and the per-rank print_summary."""

from __future__ import annotations

import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from nansentinel import cli
from nansentinel.common import exitcodes
from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.common.verdicts import RankVerdict, write_verdict
from nansentinel.launcher import agent
from nansentinel.launcher.rendezvous_guard import (
    ExclusionGuard,
    HostExcludedExit,
    RendezvousStoreGone,
    TooFewHostsExit,
)

BAR = "=" * 78
T0 = 1_700_000_000  # 2023-11-14 22:13:20Z
WHEN = "2023-11-14 22:13:20Z"


def fake_guard(run_dir: str = "/runs/job-7") -> SimpleNamespace:
    return SimpleNamespace(hostname="node-a", job_id="job-7", run_dir=Path(run_dir))


def failure(local_rank: int, message: str = "", exitcode: int = 1) -> SimpleNamespace:
    return SimpleNamespace(local_rank=local_rank, exitcode=exitcode, pid=4200 + local_rank,
                           timestamp=T0, message=message)


def hook_writing_to(marker: Path) -> str:
    """An --on-exclude template that writes its {host} and {reason} arguments to ``marker``."""
    code = "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text('|'.join(sys.argv[2:]))"
    python, script, path = (shlex.quote(a) for a in (sys.executable, code, str(marker)))
    return f"{python} -c {script} {path} {{host}} {{reason}}"


# -- print_summary --------------------------------------------------------------------------


def test_summary_one_block_per_failed_rank_with_verdicts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    failures = {
        1: failure(1, "Traceback (most recent call last):\n  ...\nRuntimeError: boom\n"),
        0: failure(0),
    }
    verdicts = {
        0: RankVerdict(rank=0, outcome="aborted", step=12, message="nansentinel: aborting",
                       hostname="node-a", local_rank=0, bad_ranks=[2], bad_hosts=["node-b"],
                       kinds=["loss"], report_path="/r/incident.json"),
        2: RankVerdict(rank=2, outcome="aborted", step=12, message="m2", hostname="node-b",
                       local_rank=None),
    }
    agent.print_summary(fake_guard(), failures, verdicts, exitcodes.EXIT_NONFINITE_ABORT,
                        "the sentinel aborted the run")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "\n".join([
        BAR,
        "nansentinel run: workers stopped on host node-a (job job-7); exit 3 "
        "(EXIT_NONFINITE_ABORT)",
        "Root cause: the sentinel aborted the run",
        f"  rank 0 (local_rank 0) on host node-a: exitcode 1, pid 4200, {WHEN}",
        "    verdict: aborted at step 12: nansentinel: aborting",
        "    bad_ranks: [2]",
        "    bad_hosts: ['node-b']",
        "    kinds: ['loss']",
        "    report_path: /r/incident.json",
        f"  rank 1 (local_rank 1) on host node-a: exitcode 1, pid 4201, {WHEN}",
        "    error: RuntimeError: boom",
        "  rank 2 (local_rank ?) on host node-b",  # a verdict without a reported failure
        "    verdict: aborted at step 12: m2",
        "Verdicts: /runs/job-7",
        BAR,
    ]) + "\n"


@pytest.mark.parametrize("code", sorted(exitcodes.NAMES))
def test_summary_names_the_exit_code(code: int, capsys: pytest.CaptureFixture[str]) -> None:
    agent.print_summary(fake_guard(), {}, {}, code, "why")
    lines = capsys.readouterr().err.splitlines()
    assert lines[1] == (
        f"nansentinel run: workers stopped on host node-a (job job-7); "
        f"exit {code} ({exitcodes.NAMES[code]})"
    )
    assert lines[2:] == ["Root cause: why", "Verdicts: /runs/job-7", BAR]


def test_summary_of_an_unknown_code_and_a_failure_without_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    agent.print_summary(fake_guard(), {3: failure(1, exitcode=-9)}, {}, 99, "?")
    err = capsys.readouterr().err
    assert "; exit 99 (?)\n" in err
    assert f"  rank 3 (local_rank 1) on host node-a: exitcode -9, pid 4201, {WHEN}\n" in err
    assert "error:" not in err


# -- refuse_excluded ------------------------------------------------------------------------


def test_refuse_excluded_returns_4_runs_the_hook_and_says_how_to_clear(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = "node b;$(touch pwned)"  # data, never code: the hook gets it as one argument
    store = ExclusionStore(tmp_path / "excluded.jsonl")
    record = ExclusionRecord(host=host, reason="3 strikes in 100 steps", step=42, time=T0,
                             job_id="job-7")
    store.add(record)
    marker = tmp_path / "hook-ran"
    code = agent.refuse_excluded(record, store, hook_writing_to(marker))
    assert code == exitcodes.EXIT_HOST_EXCLUDED == 4
    assert marker.read_text() == f"{host}|3 strikes in 100 steps"
    assert not (Path.cwd() / "pwned").exists() and not (tmp_path / "pwned").exists()
    err = capsys.readouterr().err
    clear = (f"nansentinel excluded --exclusion-file {shlex.quote(str(store.path))} "
             f"--clear {shlex.quote(host)}")
    assert err.startswith(
        f"nansentinel run: host {host} is excluded (exclusion file {store.path}; job job-7, "
        f"step 42, {WHEN}): 3 strikes in 100 steps\n"
        "  Not joining the job. Once the host is repaired, clear it with:\n"
        f"    {clear}\n"
        "nansentinel run: running --on-exclude hook: "
    )
    # The command it prints does clear the host.
    assert cli.main(shlex.split(clear)[1:]) == exitcodes.EXIT_OK
    assert store.records() == []


def test_refuse_excluded_without_hook_still_exits_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ExclusionStore(tmp_path / "x.jsonl")
    record = ExclusionRecord(host="node-c", reason="r", step=1, time=0)
    assert agent.refuse_excluded(record, store, None) == exitcodes.EXIT_HOST_EXCLUDED
    err = capsys.readouterr().err
    assert "(exclusion file" in err and "job None, step 1, time unknown): r\n" in err
    assert "--on-exclude" not in err


# -- launch, with torch's elastic_launch replaced ---------------------------------------------


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> Callable[[BaseException | None], list[Any]]:
    """Replace torch's ``elastic_launch`` (imported by launch when called) by a fake that
    records its arguments and raises the given exception (or returns)."""
    import torch.distributed.launcher.api as api

    def install(exc: BaseException | None) -> list[Any]:
        calls: list[Any] = []

        def elastic_launch(config: Any, entrypoint: Any) -> Callable[..., None]:
            def run(*args: str) -> None:
                calls.append((config, entrypoint, args))
                if exc is not None:
                    raise exc

            return run

        monkeypatch.setattr(api, "elastic_launch", elastic_launch)
        return calls

    return install


def guard(tmp_path: Path, store: ExclusionStore | None = None) -> ExclusionGuard:
    return ExclusionGuard("node-a", tmp_path / "run", store, "job-7")


def child_failed(exitcode: int = 1) -> ChildFailedError:
    f = ProcessFailure(local_rank=1, pid=4201, exitcode=exitcode, error_file="/nonexistent")
    f.timestamp = T0
    return ChildFailedError("train.py", {1: f})


def test_launch_success_is_0_and_names_hosts_excluded_meanwhile(
    tmp_path: Path, launcher: Callable[[BaseException | None], list[Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    calls = launcher(None)
    g = guard(tmp_path)
    cfg = object()
    assert agent.launch(cfg, "python", ["train.py", "--lr=1"], g, None) == exitcodes.EXIT_OK
    assert calls == [(cfg, "python", ("train.py", "--lr=1"))]
    assert capsys.readouterr().err == ""
    g.others_excluded = {"node-d", "node-c"}
    assert agent.launch(cfg, "python", [], g, None) == exitcodes.EXIT_OK
    assert capsys.readouterr().err == (
        "nansentinel run: host node-c was excluded during this run; the job continued without it\n"
        "nansentinel run: host node-d was excluded during this run; the job continued without it\n"
    )


def test_launch_child_failure_without_verdict_is_1(
    tmp_path: Path, launcher: Callable[[BaseException | None], list[Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    launcher(child_failed(exitcode=-9))
    assert agent.launch(None, "python", [], guard(tmp_path), None) == 1
    err = capsys.readouterr().err
    assert "exit 1 (EXIT_WORKER_FAILED)" in err
    assert "Root cause: a worker failed without a sentinel verdict (see its traceback)\n" in err
    assert f"  rank 1 (local_rank 1) on host node-a: exitcode -9, pid 4201, {WHEN}\n" in err
    assert "    error: Signal 9 (SIGKILL) received by PID 4201\n" in err


def test_launch_child_failure_with_abort_verdict_is_3(
    tmp_path: Path, launcher: Callable[[BaseException | None], list[Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    g = guard(tmp_path)
    write_verdict(g.run_dir, RankVerdict(rank=0, outcome="aborted", step=5, hostname="node-a",
                                         local_rank=0, message="nansentinel: aborting at step 5"))
    marker = tmp_path / "hook-ran"
    launcher(child_failed())
    assert agent.launch(None, "python", [], g, hook_writing_to(marker)) == 3
    err = capsys.readouterr().err
    assert "exit 3 (EXIT_NONFINITE_ABORT)" in err
    assert "Root cause: the sentinel aborted the run: nansentinel: aborting at step 5\n" in err
    assert "  rank 0 (local_rank 0) on host node-a\n" in err
    assert "    verdict: aborted at step 5: nansentinel: aborting at step 5\n" in err
    assert f"  rank 1 (local_rank 1) on host node-a: exitcode 1, pid 4201, {WHEN}\n" in err
    assert not marker.exists()  # the hook is for an excluded host only


def test_launch_child_failure_excluding_this_host_is_4_and_runs_the_hook(
    tmp_path: Path, launcher: Callable[[BaseException | None], list[Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    store = ExclusionStore(tmp_path / "excluded.jsonl")
    store.add(ExclusionRecord(host="node-a", reason="rank 0's evidence", step=8, job_id="job-7"))
    g = guard(tmp_path, store)
    write_verdict(g.run_dir, RankVerdict(rank=1, outcome="excluded", step=8, hostname="node-a",
                                         excluded_host="node-a", message="excluding node-a"))
    marker = tmp_path / "hook-ran"
    launcher(child_failed())
    assert agent.launch(None, "python", [], g, hook_writing_to(marker)) == 4
    assert marker.read_text() == "node-a|rank 0's evidence"  # the store's record wins
    err = capsys.readouterr().err
    assert "exit 4 (EXIT_HOST_EXCLUDED)" in err
    assert "Root cause: this host (node-a) was excluded by the sentinel: excluding node-a\n" in err


def test_launch_host_excluded_exit_is_4_with_summary_and_hook(
    tmp_path: Path, launcher: Callable[[BaseException | None], list[Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    record = ExclusionRecord(host="node-a", reason="3 strikes", step=8)
    marker = tmp_path / "hook-ran"
    launcher(HostExcludedExit(record))
    assert agent.launch(None, "python", [], guard(tmp_path), hook_writing_to(marker)) == 4
    assert marker.read_text() == "node-a|3 strikes"
    err = capsys.readouterr().err
    assert "exit 4 (EXIT_HOST_EXCLUDED)" in err
    assert (
        "Root cause: this host (node-a) is excluded: 3 strikes; its launcher leaves the job "
        "and the other hosts continue without it\n"
    ) in err


def test_launch_with_too_few_hosts_left_is_3_with_the_reason(
    tmp_path: Path, launcher: Callable[[BaseException | None], list[Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    g = guard(tmp_path)
    write_verdict(g.run_dir, RankVerdict(rank=0, outcome="excluded", step=7, hostname="node-a",
                                         excluded_host="node-b",
                                         excluded_hosts=["node-b", "node-c"],
                                         message="excluding hosts node-b, node-c"))
    launcher(TooFewHostsExit("host(s) node-b, node-c excluded ... fewer than the minimum"))
    assert agent.launch(None, "python", [], g, None) == exitcodes.EXIT_NONFINITE_ABORT
    err = capsys.readouterr().err
    assert "exit 3 (EXIT_NONFINITE_ABORT)" in err
    assert "Root cause: host(s) node-b, node-c excluded ... fewer than the minimum\n" in err
    assert "    excluded_host: node-b\n" in err


def test_launch_with_the_store_gone_is_5_naming_it(
    tmp_path: Path, launcher: Callable[[BaseException | None], list[Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    launcher(RendezvousStoreGone("the rendezvous store at node1:29400 is gone"))
    assert agent.launch(None, "python", [], guard(tmp_path), None) == 5
    err = capsys.readouterr().err
    assert "exit 5 (EXIT_EXCHANGE_TIMEOUT)" in err
    assert "Root cause: the rendezvous store at node1:29400 is gone\n" in err


def test_launch_signal_is_128_plus_its_number(
    tmp_path: Path, launcher: Callable[[BaseException | None], list[Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    launcher(SignalException("stop", signal.SIGTERM))
    assert agent.launch(None, "python", [], guard(tmp_path), None) == 128 + 15
    assert capsys.readouterr().err == (
        "nansentinel run: received SIGTERM; the workers were stopped\n"
    )


def test_launch_agent_error_is_1_or_3_after_an_exclusion(
    tmp_path: Path, launcher: Callable[[BaseException | None], list[Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    launcher(RuntimeError("rendezvous closed"))
    g = guard(tmp_path)
    assert agent.launch(None, "python", [], g, None) == exitcodes.EXIT_WORKER_FAILED
    assert capsys.readouterr().err == (
        "nansentinel run: the launcher failed on host node-a: RuntimeError: rendezvous closed\n"
    )
    g.others_excluded = {"node-b"}
    assert agent.launch(None, "python", [], g, None) == exitcodes.EXIT_NONFINITE_ABORT
    err = capsys.readouterr().err
    assert err.startswith(
        "nansentinel run: the job ended on host node-a after host(s) node-b were excluded: "
        "the rendezvous failed (RuntimeError: rendezvous closed)."
    )


def test_summary_of_a_failure_whose_message_is_only_whitespace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A worker's error file can hold a blank message: the summary still prints, no IndexError."""
    agent.print_summary(fake_guard(), {0: failure(0, "\n  \n")}, {}, 1, "a worker failed")
    err = capsys.readouterr().err
    assert "  rank 0 (local_rank 0) on host" in err and "error:" not in err
