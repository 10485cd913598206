"""``nansentinel run``: torchrun with a sentinel's launcher -- summaries, exit codes, exclusion.

Usage::

    nansentinel run [sentinel options] [torchrun options] train.py [script args]

    # one node, four workers
    nansentinel run --standalone --nproc-per-node=4 train.py

    # elastic, 2 to 3 nodes; a host the sentinel excludes leaves, the others go on
    nansentinel run --exclusion-file=/shared/job/excluded.jsonl \\
        --on-exclude='scontrol update nodename={host} state=drain reason={reason}' \\
        --nnodes=2:3 --nproc-per-node=8 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29400 --rdzv-id=$JOB train.py

It runs ``torch.distributed.run`` in this process. Every torchrun option (and its
``PET_*`` environment fallback) works unchanged; the sentinel options come first, and the
first argument that is not one of them starts torchrun's. ``--help`` lists both sets.

Sentinel options (each sets the ``NANSENTINEL_*`` variable the workers read; a flag overrides
a variable already in the environment, and a variable you exported is passed on untouched):

``--metrics-port PORT``       base port of the per-rank Prometheus exporter (rank serves on
                              PORT + LOCAL_RANK; 0 disables) -> ``NANSENTINEL_METRICS_PORT``
``--report-dir DIR``          incident reports -> ``NANSENTINEL_REPORT_DIR``
``--exclusion-file FILE``     exclusion records, on a filesystem every host sees
                              -> ``NANSENTINEL_EXCLUSION_FILE``
``--host-strikes N``          blames within the window that exclude a host
                              -> ``NANSENTINEL_HOST_STRIKES``
``--strike-window STEPS``     -> ``NANSENTINEL_STRIKE_WINDOW``
``--exchange-timeout SEC``    -> ``NANSENTINEL_EXCHANGE_TIMEOUT``
``--job-id ID``               -> ``NANSENTINEL_JOB_ID`` (default: torchrun's ``--rdzv-id``)
``--on-exclude CMD``          shell command run on the excluded host before its launcher
                              exits; ``{host}`` and ``{reason}`` are replaced, shell-quoted

The launcher also sets ``NANSENTINEL_RUN_DIR`` (unless you did): a directory it creates for
this run (under the report directory, else the system temporary directory) where each rank
leaves a verdict before it raises (see :mod:`nansentinel.verdicts`).

What happens when workers fail. torchrun's agent restarts the worker group up to
``--max-restarts`` times. When it gives up, this launcher prints one block per failed rank
(host, rank, exit code, time, and the sentinel's verdict when the rank left one) and exits
with a code from :mod:`nansentinel.exitcodes`: 3 when the sentinel aborted on non-finite
values, 4 on the host the sentinel excluded, 5 when a rank missed the health exchange, 1 for
any other failure, 2 for a usage or configuration error (nothing is started then).

Host exclusion across restarts. The sentinel on global rank 0 appends a record for the bad
host to the exclusion file, every rank writes its verdict and raises, and torchrun's agents
restart their workers. Every way an agent re-enters the job -- a restart after a failure,
or a healthy agent making room for a node waiting to join -- goes through its rendezvous
handler's ``next_rendezvous()``. This launcher wraps the handler that torchrun builds
(a rendezvous backend named ``nansentinel`` registered through torch's public handler
registry, delegating to the backend you asked for). Before each round the wrapper asks:
is this host excluded -- by its own ranks' verdicts, which are on local disk and cannot race,
or by the exclusion file? If so the agent does not rejoin: the wrapper raises, the agent
stops its workers, and instead of closing the rendezvous (which torchrun does on a normal
exit and which would end the job for everyone) the wrapper only removes this node from the
current round. The other agents then complete the next round without it, as soon as
``--nnodes``'s minimum is met, and their workers resume from their last checkpoint. The
excluded host's launcher runs ``--on-exclude`` and exits 4. A launcher started on a host
that is already in the exclusion file runs the hook and exits 4 without joining.

Limits. Continuing without a host needs an elastic range (``--nnodes=MIN:MAX`` with MIN
below the current node count) and ``--max-restarts`` >= 1; otherwise the job stops with
exit code 3 on the healthy hosts. With ``--rdzv-backend=static`` the wrapper is not
installed (the static backend has no rounds to leave); an excluded host is then refused at
its next start. The host running the c10d rendezvous store (``--rdzv-endpoint``) cannot
leave without ending the rendezvous for everyone: put the endpoint on a host you trust, or
use etcd. When ``--nnodes`` is a range this launcher sets
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless you set it): by default torchrun's agent
of group rank 0 also hosts the workers' store, and agents keep that address across rounds,
so after the excluded host was group rank 0 the survivors' workers would wait for a store
that is gone (seen with torch 2.13). Without sharing, each round's rank 0 publishes a fresh
store address.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from nansentinel import config as _config
from nansentinel.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.exitcodes import (
    EXIT_CONFIG,
    EXIT_HOST_EXCLUDED,
    EXIT_OK,
    EXIT_WORKER_FAILED,
    NAMES,
)
from nansentinel.verdicts import (
    OUTCOME_EXCLUDED,
    archive_verdicts,
    outcome_from_verdicts,
    read_verdicts,
)

#: The rendezvous backend name under which the exclusion guard is registered.
GUARD_BACKEND = "nansentinel"
_INNER_BACKEND_KEY = "nansentinel_inner_backend"
_GUARD_KEY = "nansentinel_guard"
#: Seconds the ``--on-exclude`` hook may run; a hung ``scontrol`` must not hang the launcher.
HOOK_TIMEOUT_S = 120.0
#: Seconds the excluded host waits for rank 0's exclusion record before writing its own.
RECORD_WAIT_S = 5.0
_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_PROG = "nansentinel run"


# -- options ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Opt:
    dest: str
    flags: tuple[str, ...]
    env: str | None
    kind: type
    metavar: str
    help: str


_OPTIONS: tuple[_Opt, ...] = (
    _Opt("metrics_port", ("--metrics-port", "--metrics_port"), _config.ENV_METRICS_PORT, int,
         "PORT", "base port of the per-rank Prometheus exporter (rank serves on PORT + "
         "LOCAL_RANK; 0 disables)"),
    _Opt("report_dir", ("--report-dir", "--report_dir"), _config.ENV_REPORT_DIR, str,
         "DIR", "directory for incident reports; also holds this launcher's run directory"),
    _Opt("exclusion_file", ("--exclusion-file", "--exclusion_file"),
         _config.ENV_EXCLUSION_FILE, str, "FILE",
         "exclusion records (JSON lines) on a filesystem every host sees"),
    _Opt("host_strikes", ("--host-strikes", "--host_strikes"), _config.ENV_HOST_STRIKES, int,
         "N", "non-finite blames within the strike window that exclude a host"),
    _Opt("strike_window", ("--strike-window", "--strike_window"), _config.ENV_STRIKE_WINDOW,
         int, "STEPS", "window, in steps, over which host strikes count"),
    _Opt("exchange_timeout", ("--exchange-timeout", "--exchange_timeout"),
         _config.ENV_EXCHANGE_TIMEOUT, float, "SECONDS",
         "how long a rank waits for the others at the health exchange"),
    _Opt("job_id", ("--job-id", "--job_id"), _config.ENV_JOB_ID, str, "ID",
         "job identity in reports and exclusion records (default: torchrun's --rdzv-id)"),
    _Opt("on_exclude", ("--on-exclude", "--on_exclude"), None, str, "CMD",
         "shell command run on an excluded host before its launcher exits 4; {host} and "
         "{reason} are replaced, shell-quoted (e.g. 'kubectl cordon {host}')"),
)
_FLAG_TO_OPT = {flag: opt for opt in _OPTIONS for flag in opt.flags}


def build_parser() -> argparse.ArgumentParser:
    """The parser of the sentinel options (torchrun's own parser handles the rest)."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        usage=f"{_PROG} [sentinel options] [torchrun options] training_script [script args]",
        description="Run torch.distributed.run (torchrun) with the nansentinel launcher: "
        "per-rank failure summaries, exit codes by outcome, host exclusion across restarts.",
        epilog="Every other option is torchrun's and is passed through unchanged; they follow.",
        add_help=False,
        allow_abbrev=False,
    )
    group = parser.add_argument_group("sentinel options (before torchrun options)")
    group.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    for opt in _OPTIONS:
        env = f" [env {opt.env}]" if opt.env else ""
        group.add_argument(
            *opt.flags, dest=opt.dest, type=opt.kind, metavar=opt.metavar, default=None,
            help=opt.help + env,
        )
    return parser


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into (sentinel options, torchrun options and the script).

    The sentinel options are the leading run of known flags (``--flag value``,
    ``--flag=value``, ``-h``/``--help``); the first other argument starts torchrun's part,
    which is passed on unchanged. Matching is exact -- no abbreviations -- so nothing meant
    for torchrun or the script is ever taken.
    """
    ours: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg in ("-h", "--help") or (name in _FLAG_TO_OPT and "=" in arg):
            ours.append(arg)
            i += 1
        elif arg in _FLAG_TO_OPT:
            ours.extend(argv[i : i + 2])  # a missing value is reported by the parser
            i += 2
        else:
            break
    return ours, list(argv[i:])


def hook_fields(template: str) -> set[str]:
    """Replacement fields of an ``--on-exclude`` template; raises ``ValueError`` on a
    malformed template."""
    return {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}


def format_hook(template: str, host: str, reason: str) -> str:
    """The hook command with ``{host}`` and ``{reason}`` replaced, each shell-quoted, so a
    reason with spaces or quotes cannot change the command."""
    return template.format(host=shlex.quote(host), reason=shlex.quote(reason))


def run_hook(template: str | None, host: str, reason: str) -> int | None:
    """Run the ``--on-exclude`` hook; returns its exit status (None when there is none).

    A failing or hung hook is reported and does not change the launcher's exit code: the
    host is excluded either way, and exit code 4 still tells the scheduler so.
    """
    if not template:
        return None
    command = format_hook(template, host, reason)
    _say(f"running --on-exclude hook: {command}")
    try:
        done = subprocess.run(command, shell=True, timeout=HOOK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        _say(f"--on-exclude hook did not finish within {HOOK_TIMEOUT_S:.0f} s; left behind")
        return None
    except OSError as exc:
        _say(f"--on-exclude hook could not be started: {exc}")
        return None
    if done.returncode != 0:
        _say(f"--on-exclude hook exited with status {done.returncode}")
    return done.returncode


# -- exclusion guard around torchrun's rendezvous handler -------------------------------


class HostExcludedExit(Exception):
    """Raised inside torchrun's agent when this host must not join the next rendezvous."""

    def __init__(self, record: ExclusionRecord) -> None:
        super().__init__(f"host {record.host} is excluded: {record.reason}")
        self.record = record


