"""The exporter's server process: its start, the refresher that feeds it, its end.

A rank never answers a scrape itself: a refresher thread renders the registry every
:data:`REFRESH_SECONDS` (``generate_latest``) and writes the bytes, as one length-prefixed
frame, to a small HTTP server process beside the rank (``metrics_server.py``, started with
``python -I``), which answers every scrape from the latest frame. What the metrics are (their
declarations and what each step adds) is :mod:`nansentinel.effects.metrics`; this module is
only how they leave the process, and that the process it starts ends with the rank (at
:meth:`Exporter.close`, else at interpreter exit).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from nansentinel.config import env_var
from nansentinel.result import NanSentinelError, RankIdentity

log = logging.getLogger("nansentinel")

#: The exposition format ``generate_latest`` writes (text 0.0.4, in every prometheus-client
#: release the package allows; the client's own name for it came only in 0.23).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Seconds between two renders of the registry for the server process.
REFRESH_SECONDS = 1.0
#: Seconds the server process may take to bind before the exporter gives up.
START_TIMEOUT_S = 30.0
_SERVER_SCRIPT = Path(__file__).with_name("metrics_server.py")


class MetricsPortError(NanSentinelError, RuntimeError):
    """The exporter could not bind its port; the message says which rank, host and port, and
    how to choose another one."""


class Exporter:
    """Serves one registry from a server process of its own.

    Args:
        registry: what is served (rendered every ``refresh`` seconds, and at :meth:`flush`).
        identity: the rank, for its messages and a port error.
        refresh: seconds between two renders for the server process.
    """

    def __init__(self, registry: CollectorRegistry, identity: RankIdentity,
                 refresh: float = REFRESH_SECONDS) -> None:
        self.registry, self.identity = registry, identity
        self._refresh = refresh
        self._server: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._send_lock = threading.Lock()
        self._port: int | None = None

    def serve(
        self, addr: str, port: int, certfile: str | None = None, keyfile: str | None = None
    ) -> int:
        """Serve ``/metrics`` over HTTP (HTTPS when ``certfile`` and ``keyfile`` are given).

        ``addr`` ``''`` means all IPv4 interfaces; ``port`` 0 picks a free port. Returns the
        bound port. A port that cannot be bound raises :class:`MetricsPortError` naming the
        rank, host and port, because with one port per local rank a clash is usually two jobs
        on one host, and the user needs to know which variable moves it.
        """
        if self._server is not None:
            raise RuntimeError(
                f"rank {self.identity.rank}: metrics are already served on port {self._port}"
            )
        if (certfile is None) != (keyfile is None):
            raise ValueError("certfile and keyfile must be given together for TLS")
        bind = addr or "0.0.0.0"
        args = [sys.executable, "-I", str(_SERVER_SCRIPT), bind, str(port)]
        args += [CONTENT_TYPE, *((certfile, keyfile) if certfile and keyfile else ())]
        server = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        # The first frame: the server says ok only once it can serve it. (A server that could
        # not bind has exited: the broken pipe is answered by its status line below.)
        self._send(server, generate_latest(self.registry))
        status = _first_line(server, START_TIMEOUT_S)
        if not status.startswith("ok "):
            server.kill()
            server.wait()
            server.stdout.close()  # type: ignore[union-attr]
            with contextlib.suppress(OSError):
                server.stdin.close()  # type: ignore[union-attr]
            _, code, message = [*status.split(" ", 2), "", ""][:3]
            ident = self.identity
            reason = (
                "is already in use" if code == str(errno.EADDRINUSE)
                else f"failed: {message or 'the server process did not start'}"
            )
            raise MetricsPortError(
                f"rank {ident.rank} (local rank {ident.local_rank}) on host {ident.hostname}: "
                f"binding the metrics exporter to {bind}:{port} {reason}. Each rank serves on "
                f"{env_var('metrics_port')} + LOCAL_RANK; set {env_var('metrics_port')} to a free "
                f"base port (or 0 to disable the exporter)."
            )
        self._server = server
        self._port = int(status.split()[1])
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._refresher, name=f"nansentinel-metrics-{self._port}", daemon=True
        )
        self._thread.start()
        _SERVING.add(self)  # closed at exit, before the interpreter stops its thread
        log.info(
            "rank %d: metrics on %s://%s:%d/metrics",
            self.identity.rank,
            "https" if certfile else "http",
            bind,
            self._port,
        )
        return self._port

    @property
    def port(self) -> int | None:
        """The port being served, or None when not serving."""
        return self._port

    def flush(self) -> None:
        """Render the registry now and hand it to the server process, which serves it as soon
        as its reader swaps it in (the refresher does this every ``refresh`` seconds; the stop
        path calls it so the final state is served within moments)."""
        server = self._server
        if server is None:
            return
        error = self._send(server, generate_latest(self.registry))
        if error is not None and not self._stop.is_set():  # the server process is gone
            log.warning(
                "rank %d: the metrics server process stopped (%s); no more scrapes",
                self.identity.rank, error,
            )
            self._stop.set()

    def _send(self, server: subprocess.Popen[bytes], body: bytes) -> Exception | None:
        """Write one frame to the server process; the error if it could not take it."""
        with self._send_lock:
            try:
                assert server.stdin is not None
                server.stdin.write(b"%d\n" % len(body) + body)
                server.stdin.flush()
            except (OSError, ValueError) as exc:
                return exc
        return None

    def _refresher(self) -> None:
        while not self._stop.wait(self._refresh):
            try:
                self.flush()
            except Exception:  # a collector failed: keep serving the last good render
                log.exception("rank %d: rendering the metrics failed", self.identity.rank)

    def close(self) -> None:
        """Stop the refresher and the server process (if any) and release its port; safe to
        call twice."""
        server, thread = self._server, self._thread
        self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self._server = self._thread = None
        self._port = None
        _SERVING.discard(self)
        if server is None:
            return
        with self._send_lock:
            if server.stdin is not None:
                with contextlib.suppress(OSError):
                    server.stdin.close()  # end of input: the server stops and exits
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()


def _first_line(server: subprocess.Popen[bytes], timeout: float) -> str:
    """The server process's status line (``ok PORT`` / ``error ERRNO MESSAGE``), or an
    ``error`` of our own when it says nothing in time or exits."""
    assert server.stdout is not None
    fd = server.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return f"error 0 no answer from the server process within {timeout:g} s"
        chunk = os.read(fd, 256)
        if not chunk:
            return f"error 0 the server process exited with {server.wait()} before binding"
        line += chunk
    return line.decode(errors="replace").strip()


#: Exporters still serving; shut down at interpreter exit, so that the refresher is not inside
#: the registry's collectors (psutil, torch.cuda) while the interpreter finalizes, and the
#: server process ends with its rank.
_SERVING: weakref.WeakSet[Exporter] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for exporter in list(_SERVING):
        exporter.close()
