"""The per-rank exporter: names and values of the metric contract, serving, port and TLS errors.

Every test builds its own registry and reads values with ``get_sample_value``; no test touches
prometheus_client's global registry.
"""

from __future__ import annotations

import math
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import prometheus_client
import psutil
import pytest
import torch
from prometheus_client import CollectorRegistry

from nansentinel.effects.exporter import MetricsPortError
from nansentinel.effects.metrics import (
    STEP_OUTCOMES,
    HostCollector,
    SentinelMetrics,
    normalize_gpu_uuid,
)
from nansentinel.result import KINDS, OUTCOMES, RankIdentity, StepResult

HOST = "node-a"


def identity(rank: int = 0, local_rank: int = 0, **kw: str) -> RankIdentity:
    return RankIdentity(
        rank=rank, local_rank=local_rank, world_size=4, hostname=HOST, device="cpu", **kw
    )


def result(step: int = 0, **kw: object) -> StepResult:
    fields: dict[str, object] = dict(
        step=step,
        applied=True,
        outcome="applied",
        bad_ranks=[],
        bad_hosts=[],
        kinds=[],
        local_kinds=[],
        local_loss=1.5,
        local_grad_norm=0.25,
        consecutive_skips=0,
    )
    fields.update(kw)
    return StepResult(**fields)  # type: ignore[arg-type]


def bad_result(step: int, *, local: list[str], host: str = HOST, **kw: object) -> StepResult:
    return result(
        step,
        applied=False,
        outcome="skipped",
        bad_ranks=[1],
        bad_hosts=[host],
        kinds=local or ["grad"],
        local_kinds=local,
        consecutive_skips=1,
        **kw,
    )