class ExclusionGuard:
    """Decides, before each rendezvous round, whether this host may (re)join.

    Args:
        hostname: this host's identity, as the sentinel names hosts.
        run_dir: where this host's ranks write their verdicts.
        store: the shared exclusion store, or None when no file is configured.
        job_id: written into a record this guard has to add itself.
    """

    def __init__(
        self, hostname: str, run_dir: Path, store: ExclusionStore | None, job_id: str | None
    ) -> None:
        self.hostname = hostname
        self.run_dir = run_dir
        self.store = store
        self.job_id = job_id
        self.excluded: ExclusionRecord | None = None
        self.others_excluded: set[str] = set()
        self._rounds = 0

    def __repr__(self) -> str:  # shown in torchrun's "rdzv_configs" log line
        return f"ExclusionGuard(host={self.hostname!r}, store={self.store!r})"

    def check(self) -> ExclusionRecord | None:
        """The record that keeps this host out, or None when it may join."""
        for verdict in read_verdicts(self.run_dir).values():
            if (
                verdict.get("outcome") == OUTCOME_EXCLUDED
                and verdict.get("excluded_host") == self.hostname
            ):
                return self._record_from_verdict(verdict)
        if self.store is not None:
            mine = self.store.records_for(self.hostname)
            if mine:
                return mine[-1]
        return None

    def before_round(self) -> None:
        """Called by the handler wrapper before each ``next_rendezvous()``."""
        record = self.check()
        if record is not None:
            self.excluded = record
            raise HostExcludedExit(record)
        if self._rounds > 0:
            for verdict in read_verdicts(self.run_dir).values():
                host = verdict.get("excluded_host")
                if verdict.get("outcome") == OUTCOME_EXCLUDED and host:
                    self.others_excluded.add(str(host))
            archived = archive_verdicts(self.run_dir)
            if archived is not None:
                _say(f"verdicts of the failed attempt kept in {archived}")
        self._rounds += 1

    def _record_from_verdict(self, verdict: Mapping[str, Any]) -> ExclusionRecord:
        """Prefer rank 0's record (it carries the cluster's evidence); if it does not show
        up in the shared file within RECORD_WAIT_S, write one from this verdict, so a
        launcher started later on this host still refuses to join."""
        if self.store is not None:
            deadline = time.monotonic() + RECORD_WAIT_S
            while True:
                mine = self.store.records_for(self.hostname)
                if mine:
                    return mine[-1]
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.2)
        step = verdict.get("step")
        record = ExclusionRecord(
            host=self.hostname,
            reason=str(verdict.get("message") or "excluded by the sentinel"),
            step=int(step) if isinstance(step, int) else -1,
            evidence={
                "source": "launcher (from this host's verdicts)",
                "bad_ranks": verdict.get("bad_ranks"),
                "kinds": verdict.get("kinds"),
                "report_path": verdict.get("report_path"),
            },
            job_id=self.job_id,
        )
        if self.store is not None:
            try:
                self.store.add(record)
            except OSError as exc:
                _say(f"could not record the exclusion in {self.store.path}: {exc}")
        return record


