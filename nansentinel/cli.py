"""The ``nansentinel`` command: ``run`` (torchrun wrapper), ``demo``, ``excluded``,
``incidents``, ``files``.

``nansentinel demo`` is the first thing to run on a fresh machine: 4 CPU ranks (gloo) train a
small transformer on synthetic data with one injected fault, and rank 0 prints each step and
the incident, naming the poisoned rank and host.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from nansentinel.config import DEFAULT_REPORT_DIR, ConfigError, SentinelConfig, env_var

USAGE = """usage: nansentinel {run,demo,excluded,incidents,files,store} ...

  run        launch a training script like torchrun does, with the sentinel's options
             (nansentinel run --help)
  demo       run the demo job: 4 CPU ranks, a small transformer, one injected fault
  excluded   list the hosts excluded from runs (and --clear HOST to lift one)
  incidents  list the incident reports, newest first; `incidents show ID` explains one
             (--html OUT: a page with its loss and gradient-norm curves)
  files      write the files the package ships (Slurm script, Kubernetes examples,
             Prometheus rules, Alertmanager routing, Grafana dashboard, runbook) under a
             folder: nansentinel files SET DIR; without arguments, list the sets
  store      serve the c10d rendezvous store in a process of its own, so that any
             training host may leave the job (nansentinel files slurm: nansentinel.sbatch)
  --version  print the version
