"""The alert path for real: exporters -> Prometheus (the real rules) -> Alertmanager (the real
routing) -> a webhook, and the Grafana dashboard's queries against that Prometheus.

No training runs here: four in-process exporters (ranks 0-1 on node-good, 2-3 on node-bad)
are fed the StepResults the core would produce for a run in which rank 2's gradients (then
loss) turn non-finite twice, a step overflows, and the cluster excludes node-bad. The real
training path is covered by the end-to-end tests in tests/e2e.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nansentinel.effects.metrics import SentinelMetrics
from nansentinel.result import RankIdentity, StepResult
from tests.deploy.test_deploy_files import (
    ALERTMANAGER,
    DASHBOARD,
    RULES,
    dashboard_queries,
    substitute,
    tool,
)
from tests.e2e import prom

needs_servers = pytest.mark.skipif(
    not (prom.have_prometheus() and prom.have_alertmanager()),
    reason="Prometheus/Alertmanager not installed (apt-get install prometheus "
    "prometheus-alertmanager)",
)

HOSTS = {0: "node-good", 1: "node-good", 2: "node-bad", 3: "node-bad"}
BAD_RANK = 2
STEP_SECONDS = 0.2
#: Step -> what happens at it (relative to the first step fed after the baseline scrape).
BLAME_STEPS = {3: ["grad"], 6: ["loss", "grad"]}
OVERFLOW_STEP = 9
EXCLUDE_STEP = 11


def step_result(step: int, rank: int) -> StepResult:
    """What the core would report on ``rank`` at ``step`` of the scenario."""
    excluded = ["node-bad"] if step >= EXCLUDE_STEP else []
    local_loss: float = 2.0 / (1 + 0.05 * step) + 0.01 * rank
    local_grad_norm: float = 1.0 + 0.1 * rank
    kwargs: dict[str, Any] = dict(
        step=step, applied=True, outcome="applied", bad_ranks=[], bad_hosts=[], kinds=[],
        local_kinds=[], consecutive_skips=0, excluded_hosts=excluded,
    )  # fmt: skip
    if step in BLAME_STEPS:
        kinds = BLAME_STEPS[step]
        local = kinds if rank == BAD_RANK else []
        if "loss" in local:
            local_loss = math.nan
        if "grad" in local:
            local_grad_norm = math.inf
        kwargs.update(
            applied=False, outcome="skipped", bad_ranks=[BAD_RANK], bad_hosts=[HOSTS[BAD_RANK]],
            kinds=kinds, local_kinds=local, consecutive_skips=1,
        )  # fmt: skip
    elif step == OVERFLOW_STEP:
        kwargs.update(applied=False, outcome="overflow", overflow=True)
    elif step == EXCLUDE_STEP:
        kwargs.update(applied=False, outcome="excluded")
    return StepResult(local_loss=local_loss, local_grad_norm=local_grad_norm, **kwargs)


@dataclass
class Stack:
    prometheus: prom.PrometheusServer
    alertmanager: prom.AlertmanagerServer
    hook: prom.WebhookReceiver
    started: float


def feed(exporters: dict[int, SentinelMetrics], stop: threading.Event) -> None:
    """Observe one step on every rank each STEP_SECONDS until stopped."""
    step = 0
    while not stop.is_set():
        for rank, metrics in exporters.items():
            metrics.observe_step(step_result(step, rank), 2e-4 * (1 + rank) * (1 + step % 3))
        step += 1
        stop.wait(STEP_SECONDS)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("alerting")
    started = time.monotonic()
    exporters: dict[int, SentinelMetrics] = {}
    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(exporters, stop), name="feeder", daemon=True)
    with contextlib.ExitStack() as resources:
        hook = resources.enter_context(prom.webhook_receiver())
        am_config = prom.adapt_alertmanager_config(ALERTMANAGER, hook.url)
        am = resources.enter_context(prom.alertmanager(am_config, tmp))
        try:
            targets = []
            for rank, host in HOSTS.items():
                identity = RankIdentity(rank, rank % 2, len(HOSTS), host, "cpu", str(rank % 2))
                exporters[rank] = SentinelMetrics(identity)
                targets.append(f"127.0.0.1:{exporters[rank].serve('127.0.0.1', 0)}")
            server = resources.enter_context(prom.prometheus(targets, RULES, am.url, tmp))
            # The baseline (every counter at 0) must be scraped before the first blame, as in
            # a real run, so that increase() sees the blames.
            server.wait_for_targets(len(HOSTS))
            feeder.start()
            yield Stack(server, am, hook, started)
        finally:
            stop.set()
            if feeder.is_alive():
                feeder.join(timeout=5)
            for metrics in exporters.values():
                metrics.close()


@pytest.mark.e2e
@needs_servers
@pytest.mark.timeout(60)
def test_bad_host_page_reaches_the_pager_naming_host_and_rank(stack: Stack) -> None:
    wanted = {"hostname": "node-bad", "rank": str(BAD_RANK)}
    payload = stack.hook.wait_for(
        lambda p: prom.firing(p, "NanSentinelBadHost", **wanted) is not None, timeout=30
    )
    elapsed = time.monotonic() - stack.started
    alert = prom.firing(payload, "NanSentinelBadHost", **wanted)
    assert alert is not None
    assert payload["receiver"] == "nansentinel-pager", payload
    assert payload["groupLabels"] == {"hostname": "node-bad"}
    labels = alert["labels"]
    assert labels["severity"] == "page"
    assert labels["reason"] == "repeated_blame"
    description = alert["annotations"]["description"]
    assert f"Rank {BAD_RANK} on host node-bad" in description, description
    assert "on 2 steps in the last 10 minutes" in description, description
    assert alert["annotations"]["runbook_url"] == "runbook.md#nansentinelbadhost"
    # The healthy host is never paged.
    for p in stack.hook.payloads:
        assert prom.firing(p, "NanSentinelBadHost", hostname="node-good") is None, p
    print(f"page delivered {elapsed:.1f} s after the servers began to start")


def label_values(expr: str) -> tuple[str, str]:
    match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr.strip())
    assert match, expr
    return match.group(1), match.group(2)


@pytest.mark.e2e
@needs_servers
@pytest.mark.timeout(60)
def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [(title, substitute(expr)) for title, expr in dashboard_queries(dashboard)]
    annotations = [
        ("annotation " + a["name"], substitute(a["expr"]))
        for a in dashboard["annotations"]["list"]
        if "expr" in a
    ]
    # Device memory is exported only on CUDA; here its queries must be valid, not filled.
    cuda_only = [(t, q) for t, q in queries if "nansentinel_device_" in q]
    assert cuda_only, "the dashboard lost its device memory panel"
    expected = [(t, q) for t, q in queries + annotations if (t, q) not in cuda_only]

    def empty() -> list[str]:
        return [f"{title}: {q}" for title, q in expected if not stack.prometheus.query(q)]

    # Rates and quantiles need two scrapes after the events; wait for them, bounded.
    deadline = time.monotonic() + 30
    missing = empty()
    while missing and time.monotonic() < deadline:
        time.sleep(0.5)
        missing = empty()
    assert not missing, "queries without data:\n" + "\n".join(missing)
    for title, q in cuda_only:
        assert stack.prometheus.query(q) == [], title  # parses (else ServerError), no CUDA here

    values = {
        name: sorted({s["metric"][label] for s in stack.prometheus.query(substitute(selector))})
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
        for name, (selector, label) in [(v["name"], label_values(v["query"]["query"]))]
    }
    assert values == {
        "job": ["nansentinel"],
        "hostname": ["node-bad", "node-good"],
        "rank": ["0", "1", "2", "3"],
    }


@pytest.mark.e2e
@needs_servers
@pytest.mark.timeout(60)
def test_prometheus_sees_the_blame_with_host_and_rank(stack: Stack) -> None:
    rows = prom.wait_until(
        lambda: stack.prometheus.query("nansentinel:rank_blamed_steps:increase10m >= 2"),
        timeout=30,
        what="rank 2's two blamed steps in the recording rule",
    )
    assert [(r["metric"]["hostname"], r["metric"]["rank"]) for r in rows] == [("node-bad", "2")]
    excluded = prom.wait_until(
        lambda: stack.prometheus.query("nansentinel_host_excluded == 1"),
        timeout=30,
        what="node-bad excluded in the cluster view",
    )
    assert [r["metric"]["hostname"] for r in excluded] == ["node-bad"]
    # Only rank 0 exports the cluster view.
    assert len(stack.prometheus.query("count by (instance) (nansentinel_host_blamed_total)")) == 1


@pytest.mark.parametrize("only_pages", [False, True])
def test_alertmanager_config_builder_is_valid(tmp_path: Path, only_pages: bool) -> None:
    path = tmp_path / "am.yml"
    path.write_text(prom.alertmanager_config("http://127.0.0.1:1/hook", only_pages=only_pages))
    proc = subprocess.run(
        [tool("amtool"), "check-config", str(path)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    routed = subprocess.run(
        [tool("amtool"), "config", "routes", "test", f"--config.file={path}",
         "--verify.receivers=" + ("blackhole" if only_pages else "webhook"), "severity=warning"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert routed.returncode == 0, routed.stdout + routed.stderr


def test_adapted_deploy_config_keeps_the_routing(tmp_path: Path) -> None:
    path = tmp_path / "am.yml"
    path.write_text(prom.adapt_alertmanager_config(ALERTMANAGER, "http://127.0.0.1:1"))
    proc = subprocess.run(
        [tool("amtool"), "config", "routes", "test", f"--config.file={path}",
         "--verify.receivers=nansentinel-pager", "severity=page", "hostname=h"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "http://127.0.0.1:1/nansentinel-pager" in path.read_text()