class GuardedRendezvousHandler:
    """torchrun's rendezvous handler with an exclusion check before every round.

    Implements torch's ``RendezvousHandler`` interface by delegation. Deliberately not a
    subclass: torch's registry only checks :meth:`get_backend`, and delegation keeps every
    attribute of the real handler reachable (``__getattr__``).
    """

    def __init__(self, inner: Any, guard: ExclusionGuard) -> None:
        self._inner = inner
        self._guard = guard

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_backend(self) -> str:
        return GUARD_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return bool(self._inner.use_agent_store)

    def next_rendezvous(self) -> Any:
        self._guard.before_round()
        return self._inner.next_rendezvous()

    def is_closed(self) -> bool:
        return bool(self._inner.is_closed())

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return int(self._inner.num_nodes_waiting())

    def get_run_id(self) -> str:
        return str(self._inner.get_run_id())

    def shutdown(self) -> bool:
        """Close the rendezvous on a normal exit; on exclusion only leave it.

        torchrun's ``launch_agent`` calls ``shutdown()`` whenever the agent exits other than
        by a signal, and for the dynamic (c10d, etcd) handler that *closes* the rendezvous:
        every other agent would then fail its next round with ``RendezvousClosedError``.
        """
        if self._guard.excluded is None:
            return bool(self._inner.shutdown())
        _leave_rendezvous(self._inner)
        return True


