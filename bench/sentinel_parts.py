"""``overhead.py --profile``: where the sentinel's time goes, part by part.

perf_counter wrappers are installed around the sentinel's methods from outside the library
(the benchmark must not need changes to ``nansentinel/``). Each wrapper costs about a
microsecond a call and there are a dozen calls a step: negligible against the milliseconds
being attributed. Parts that a newer library no longer has are skipped, not fatal, so the
profile keeps working while the internals move; the table says which were missing.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

OPTIMIZER = "  optimizer.step (the user's, not ours)"
WAIT = "  exchange.wait (incl. the wait for the collective)"
#: (label, "module:attribute path"); indentation in the label shows nesting.
PARTS = (
    ("check_batch", "nansentinel.step.sentinel:Sentinel.check_batch"),
    ("check_loss", "nansentinel.step.sentinel:Sentinel.check_loss"),
    ("comm hook, all buckets (in backward)", "nansentinel.engines.ddp:_comm_hook"),
    ("FSDP2 reduce-scatter checks (in backward)", "nansentinel.engines.fsdp:FSDPPath.check"),
    ("  checks.tensor_norm (buckets; batch tensors too)", "nansentinel.checks:tensor_norm"),
    ("  launch_exchange: pack row + start exchange",
     "nansentinel.step.sentinel:Sentinel.launch_exchange"),
    ("    LocalHealth.row (pack the row)", "nansentinel.checks.health:LocalHealth.row"),
    ("    exchange.launch", "nansentinel.wire.exchange:HealthExchange.launch"),
    ("  dist.all_reduce calls (buckets + health vector)", "torch.distributed:all_reduce"),
    ("  watchdog arm (all callers)", "nansentinel.wire.watchdog:Watchdog.arm"),
    ("step()", "nansentinel.step.sentinel:Sentinel.step"),
    (WAIT, "nansentinel.wire.exchange:HealthExchange.wait"),
    ("  decide", "nansentinel.step.sentinel:decide"),
    ("  history.record", "nansentinel.decide.policy:History.record"),
    ("  _result", "nansentinel.step.sentinel:Sentinel._result"),
)


class PartTimer:
    """Accumulates seconds and calls per part, only inside the attached variant's steps."""

    def __init__(self) -> None:
        self.enabled = False
        self.armed = False  # set for the measured rounds; warm-up is not counted
        self.total: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.missing: list[str] = []

    def install(self) -> None:
        """Patch before the Sentinel is built, so that DDP registers the wrapped comm hook."""
        for label, target in PARTS:
            module, _, path = target.partition(":")
            *owners, attr = path.split(".")
            try:
                owner: Any = importlib.import_module(module)
                for name in owners:
                    owner = getattr(owner, name)
                fn = getattr(owner, attr)
            except (ImportError, AttributeError):
                self.missing.append(target)
                continue
            setattr(owner, attr, self.wrap(fn, label))

    def attach(self, variant: Any) -> None:
        """Count only inside ``variant``'s steps (``torch.distributed.all_reduce`` is shared
        with the other variants), and time its optimizer step, which is the user's cost."""
        if variant is None:
            return
        opt = variant.optimizer
        opt.step = self.wrap(opt.step, OPTIMIZER)
        step = variant.step

        def counted(batch: dict[str, torch.Tensor]) -> None:
            self.enabled = self.armed
            try:
                step(batch)
            finally:
                self.enabled = False

        variant.step = counted

    def wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)  # keeps the signature DDP inspects on a comm hook
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            started, started_cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - started
                self.cpu[label] += time.thread_time() - started_cpu
                self.calls[label] += 1

        return wrapper

    def per_step(self, steps: int) -> dict[str, Any]:
        labels = [label for label, _ in PARTS] + [OPTIMIZER]
        parts = {
            label: {
                "ms_per_step": self.total[label] * 1e3 / steps,
                "cpu_ms_per_step": self.cpu[label] * 1e3 / steps,
                "calls_per_step": self.calls[label] / steps,
            }
            for label in labels
        }
        return {"parts": parts, "missing": self.missing}


def render(profile: dict[str, Any], summary: dict[str, dict[str, float]]) -> str:
    """The breakdown table and the sentinel's own time set against the measured difference."""
    parts = profile["parts"]

    def ours(key: str) -> float:
        ms = {k: v[key] for k, v in parts.items()}
        top = ("check_batch", "check_loss", "comm hook, all buckets (in backward)", "step()")
        return sum(ms[k] for k in top) - ms[OPTIMIZER] - ms[WAIT]

    lines = [
        "where the sentinel's time goes (rank 0, mean ms per measured step):",
        "",
        "| part | wall ms/step | CPU ms/step | calls/step |",
        "|---|---:|---:|---:|",
    ]
    for label, v in parts.items():
        name = label.lstrip(" ")
        indent = "&nbsp;" * (len(label) - len(name))
        lines.append(
            f"| {indent}{name} | {v['ms_per_step']:.3f} | {v['cpu_ms_per_step']:.3f} "
            f"| {v['calls_per_step']:.1f} |"
        )
    lines += [
        "",
        "- the sentinel's own time (both checks + comm hook + step(), less the wait and the "
        f"optimizer): wall {ours('ms_per_step'):.3f} ms/step, CPU {ours('cpu_ms_per_step'):.3f} "
        "ms/step (wall counts time the core spent elsewhere, e.g. on gloo threads)",
    ]
    for name in ("sentinel", "pyhook"):
        if name in summary:
            row = summary[name]
            cpu = row.get("cpu_extra_ms_median")
            lines.append(
                f"- {name}: median per-round extra over the baseline step: wall "
                f"{row['extra_ms_median']:.3f} ms"
                + (f", CPU (both ranks' training threads) {cpu:.3f} ms" if cpu is not None else "")
            )
    if profile["missing"]:
        lines.append(f"- not in this library version: {', '.join(profile['missing'])}")
    return "\n".join(lines)
