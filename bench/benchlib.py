"""Shared pieces of the overhead benchmarks (``overhead.py`` on CPU/gloo, ``gpu_checks.py`` on
CUDA/NCCL): the model, the training-loop variants, the balanced step order, the statistics and
the table.

Why one module for both: the CPU and the GPU numbers are only comparable if they time the very
same loops and summarise them the same way. Nothing here starts processes or picks a backend.

The variants are the ways people guard a training step against NaN/Inf:

``baseline``
    plain DDP: forward, backward, ``optimizer.step()``, ``zero_grad()``. With ``fsdp=True``
    every variant's model is FSDP2-sharded instead (``fully_shard`` on each encoder layer, then
    the root, over all ranks) and the baseline is plain ``fully_shard``.
``sentinel``
    the same loop with nansentinel's three calls (``check_batch``, ``check_loss``, ``step``).
``pyhook``
    diagnostic, not a guard: plain DDP with torch's own *Python* all-reduce comm hook. Any
    sentinel that checks buckets inside a comm hook pays at least this much, so it splits the
    sentinel's overhead into "being a Python comm hook" and "the checks themselves".
``hooks``
    the usual blog recipe: a ``register_hook`` on every parameter doing
    ``if not torch.isfinite(grad).all()`` (one host sync per tensor) plus a forward hook on every
    module checking its outputs the same way.
``anomaly``
    ``torch.autograd.set_detect_anomaly(True)`` around forward and backward.

For the breakdown of the sentinel's cost on a GPU (not in the default set):

``sync``
    plain DDP plus one ``torch.cuda.synchronize()`` before ``optimizer.step()``: what the one
    blocking read of a host gate costs by itself (a no-op on CPU).
``pyhook_sync``
    ``pyhook`` and ``sync`` together.
``sentinel_host``
    nansentinel forced onto the host gate (``gate="host"``): with a fused optimizer, the
    difference to ``sentinel`` is what skipping on the device saves.
``sentinel_device``
    nansentinel on ``gate="device"``: the device gate with the decision left to the next
    sentinel call; against ``sentinel`` (the default ``auto``, which decides inside ``step()``
    once the optimizer step is queued), what deciding a call later saves.
``sentinel_nochecks``
    nansentinel without ``check_batch``/``check_loss``: the gradient path and the decision.

For the replica fingerprints' cost (``sentinel`` runs them at the default interval):

``sentinel_nofp``
    nansentinel with ``fingerprint_every=0``.
``sentinel_fp1``
    nansentinel with ``fingerprint_every=1``: a check after every step.

For ``policy="drop"`` (issue 30; compare it with ``sentinel``, whose policy is ``skip``):

``sentinel_drop``
    nansentinel with ``policy="drop"``: every bucket passes the withhold (a host read of a
    CPU flag; a ``masked_fill_`` on a GPU), four more bytes in the exchange, the host gate.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel import checks

BASELINE = "baseline"
DEFAULT_VARIANTS = ("baseline", "sentinel", "pyhook", "hooks", "anomaly")
VARIANTS = (*DEFAULT_VARIANTS, "sync", "pyhook_sync", "sentinel_host", "sentinel_device",
            "sentinel_nochecks", "sentinel_nofp", "sentinel_fp1", "sentinel_drop")
#: ``--optimizer`` choices: torch's default AdamW implementation, or forced foreach / fused.
OPTIMIZERS = ("adamw", "foreach", "fused")
LABELS = {
    "baseline": "baseline (plain DDP)",
    "sentinel": "nansentinel",
    "pyhook": "DDP + Python allreduce comm hook (diagnostic floor)",
    "hooks": "blog recipe: per-param grad hooks + forward hooks",
    "anomaly": "set_detect_anomaly(True)",
    "sync": "DDP + one cuda.synchronize() before optimizer.step()",
    "pyhook_sync": "DDP + Python comm hook + one synchronize()",
    "sentinel_host": "nansentinel, host gate forced",
    "sentinel_device": 'nansentinel, gate="device" (decided at the next call)',
    "sentinel_nochecks": "nansentinel without check_batch/check_loss",
    "sentinel_nofp": "nansentinel without replica fingerprints (fingerprint_every=0)",
    "sentinel_fp1": "nansentinel, replica fingerprints every step (fingerprint_every=1)",
    "sentinel_drop": 'nansentinel, policy="drop"',
}
#: The replica fingerprint interval of the variants that set one (the others: the default).
FINGERPRINT_EVERY = {"sentinel_nofp": 0, "sentinel_fp1": 1}
#: The issue's targets for the sentinel (median step-time ratio, peak-memory ratio).
TIME_TARGET = 1.01
MEMORY_TARGET = 1.05


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Size of the benchmark transformer. The default (3.7 M parameters, batch 8 x 64 tokens)
    takes ~150 ms a step on one core of the dev machine: long enough that timer and scheduler
    noise stay small, short enough for ~120 rounds of every variant in a few minutes."""

    d_model: int = 256
    nhead: int = 4
    ff: int = 1024
    layers: int = 4
    seq: int = 64
    batch: int = 8
    vocab: int = 1024
    autocast: bool = False
    """Forward under ``torch.autocast(dtype=bfloat16)`` (weights and gradients stay fp32)."""