def _leave_rendezvous(handler: Any) -> None:
    """Remove this node from the current round of a dynamic rendezvous, so the others
    complete the next round without waiting for our keep-alive to expire.

    Uses torch internals (``_stop_heartbeats``, ``_op_executor``, ``_RendezvousExitOp``);
    when they are missing the result is the same, only later: the node stops sending
    keep-alives when this process exits and the others drop it after
    ``keep_alive_interval * keep_alive_max_attempt`` seconds.
    """
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

        handler._stop_heartbeats()
        close = getattr(getattr(handler, "settings", None), "timeout", None)
        seconds = close.close.total_seconds() if close is not None else 30.0
        handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + seconds)
    except Exception as exc:  # any failure has the same fallback
        _say(
            f"could not leave the rendezvous cleanly ({type(exc).__name__}: {exc}); "
            "the other hosts drop this one when its keep-alive expires"
        )


def _create_guarded_handler(params: Any) -> GuardedRendezvousHandler:
    """Rendezvous backend creator registered under :data:`GUARD_BACKEND`."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    extra = dict(params.config)
    guard = extra.pop(_GUARD_KEY)
    inner_params = RendezvousParameters(
        backend=extra.pop(_INNER_BACKEND_KEY),
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        **extra,
    )
    return GuardedRendezvousHandler(rdzv_registry.get_rendezvous_handler(inner_params), guard)


def _install_guard(launch_config: Any, guard: ExclusionGuard) -> bool:
    """Route ``launch_config``'s rendezvous through the guard; False for static."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    if launch_config.rdzv_backend == "static":
        return False
    rendezvous_handler_registry.register(GUARD_BACKEND, _create_guarded_handler)
    launch_config.rdzv_configs[_INNER_BACKEND_KEY] = launch_config.rdzv_backend
    launch_config.rdzv_configs[_GUARD_KEY] = guard
    launch_config.rdzv_backend = GUARD_BACKEND
    return True


