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

from nansentinel.common.inject import Fault, parse_inject
from nansentinel.config import ConfigError, SentinelConfig
from nansentinel.effects.recovery import SnapshotMemoryError
from nansentinel.result import (
    ArgumentTypeError,
    ExchangeTimeoutError,
    HostExcludedError,
    NonFiniteError,
    Outcome,
    RankIdentity,
    ResultPending,
    SentinelUsageError,
    StepResult,
)
from nansentinel.step.record import PendingResult
from nansentinel.step.sentinel import Sentinel

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "ConfigError",
    "ExchangeTimeoutError",
    "Fault",
    "HostExcludedError",
    "NonFiniteError",
    "Outcome",
    "PendingResult",
    "RankIdentity",
    "ResultPending",
    "Sentinel",
    "SentinelConfig",
    "SentinelUsageError",
    "SnapshotMemoryError",
    "StepResult",
    "__version__",
    "parse_inject",
]
