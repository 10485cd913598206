"""The exporter's HTTP server, a small process of its own beside each training rank.

Run as a script (``python -I metrics_server.py ADDR PORT CONTENT_TYPE [CERTFILE KEYFILE]``)
by :class:`nansentinel.effects.metrics.SentinelMetrics`; it imports only the standard library, so it
starts in tens of milliseconds and holds no copy of torch.

Why a process: a scrape served from a thread of the training process renders the registry
under the training process's GIL, and many scrapers (or one slow one over TLS) then take turns
with the training loop's Python. Here the rank renders its metrics once a refresh interval and
writes the bytes into this process's stdin; scrapes are answered from the latest bytes, on
another core if there is one, and never touch the training process.

Protocol. stdin carries frames, each ``LENGTH\\n`` followed by LENGTH bytes of exposition
text. On start the server binds, reads the first frame, and only then writes one line to
stdout: ``ok PORT`` (so the first scrape already gets metrics) or ``error ERRNO MESSAGE``.
Every scrape gets the latest frame (``/metrics`` or ``/``; anything else
is 404). End of stdin -- the rank closed it or died -- stops the server and ends the process,
so it never outlives its rank.
"""

from __future__ import annotations

import http.server
import socketserver
import ssl
import sys
import threading


class _State:
    body = b""
    lock = threading.Lock()


class _Handler(http.server.BaseHTTPRequestHandler):
    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        with _State.lock:
            body = _State.body
        self.send_response(200)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Scrapes are not logged: the rank's log is for training."""


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Scrapers synchronised on the same second (many Prometheus replicas, a federation) must
    # not overflow the listen queue: the default of 5 makes their SYNs wait for a resend.
    request_queue_size = 128


def _read_frame(stream: object) -> bytes | None:
    """The next frame from the rank, or None at the end of its input."""
    try:
        header = stream.readline()  # type: ignore[attr-defined]
        if not header:
            return None
        size = int(header)
        body: bytes = stream.read(size)  # type: ignore[attr-defined]
    except (OSError, ValueError):
        return None
    return body if len(body) == size else None


def _read_frames(stream: object, server: _Server) -> None:
    """Replace the body with each frame from the rank; at end of input, stop serving."""
    try:
        while (body := _read_frame(stream)) is not None:
            with _State.lock:
                _State.body = body
    finally:
        server.shutdown()


def main(argv: list[str]) -> int:
    addr, port, content_type = argv[0], int(argv[1]), argv[2]
    certfile, keyfile = (argv[3], argv[4]) if len(argv) >= 5 else (None, None)
    _Handler.content_type = content_type
    try:
        server = _Server((addr, port), _Handler)
        if certfile and keyfile:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certfile, keyfile)
            server.socket = context.wrap_socket(server.socket, server_side=True)
    except OSError as exc:
        message = str(exc).replace("\n", " ")
        sys.stdout.write(f"error {exc.errno or 0} {message}\n")
        sys.stdout.flush()
        return 1
    first = _read_frame(sys.stdin.buffer)
    if first is None:  # the rank is gone already
        server.server_close()
        return 0
    _State.body = first
    sys.stdout.write(f"ok {server.server_address[1]}\n")
    sys.stdout.flush()
    reader = threading.Thread(
        target=_read_frames, args=(sys.stdin.buffer, server), name="frames", daemon=True
    )
    reader.start()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
