"""Per-rank Prometheus exporter: what this rank saw, what the cluster decided, how the host is.

Every rank serves its own ``/metrics`` (base port + ``LOCAL_RANK``), because the point of the
sentinel is to name the rank: a rank's *own* non-finite detections, loss and gradient norm are
only meaningful before the all-reduce, so they are exported per rank, never aggregated here.
Prometheus joins them with ``nansentinel_rank_info`` (``* on(job, instance) group_left(hostname,
rank) nansentinel_rank_info``) to put a host and a rank on every series, and with DCGM's
exporter through ``hostname`` and ``gpu_uuid``.

The metric names are a contract: the alert rules, the runbook and the Grafana dashboard of the
monitoring set (``nansentinel files monitoring``) depend on them. Labels are bounded (kinds,
outcomes, host names; never step numbers or free text), so a long run does not grow the series
count.

This module declares the metrics and records each step into them; how they leave the process
is the exporter's (exporter.py). Cost: :meth:`SentinelMetrics.observe_step` is a handful of
pre-resolved counter and gauge updates. Scrapes never reach the training process: a refresher
thread renders the registry once a second (host health -- CPU, memory, device memory -- is
read then) and hands the bytes to a small HTTP server process beside the rank
(``metrics_server.py``), which answers every scrape from the latest bytes. So the rank pays
one render a second, whatever the number of scrapers, and a scrape sees values at most a
refresh interval old.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from nansentinel.effects.exporter import REFRESH_SECONDS, Exporter
from nansentinel.result import (
    KINDS,
    OUTCOMES,
    STATE_KINDS,
    VERDICTS,
    RankIdentity,
    StepResult,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("nansentinel")

PREFIX = "nansentinel"

#: Values of the ``outcome`` label of ``nansentinel_steps_total``: every
#: :class:`~nansentinel.result.Outcome`, created at start so each series exists from zero.
STEP_OUTCOMES = OUTCOMES

#: Values of the ``file`` label of ``nansentinel_report_failures_total``.
REPORT_FILES = ("report", "batch", "skip_list", "detail")

#: ``check_seconds`` buckets: the sentinel's own time per step spans ~10 µs (a flag read on a
#: small model) to ~1 s (a detection that writes an incident report).
CHECK_SECONDS_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


def normalize_gpu_uuid(uuid: str) -> str:
    """Return ``uuid`` in the ``GPU-…`` form DCGM's exporter uses for its ``UUID`` label.

    torch reports the bare UUID (``torch.cuda.get_device_properties(i).uuid``); without the
    prefix a join with DCGM's series would silently match nothing. MIG UUIDs keep their
    ``MIG-`` prefix; an empty string (CPU) stays empty.
    """
    uuid = uuid.strip()
    if not uuid or uuid.startswith(("GPU-", "MIG-")):
        return uuid
    return f"GPU-{uuid}"


class HostCollector(Collector):
    """Host and process health, read at each refresh of the served metrics (once a second,
    off the training step).

    CPU utilisation is computed from this collector's own previous reading, not from
    ``psutil.cpu_percent``'s process-wide state, so that another caller in the training
    process cannot shorten or reset our interval.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self._device = device if device is not None and device.type == "cuda" else None
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._last_busy, self._last_total = self._cpu_times()

    @staticmethod
    def _cpu_times() -> tuple[float, float]:
        times = psutil.cpu_times()
        # On Linux guest time is already counted in user time; psutil's cpu_percent does the same.
        total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
        idle = times.idle + getattr(times, "iowait", 0.0)
        return total - idle, total

    def cpu_utilization(self) -> float:
        """Fraction (0..1) of all CPUs busy since the previous call."""
        busy, total = self._cpu_times()
        with self._lock:
            d_busy, d_total = busy - self._last_busy, total - self._last_total
            self._last_busy, self._last_total = busy, total
        if d_total <= 0:
            return 0.0
        return min(1.0, max(0.0, d_busy / d_total))

    def describe(self) -> list[GaugeMetricFamily]:
        """Nothing to pre-declare; avoids a collect() (and a psutil read) at registration."""
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            f"{PREFIX}_host_cpu_utilization_ratio",
            "Fraction of all host CPUs busy since the previous refresh (about 1 s; 0..1).",
            value=self.cpu_utilization(),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_host_memory_available_bytes",
            "Host memory available to new processes without swapping.",
            value=float(psutil.virtual_memory().available),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_process_resident_memory_bytes",
            "Resident memory of this rank's process.",
            value=float(self._process.memory_info().rss),
        )
        if self._device is not None:
            import torch

            yield GaugeMetricFamily(
                f"{PREFIX}_device_memory_allocated_bytes",
                "CUDA memory held by tensors of this rank (torch.cuda.memory_allocated).",
                value=float(torch.cuda.memory_allocated(self._device)),
            )
            yield GaugeMetricFamily(
                f"{PREFIX}_device_memory_reserved_bytes",
                "CUDA memory reserved by this rank's caching allocator.",
                value=float(torch.cuda.memory_reserved(self._device)),
            )