# -- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``nansentinel run``: parse, check exclusion, launch torchrun in-process; returns the
    exit code (see :mod:`nansentinel.exitcodes`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = split_argv(argv)
    parser = build_parser()
    try:
        opts = parser.parse_args(ours)
    except SystemExit as exc:  # argparse has printed the usage error
        return _exit_status(exc)

    from torch.distributed import run as torchrun

    torch_parser = _torchrun_parser(parser, theirs)
    if opts.help:
        torch_parser.print_help()
        return EXIT_OK
    try:
        args = torch_parser.parse_args(theirs)
    except SystemExit as exc:
        return _exit_status(exc)
    if opts.on_exclude:
        problem = _check_hook(opts.on_exclude)
        if problem:
            return _config_error(problem)

    try:
        _resolve_standalone(args)
    except (RuntimeError, ValueError) as exc:
        return _config_error(f"--nnodes={args.nnodes!r}: {exc}")
    job_id = opts.job_id or os.environ.get(_config.ENV_JOB_ID) or args.rdzv_id
    env = _worker_env(opts, job_id)
    try:
        cfg = _config.SentinelConfig.from_env({**os.environ, **env})
    except _config.ConfigError as exc:
        message = str(exc)
        for opt in _OPTIONS:  # a value we put in the environment came from a flag
            if opt.env and getattr(opts, opt.dest) is not None:
                message = message.replace(f"environment variable {opt.env}", opt.flags[0])
        return _config_error(message)
    hostname = _config.resolve_hostname(cfg.hostname)
    store = ExclusionStore(cfg.exclusion_file) if cfg.exclusion_file else None
    if store is not None:
        mine = store.records_for(hostname)
        if mine:
            return _refuse_excluded(mine[-1], store, opts.on_exclude)

    explicit_reports = opts.report_dir or os.environ.get(_config.ENV_REPORT_DIR)
    with _restored_process_state():
        run_dir, created = _make_run_dir(explicit_reports, hostname)
        # Verdicts describe this launch only: a reused NANSENTINEL_RUN_DIR may hold old ones.
        archive_verdicts(run_dir)
        env[_config.ENV_RUN_DIR] = str(run_dir)
        os.environ.update(env)
        try:
            launch_config, cmd, cmd_args = torchrun.config_from_args(args)
        except (AssertionError, ValueError, RuntimeError) as exc:
            return _config_error(f"torchrun options: {exc}")
        guard = ExclusionGuard(hostname, run_dir, store, job_id)
        guarded = _install_guard(launch_config, guard)
        if guarded and launch_config.max_nodes > launch_config.min_nodes:
            # Membership may change; see "Limits" in the module docstring.
            os.environ.setdefault(_SHARE_STORE_ENV, "1")
        code = _launch(launch_config, cmd, cmd_args, guard, opts.on_exclude)
    if code == EXIT_OK and created:
        _remove_empty_tree(run_dir)
    return code


def _launch(
    launch_config: Any, cmd: Any, cmd_args: list[str], guard: ExclusionGuard, hook: str | None
) -> int:
    """Run torchrun's agent; map how it ended to an exit code, with a summary."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(config=launch_config, entrypoint=cmd)(*cmd_args)
    except HostExcludedExit as exc:
        _print_summary(
            guard, {}, read_verdicts(guard.run_dir), EXIT_HOST_EXCLUDED,
            f"this host ({guard.hostname}) is excluded: {exc.record.reason}; its launcher "
            "leaves the job and the other hosts continue without it",
        )
        run_hook(hook, exc.record.host, exc.record.reason)
        return EXIT_HOST_EXCLUDED
    except ChildFailedError as exc:
        verdicts = read_verdicts(guard.run_dir)
        outcome = outcome_from_verdicts(verdicts, guard.hostname)
        _print_summary(guard, exc.failures, verdicts, outcome.exit_code, outcome.explanation)
        if outcome.exit_code == EXIT_HOST_EXCLUDED:
            # No restart was left to reach the guard: record the exclusion here.
            record = guard.check()
            run_hook(hook, guard.hostname, record.reason if record else outcome.explanation)
        return outcome.exit_code
    except SignalException as exc:
        _say(f"received {signal.Signals(exc.sigval).name}; the workers were stopped")
        return 128 + int(exc.sigval)
    except Exception as exc:  # rendezvous, agent: say it, no dump
        _say(f"the launcher failed on host {guard.hostname}: {type(exc).__name__}: {exc}")
        return EXIT_WORKER_FAILED
    for host in sorted(guard.others_excluded):
        _say(f"host {host} was excluded during this run; the job continued without it")
    return EXIT_OK


def _torchrun_parser(ours: argparse.ArgumentParser, theirs: list[str]) -> Any:
    """torchrun's own parser, with help that shows both option sets and a hint when a
    sentinel option was put among torchrun's."""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.prog = f"{_PROG} [sentinel options]"
    torch_help = parser.print_help

    def print_both(file: Any = None) -> None:
        ours.print_help(file)
        print("\ntorchrun options:\n", file=file)
        torch_help(file)

    parser.print_help = print_both  # type: ignore[method-assign]
    misplaced = [a for a in theirs if a.split("=", 1)[0] in _FLAG_TO_OPT]
    if misplaced:
        torch_error = parser.error

        def error(message: str) -> Any:
            torch_error(
                f"{message}\n(sentinel options such as {misplaced[0].split('=', 1)[0]} must "
                "come before all torchrun options)"
            )

        parser.error = error  # type: ignore[method-assign]
    return parser


def _check_hook(template: str) -> str | None:
    try:
        unknown = hook_fields(template) - {"host", "reason"}
    except ValueError as exc:
        return f"--on-exclude {template!r} is malformed: {exc}"
    if unknown:
        return (
            f"--on-exclude {template!r} uses {{{', '.join(sorted(unknown))}}}; only {{host}} "
            "and {reason} are replaced (write {{ and }} for literal braces)"
        )
    return None


def _resolve_standalone(args: argparse.Namespace) -> None:
    """What ``torch.distributed.run.run`` does before ``config_from_args``: a local c10d
    rendezvous for ``--standalone`` or a single static node. Done here because the guard
    must be installed between ``config_from_args`` and the launch."""
    from torch.distributed import run as torchrun

    local = args.standalone
    if not local and args.rdzv_backend == "static" and not args.rdzv_endpoint:
        local = args.master_port is None and torchrun.parse_min_max_nnodes(args.nnodes)[1] == 1
    if local:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _worker_env(opts: argparse.Namespace, job_id: str) -> dict[str, str]:
    """The ``NANSENTINEL_*`` variables this launcher sets for its workers: one per flag
    given (a flag overrides the environment, with a warning when they differ), plus the job
    id unless the user exported one."""
    env: dict[str, str] = {}
    for opt in _OPTIONS:
        value = getattr(opts, opt.dest)
        if opt.env is None or value is None:
            continue
        before = os.environ.get(opt.env)
        if before is not None and before != str(value):
            _say(f"{opt.flags[0]}={value} overrides {opt.env}={before} from the environment")
        env[opt.env] = str(value)
    env.setdefault(_config.ENV_JOB_ID, os.environ.get(_config.ENV_JOB_ID) or job_id)
    return env


def _make_run_dir(report_dir: str | None, hostname: str) -> tuple[Path, bool]:
    """This launcher's run directory and whether it created it: the user's
    ``NANSENTINEL_RUN_DIR`` as is, else a fresh directory under ``report_dir/runs`` (kept
    with the incident reports) or the system temporary directory."""
    given = os.environ.get(_config.ENV_RUN_DIR)
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        return Path(given), False
    base = Path(report_dir) / "runs" if report_dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in hostname)
    return Path(tempfile.mkdtemp(prefix=f"nansentinel-run-{safe}-", dir=base)), True