def value(m: SentinelMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_private_registry_by_default() -> None:
    a, b = SentinelMetrics(identity()), SentinelMetrics(identity())
    assert a.registry is not prometheus_client.REGISTRY
    assert a.registry is not b.registry
    a.observe_step(result(), 0.001)
    assert value(b, "nansentinel_steps_total", outcome="applied") == 0


def test_injected_registry_is_used() -> None:
    registry = CollectorRegistry()
    m = SentinelMetrics(identity(), registry=registry)
    assert m.registry is registry
    assert registry.get_sample_value("nansentinel_step") == 0


def test_counters_are_pre_initialised_so_increase_sees_the_first_event() -> None:
    m = SentinelMetrics(identity(rank=1))
    for outcome in STEP_OUTCOMES:
        assert value(m, "nansentinel_steps_total", outcome=outcome) == 0
    for kind in KINDS:
        assert value(m, "nansentinel_nonfinite_total", kind=kind) == 0
    assert value(m, "nansentinel_blamed_steps_total") == 0
    assert value(m, "nansentinel_rank_healthy") == 1
    assert value(m, "nansentinel_last_step_timestamp_seconds") == 0


def test_healthy_step() -> None:
    m = SentinelMetrics(identity(), clock=lambda: 1234.5)
    m.observe_step(result(step=7, local_loss=2.0, local_grad_norm=3.0), 0.002)
    assert value(m, "nansentinel_steps_total", outcome="applied") == 1
    assert value(m, "nansentinel_steps_total", outcome="skipped") == 0
    assert value(m, "nansentinel_rank_healthy") == 1
    assert value(m, "nansentinel_loss") == 2.0
    assert value(m, "nansentinel_grad_norm") == 3.0
    assert value(m, "nansentinel_step") == 7
    assert value(m, "nansentinel_last_step_timestamp_seconds") == 1234.5
    assert value(m, "nansentinel_check_seconds_count") == 1
    assert value(m, "nansentinel_check_seconds_sum") == pytest.approx(0.002)
    assert value(m, "nansentinel_check_seconds_bucket", le="0.0025") == 1
    assert value(m, "nansentinel_check_seconds_bucket", le="0.001") == 0
    assert value(m, "nansentinel_blamed_steps_total") == 0


def test_spikes_count_per_signal_with_the_batchs_own() -> None:
    m = SentinelMetrics(identity())
    m.observe_step(result(5, local_spikes=["loss", "batch"]), 0.001)
    m.observe_step(result(6, local_spikes=["batch"]), 0.001)
    assert value(m, "nansentinel_loss_spikes_total") == 1
    assert value(m, "nansentinel_grad_norm_spikes_total") == 0
    assert value(m, "nansentinel_batch_spikes_total") == 2


def test_collapses_count_per_signal_from_zero() -> None:
    m = SentinelMetrics(identity())
    assert value(m, "nansentinel_collapses_total", signal="loss") == 0
    m.observe_step(result(5, collapsed={"loss": 0.01, "grad_norm": 0.05}), 0.001)
    m.observe_step(result(6, collapsed={"loss": 0.02}), 0.001)
    assert value(m, "nansentinel_collapses_total", signal="loss") == 2
    assert value(m, "nansentinel_collapses_total", signal="grad_norm") == 1


def test_non_finite_step_counts_each_local_kind_and_one_blamed_step() -> None:
    m = SentinelMetrics(identity(rank=1))
    m.observe_step(
        bad_result(3, local=["loss", "grad"], local_loss=math.nan, local_grad_norm=math.inf), 0.01
    )
    assert value(m, "nansentinel_nonfinite_total", kind="loss") == 1
    assert value(m, "nansentinel_nonfinite_total", kind="grad") == 1
    assert value(m, "nansentinel_nonfinite_total", kind="batch") == 0
    assert value(m, "nansentinel_blamed_steps_total") == 1
    assert value(m, "nansentinel_steps_total", outcome="skipped") == 1
    assert value(m, "nansentinel_rank_healthy") == 0
    assert math.isnan(value(m, "nansentinel_loss"))  # type: ignore[arg-type]
    assert value(m, "nansentinel_grad_norm") == math.inf
    m.observe_step(result(4), 0.001)
    assert value(m, "nansentinel_rank_healthy") == 1


def test_only_local_kinds_count_on_a_healthy_rank_of_a_bad_step() -> None:
    # Rank 0 is fine while rank 1 was blamed: the step is skipped here too, but rank 0's
    # own detections stay at zero (the whole point of checking before the all-reduce).
    m = SentinelMetrics(identity(rank=0))
    m.observe_step(bad_result(3, local=[]), 0.001)
    assert value(m, "nansentinel_steps_total", outcome="skipped") == 1
    assert value(m, "nansentinel_nonfinite_total", kind="grad") == 0
    assert value(m, "nansentinel_blamed_steps_total") == 0
    assert value(m, "nansentinel_rank_healthy") == 1


def test_the_models_own_state_counts_by_kind_apart_from_the_batch_loss_and_gradients() -> None:
    """A poisoned weight and its optimizer state (named by the state check), a buffer and a
    hyperparameter (the row's) count in nansentinel_state_nonfinite_total by kind, from 0;
    a hyperparameter alone (the schedule's, on every rank) blames no rank."""
    m = SentinelMetrics(identity(rank=1))
    for kind in ("weight", "optimizer_state", "buffer", "hyperparameter"):
        assert value(m, "nansentinel_state_nonfinite_total", kind=kind) == 0
    m.observe_step(bad_result(3, local=["loss", "grad", "weight", "optimizer_state"],
                              local_loss=math.nan, local_grad_norm=math.nan), 0.01)
    m.observe_step(bad_result(4, local=["hyperparameter"]), 0.01)
    counts = {kind: value(m, "nansentinel_state_nonfinite_total", kind=kind)
              for kind in ("weight", "optimizer_state", "buffer", "hyperparameter")}
    assert counts == {"weight": 1, "optimizer_state": 1, "buffer": 0, "hyperparameter": 1}
    assert value(m, "nansentinel_blamed_steps_total") == 1  # the weight's step, not the rate's


def test_missing_loss_keeps_the_last_value() -> None:
    m = SentinelMetrics(identity())
    m.observe_step(result(0, local_loss=4.0, local_grad_norm=1.0), 0.001)
    m.observe_step(result(1, local_loss=None, local_grad_norm=None), 0.001)
    assert value(m, "nansentinel_loss") == 4.0
    assert value(m, "nansentinel_grad_norm") == 1.0
    assert value(m, "nansentinel_step") == 1


def test_unknown_outcome_is_refused_with_its_name() -> None:
    m = SentinelMetrics(identity())
    with pytest.raises(ValueError, match=r"step 5: outcome 'retried'"):
        m.observe_step(result(5, outcome="retried"), 0.001)


def test_outcome_label_values_cover_every_outcome_of_the_core() -> None:
    assert set(OUTCOMES) <= set(STEP_OUTCOMES)
    assert {"applied", "skipped", "rolled_back"} <= set(STEP_OUTCOMES)


def test_cluster_view_only_on_rank_zero_by_default() -> None:
    rank0, rank1 = SentinelMetrics(identity(rank=0)), SentinelMetrics(identity(rank=1))
    step = bad_result(3, local=[], host="node-bad", excluded_hosts=["node-bad"])
    for m in (rank0, rank1):
        m.observe_step(step, 0.001)
        m.observe_step(step, 0.001)
    assert value(rank0, "nansentinel_host_blamed_total", hostname="node-bad") == 2
    assert value(rank0, "nansentinel_host_excluded", hostname="node-bad") == 1
    assert value(rank1, "nansentinel_host_blamed_total", hostname="node-bad") is None
    assert value(rank1, "nansentinel_host_excluded", hostname="node-bad") is None


def test_cluster_view_can_be_forced_either_way() -> None:
    forced_on = SentinelMetrics(identity(rank=3), cluster_view=True)
    forced_off = SentinelMetrics(identity(rank=0), cluster_view=False)
    for m in (forced_on, forced_off):
        m.observe_step(bad_result(1, local=[], host="node-x"), 0.001)
    assert value(forced_on, "nansentinel_host_blamed_total", hostname="node-x") == 1
    assert value(forced_off, "nansentinel_host_blamed_total", hostname="node-x") is None


def test_rank_info_is_the_dcgm_join_key() -> None:
    m = SentinelMetrics(identity(rank=5, local_rank=1, gpu="1", gpu_uuid="0a1b2c3d-aaaa"))
    labels = dict(
        rank="5",
        local_rank="1",
        world_size="4",
        hostname=HOST,
        gpu="1",
        gpu_uuid="GPU-0a1b2c3d-aaaa",
    )
    assert value(m, "nansentinel_rank_info", **labels) == 1
    cpu = SentinelMetrics(identity())
    assert (
        value(
            cpu,
            "nansentinel_rank_info",
            rank="0",
            local_rank="0",
            world_size="4",
            hostname=HOST,
            gpu="",
            gpu_uuid="",
        )
        == 1
    )


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("", ""),
        ("1d3e5f7a-0000-1111-2222-333344445555", "GPU-1d3e5f7a-0000-1111-2222-333344445555"),
        ("GPU-1d3e5f7a", "GPU-1d3e5f7a"),
        ("MIG-7a1c", "MIG-7a1c"),
        (" 1d3e ", "GPU-1d3e"),
    ],
)
def test_normalize_gpu_uuid(raw: str, normalised: str) -> None:
    assert normalize_gpu_uuid(raw) == normalised


