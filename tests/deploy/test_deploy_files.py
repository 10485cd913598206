"""The shipped monitoring and Kubernetes files are code: lint them with the real tools and keep
their pieces consistent with each other.

promtool (Prometheus) and amtool (Alertmanager) come from Debian's ``prometheus`` and
``prometheus-alertmanager`` packages (tests/run.sh installs them); a test that needs one is
skipped, saying so, only when the binary is absent.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from prometheus_client import generate_latest

from nansentinel.effects.metrics import HostCollector, SentinelMetrics
from nansentinel.result import RankIdentity, StepResult

ROOT = Path(__file__).resolve().parents[2]
FILES = ROOT / "nansentinel" / "files"  # the sets `nansentinel files` writes out
DEPLOY = FILES / "monitoring"
PROMETHEUS_DIR = DEPLOY / "prometheus"
RULES = PROMETHEUS_DIR / "rules" / "nansentinel.rules.yml"
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.test.yml"))
ALERTMANAGER = DEPLOY / "alertmanager" / "alertmanager.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "nansentinel.json"
RUNBOOK = DEPLOY / "runbook.md"
ALERTS = {
    "NanSentinelBadHost": "page",
    "NanSentinelNonFiniteDetected": "warning",
    "NanSentinelReplicaDiverged": "page",
    "NanSentinelStateNonFinite": "page",
    "NanSentinelHyperparameterNonFinite": "warning",
    "NanSentinelStepsSkipped": "warning",
    "NanSentinelRankStalled": "page",
    "NanSentinelExporterDown": "warning",
}
#: What the Grafana template variables stand for when a query is run outside Grafana.
GRAFANA_SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$job": ".*",
    "$hostname": ".*",
    "$rank": ".*",
}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian: prometheus / prometheus-alertmanager)")
    return path


def run(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, input=stdin, timeout=60, cwd=ROOT, check=False
    )


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in load_yaml(RULES)["groups"] for r in g["rules"] if "alert" in r]


def dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every panel target, rows included."""
    found = []
    stack = list(dashboard["panels"])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    return found


def substitute(expr: str) -> str:
    # Longest names first: $__rate_interval before $__interval.
    for name in sorted(GRAFANA_SUBSTITUTIONS, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_SUBSTITUTIONS[name])
    return expr


# -- Prometheus --------------------------------------------------------------------------------


