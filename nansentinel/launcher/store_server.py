"""``nansentinel store``: the c10d rendezvous store in a process of its own.

With ``--rdzv-backend=c10d`` the store lives, by default, in the launcher of the host named by
``--rdzv-endpoint``: when the sentinel excludes that host its launcher leaves, the store goes
with it and the job ends on every host. A batch script starts this server beside the training
instead (on the batch host, before ``srun``), points every launcher at it with
``--rdzv-conf=is_host=0`` (no launcher then tries to serve it), and any training host,
the first one included, can leave. It serves until SIGTERM/SIGINT/SIGHUP, or until the
process given by ``--parent`` (the batch script) is gone, so a job killed hard leaves no
server behind; on SIGTERM with ``--parent`` it keeps serving until the parent exits, because
the launchers still use the store while they stop.

``--port 0`` (the default) takes a free port; the port is written to ``--port-file``
atomically once the server listens, for the script to read.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from nansentinel.common.exitcodes import EXIT_CONFIG, EXIT_OK
from nansentinel.launcher.console import exit_status

#: Seconds between two looks at the parent process.
PARENT_POLL_S = 1.0


def store_main(argv: list[str] | None = None) -> int:
    """``nansentinel store``: serve a c10d rendezvous store until told to stop."""
    parser = argparse.ArgumentParser(
        prog="nansentinel store",
        description="Serve the c10d rendezvous store in a process of its own, so that any "
        "training host can leave the job (point launchers at it with --rdzv-endpoint=HOST:PORT "
        "--rdzv-conf=is_host=0).",
        allow_abbrev=False,
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default all)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: a free one)")
    parser.add_argument("--port-file", metavar="FILE",
                        help="write the port here once listening (atomically)")
    parser.add_argument("--parent", type=int, metavar="PID",
                        help="stop when this process is gone (the batch script: $$)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exit_status(exc)
    if not 0 <= args.port <= 65535:
        print(f"nansentinel store: error: --port {args.port} is not a TCP port",
              file=sys.stderr)
        return EXIT_CONFIG

    from torch.distributed import TCPStore

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if args.parent is None or signum != signal.SIGTERM:
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        store = TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(days=30))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"nansentinel store: error: cannot listen on {args.host}:{args.port}: {exc}",
              file=sys.stderr)
        return EXIT_CONFIG
    port = int(store.port)
    if args.port_file:
        try:
            _write_atomically(Path(args.port_file), f"{port}\n")
        except OSError as exc:
            print(f"nansentinel store: error: --port-file {args.port_file}: {exc}",
                  file=sys.stderr)
            return EXIT_CONFIG
    print(f"nansentinel store: serving the rendezvous store on {args.host}:{port}", flush=True)
    while not stop.wait(PARENT_POLL_S):
        if args.parent is not None and not _alive(args.parent):
            break
    why = "told to stop" if stop.is_set() else "its parent is gone"
    print(f"nansentinel store: stopped ({why})", flush=True)
    del store
    return EXIT_OK


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs and is still our parent (a child whose parent died is
    handed to another process, and a pid can be reused)."""
    if os.getppid() != pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