def _remove_empty_tree(path: Path) -> None:
    """Remove ``path`` if it holds only empty directories (a clean run leaves nothing)."""
    for root, _dirs, _files in sorted(os.walk(path), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):
            os.rmdir(root)


@contextlib.contextmanager
def _restored_process_state() -> Iterator[None]:
    """Give back the environment and the signal handlers that torchrun's agent changes
    (it sets OMP_NUM_THREADS, TORCHELASTIC_* and installs SIGTERM/SIGINT handlers), so that
    :func:`main` can be called in-process, e.g. from a test, without side effects."""
    saved_env = dict(os.environ)
    signals = [getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
               if hasattr(signal, n)]
    in_main = threading.current_thread() is threading.main_thread()
    saved_handlers = {s: signal.getsignal(s) for s in signals} if in_main else {}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in saved_env]:
            del os.environ[key]
        for key, value in saved_env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        for sig, handler in saved_handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def _refuse_excluded(record: ExclusionRecord, store: ExclusionStore, hook: str | None) -> int:
    _say(
        f"host {record.host} is excluded (exclusion file {store.path}; job {record.job_id}, "
        f"step {record.step}, {_format_time(record.time)}): {record.reason}\n"
        "  Not joining the job. Once the host is repaired, clear it with:\n"
        f"    nansentinel excluded --exclusion-file {shlex.quote(str(store.path))} "
        f"--clear {shlex.quote(record.host)}"
    )
    run_hook(hook, record.host, record.reason)
    return EXIT_HOST_EXCLUDED


