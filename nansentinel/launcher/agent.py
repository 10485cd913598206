"""How a launch ends: the exit code, and a per-rank summary of why the workers stopped.

torchrun's agent ends in one of a few ways -- the workers finished, they failed past
``--max-restarts``, the exclusion guard kept this host out, a signal arrived -- and a job
script should not have to read logs to tell which. :func:`launch` runs the agent and turns
its ending into one code of :mod:`nansentinel.common.exitcodes`, taking the reason from the verdicts
the ranks left (:mod:`nansentinel.common.verdicts`), and prints one block per failed rank in the
spirit of torchrun's ``@record`` summary: host, rank, exit code, time, and the sentinel's
verdict. :func:`refuse_excluded` is the ending of a launch that never started.
"""

from __future__ import annotations

import shlex
import signal
import sys
from collections.abc import Mapping
from typing import Any

from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.common.exitcodes import (
    EXIT_EXCHANGE_TIMEOUT,
    EXIT_HOST_EXCLUDED,
    EXIT_NONFINITE_ABORT,
    EXIT_OK,
    EXIT_WORKER_FAILED,
    NAMES,
)
from nansentinel.common.verdicts import CLOSED, RankVerdict, outcome_from_verdicts, read_verdicts
from nansentinel.launcher.console import PROG, format_time, say
from nansentinel.launcher.on_exclude import run_hook
from nansentinel.launcher.rendezvous_guard import (
    ExclusionGuard,
    HostExcludedExit,
    RendezvousStoreGone,
    TooFewHostsExit,
)
from nansentinel.launcher.signals import signal_exit_code


def launch(
    launch_config: Any, cmd: Any, cmd_args: list[str], guard: ExclusionGuard, hook: str | None
) -> int:
    """Run torchrun's agent; map how it ended to an exit code, with a summary."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(config=launch_config, entrypoint=cmd)(*cmd_args)
    except HostExcludedExit as exc:
        print_summary(
            guard, {}, read_verdicts(guard.run_dir), EXIT_HOST_EXCLUDED,
            f"this host ({guard.hostname}) is excluded: {exc.record.reason}; its launcher "
            "leaves the job and the other hosts continue without it",
        )
        run_hook(hook, exc.record.host, exc.record.reason)
        return EXIT_HOST_EXCLUDED
    except RendezvousStoreGone as exc:
        verdicts = read_verdicts(guard.run_dir)
        leaving = guard.others_excluded | {h for v in verdicts.values() for h in v.excludes}
        if leaving:  # the store left with a host the sentinel excluded: that is the cause
            print_summary(guard, {}, verdicts, EXIT_NONFINITE_ABORT, (
                f"the job ended on host {guard.hostname} after host(s) "
                f"{', '.join(sorted(leaving))} were excluded: the rendezvous store went with "
                f"them ({exc}). If the excluded host ran the rendezvous store "
                "(--rdzv-endpoint), run the store on a host that trains nothing; see the "
                "README."))
            return EXIT_NONFINITE_ABORT
        print_summary(guard, {}, verdicts, EXIT_EXCHANGE_TIMEOUT, str(exc))
        return EXIT_EXCHANGE_TIMEOUT
    except TooFewHostsExit as exc:
        print_summary(guard, {}, read_verdicts(guard.run_dir), EXIT_NONFINITE_ABORT, str(exc))
        return EXIT_NONFINITE_ABORT
    except ChildFailedError as exc:
        verdicts = read_verdicts(guard.run_dir)
        outcome = outcome_from_verdicts(verdicts, guard.hostname, failed=list(exc.failures))
        print_summary(guard, exc.failures, verdicts, outcome.exit_code, outcome.explanation)
        if outcome.exit_code == EXIT_HOST_EXCLUDED:
            # No restart was left to reach the guard: record the exclusion here.
            record = guard.check()
            run_hook(hook, guard.hostname, record.reason if record else outcome.explanation)
        return outcome.exit_code
    except SignalException as exc:
        say(f"received {signal.Signals(exc.sigval).name}; the workers were stopped")
        return signal_exit_code(exc.sigval)
    except Exception as exc:  # rendezvous, agent: say it, no dump
        if guard.others_excluded:
            # Typically: the excluded host ran the rendezvous store, which left with it.
            say(
                f"the job ended on host {guard.hostname} after host(s) "
                f"{', '.join(sorted(guard.others_excluded))} were excluded: the rendezvous "
                f"failed ({type(exc).__name__}: {exc}). If the excluded host ran the "
                "rendezvous store (--rdzv-endpoint), run the store on a host that trains "
                "nothing; see the README."
            )
            return EXIT_NONFINITE_ABORT
        say(f"the launcher failed on host {guard.hostname}: {type(exc).__name__}: {exc}")
        return EXIT_WORKER_FAILED
    for host in sorted(guard.others_excluded):
        say(f"host {host} was excluded during this run; the job continued without it")
    return EXIT_OK


def refuse_excluded(record: ExclusionRecord, store: ExclusionStore, hook: str | None) -> int:
    """Keep a host that is already excluded out of the job: say why and how to clear it,
    run the hook, and return exit code 4 without starting anything."""
    say(
        f"host {record.host} is excluded (exclusion file {store.path}; job {record.job_id}, "
        f"step {record.step}, {format_time(record.time)}): {record.reason}\n"
        "  Not joining the job. Once the host is repaired, clear it with:\n"
        f"    nansentinel excluded --exclusion-file {shlex.quote(str(store.path))} "
        f"--clear {shlex.quote(record.host)}"
    )
    run_hook(hook, record.host, record.reason)
    return EXIT_HOST_EXCLUDED


def print_summary(
    guard: ExclusionGuard,
    failures: Mapping[int, Any],
    verdicts: Mapping[int, RankVerdict],
    code: int,
    root_cause: str,
) -> None:
    """A per-rank root-cause block, like torchrun's ``@record`` summary, plus verdicts."""
    bar = "=" * 78
    lines = [
        bar,
        f"{PROG}: workers stopped on host {guard.hostname} (job {guard.job_id}); "
        f"exit {code} ({NAMES.get(code, '?')})",
        f"Root cause: {root_cause}",
    ]
    # A rank that closed cleanly and did not fail is not part of the story.
    told = {r for r, v in verdicts.items() if v.outcome != CLOSED or r in failures}
    for rank in sorted(set(failures) | told):
        failure, verdict = failures.get(rank), verdicts.get(rank)
        host = (verdict.hostname if verdict else "") or guard.hostname
        if failure is not None:
            local = failure.local_rank
            status = (
                f": exitcode {failure.exitcode}, pid {failure.pid}, "
                f"{format_time(failure.timestamp)}"
            )
        else:  # the agent restarts a failed group without reporting it; the verdict remains
            known = verdict.local_rank if verdict else None
            local, status = ("?" if known is None else known), ""
        lines.append(f"  rank {rank} (local_rank {local}) on host {host}{status}")
        if verdict is not None:
            lines.append(
                f"    verdict: {verdict.outcome} at step {verdict.step}: {verdict.message}"
            )
            for key in ("bad_ranks", "bad_hosts", "kinds", "excluded_host", "report_path"):
                if getattr(verdict, key):
                    lines.append(f"    {key}: {getattr(verdict, key)}")
        elif failure is not None and str(failure.message or "").strip():
            lines.append(f"    error: {str(failure.message).strip().splitlines()[-1]}")
    lines += [f"Verdicts: {guard.run_dir}", bar]
    print("\n".join(lines), file=sys.stderr, flush=True)