#: For the smoke test: a step takes about a millisecond, the numbers mean nothing.
TINY = ModelConfig(d_model=32, nhead=2, ff=64, layers=1, seq=8, batch=4, vocab=64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What every spawned benchmark phase needs (``overhead.py``'s phases add their own
    fields); plain data so that it pickles across ``spawn``."""

    model: ModelConfig
    steps: int
    warmup: int
    threads: int
    collective_timeout: float
    port: int
    """The parent's rendezvous store (0 until the parent has one)."""
    out_dir: str
    """Where each rank writes its JSON result, named after ``phase``."""
    phase: str


class BenchModel(nn.Module):
    """Float features in (so that ``check_batch`` has bytes to read), token logits out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.nhead, cfg.ff, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        self.autocast = cfg.autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.autocast:
            return self.head(self.encoder(self.proj(x)))
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.head(self.encoder(self.proj(x))).float()


def make_batch(
    cfg: ModelConfig, rank: int, step: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """A deterministic batch per (rank, step); every variant gets the same one in a round, so
    every variant does exactly the same arithmetic."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, generator=g)
    targets = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    return {"x": x.to(device), "targets": targets.to(device)}


def compute_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


# --- the variants ----------------------------------------------------------------------------


class Variant:
    """One DDP model + optimizer and the loop of one guard. ``step`` runs one training step."""

    name = BASELINE

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        loss = compute_loss(self.model, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def close(self) -> None:
        """Release what the variant holds beyond the model (hooks, servers)."""


class SentinelVariant(Variant):
    name = "sentinel"

    def __init__(
        self, model: DDP, optimizer: torch.optim.Optimizer, report_dir: str, *,
        gate: str = "auto", checks: bool = True, fingerprint_every: int | None = None,
        policy: str = "skip",
    ) -> None:
        super().__init__(model, optimizer)
        # env={}: a stray NANSENTINEL_INJECT or port in the caller's shell must not change what
        # is measured. No metrics exporter, as in the documented benchmark usage.
        interval = {} if fingerprint_every is None else {"fingerprint_every": fingerprint_every}
        self.sentinel = nansentinel.Sentinel(
            model, optimizer, metrics_port=0, report_dir=report_dir, env={}, gate=gate,
            policy=policy, **interval,
        )
        self.checks = checks
        self._last: Any = None

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        if self.checks:
            self.sentinel.check_batch(batch)  # also decides a step pending on the device gate
        self._verify_last()
        loss = compute_loss(self.model, batch)
        if self.checks:
            self.sentinel.check_loss(loss)
        loss.backward()
        # Not read here: reading the result would decide it now, a host sync by choice.
        self._last = self.sentinel.step()
        self.optimizer.zero_grad()

    def _verify_last(self) -> None:
        last, self._last = self._last, None
        if last is not None and not last.applied:
            raise RuntimeError(f"the sentinel skipped a healthy benchmark step: {last}")

    def close(self) -> None:
        self.sentinel.close()
        self._verify_last()


class SyncVariant(Variant):
    """The cost of one blocking host read before the optimizer, and nothing else."""

    name = "sync"

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        loss = compute_loss(self.model, batch)
        loss.backward()
        if loss.is_cuda:
            torch.cuda.synchronize()
        self.optimizer.step()
        self.optimizer.zero_grad()


class PyHookVariant(Variant):
    name = "pyhook"

    def __init__(self, model: DDP, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        model.register_comm_hook(model.process_group, allreduce_hook)


class PyHookSyncVariant(SyncVariant):
    name = "pyhook_sync"

    def __init__(self, model: DDP, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        model.register_comm_hook(model.process_group, allreduce_hook)


class BlogHooksVariant(Variant):
    """The recipe most posts give: it finds the first bad tensor, at the price of one host
    sync per parameter and per module output, and it names nothing across ranks."""

    name = "hooks"

    def __init__(self, model: DDP, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        inner = unwrap(model)
        self._handles = [
            p.register_hook(_grad_hook(n)) for n, p in inner.named_parameters() if p.requires_grad
        ]
        self._handles += [
            m.register_forward_hook(_forward_hook(n)) for n, m in inner.named_modules()
        ]

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class AnomalyVariant(Variant):
    name = "anomaly"

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        with torch.autograd.set_detect_anomaly(True):
            loss = compute_loss(self.model, batch)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def _grad_hook(name: str) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        if not torch.isfinite(grad).all():  # a host sync per gradient tensor, as in the posts
            raise FloatingPointError(f"non-finite gradient in {name}")

    return hook


def _forward_hook(name: str) -> Callable[..., None]:
    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        for t in _tensors(output):
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise FloatingPointError(f"non-finite output of {name}")

    return hook


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from _tensors(o)


def build_variant(
    name: str,
    cfg: ModelConfig,
    device: torch.device,
    *,
    report_dir: str,
    seed: int = 0,
    fsdp: bool = False,
    optimizer: str = "adamw",
    bucket_cap_mb: float | None = None,
    fsdp1: bool = False,
) -> Variant:
    """A fresh DDP (or, with ``fsdp``, FSDP2) model — same seed, hence the same initial weights
    for every variant — and an AdamW optimizer (``optimizer``: torch's default, ``foreach`` or
    ``fused``), wrapped in the named variant; ``fsdp1``: FSDP1 instead (:func:`shard_fsdp1`).
    Needs an initialised process group."""
    torch.manual_seed(seed)
    module = BenchModel(cfg).to(device)
    model: nn.Module
    if fsdp1:
        if name in ("pyhook", "pyhook_sync"):
            raise ValueError(f"the {name} variant is a DDP comm hook; it has no FSDP1 form")
        model = shard_fsdp1(module, device)
    elif fsdp:
        if name in ("pyhook", "pyhook_sync"):
            raise ValueError(f"the {name} variant is a DDP comm hook; it has no FSDP2 form")
        model = shard(module, device)
    else:
        device_ids = [device.index] if device.type == "cuda" else None
        # init_sync=False: the seed already makes the weights identical on every rank, and the
        # initial broadcast's buffers can be freed on a gloo thread, where the CPU memory
        # profiler does not see the free (the peak then came out a random 14 MB high).
        extra = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        model = DDP(module, device_ids=device_ids, init_sync=False, **extra)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(optimizer, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **impl)
    if name == BASELINE:
        return Variant(model, opt)
    if name.startswith("sentinel"):
        variant = SentinelVariant(
            model, opt, report_dir,
            gate={"sentinel_host": "host", "sentinel_device": "device"}.get(name, "auto"),
            checks=name != "sentinel_nochecks", fingerprint_every=FINGERPRINT_EVERY.get(name),
            policy="drop" if name == "sentinel_drop" else "skip",
        )
        variant.name = name
        return variant
    if name == "sync":
        return SyncVariant(model, opt)
    if name == "pyhook_sync":
        return PyHookSyncVariant(model, opt)
    if name == "pyhook":
        return PyHookVariant(model, opt)
    if name == "hooks":
        return BlogHooksVariant(model, opt)
    if name == "anomaly":
        return AnomalyVariant(model, opt)
    raise ValueError(f"unknown variant {name!r}; expected one of {', '.join(VARIANTS)}")


def shard(module: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2 as torchtitan applies it: each encoder layer its own group, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in module.encoder.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    return fully_shard(module, mesh=mesh)


def shard_fsdp1(module: nn.Module, device: torch.device) -> nn.Module:
    """FSDP1 as Lightning's and Accelerate's users wrap it: each encoder layer its own unit
    (an auto-wrap policy by class), the rest in the root's; FULL_SHARD, ``use_orig_params``."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        module, auto_wrap_policy=ModuleWrapPolicy({nn.TransformerEncoderLayer}),
        device_id=device, use_orig_params=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module: DDP's ``.module``; an FSDP2 model, and an FSDP1 root (whose
    ``state_dict`` is the whole model's, gathered), are their own."""
    return model.module if isinstance(model, DDP) else model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def parse_variants(text: str) -> list[str]:
    """``"baseline,sentinel"`` -> list; the baseline is always first, since every ratio needs
    it."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; expected some of {', '.join(VARIANTS)}")
    return [BASELINE] + [v for v in dict.fromkeys(names) if v != BASELINE]


# --- step order --------------------------------------------------------------------------------


def balanced_orders(n: int) -> list[list[int]]:
    """Williams design: orders of ``n`` variants such that, over one cycle, every variant sits
    in every position equally often and follows every other variant equally often.

    Why: a step can slow the next one (allocator state, caches, a GC debt). With a fixed
    A B C D order the baseline would always follow the same variant and carry its debt; this
    spreads such carry-over over all variants evenly.
    """
    first: list[int] = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(v + i) % n for v in first] for i in range(n)]
    if n % 2:
        rows += [list(reversed(r)) for r in rows]
    return rows


@dataclasses.dataclass
class Rounds:
    """Per variant, one entry per round: wall seconds, and CPU seconds of the calling thread."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def run_rounds(
    variants: Sequence[Variant],
    batches: Callable[[int], dict[str, torch.Tensor]],
    rounds: int,
    sync: Callable[[], None],
    *,
    first_round: int = 0,
) -> Rounds:
    """Run every variant once per round in a balanced order; return each variant's step times
    indexed by round, so that ratios pair steps of the same round (at most a few hundred ms
    apart: slow drifts of the machine hit both sides of a ratio).

    Wall time is what the targets are about. The thread's CPU time is recorded beside it
    because it hardly moves when other processes take the core away, so on a shared machine
    it still shows the work a guard adds (on CPU the checks run on this thread; it misses
    only work moved to other threads, such as a comm hook's ``then`` callbacks).
    """
    orders = balanced_orders(len(variants))
    wall: dict[str, list[float]] = {v.name: [0.0] * rounds for v in variants}
    cpu: dict[str, list[float]] = {v.name: [0.0] * rounds for v in variants}
    for r in range(rounds):
        batch = batches(first_round + r)
        for i in orders[(first_round + r) % len(orders)]:
            v = variants[i]
            sync()
            started, started_cpu = time.perf_counter(), time.thread_time()
            v.step(batch)
            sync()
            wall[v.name][r] = time.perf_counter() - started
            cpu[v.name][r] = time.thread_time() - started_cpu
    return Rounds(wall, cpu)


# --- statistics and the table --------------------------------------------------------------


def quantile(data: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), without needing numpy."""
    if not data:
        return math.nan
    xs = sorted(data)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def median_ci(data: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """Distribution-free ~95% confidence interval of the median (order statistics around
    n/2 +- z*sqrt(n)/2). Why: it tells whether a 1% target is resolved by this run's noise at
    all, without assuming the step times are normal (they are not: they have a long tail)."""
    xs = sorted(data)
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    half = z * math.sqrt(n) / 2
    lo = max(0, math.floor(n / 2 - half))
    hi = min(n - 1, math.ceil(n / 2 + half) - 1)
    return xs[lo], xs[hi]


def summarize(
    times: dict[str, list[float]],
    memory: dict[str, float] | None = None,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, dict[str, float]]:
    """Per variant: median step (ms) and the median, p10, p90 and 95% CI of the per-round
    ratios to the baseline step of the same round; plus the peak-memory ratio and the same
    paired ratio of CPU time when given."""
    base = times[BASELINE]
    out: dict[str, dict[str, float]] = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base, strict=True) if b > 0]
        extra = [t - b for t, b in zip(ts, base, strict=True)]
        lo, hi = median_ci(ratios)
        row = {
            "steps": len(ts),
            "median_ms": statistics.median(ts) * 1e3 if ts else math.nan,
            "ratio_median": statistics.median(ratios) if ratios else math.nan,
            # Paired, like the ratios: comparable with a profile's milliseconds, unlike a
            # difference of two medians.
            "extra_ms_median": statistics.median(extra) * 1e3 if extra else math.nan,
            "ratio_p10": quantile(ratios, 0.1),
            "ratio_p90": quantile(ratios, 0.9),
            "ratio_ci95_low": lo,
            "ratio_ci95_high": hi,
            "memory_ratio": math.nan,
        }
        if memory and memory.get(name) and memory.get(BASELINE):
            row["memory_ratio"] = memory[name] / memory[BASELINE]
        if cpu:
            cpu_ratios = [t / b for t, b in zip(cpu[name], cpu[BASELINE], strict=True) if b > 0]
            lo, hi = median_ci(cpu_ratios)
            row["cpu_ratio_median"] = statistics.median(cpu_ratios) if cpu_ratios else math.nan
            row["cpu_ratio_ci95_low"], row["cpu_ratio_ci95_high"] = lo, hi
            cpu_extra = [t - b for t, b in zip(cpu[name], cpu[BASELINE], strict=True)]
            row["cpu_extra_ms_median"] = statistics.median(cpu_extra) * 1e3
        out[name] = row
    return out


def markdown_table(
    summary: dict[str, dict[str, float]], labels: dict[str, str] | None = None
) -> str:
    """The table; a last column of CPU-time ratios when they were measured. ``labels``
    overrides :data:`LABELS` (e.g. the FSDP2 baseline)."""
    labels = {**LABELS, **(labels or {})}
    with_cpu = all("cpu_ratio_median" in s for s in summary.values())
    lines = [
        "| variant | median step ms | median ratio vs baseline | p10–p90 ratio "
        "| 95% CI of median ratio | peak memory ratio |"
        + (" CPU-time ratio (95% CI) |" if with_cpu else ""),
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if with_cpu else ""),
    ]
    for name, s in summary.items():
        mem = "n/a" if math.isnan(s["memory_ratio"]) else f"{s['memory_ratio']:.3f}"
        line = (
            f"| {labels.get(name, name)} | {s['median_ms']:.1f} | {s['ratio_median']:.3f} "
            f"| {s['ratio_p10']:.3f}–{s['ratio_p90']:.3f} "
            f"| {s['ratio_ci95_low']:.3f}–{s['ratio_ci95_high']:.3f} | {mem} |"
        )
        if with_cpu:
            line += (
                f" {s['cpu_ratio_median']:.3f} ({s['cpu_ratio_ci95_low']:.3f}–"
                f"{s['cpu_ratio_ci95_high']:.3f}) |"
            )
        lines.append(line)
    return "\n".join(lines)


def paired_report(report: dict[str, Any], setup: str, labels: Any, weights: str) -> str:
    """A paired run's markdown (the pipeline and DeepSpeed variants): ``setup`` and the load,
    the nansentinel imported, the table, the verdict, and the final weights' difference
    (``weights`` says over what)."""
    load = report["loadavg_1m_before_after"]
    note = f" ({report['note']})" if report["note"] else ""
    lines = [f"{setup}, torch {report['torch']}, load average {load[0]:.1f} -> {load[1]:.1f}",
             f"nansentinel: {report['nansentinel']}{note}", "",
             markdown_table(report["summary"], labels), ""]
    lines += [f"- {v}" for v in verdict(report["summary"])]
    lines.append(f"- final weights, max |sentinel - baseline|{weights}: "
                 f"{report['weights_max_abs_diff_vs_baseline']['sentinel']:.2e} (the sentinel "
                 "applied every step)")
    return "\n".join(lines)


def verdict(summary: dict[str, dict[str, float]]) -> list[str]:
    """Plain sentences on the sentinel's targets. A target counts as met or missed only when
    the whole confidence interval is on one side of it; otherwise this run cannot tell."""
    s = summary.get("sentinel")
    if s is None:
        return []
    if s["ratio_ci95_high"] <= TIME_TARGET:
        t = "met"
    elif s["ratio_ci95_low"] > TIME_TARGET:
        t = "MISSED"
    else:
        t = "not resolved by this run's noise (the CI straddles the target)"
    lines = [
        f"sentinel step-time target (median ratio <= {TIME_TARGET}): {t}; median "
        f"{s['ratio_median']:.4f}, 95% CI {s['ratio_ci95_low']:.4f}–{s['ratio_ci95_high']:.4f}"
    ]
    if not math.isnan(s["memory_ratio"]):
        m = "met" if s["memory_ratio"] <= MEMORY_TARGET else "MISSED"
        lines.append(
            f"sentinel peak-memory target (ratio <= {MEMORY_TARGET}): {m}; "
            f"ratio {s['memory_ratio']:.4f}"
        )
    return lines


# --- the check's own cost against one read of the gradient bytes ---------------------------


def model_grads(cfg: ModelConfig, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """The gradient tensors of one backward of the benchmark model (no DDP, no optimizer)."""
    torch.manual_seed(seed)
    model = BenchModel(cfg).to(device)
    compute_loss(model, make_batch(cfg, 0, 0, device)).backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


def check_cost(
    grads: Sequence[torch.Tensor],
    timer: Callable[[Callable[[], object]], float],
    reps: int,
) -> dict[str, float]:
    """Median seconds of the sentinel's gradient checks against a plain ``torch.sum`` over one
    flat tensor of the same bytes ("one read"), and against ``isfinite().all()`` (the blog
    recipe's check) over the same flat tensor, interleaved rep by rep. The checks: under DDP,
    ``checks.tensor_norm`` over the flat bucket (what the comm hook runs); without DDP,
    ``checks.grad_norms`` over the separate gradient tensors.

    ``timer(fn)`` returns the seconds one call of ``fn`` took (host clock with syncs on CPU,
    CUDA events on a GPU).
    """
    numel = sum(g.numel() for g in grads)
    flat = torch.randn(numel, dtype=grads[0].dtype, device=grads[0].device)
    cases: dict[str, Callable[[], object]] = {
        "bucket_norm": lambda: checks.tensor_norm(flat),
        "grad_norms": lambda: checks.grad_norms(grads),
        "sum_one_read": lambda: torch.sum(flat),
        "isfinite_all": lambda: torch.isfinite(flat).all(),
    }
    for fn in cases.values():  # warm-up: first calls allocate and pick kernels
        for _ in range(3):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for k, fn in cases.items():
            samples[k].append(timer(fn))
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "tensors": len(grads),
        "bytes": numel * flat.element_size(),
        "bucket_norm_ms": med["bucket_norm"] * 1e3,
        "bucket_norm_vs_one_read": med["bucket_norm"] / med["sum_one_read"],
        "grad_norms_ms": med["grad_norms"] * 1e3,
        "sum_one_read_ms": med["sum_one_read"] * 1e3,
        "isfinite_all_ms": med["isfinite_all"] * 1e3,
        "grad_norms_vs_one_read": med["grad_norms"] / med["sum_one_read"],
        "isfinite_vs_one_read": med["isfinite_all"] / med["sum_one_read"],
    }


def check_cost_line(cost: dict[str, float]) -> str:
    return (
        f"check cost over {cost['bytes'] / 2**20:.1f} MiB of gradients: the DDP bucket check "
        f"(checks.tensor_norm, flat) {cost['bucket_norm_ms']:.3f} ms = "
        f"{cost['bucket_norm_vs_one_read']:.2f}x one read (torch.sum over the same bytes, "
        f"{cost['sum_one_read_ms']:.3f} ms); without DDP, checks.grad_norms over "
        f"{cost['tensors']} tensors {cost['grad_norms_ms']:.3f} ms = "
        f"{cost['grad_norms_vs_one_read']:.2f}x; isfinite().all(): "
        f"{cost['isfinite_vs_one_read']:.2f}x"
    )


def library_revision() -> str:
    """Which nansentinel was measured: its path, and the git commit of its checkout with a mark
    when its files differ from that commit (others may be editing the tree while it runs)."""
    pkg = Path(nansentinel.__file__).resolve().parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(pkg), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(pkg), "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"{pkg} (not a git checkout)"
    return f"{pkg} at {rev}" + (" + uncommitted changes" if dirty else "")