def _print_summary(
    guard: ExclusionGuard,
    failures: Mapping[int, Any],
    verdicts: Mapping[int, Mapping[str, Any]],
    code: int,
    root_cause: str,
) -> None:
    """A per-rank root-cause block, like torchrun's ``@record`` summary, plus verdicts."""
    bar = "=" * 78
    lines = [
        bar,
        f"{_PROG}: workers stopped on host {guard.hostname} (job {guard.job_id}); "
        f"exit {code} ({NAMES.get(code, '?')})",
        f"Root cause: {root_cause}",
    ]
    for rank in sorted(set(failures) | set(verdicts)):
        failure, verdict = failures.get(rank), verdicts.get(rank)
        host = (verdict or {}).get("hostname") or guard.hostname
        if failure is not None:
            local = failure.local_rank
            status = (
                f": exitcode {failure.exitcode}, pid {failure.pid}, "
                f"{_format_time(failure.timestamp)}"
            )
        else:  # the agent restarts a failed group without reporting it; the verdict remains
            local, status = (verdict or {}).get("local_rank", "?"), ""
        lines.append(f"  rank {rank} (local_rank {local}) on host {host}{status}")
        if verdict is not None:
            lines.append(
                f"    verdict: {verdict.get('outcome')} at step {verdict.get('step')}: "
                f"{verdict.get('message', '')}"
            )
            for key in ("bad_ranks", "bad_hosts", "kinds", "excluded_host", "report_path"):
                if verdict.get(key):
                    lines.append(f"    {key}: {verdict[key]}")
        elif failure is not None and failure.message:
            lines.append(f"    error: {str(failure.message).strip().splitlines()[-1]}")
    lines += [f"Verdicts: {guard.run_dir}", bar]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _say(message: str) -> None:
    print(f"{_PROG}: {message}", file=sys.stderr, flush=True)