class SentinelMetrics:
    """One rank's exporter. The sentinel calls :meth:`observe_step` once per step.

    Args:
        identity: where this rank runs; exported once as ``nansentinel_rank_info``.
        registry: where the metrics live; ``None`` creates a private registry (never the global
            one, so that two sentinels or a test never see each other's values).
        cluster_view: export the cluster-wide ``host_blamed_total`` / ``host_excluded``;
            ``None`` means only on global rank 0, because every rank holds the same view and
            exporting it N times would multiply every sum by N.
        device: the rank's device; device memory is exported only when it is a CUDA device.
        clock: wall clock for ``last_step_timestamp_seconds`` (injectable for tests).
        refresh: seconds between two renders for the server process (:data:`REFRESH_SECONDS`).
    """

    def __init__(
        self,
        identity: RankIdentity,
        *,
        registry: CollectorRegistry | None = None,
        cluster_view: bool | None = None,
        device: torch.device | None = None,
        clock: Callable[[], float] = time.time,
        refresh: float = REFRESH_SECONDS,
    ) -> None:
        self.identity = identity
        self.registry: CollectorRegistry = registry if registry is not None else CollectorRegistry()
        self.cluster_view = identity.rank == 0 if cluster_view is None else cluster_view
        self._clock = clock
        #: The server process that answers the scrapes, and the thread that feeds it.
        self.exporter = Exporter(self.registry, identity, refresh)
        r = self.registry

        nonfinite = Counter(
            f"{PREFIX}_nonfinite",
            "Non-finite values found in this rank's own batch, loss or "
            "gradients (before the all-reduce).",
            ["kind"],
            registry=r,
        )
        # Pre-resolved children: observe_step does no label lookups, and every kind exports 0
        # from the first scrape, so that increase() sees the first detection.
        self._nonfinite = {kind: nonfinite.labels(kind=kind) for kind in KINDS}
        self._blamed = Counter(
            f"{PREFIX}_blamed_steps",
            "Steps on which this rank's own checks found a non-finite "
            "value (one per step, whatever the number of kinds) that did not merely reach it "
            "from another rank (a pipeline stage, a collective in the forward).",
            registry=r,
        )
        steps = Counter(
            f"{PREFIX}_steps",
            "Steps decided, by cluster-wide outcome.",
            ["outcome"],
            registry=r,
        )
        self._steps = {outcome: steps.labels(outcome=outcome) for outcome in STEP_OUTCOMES}
        state = Counter(
            f"{PREFIX}_state_nonfinite",
            "Steps at which this rank's own state held a non-finite value, by kind: a weight "
            "or an optimizer-state tensor (read on an incident, before a snapshot, by the "
            "replica fingerprints), a floating buffer (every step), a hyperparameter (every "
            "step). The action is in the step's result and report (repaired from a replica, "
            "rolled back over, stopped for).",
            ["kind"],
            registry=r,
        )
        self._state_nonfinite = {kind: state.labels(kind=kind) for kind in STATE_KINDS}
        self._replica_divergence = Counter(
            f"{PREFIX}_replica_divergence",
            "Fingerprint checks at which this rank's replica (weights, optimizer state) had "
            "silently diverged from its replica group's (silent data corruption).",
            registry=r,
        )
        self._healthy = Gauge(
            f"{PREFIX}_rank_healthy",
            "1 when this rank's last step was finite, else 0.",
            registry=r,
        )
        self._healthy.set(1)
        self._loss = Gauge(
            f"{PREFIX}_loss",
            "This rank's loss before any reduction (NaN when non-finite).",
            registry=r,
        )
        self._grad_norm = Gauge(
            f"{PREFIX}_grad_norm",
            "L2 norm of this rank's gradients before the all-reduce.",
            registry=r,
        )
        self._step = Gauge(f"{PREFIX}_step", "Index of the last step decided.", registry=r)
        spikes = {
            signal: Counter(
                f"{PREFIX}_{signal}_spikes",
                f"Steps on which this rank's own {signal.replace('_', ' ')} spiked over its "
                "running median (spike_ratio and spike_zscore).",
                registry=r,
            )
            for signal in ("loss", "grad_norm")
        }
        spikes["batch"] = Counter(
            f"{PREFIX}_batch_spikes",
            "Steps on which this rank's batch norm spiked over its running median "
            "(spikes.DATA_RATIO): its input changed; with a loss or grad-norm spike, the "
            "step is the data's.",
            registry=r,
        )
        self._spikes = spikes
        collapses = Counter(
            f"{PREFIX}_collapses",
            "Steps on which the cluster mean of the loss or the gradient norm collapsed far "
            "below its running median (1/spike_ratio and spike_zscore): degenerate data.",
            ["signal"],
            registry=r,
        )
        self._collapses = {s: collapses.labels(signal=s) for s in ("loss", "grad_norm")}
        self._lr_factor = Gauge(
            f"{PREFIX}_lr_factor",
            "Learning-rate factor in force (below 1 during a cooldown after a rollback).",
            registry=r,
        )
        self._lr_factor.set(1)
        self._lr_held = Counter(
            f"{PREFIX}_lr_held_steps",
            "Steps at which a param group's learning rate jumped past lr_jump_ratio x the "
            "highest it had applied and was held at its last applied rate (issue 52).",
            registry=r,
        )
        self._timestamp = Gauge(
            f"{PREFIX}_last_step_timestamp_seconds",
            "Unix time of the last step decided (0 before the first); for stall alerts.",
            registry=r,
        )
        self._check_seconds = Histogram(
            f"{PREFIX}_check_seconds",
            "Time the sentinel itself spent on a step.",
            buckets=CHECK_SECONDS_BUCKETS,
            registry=r,
        )
        failures = Counter(
            f"{PREFIX}_report_failures",
            "Incident files this rank could not write (a full or read-only disk); training "
            "went on without them.",
            ["file"],
            registry=r,
        )
        self._report_failures = {f: failures.labels(file=f) for f in REPORT_FILES}
        self._reports_suppressed = Counter(
            f"{PREFIX}_spike_reports_suppressed",
            "Warn-level spikes (the step applied) logged without an incident report, because "
            "one such report was written within the last spike_window steps.",
            registry=r,
        )
        info = Info(f"{PREFIX}_rank", "Where this rank runs; join key with DCGM.", registry=r)
        info.info(
            {
                "rank": str(identity.rank),
                "local_rank": str(identity.local_rank),
                "world_size": str(identity.world_size),
                "hostname": identity.hostname,
                "gpu": identity.gpu,
                "gpu_uuid": normalize_gpu_uuid(identity.gpu_uuid),
            }
        )
        if self.cluster_view:
            self._host_blamed: Counter | None = Counter(
                f"{PREFIX}_host_blamed",
                "Steps on which the cluster blamed a host (cluster view, exported by rank 0 only).",
                ["hostname"],
                registry=r,
            )
            self._host_excluded: Gauge | None = Gauge(
                f"{PREFIX}_host_excluded",
                "1 for each host the cluster has excluded (cluster view, exported by rank 0 only).",
                ["hostname"],
                registry=r,
            )
            verdicts = Counter(
                f"{PREFIX}_verdicts",
                "Replay verdicts of incidents: data, host, transient, divergence (cluster view, "
                "exported by rank 0 only).",
                ["verdict"],
                registry=r,
            )
            self._verdicts: dict[str, Any] | None = {
                v: verdicts.labels(verdict=v) for v in VERDICTS
            }
        else:
            self._host_blamed = self._host_excluded = None
            self._verdicts = None
        r.register(HostCollector(device))

    def observe_step(self, result: StepResult, check_seconds: float) -> None:
        """Record one decided step; a few counter/gauge updates, no I/O."""
        step_counter = self._steps.get(result.outcome)
        if step_counter is None:
            raise ValueError(
                f"step {result.step}: outcome {result.outcome!r} is not one of "
                f"{', '.join(STEP_OUTCOMES)}; nansentinel_steps_total keeps its labels bounded"
            )
        step_counter.inc()
        nonfinite = [k for k in result.local_kinds if k in self._nonfinite]
        for kind in nonfinite:
            self._nonfinite[kind].inc()
        if nonfinite and self.identity.rank not in result.reached:
            self._blamed.inc()
        for kind in result.local_kinds:
            if kind in self._state_nonfinite:
                self._state_nonfinite[kind].inc()
        if "replica" in result.local_kinds:  # finite but wrong: not a non-finite blame
            self._replica_divergence.inc()
        self._healthy.set(0 if nonfinite else 1)
        if result.local_loss is not None:
            self._loss.set(result.local_loss)
        if result.local_grad_norm is not None:
            self._grad_norm.set(result.local_grad_norm)
        self._step.set(result.step)
        self._timestamp.set(self._clock())
        for signal in result.local_spikes:
            self._spikes[signal].inc()
        for signal in result.collapsed:
            self._collapses[signal].inc()
        self._lr_factor.set(result.lr_factor)
        if result.lr_held:
            self._lr_held.inc()
        if self._verdicts is not None and result.verdict in self._verdicts:
            self._verdicts[result.verdict].inc()
        if not math.isnan(check_seconds):
            self._check_seconds.observe(check_seconds)
        if self._host_blamed is not None and self._host_excluded is not None:
            for host in result.bad_hosts:
                self._host_blamed.labels(hostname=host).inc()
            for host in result.excluded_hosts:
                self._host_excluded.labels(hostname=host).set(1)

    def observe_suppressed_report(self) -> None:
        """Count a warn-level spike logged without a report (the rate limit, detection.py)."""
        self._reports_suppressed.inc()

    def observe_report_failure(self, file: str) -> None:
        """Count an incident file (``report``, ``batch``, ``skip_list``) not written, or a
        blamed rank's share of it (``detail``: its sample ids, curves) not taken."""
        counter = self._report_failures.get(file)
        if counter is None:
            raise ValueError(f"report failure of {file!r}: expected one of {REPORT_FILES}")
        counter.inc()

    def serve(
        self, addr: str, port: int, certfile: str | None = None, keyfile: str | None = None
    ) -> int:
        """Serve this registry on ``/metrics``: :meth:`Exporter.serve` (the bound port)."""
        return self.exporter.serve(addr, port, certfile, keyfile)

    @property
    def port(self) -> int | None:
        """The port being served, or None when not serving."""
        return self.exporter.port

    def flush(self) -> None:
        """Hand the server process this registry's values now (:meth:`Exporter.flush`)."""
        self.exporter.flush()

    def close(self) -> None:
        """Stop serving (:meth:`Exporter.close`); safe to call twice."""
        self.exporter.close()


def serve_rank(identity: RankIdentity, config: Any, registry: CollectorRegistry | None,
               device: torch.device) -> SentinelMetrics:
    """This rank's exporter, serving on ``metrics_port`` + its local rank."""
    metrics = SentinelMetrics(identity, registry=registry, device=device)
    metrics.serve(config.metrics_addr, config.metrics_port + identity.local_rank,
                  config.metrics_certfile, config.metrics_keyfile)
    return metrics
