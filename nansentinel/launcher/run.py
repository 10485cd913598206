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
``--on-exclude CMD``          command run on the excluded host before its launcher exits,
                              without a shell: split into arguments, then ``{host}`` and
                              ``{reason}`` replaced inside each (also in the environment as
                              ``NANSENTINEL_EXCLUDED_HOST``, ``NANSENTINEL_EXCLUSION_REASON``)

The launcher also sets ``NANSENTINEL_RUN_DIR`` (unless you did): a directory it creates for
this run (under the report directory, else the system temporary directory) where each rank
leaves a verdict before it raises (see :mod:`nansentinel.common.verdicts`).

What happens when workers fail. torchrun's agent restarts the worker group up to
``--max-restarts`` times. When it gives up, this launcher prints one block per failed rank
(host, rank, exit code, time, and the sentinel's verdict when the rank left one) and exits
with a code from :mod:`nansentinel.common.exitcodes`: 3 when the sentinel aborted on non-finite
values, 4 on the host the sentinel excluded, 5 when a rank missed the health exchange or the
rendezvous store is gone (every rank's verdict and the summary name its address), 1 for
any other failure, 2 for a usage or configuration error (nothing is started then), 128 + the
signal when one stopped it (143 for SIGTERM, 130 for SIGINT).

Signals. On SIGTERM, SIGINT, SIGHUP or SIGQUIT the workers get the same signal at once and
SIGKILL 30 s later, and the launcher exits 128 + the signal within 33 s, even when its agent
is blocked on an unreachable rendezvous store (:mod:`nansentinel.launcher.signals`). Each
worker is started so that the kernel kills it when its launcher dies, however it dies
(:mod:`nansentinel.launcher.orphan_guard`): no worker outlives its launcher.

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
exit code 3 on the healthy hosts. Hosts excluded at the same step leave together; when they
leave fewer than MIN, the guard ends every remaining launcher at once with exit 3 and a line
naming them, before a round that could only wait out its join timeout.
``--rdzv-backend=static`` has no rounds to leave, so with more than one node it is refused
at start (exit 2). The host running the c10d rendezvous
store (``--rdzv-endpoint``) cannot leave without ending the rendezvous for everyone: if it is
excluded, its launcher says so and closes the rendezvous (exit 4), and the other launchers
end with exit 3 naming it; run the store on a host that trains nothing (README).
When ``--nnodes`` is a range this launcher sets
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
import hashlib
import os
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from nansentinel import config as _config
from nansentinel.common.exclusion import ExclusionStore
from nansentinel.common.exitcodes import EXIT_CONFIG, EXIT_OK, NAMES
from nansentinel.common.verdicts import VerdictInbox, archive_verdicts
from nansentinel.launcher.agent import launch, refuse_excluded
from nansentinel.launcher.console import PROG, exit_status, say
from nansentinel.launcher.on_exclude import check_hook
from nansentinel.launcher.rendezvous_guard import (
    ExclusionGuard,
    install_guard,
)
from nansentinel.launcher.signals import SignalBound, guarded_command

_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


# -- options ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Opt:
    dest: str
    """The option's name; when it is also a SentinelConfig field, the option sets that
    field's ``NANSENTINEL_*`` variable for the workers."""
    flags: tuple[str, ...]
    kind: type
    metavar: str
    help: str

    @property
    def env(self) -> str | None:
        return _config.env_var(self.dest) if self.dest in _config.KNOWN_FIELDS else None


_OPTIONS: tuple[_Opt, ...] = (
    _Opt("metrics_port", ("--metrics-port", "--metrics_port"), int, "PORT",
         "base port of the per-rank Prometheus exporter (rank serves on PORT + LOCAL_RANK; "
         "0 disables)"),
    _Opt("report_dir", ("--report-dir", "--report_dir"), str, "DIR",
         "directory for incident reports; also holds this launcher's run directory"),
    _Opt("exclusion_file", ("--exclusion-file", "--exclusion_file"), str, "FILE",
         "exclusion records (JSON lines) on a filesystem every host sees"),
    _Opt("host_strikes", ("--host-strikes", "--host_strikes"), int, "N",
         "non-finite blames within the strike window that exclude a host"),
    _Opt("strike_window", ("--strike-window", "--strike_window"), int, "STEPS",
         "window, in steps, over which host strikes count"),
    _Opt("exchange_timeout", ("--exchange-timeout", "--exchange_timeout"), float, "SECONDS",
         "how long a rank waits for the others at the health exchange"),
    _Opt("job_id", ("--job-id", "--job_id"), str, "ID",
         "job identity in reports and exclusion records (default: torchrun's --rdzv-id)"),
    _Opt("on_exclude", ("--on-exclude", "--on_exclude"), str, "CMD",
         "command run on an excluded host before its launcher exits 4, without a shell: "
         "split into arguments, then {host} and {reason} replaced inside each (also "
         "NANSENTINEL_EXCLUDED_HOST, NANSENTINEL_EXCLUSION_REASON in its environment; "
         "e.g. 'kubectl cordon {host}')"),
)
_FLAG_TO_OPT = {flag: opt for opt in _OPTIONS for flag in opt.flags}


def build_parser() -> argparse.ArgumentParser:
    """The parser of the sentinel options (torchrun's own parser handles the rest)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [sentinel options] [torchrun options] training_script [script args]",
        description="Run torch.distributed.run (torchrun) with the nansentinel launcher: "
        "per-rank failure summaries, exit codes by outcome, host exclusion across restarts.",
        epilog="exit codes: " + "; ".join(
            f"{code} {name}" for code, name in sorted(NAMES.items())) + " (nansentinel/common/"
        "exitcodes.py says when each is used). Every other option is torchrun's and is passed "
        "through unchanged; they follow.",
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


# -- main ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``nansentinel run``: parse, check exclusion, launch torchrun in-process; returns the
    exit code (see :mod:`nansentinel.common.exitcodes`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = split_argv(argv)
    parser = build_parser()
    try:
        opts = parser.parse_args(ours)
    except SystemExit as exc:  # argparse has printed the usage error
        return exit_status(exc)

    from torch.distributed import run as torchrun

    torch_parser = _torchrun_parser(parser, theirs)
    if opts.help:
        torch_parser.print_help()
        return EXIT_OK
    try:
        args = torch_parser.parse_args(theirs)
    except SystemExit as exc:
        return exit_status(exc)
    if opts.on_exclude:
        problem = check_hook(opts.on_exclude)
        if problem:
            return _config_error(problem)

    try:
        _resolve_standalone(args)
    except (RuntimeError, ValueError) as exc:
        return _config_error(f"--nnodes={args.nnodes!r}: {exc}")
    job_id = opts.job_id or os.environ.get(_config.env_var("job_id")) or args.rdzv_id
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
        try:
            mine = store.records_for(hostname)
        except OSError as exc:
            return _config_error(f"--exclusion-file {store.path} (or "
                                 f"{_config.env_var('exclusion_file')}): cannot be read "
                                 f"({exc.strerror or exc})")
        if mine:
            return refuse_excluded(mine[-1], store, opts.on_exclude)

    explicit_reports = opts.report_dir or os.environ.get(_config.env_var("report_dir"))
    with _restored_process_state():
        try:
            run_dir, created = _make_run_dir(explicit_reports, hostname)
            # Verdicts describe this launch only: a reused NANSENTINEL_RUN_DIR may hold old ones.
            archive_verdicts(run_dir)
        except OSError as exc:
            return _config_error(_run_dir_problem(explicit_reports, exc))
        env[_config.env_var("run_dir")] = str(run_dir)
        os.environ.update(env)
        try:
            launch_config, cmd, cmd_args = torchrun.config_from_args(args)
        except (AssertionError, ValueError, RuntimeError) as exc:
            # Some torch releases refuse with a bare assert (2.9: --nnodes=3:1): name the
            # options then, so the user still learns what was wrong.
            detail = str(exc) or (f"refused by torch (--nnodes={args.nnodes}, "
                                  f"--nproc-per-node={args.nproc_per_node})")
            return _config_error(f"torchrun options: {detail}")
        if launch_config.nproc_per_node < 1:  # torch's agent asserts it, with no message
            if created:
                _remove_empty_tree(run_dir)
            return _config_error(f"--nproc-per-node={args.nproc_per_node}: at least 1 worker "
                                 "per node is needed")
        if launch_config.rdzv_backend == "static" and launch_config.max_nodes > 1:
            if created:
                _remove_empty_tree(run_dir)
            return _config_error(STATIC_REFUSED)
        problem = _script_problem(args)
        if problem:  # before any worker starts (each would fail with python's own error)
            if created:
                _remove_empty_tree(run_dir)
            return _config_error(problem)
        guard = ExclusionGuard(hostname, run_dir, store, job_id)
        guarded = install_guard(launch_config, guard)
        if guarded and launch_config.max_nodes > launch_config.min_nodes:
            # Membership may change; see "Limits" in the module docstring.
            os.environ.setdefault(_SHARE_STORE_ENV, "1")
        # The workers' verdicts also come by socket: a full or read-only run directory
        # must not turn an abort (3), an exclusion (4) or a timeout (5) into exit 1.
        cmd, cmd_args = guarded_command(cmd, cmd_args)  # dies with this launcher
        with VerdictInbox(run_dir), SignalBound():
            code = launch(launch_config, cmd, cmd_args, guard, opts.on_exclude)
    if code == EXIT_OK and created:
        _remove_empty_tree(run_dir)
    return code


#: Why several nodes under static rendezvous are refused (an exclusion could not be kept).
STATIC_REFUSED = (
    "--rdzv-backend=static with several nodes cannot keep an excluded host out: the static "
    "rendezvous has no rounds to leave, so a restart would bring the faulty host back. Use "
    "--rdzv-backend=c10d (with --nnodes=MIN:MAX to continue without it)."
)


def _torchrun_parser(ours: argparse.ArgumentParser, theirs: list[str]) -> Any:
    """torchrun's own parser, with help that shows both option sets and a hint when a
    sentinel option was put among torchrun's."""
    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.prog = f"{PROG} [sentinel options]"
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
            say(f"{opt.flags[0]}={value} overrides {opt.env}={before} from the environment")
        env[opt.env] = str(value)
    job_var = _config.env_var("job_id")
    env.setdefault(job_var, os.environ.get(job_var) or job_id)
    return env


def _make_run_dir(report_dir: str | None, hostname: str) -> tuple[Path, bool]:
    """This launcher's run directory and whether it created it: the user's
    ``NANSENTINEL_RUN_DIR`` as is, else a fresh directory under ``report_dir/runs`` (kept
    with the incident reports) or the system temporary directory."""
    given = os.environ.get(_config.env_var("run_dir"))
    if given:
        Path(given).mkdir(parents=True, exist_ok=True)
        return Path(given), False
    base = Path(report_dir) / "runs" if report_dir else Path(tempfile.gettempdir())
    _private_dirs(base)
    return Path(tempfile.mkdtemp(prefix=f"nansentinel-run-{file_safe(hostname)}-", dir=base)), True


def _run_dir_problem(report_dir: str | None, exc: OSError) -> str:
    """One line naming the option or variable whose directory could not be made."""
    given = os.environ.get(_config.env_var("run_dir"))
    if given:
        where = f"{_config.env_var('run_dir')}={given}"
    elif report_dir:
        where = f"--report-dir {report_dir} (or {_config.env_var('report_dir')})"
    else:
        where = f"the temporary directory {tempfile.gettempdir()}"
    reason = exc.strerror or type(exc).__name__
    return (f"{where}: cannot create the run directory there ({reason}: {exc.filename}); "
            "give a writable directory")


def _private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents 0700 (the umask narrows it further): the
    report directory holds the user's batches and names hosts. One that exists is left as
    it is."""
    missing = []
    while not directory.exists() and directory.parent != directory:
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        d.mkdir(mode=0o700, exist_ok=True)


def file_safe(name: str, limit: int = 64) -> str:
    """``name`` as a short ASCII file-name part: a host name is data from the environment and
    may hold ``/``, newlines or thousands of characters. A long or altered name keeps a
    hash suffix, so two hosts never share a directory."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_" for c in name)
    if safe == name and len(name) <= limit:
        return name
    digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{safe[:limit]}-{digest}"


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


def _script_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the training script's path, in one line (None: nothing, or
    nothing this launcher can tell: ``-m`` names a module, ``--no-python`` a command)."""
    if getattr(args, "module", False) or getattr(args, "no_python", False):
        return None
    script = getattr(args, "training_script", None)
    if not script:
        return None
    path = Path(script)
    if not path.exists():
        return f"training script {script}: no such file (nothing was started)"
    if not path.is_file():
        return f"training script {script} is not a file (nothing was started)"
    return None


def _config_error(message: str) -> int:
    say(f"error: {message}")
    return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