def _config_error(message: str) -> int:
    _say(f"error: {message}")
    return EXIT_CONFIG


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return EXIT_OK
    return exc.code if isinstance(exc.code, int) else EXIT_CONFIG


def _format_time(epoch: float | int | None) -> str:
    if not epoch:
        return "time unknown"
    when = datetime.datetime.fromtimestamp(float(epoch), tz=datetime.timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M:%SZ")


# -- nansentinel excluded ----------------------------------------------------------------


def excluded_main(argv: list[str] | None = None) -> int:
    """``nansentinel excluded``: list the excluded hosts, or clear one after repair."""
    parser = argparse.ArgumentParser(
        prog="nansentinel excluded",
        description="List the hosts the sentinel has excluded (host, step, time, job, reason, "
        "evidence), or clear a repaired host so that its launcher may join again.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--exclusion-file", "--exclusion_file", metavar="FILE",
        default=os.environ.get(_config.ENV_EXCLUSION_FILE),
        help=f"the exclusion file [env {_config.ENV_EXCLUSION_FILE}]",
    )
    parser.add_argument("--clear", metavar="HOST", action="append", default=[],
                        help="remove every record of HOST (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return _exit_status(exc)
    if not args.exclusion_file:
        print(
            "nansentinel excluded: error: no exclusion file; pass --exclusion-file FILE or set "
            f"{_config.ENV_EXCLUSION_FILE}",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    store = ExclusionStore(args.exclusion_file)
    try:
        if args.clear:
            for host in args.clear:
                removed = store.clear(host)
                print(f"cleared {removed} exclusion record(s) of host {host} from {store.path}")
            return EXIT_OK
        records = store.records()
    except OSError as exc:
        print(f"nansentinel excluded: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in records], indent=2, default=str))
        return EXIT_OK
    if not records:
        print(f"no excluded hosts in {store.path}")
        return EXIT_OK
    for r in records:
        print(f"{r.host}  step {r.step}  {_format_time(r.time)}  job {r.job_id}")
        print(f"    reason:   {r.reason}")
        if r.evidence:
            print(f"    evidence: {_summarize(r.evidence)}")
    return EXIT_OK


def _summarize(evidence: Mapping[str, Any], limit: int = 160) -> str:
    text = ", ".join(f"{k}={v}" for k, v in evidence.items() if v not in (None, "", [], {}))
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
