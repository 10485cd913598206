"""Real Prometheus, Alertmanager and a webhook receiver on loopback, for end-to-end tests.

The alert path is only proven when a real Prometheus evaluates the real rules file on real
scrapes and a real Alertmanager routes the result: promtool's unit tests cannot catch a wrong
job label, a scrape config the exporter does not answer, or routing that drops the page. These
helpers start the servers (Debian's ``prometheus`` 2.42 and ``prometheus-alertmanager`` 0.25)
on free ports of 127.0.0.1 with their own storage under a temporary directory, wait until they
are ready, and always stop them. Every wait is bounded; a server that fails to start raises
:class:`ServerError` with its log.

Typical use::

    with webhook_receiver() as hook, \\
         alertmanager(alertmanager_config(hook.url), tmp) as am, \\
         prometheus(["127.0.0.1:9410"], RULES, am.url, tmp) as prom:
        prom.wait_for_targets(1)
        payload = hook.wait_for(lambda p: firing(p, "NanSentinelBadHost"), timeout=20)
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from tests.support import free_port

T = TypeVar("T")

PROMETHEUS_BIN = shutil.which("prometheus") or "/usr/bin/prometheus"
ALERTMANAGER_BIN = (
    shutil.which("prometheus-alertmanager")
    or shutil.which("alertmanager")
    or "/usr/bin/prometheus-alertmanager"
)
#: Bounded waits (seconds): start-up on a loaded 2-core CI machine, then one HTTP call.
START_TIMEOUT = 30.0
HTTP_TIMEOUT = 5.0


class ServerError(RuntimeError):
    """A server did not start or answered with an error; the message carries its log."""


def have_prometheus() -> bool:
    """True when the Prometheus binary is installed."""
    return Path(PROMETHEUS_BIN).is_file()


def have_alertmanager() -> bool:
    """True when the Alertmanager binary is installed."""
    return Path(ALERTMANAGER_BIN).is_file()



def wait_until(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Call ``probe`` until it returns something truthy, and return that; raise
    ``TimeoutError`` naming ``what`` (and the last exception, if any) after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = probe()
            if value:
                return value
        except Exception as exc:  # a server still starting refuses connections
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(interval)


def http_get_json(url: str, timeout: float = HTTP_TIMEOUT) -> Any:
    """GET ``url`` and decode its JSON body."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


