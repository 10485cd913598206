"""nansentinel: a NaN/Inf sentinel for multi-node PyTorch training.

Each rank checks its own batch, loss and gradients *before* the gradient all-reduce, the ranks
share a fixed-size health vector in one small collective, and every rank takes the same decision:
apply the step, skip it, or abort — naming the rank and host that was poisoned.

    sentinel = nansentinel.Sentinel(model, optimizer)
    for batch in loader:
        sentinel.check_batch(batch)
        loss = loss_fn(model(batch["x"]), batch["y"])
        sentinel.check_loss(loss)
        loss.backward()
        result = sentinel.step()
        optimizer.zero_grad()
"""

from typing import TYPE_CHECKING, Any

from nansentinel.config import ConfigError, SentinelConfig
from nansentinel.result import (
    ArgumentTypeError,
    ExchangeTimeoutError,
    HostExcludedError,
    NanSentinelError,
    NonFiniteError,
    NonFiniteStateError,
    Outcome,
    RankIdentity,
    ResultPending,
    SentinelUsageError,
    StepResult,
    StopRequested,
)

if TYPE_CHECKING:
    from nansentinel.common.inject import Fault, parse_inject
    from nansentinel.effects.recovery import SnapshotMemoryError
    from nansentinel.step.record import PendingResult
    from nansentinel.step.sentinel import Sentinel

#: The names that need torch, imported on first use: ``nansentinel incidents`` and
#: ``nansentinel excluded`` only read files, and importing torch cost them 5-9 s a call.
_LAZY = {
    "Fault": "nansentinel.common.inject", "parse_inject": "nansentinel.common.inject",
    "SnapshotMemoryError": "nansentinel.effects.recovery",
    "PendingResult": "nansentinel.step.record", "Sentinel": "nansentinel.step.sentinel",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'nansentinel' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # once: the next access is a plain attribute
    return value


__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "ConfigError",
    "ExchangeTimeoutError",
    "Fault",
    "HostExcludedError",
    "NanSentinelError",
    "NonFiniteError",
    "NonFiniteStateError",
    "Outcome",
    "PendingResult",
    "RankIdentity",
    "ResultPending",
    "Sentinel",
    "SentinelConfig",
    "SentinelUsageError",
    "SnapshotMemoryError",
    "StepResult",
    "StopRequested",
    "__version__",
    "parse_inject",
]