def test_host_metrics_are_read_at_scrape_time() -> None:
    m = SentinelMetrics(identity(), device=torch.device("cpu"))
    cpu = value(m, "nansentinel_host_cpu_utilization_ratio")
    assert cpu is not None and 0.0 <= cpu <= 1.0
    assert (value(m, "nansentinel_host_memory_available_bytes") or 0) > 0
    assert (value(m, "nansentinel_process_resident_memory_bytes") or 0) > 1_000_000
    # Device memory exists only for a CUDA device.
    assert value(m, "nansentinel_device_memory_allocated_bytes") is None


def test_cpu_utilization_follows_busy_time() -> None:
    collector = HostCollector()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # keep one core busy for 0.3 s of CPU time
        pass
    ratio = collector.cpu_utilization()
    # This process alone kept a core busy since the collector's first reading.
    assert 0.0 < ratio <= 1.0


def test_device_memory_is_read_for_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CUDA branch on a CPU machine: torch's allocator counters are stubbed.
    seen: list[torch.device] = []

    def allocated(device: torch.device) -> int:
        seen.append(device)
        return 3 << 20

    monkeypatch.setattr(torch.cuda, "memory_allocated", allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 8 << 20)
    m = SentinelMetrics(identity(), device=torch.device("cuda", 1))
    assert value(m, "nansentinel_device_memory_allocated_bytes") == 3 << 20
    assert value(m, "nansentinel_device_memory_reserved_bytes") == 8 << 20
    assert seen and all(d == torch.device("cuda", 1) for d in seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_memory_on_cuda() -> None:
    device = torch.device("cuda", 0)
    m = SentinelMetrics(identity(), device=device)
    x = torch.ones(1024, 1024, device=device)
    allocated = value(m, "nansentinel_device_memory_allocated_bytes")
    assert allocated is not None and allocated >= x.numel() * 4
    reserved = value(m, "nansentinel_device_memory_reserved_bytes")
    assert reserved is not None and reserved >= allocated


def scrape(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=5, context=context) as response:
        return response.read().decode()


def test_serve_scrape_and_close() -> None:
    m = SentinelMetrics(identity(rank=2, local_rank=2), refresh=0.2)
    port = m.serve("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        assert port > 0 and m.port == port
        # Served from the start, before any step, with every series at zero.
        assert 'nansentinel_nonfinite_total{kind="batch"} 0.0' in scrape(url)
        m.observe_step(bad_result(9, local=["batch"]), 0.001)
        # The refresher hands the new values to the server process within its interval.
        deadline = time.monotonic() + 5
        while 'nansentinel_nonfinite_total{kind="batch"} 1.0' not in (text := scrape(url)):
            assert time.monotonic() < deadline, text
            time.sleep(0.05)
        assert 'hostname="node-a"' in text and 'rank="2"' in text
        assert "nansentinel_host_cpu_utilization_ratio" in text

        with pytest.raises(RuntimeError, match="already served"):
            m.serve("127.0.0.1", 0)
    finally:
        m.close()
    m.close()  # idempotent
    assert m.port is None
    with pytest.raises(urllib.error.URLError):
        scrape(f"http://127.0.0.1:{port}/metrics")
    # The port is released: a restarted exporter can serve on it again.
    again = SentinelMetrics(identity(rank=2, local_rank=2))
    try:
        assert again.serve("127.0.0.1", port) == port
    finally:
        again.close()


def test_flush_hands_the_values_over_without_waiting_for_the_refresher() -> None:
    """The stop path flushes, so the final state is served within moments, not a refresh."""
    m = SentinelMetrics(identity(), refresh=3600)
    port = m.serve("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        m.observe_step(bad_result(3, local=["loss"]), 0.001)
        assert 'nansentinel_nonfinite_total{kind="loss"} 0.0' in scrape(url)  # not yet handed
        m.flush()
        deadline = time.monotonic() + 5  # the server process swaps in the frame it was handed
        while 'nansentinel_nonfinite_total{kind="loss"} 1.0' not in (text := scrape(url)):
            assert time.monotonic() < deadline, text
            time.sleep(0.02)
    finally:
        m.close()


def test_empty_addr_means_all_interfaces(free_port: Callable[[], int]) -> None:
    m = SentinelMetrics(identity())
    port = m.serve("", free_port())
    try:
        assert "nansentinel_step" in scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        m.close()


def test_busy_port_names_port_rank_host_and_variable() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        m = SentinelMetrics(identity(rank=6, local_rank=2))
        with pytest.raises(MetricsPortError) as info:
            m.serve("127.0.0.1", port)
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert str(port) in message
    assert "rank 6" in message and "local rank 2" in message
    assert HOST in message
    assert "NANSENTINEL_METRICS_PORT" in message
    assert "already in use" in message
    assert m.port is None
    m.close()


def test_tls_needs_both_files() -> None:
    m = SentinelMetrics(identity())
    with pytest.raises(ValueError, match="together"):
        m.serve("127.0.0.1", 0, certfile="cert.pem")


def make_self_signed(tmp_path: Path) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed; cannot make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-days",
            "1",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


def test_tls(tmp_path: Path) -> None:
    cert, key = make_self_signed(tmp_path)
    m = SentinelMetrics(identity())
    port = m.serve("127.0.0.1", 0, certfile=str(cert), keyfile=str(key))
    try:
        context = ssl.create_default_context(cafile=str(cert))
        text = scrape(f"https://127.0.0.1:{port}/metrics", context)
        assert "nansentinel_rank_info" in text
        # Plain HTTP to the TLS port gets no metrics.
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            scrape(f"http://127.0.0.1:{port}/metrics")
        # A client that does not trust the certificate is refused.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            scrape(f"https://127.0.0.1:{port}/metrics", ssl.create_default_context())
    finally:
        m.close()


def test_the_server_process_ends_with_its_rank(tmp_path: Path) -> None:
    """A rank killed outright (no atexit, no close) leaves no server process or bound port."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import sys, time\n"
        "from nansentinel.effects.metrics import SentinelMetrics\n"
        "from nansentinel.result import RankIdentity\n"
        "m = SentinelMetrics(RankIdentity(0, 0, 1, 'node-a', 'cpu'))\n"
        "port = m.serve('127.0.0.1', 0)\n"
        "print(port, m.exporter._server.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None
        port, pid = (int(x) for x in rank.stdout.readline().split())
        assert "nansentinel_rank_info" in scrape(f"http://127.0.0.1:{port}/metrics")
        rank.kill()
        rank.wait(timeout=10)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the server process outlived its rank"
            time.sleep(0.05)
        with pytest.raises(urllib.error.URLError):
            scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        rank.kill()
        rank.wait()