"""


def main(argv: list[str] | None = None) -> int:
    """The command: the exit code of the subcommand ``argv`` names. A reader that stops
    early (``nansentinel incidents --json | head``) ends the output quietly, with the code a
    command killed by SIGPIPE has, instead of a "Broken pipe" error line."""
    try:
        return _dispatch(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # Python flushes stdout again at exit and would print the error there: point the
        # descriptor at /dev/null first (the recipe of Python's signal documentation).
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return EXIT_BROKEN_PIPE


#: What torch 2.x warns at import without numpy (the start of the message).
NUMPY_WARNING = "Failed to initialize NumPy"


#: The exit code of a command whose reader closed the pipe (128 + SIGPIPE, as the shell
#: reports ``ls | head``'s ``ls``).
EXIT_BROKEN_PIPE = 141


def _dispatch(argv: list[str]) -> int:
    # A path or a host from argv or a file may hold bytes that are not UTF-8 (Python keeps
    # them as lone surrogates): printed, they are escaped instead of failing the command.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from nansentinel import __version__

        print(f"nansentinel {__version__} (Python {sys.version.split()[0]})")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        from nansentinel.launcher.run import main as run_main

        return run_main(rest)
    if command == "excluded":
        from nansentinel.launcher.excluded_command import excluded_main

        return excluded_main(rest)
    if command == "files":
        from nansentinel.files import files_main

        return files_main(rest)
    if command == "store":
        from nansentinel.launcher.store_server import store_main

        return store_main(rest)
    try:  # argparse's usage errors and --help return their code: main(argv) never exits
        if command == "demo":
            return demo(rest)
        if command == "incidents":
            return incidents(rest)
    except SystemExit as exc:
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
    print(f"nansentinel: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


#: The demo's fire drill when neither ``--inject`` nor NANSENTINEL_INJECT says otherwise (the
#: command sets the variable for the workers; the demo module itself reads only the config).
DEFAULT_INJECT = "kind=grad,rank=2,step=5,value=nan"


def demo(argv: list[str]) -> int:
    """Run the demo job under torchrun, in this process."""
    with warnings.catch_warnings():  # this process imports torch too (below: the ranks)
        warnings.filterwarnings("ignore", message=NUMPY_WARNING)
        return _demo(argv)


def _demo(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nansentinel demo", description=demo.__doc__)
    p.add_argument("--nproc", type=int, default=4, help="CPU ranks (default 4)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--inject", default=None,
                   help=f"fault spec (default: {env_var('inject')}, else {DEFAULT_INJECT!r}; "
                   "'' for none)")
    p.add_argument("--policy", default=None,
                   help=f"skip, abort, rollback or drop (default: {env_var('policy')}, "
                   "else skip)")
    # No default from the environment here: a variable's value is checked where the workers'
    # config reads it, so that its error names the variable, not a flag nobody typed.
    p.add_argument("--report-dir", default=None,
                   help=f"report directory (default: {env_var('report_dir')}, else "
                   f"{DEFAULT_REPORT_DIR})")
    p.add_argument("--metrics-port", type=int, default=None,
                   help=f"base port of the per-rank exporters (default: "
                   f"{env_var('metrics_port')}, else 0: off)")
    p.add_argument("--sleep", type=float, default=0.0,
                   help="pause after each step, seconds (to watch the metrics live)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 instead of DDP (gradients checked before "
                   "each reduce-scatter)")
    args = p.parse_args(argv)
    problem = _demo_problem(args)
    if problem:  # one line here, not a traceback from every rank
        print(f"nansentinel demo: error: {problem}", file=sys.stderr)
        return 2
    # What the command line says overrides the environment, and an error names the option.
    given: dict[str, Any] = {}
    if args.policy is not None:
        given["policy"] = args.policy
    if args.report_dir is not None:
        given["report_dir"] = args.report_dir
    if args.metrics_port is not None:
        given["metrics_port"] = args.metrics_port
    if args.inject is not None:
        given["inject"] = args.inject or None
    elif env_var("inject") not in os.environ:
        # Rank 2 where there is one; the last rank of a smaller demo (a fault that never
        # fires would show nothing).
        given["inject"] = DEFAULT_INJECT.replace("rank=2", f"rank={min(2, args.nproc - 1)}")
    try:  # a bad value is one clear line here, not a traceback from every worker
        cfg = SentinelConfig.from_env(os.environ, **given)
    except ConfigError as exc:
        where = f" (from --{exc.field.replace('_', '-')})" if exc.field in given else ""
        print(f"nansentinel demo: error: {exc}{where}", file=sys.stderr)
        return 2
    idle = _idle_faults(cfg.inject, args.nproc)
    if idle:
        print(f"nansentinel demo: error: {idle}", file=sys.stderr)
        return 2
    # The ranks read the demo's settings from the environment they inherit; it is put back
    # afterwards, so that a caller of main() in-process keeps the environment it had.
    saved = dict(os.environ)
    try:
        os.environ[env_var("policy")] = cfg.policy
        if cfg.inject:
            os.environ[env_var("inject")] = cfg.inject
        else:
            os.environ.pop(env_var("inject"), None)
        # One thread per CPU rank: the ranks share the machine, and torchrun otherwise prints its
        # OMP_NUM_THREADS banner to a first-time user. A value you exported is kept.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # torch warns "Failed to initialize NumPy" at import where numpy is not installed (an
        # optional dependency of torch that nansentinel does not use): not a first-time user's
        # concern. The launcher here and the ranks (through the environment) pass it over.
        os.environ["PYTHONWARNINGS"] = ",".join(
            filter(None, (os.environ.get("PYTHONWARNINGS"), f"ignore:{NUMPY_WARNING}")))
        from nansentinel.launcher.run import main as run

        print(
            f"nansentinel demo: {args.nproc} CPU ranks ({'FSDP2' if args.fsdp else 'DDP'}), "
            f"{args.steps} steps, policy {cfg.policy}, "
            f"injecting {cfg.inject or 'nothing'}; reports in {cfg.report_dir}",
            flush=True,
        )
        # Through `nansentinel run`, as users launch: its summary and exit codes apply. A
        # flag is passed on only where it was given (or where the demo's default differs from
        # the sentinel's and no variable is set): a variable reaches the workers as it is.
        flags = [f"--report-dir={args.report_dir}"] if args.report_dir is not None else []
        if args.metrics_port is not None or env_var("metrics_port") not in os.environ:
            flags.append(f"--metrics-port={args.metrics_port or 0}")
        return run([
            *flags, "--standalone", f"--nproc-per-node={args.nproc}", "--monitor-interval=0.5",
            "-m", "nansentinel.demo", "--steps", str(args.steps), "--sleep", str(args.sleep),
            *(["--fsdp"] if args.fsdp else []),
        ])
    finally:
        os.environ.clear()
        os.environ.update(saved)


#: The most CPU ranks the demo starts (each is a process with its own copy of the model).
MAX_DEMO_RANKS = 64


def _demo_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the demo's own options, in one line (None: nothing). The worker
    checks ``--steps`` and ``--sleep`` too (``demo.demo_arg_problem``), for a direct
    ``python -m nansentinel.demo``; the command does not import the worker side."""
    if not 1 <= args.nproc <= MAX_DEMO_RANKS:
        return f"--nproc={args.nproc}: must be from 1 to {MAX_DEMO_RANKS} CPU ranks"
    if args.steps < 0:
        return f"--steps={args.steps}: must be 0 or more"
    if not 0 <= args.sleep <= 3600:  # NaN fails too; time.sleep refuses a negative pause
        return f"--sleep={args.sleep}: must be a number of seconds from 0 to 3600"
    return None