def test_promtool_check_config() -> None:
    proc = run(tool("promtool"), "check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_check_rules() -> None:
    proc = run(tool("promtool"), "check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(ALERTS) + 2} rules found" in proc.stdout


def test_promtool_rule_unit_tests() -> None:
    assert RULE_TESTS, "no promtool rule tests in deploy/prometheus/tests"
    proc = run(tool("promtool"), "test", "rules", *map(str, RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(RULE_TESTS), proc.stdout


def test_every_alert_has_a_firing_and_a_quiet_rule_test() -> None:
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in RULE_TESTS:
        for case in load_yaml(path)["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert set(ALERTS) <= firing, f"no firing test for {set(ALERTS) - firing}"
    assert set(ALERTS) <= quiet, f"no quiet test for {set(ALERTS) - quiet}"


def test_alerts_have_severity_annotations_and_runbook_anchors() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    assert set(rules) == set(ALERTS)
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line[3:].strip().lower()).replace(" ", "-")
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("## ")
    }
    for name, rule in rules.items():
        assert rule["labels"]["severity"] == ALERTS[name], name
        notes = rule["annotations"]
        text = notes["summary"] + notes["description"]
        assert "hostname" in text and "rank" in text.lower(), f"{name} must name host and rank"
        url = notes["runbook_url"]
        assert url.startswith("runbook.md#"), url
        assert url.split("#", 1)[1] in anchors, f"{name}: no runbook section for {url}"


def test_exporter_output_passes_promtool_check_metrics() -> None:
    m = SentinelMetrics(RankIdentity(0, 0, 2, "node-a", "cpu", "0", "abc"))
    m.observe_step(
        StepResult(
            step=3, applied=False, outcome="skipped", bad_ranks=[0], bad_hosts=["node-a"],
            kinds=["grad"], local_kinds=["grad"], local_loss=float("nan"),
            local_grad_norm=float("inf"), consecutive_skips=1, excluded_hosts=["node-a"],
        ),
        0.003,
    )  # fmt: skip
    proc = run(tool("promtool"), "check", "metrics", stdin=generate_latest(m.registry).decode())
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def exported_names(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every sample name a rank-0 exporter can produce, CUDA ones included."""
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    m = SentinelMetrics(RankIdentity(0, 0, 1, "h", "cpu"), cluster_view=True)
    m.registry.register(HostCollector(torch.device("cuda", 0)))
    m.observe_step(
        StepResult(
            step=0, applied=False, outcome="skipped", bad_ranks=[0], bad_hosts=["h"],
            kinds=["loss"], local_kinds=["loss"], local_loss=1.0, local_grad_norm=1.0,
            consecutive_skips=1, excluded_hosts=["h"],
        ),
        0.001,
    )  # fmt: skip
    return {s.name for family in m.registry.collect() for s in family.samples}


def test_every_metric_used_in_deploy_is_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    names = exported_names(monkeypatch)
    for path in [RULES, DASHBOARD, RUNBOOK, *RULE_TESTS]:
        # (A trailing "/" is a directory, e.g. the default report dir nansentinel_reports/.)
        used = set(re.findall(r"\bnansentinel_[a-z_]+(?![a-z_/])", path.read_text()))
        # Recording rules are `nansentinel:…`, not matched here; rank_info is an Info metric.
        unknown = used - names
        assert not unknown, f"{path.relative_to(ROOT)} uses metrics nobody exports: {unknown}"


# -- Kubernetes --------------------------------------------------------------------------------


def test_prometheusrule_carries_the_same_groups_as_the_rules_file() -> None:
    rule = load_yaml(FILES / "kubernetes" / "prometheusrule.yaml")
    assert rule["kind"] == "PrometheusRule"
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == load_yaml(RULES)["groups"], (
        "nansentinel/files/kubernetes/prometheusrule.yaml is out of date; regenerate it (see its "
        "header)"
    )


def test_podmonitor_scrapes_one_named_port_per_local_rank_as_job_nansentinel() -> None:
    monitor = load_yaml(FILES / "kubernetes" / "podmonitor.yaml")
    assert monitor["kind"] == "PodMonitor"
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == [f"metrics-{i}" for i in range(8)]
    for endpoint in endpoints:
        assert endpoint["path"] == "/metrics"
        relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        assert relabel["job"]["replacement"] == "nansentinel"  # the rules select this job


# -- Alertmanager ------------------------------------------------------------------------------


def test_amtool_check_config() -> None:
    proc = run(tool("amtool"), "check-config", str(ALERTMANAGER))
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["severity=page", "alertname=NanSentinelBadHost", "hostname=n1"], "nansentinel-pager"),
        (["severity=page", "alertname=NanSentinelRankStalled"], "nansentinel-pager"),
        (["severity=warning", "alertname=NanSentinelExporterDown"], "nansentinel-warnings"),
    ],
)
def test_alertmanager_routes_pages_to_the_pager(labels: list[str], receiver: str) -> None:
    proc = run(
        tool("amtool"), "config", "routes", "test", f"--config.file={ALERTMANAGER}",
        f"--verify.receivers={receiver}", *labels,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_pages_are_grouped_by_hostname() -> None:
    config = load_yaml(ALERTMANAGER)
    pager = [r for r in config["route"]["routes"] if r["receiver"] == "nansentinel-pager"]
    assert pager and pager[0]["group_by"] == ["hostname"]


def test_commented_pagerduty_receiver_is_valid_when_uncommented(tmp_path: Path) -> None:
    lines = ALERTMANAGER.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# pagerduty_configs:")
    out = lines[:start]
    i = start
    while i < len(lines) and lines[i].lstrip().startswith("#"):
        out.append(lines[i].replace("# ", "", 1))
        i += 1
    out += lines[i:]
    uncommented = tmp_path / "alertmanager.yml"
    uncommented.write_text("\n".join(out) + "\n")
    receivers = {r["name"]: r for r in load_yaml(uncommented)["receivers"]}
    assert "pagerduty_configs" in receivers["nansentinel-pager"]
    proc = run(tool("amtool"), "check-config", str(uncommented))
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- Grafana -----------------------------------------------------------------------------------


def test_dashboard_structure() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "hostname", "rank"} <= set(variables)
    for name in ("job", "hostname", "rank"):
        assert "nansentinel_rank_info" in variables[name]["query"]["query"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(title for title, _ in dashboard_queries(dashboard)).lower()
    for needed in ("health", "non-finite", "skipped", "loss", "gradient norm", "sentinel time",
                   "cpu", "memory", "blamed", "excluded"):  # fmt: skip
        assert needed in titles, f"no panel about {needed}"
    for title, expr in dashboard_queries(dashboard):
        assert '$job"' in expr, f"panel {title!r} ignores the job variable: {expr}"


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every panel query is valid PromQL (checked offline as recording rules)."""
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    rules = [{"record": f"dashboard:q{i}", "expr": substitute(expr)} for i, (_, expr) in
             enumerate(queries)]  # fmt: skip
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = run(tool("promtool"), "check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_provisioning() -> None:
    sources = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")
    assert [s["type"] for s in sources["datasources"]] == ["prometheus"]
    providers = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "nansentinel.yaml")
    assert providers["providers"][0]["type"] == "file"
    assert providers["providers"][0]["options"]["path"]