@dataclasses.dataclass
class _Process:
    """A started server: its process, log file and base URL."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    url: str

    def log(self) -> str:
        """The server's output so far (for error messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-20_000:]
        except OSError:
            return "(no log)"

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ServerError(
                f"{self.name} exited with status {self.proc.returncode}; log:\n{self.log()}"
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def _start(name: str, argv_for_port: Callable[[int], list[str]], log_path: Path) -> _Process:
    """Start a server on a free port and wait for ``/-/ready``; retry on a port clash
    (another process may take the free port between :func:`free_port` and the bind)."""
    for attempt in range(3):
        port = free_port()
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv_for_port(port),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        server = _Process(name, proc, log_path, f"http://127.0.0.1:{port}")

        def ready(server: _Process = server) -> bool:
            server.check_alive()
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as response:
                return response.status == 200

        try:
            wait_until(ready, START_TIMEOUT, f"{name} to be ready at {server.url}", 0.1)
            return server
        except ServerError:
            server.stop()
            if "address already in use" in server.log() and attempt < 2:
                continue
            raise
        except TimeoutError as exc:
            server.stop()
            raise ServerError(f"{exc}; {name} log:\n{server.log()}") from None
    raise AssertionError("unreachable")


@dataclasses.dataclass
class PrometheusServer:
    """A running Prometheus; query it through the HTTP API."""

    url: str
    config_path: Path
    _server: _Process

    def log(self) -> str:
        """Prometheus's output so far."""
        return self._server.log()

    def _api(self, path: str, **params: str) -> Any:
        self._server.check_alive()
        query = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            body = http_get_json(url)
        except urllib.error.HTTPError as exc:  # 400/422: a bad query; say which
            detail = exc.read().decode(errors="replace")
            raise ServerError(f"GET {url} -> {exc.code}: {detail}") from None
        if body.get("status") != "success":
            raise ServerError(f"GET {url} -> {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Evaluate ``expr`` now (``/api/v1/query``); returns the result list (vector)
        or ``[result]`` for a scalar/string. A syntax error raises :class:`ServerError`."""
        data = self._api("query", query=expr)
        result = data["result"]
        return result if data["resultType"] in ("vector", "matrix") else [result]

    def alerts(self) -> list[dict[str, Any]]:
        """Active (pending and firing) alerts (``/api/v1/alerts``)."""
        return list(self._api("alerts")["alerts"])

    def targets(self) -> list[dict[str, Any]]:
        """Active scrape targets with their health (``/api/v1/targets``)."""
        return list(self._api("targets", state="active")["activeTargets"])

    def wait_for_targets(self, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        """Wait until ``count`` targets have been scraped successfully."""

        def healthy() -> list[dict[str, Any]]:
            up = [t for t in self.targets() if t.get("health") == "up"]
            return up if len(up) >= count else []

        return wait_until(healthy, timeout, f"{count} healthy scrape targets")


def prometheus_config(
    targets: list[str],
    rules_file: Path | None,
    alertmanager_url: str | None,
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    job: str = "nansentinel",
) -> str:
    """A Prometheus configuration (JSON, which is YAML) scraping ``targets`` as ``job``."""
    config: dict[str, Any] = {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": evaluation_interval,
        },
        "rule_files": [str(rules_file)] if rules_file is not None else [],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]}],
    }
    if alertmanager_url:
        parsed = urllib.parse.urlsplit(alertmanager_url)
        config["alerting"] = {
            "alertmanagers": [
                {
                    "scheme": parsed.scheme or "http",
                    "path_prefix": parsed.path or "/",
                    "timeout": "2s",
                    "static_configs": [{"targets": [parsed.netloc]}],
                }
            ]
        }
    return json.dumps(config, indent=2)


@contextlib.contextmanager
def prometheus(
    targets: list[str],
    rules_file: Path | None,
    alertmanager_url: str | None,
    tmp: Path,
    scrape_interval: str = "1s",
    evaluation_interval: str = "1s",
    job: str = "nansentinel",
) -> Iterator[PrometheusServer]:
    """Run Prometheus scraping ``targets`` (``host:port``) with ``rules_file``, sending alerts
    to ``alertmanager_url``; its config, data and log live in a new directory under ``tmp``."""
    workdir = Path(tmp) / f"prometheus-{free_port()}"
    workdir.mkdir(parents=True)
    config_path = workdir / "prometheus.yml"
    config_path.write_text(
        prometheus_config(
            targets, rules_file, alertmanager_url, scrape_interval, evaluation_interval, job
        )
    )
    server = _start(
        "prometheus",
        lambda port: [
            PROMETHEUS_BIN,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=info",
        ],
        workdir / "prometheus.log",
    )
    try:
        yield PrometheusServer(server.url, config_path, server)
    finally:
        server.stop()


@dataclasses.dataclass
class AlertmanagerServer:
    """A running Alertmanager."""

    url: str
    _server: _Process

    def log(self) -> str:
        """Alertmanager's output so far."""
        return self._server.log()

    def alerts(self) -> list[dict[str, Any]]:
        """Alerts Alertmanager holds (``/api/v2/alerts``)."""
        self._server.check_alive()
        return list(http_get_json(f"{self.url}/api/v2/alerts"))


def alertmanager_config(
    webhook_url: str, *, only_pages: bool = False, group_by: tuple[str, ...] = ("hostname",)
) -> str:
    """An Alertmanager configuration (JSON, which is YAML) that sends alerts to
    ``webhook_url`` quickly (group_wait and group_interval 1 s, repeat 1 h): every alert, or
    only ``severity="page"`` ones when ``only_pages``."""
    hook = {"name": "webhook", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}
    timing = {"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"}
    route: dict[str, Any] = {"receiver": "webhook", "group_by": list(group_by), **timing}
    receivers: list[dict[str, Any]] = [hook]
    if only_pages:
        route["receiver"] = "blackhole"
        route["routes"] = [{"receiver": "webhook", "matchers": ['severity="page"'], **timing}]
        receivers.append({"name": "blackhole"})
    return json.dumps({"route": route, "receivers": receivers}, indent=2)


def adapt_alertmanager_config(path: Path, webhook_url: str, wait: str = "1s") -> str:
    """A deployable Alertmanager config (the monitoring set's ``alertmanager/alertmanager.yml``)
    made testable: every webhook receiver posts to ``webhook_url``/<receiver name>, other
    integrations (PagerDuty, e-mail) are dropped, and every route waits ``wait`` instead of
    its production timing, so that a test exercises the real routing and inhibition quickly.
    """
    import yaml  # tests/requirements.txt; only this helper needs it

    config = yaml.safe_load(Path(path).read_text())
    for receiver in config.get("receivers", []):
        hooks = receiver.get("webhook_configs", [])
        for key in [k for k in receiver if k.endswith("_configs") and k != "webhook_configs"]:
            del receiver[key]
        for hook in hooks:
            hook["url"] = f"{webhook_url}/{receiver['name']}"

    def speed_up(route: dict[str, Any]) -> None:
        route["group_wait"] = route["group_interval"] = wait
        route["repeat_interval"] = "1h"
        for child in route.get("routes", []):
            speed_up(child)

    speed_up(config["route"])
    return json.dumps(config, indent=2)


@contextlib.contextmanager
def alertmanager(config: str | Path, tmp: Path) -> Iterator[AlertmanagerServer]:
    """Run Alertmanager with ``config`` (YAML text, or a path to a file) and no clustering."""
    workdir = Path(tmp) / f"alertmanager-{free_port()}"
    workdir.mkdir(parents=True)
    if isinstance(config, Path):
        config_path = config
    else:
        config_path = workdir / "alertmanager.yml"
        config_path.write_text(config)
    server = _start(
        "alertmanager",
        lambda port: [
            ALERTMANAGER_BIN,
            f"--config.file={config_path}",
            f"--storage.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=info",
        ],
        workdir / "alertmanager.log",
    )
    try:
        yield AlertmanagerServer(server.url, server)
    finally:
        server.stop()


class WebhookReceiver:
    """Collects the JSON payloads Alertmanager POSTs; thread-safe."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._payloads: list[dict[str, Any]] = []
        self._cond = threading.Condition()

    def _add(self, payload: dict[str, Any]) -> None:
        with self._cond:
            self._payloads.append(payload)
            self._cond.notify_all()

    @property
    def payloads(self) -> list[dict[str, Any]]:
        """A copy of every payload received so far, oldest first."""
        with self._cond:
            return list(self._payloads)

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float
    ) -> dict[str, Any]:
        """The first payload (already received or arriving within ``timeout``) for which
        ``predicate`` is true; ``TimeoutError`` listing what did arrive otherwise."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for payload in self._payloads[seen:]:
                    if predicate(payload):
                        return payload
                seen = len(self._payloads)
                left = deadline - time.monotonic()
                if left <= 0:
                    summary = [summarize(p) for p in self._payloads]
                    raise TimeoutError(
                        f"no matching webhook payload within {timeout:.0f} s; received: {summary}"
                    )
                self._cond.wait(left)


def summarize(payload: dict[str, Any]) -> list[str]:
    """One line per alert of a payload: status, alertname and labels (for error messages)."""
    return [
        f"{a.get('status')} {a.get('labels', {}).get('alertname')} {a.get('labels')}"
        for a in payload.get("alerts", [])
    ]


def firing(payload: dict[str, Any], alertname: str, **labels: str) -> dict[str, Any] | None:
    """The first firing alert named ``alertname`` with ``labels`` in ``payload``, or None."""
    for alert in payload.get("alerts", []):
        alert_labels = alert.get("labels", {})
        if (
            alert.get("status") == "firing"
            and alert_labels.get("alertname") == alertname
            and all(alert_labels.get(k) == v for k, v in labels.items())
        ):
            return alert
    return None


@contextlib.contextmanager
def webhook_receiver() -> Iterator[WebhookReceiver]:
    """An HTTP server on a free loopback port that records Alertmanager webhook payloads."""
    holder: list[WebhookReceiver] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            try:
                payload = json.loads(body)
            except json.JSONDecodeError:
                self.send_error(400, "expected a JSON body")
                return
            holder[0]._add(payload)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    receiver = WebhookReceiver(f"http://127.0.0.1:{server.server_address[1]}/alerts")
    holder.append(receiver)
    thread = threading.Thread(target=server.serve_forever, name="webhook", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