def _idle_faults(spec: str | None, nproc: int) -> str | None:
    """A fault the demo's ranks can never fire (a rank past the last), named; None if all
    can."""
    if not spec:
        return None
    from nansentinel.common.inject import parse_inject

    idle = sorted({f.rank for f in parse_inject(spec) if f.rank is not None and f.rank >= nproc})
    if not idle:
        return None
    return (f"the fault spec {spec!r} names rank {', '.join(map(str, idle))}, but the demo runs "
            f"ranks 0-{nproc - 1} (--nproc={nproc}): it would never fire; name a rank below "
            f"{nproc}")


def incidents(argv: list[str]) -> int:
    """List the incident reports of a directory, or explain one (``show``)."""
    import json

    from nansentinel.common.text import printable
    from nansentinel.reading import incidents as reading

    default = os.environ.get(env_var("report_dir"), DEFAULT_REPORT_DIR)
    showing = bool(argv) and argv[0] == "show"
    p = argparse.ArgumentParser(
        prog="nansentinel incidents" + (" show" if showing else ""),
        description="Explain one incident: what, where, what the sentinel did, the verdict, "
        "what to do next, the numbers." if showing else
        "List the incident reports, newest first (`nansentinel incidents show ID` explains one).",
    )
    if showing:
        p.add_argument("id", metavar="ID|FILE",
                       help="an ID as the listing prints it (the step, or JOB:STEP), or a file")
        p.add_argument("--dir", default=default,
                       help=f"report directory (default: {env_var('report_dir')}, else "
                       f"{DEFAULT_REPORT_DIR})")
        p.add_argument("--html", metavar="OUT",
                       help="also write a self-contained HTML page with the incident's curves "
                       "(needs nansentinel[report])")
    else:
        p.add_argument("dir", nargs="?", default=default, metavar="DIR",
                       help=f"report directory (default: {env_var('report_dir')}, else "
                       f"{DEFAULT_REPORT_DIR})")
        p.add_argument("--json", action="store_true", help="one JSON list, for scripts")
    args = p.parse_args(argv[1:] if showing else argv)
    prog = p.prog
    try:
        if not showing:
            found, errors = reading.scan(Path(args.dir))
            if args.json:
                rows = [i.row(n) for n, i in zip(reading.ids(found), found, strict=True)]
                print(json.dumps(rows, indent=2))
            else:
                print(reading.table(found))
            for line in errors:
                print(f"{prog}: error: {printable(line, 2000)}", file=sys.stderr)
            return 2 if errors else 0
        incident = reading.find(args.id, Path(args.dir))
        sections = reading.explain(incident)
        if args.html:
            from nansentinel.reading import page

            written = page.write(incident, sections, Path(args.html))
            sections.append(reading.Section("Page", (f"written to {written}",)))
        print(reading.render(sections), end="")
        return 0
    except BrokenPipeError:
        raise  # the reader stopped reading: main() ends quietly
    except (reading.ReportError, OSError) as exc:
        print(f"{prog}: error: {printable(exc, 2000)}", file=sys.stderr)
        return 2
