"""What a framework prepared, recognised by the Sentinel itself.

The framework helpers (``AcceleratedSentinel``, the Trainer's and Lightning's callbacks) refuse
a misconfigured run by name, but a user may take the README's three calls instead, on a model
and optimizer that Accelerate prepared. The refusal must hold whichever entry point they took,
so ``Sentinel(...)`` recognises a prepared optimizer by its type's module (no framework is
imported for it) and asks the framework what it believes before anything is installed.
"""

from __future__ import annotations

import sys
from typing import Any

from nansentinel.result import SentinelUsageError
from nansentinel.wire.collectives import job_rank, job_size


def require_one_world(framework_size: int | None, framework: str, fix: str) -> None:
    """Raise :class:`SentinelUsageError` when the job's process group has more ranks than the
    framework believes it runs (``framework_size``; None: not known). Accelerate on CPU ranks
    without ``cpu=True`` (the Trainer without ``use_cpu=True``) sets up the process group but
    runs every rank alone: no DDP, no sharded data, a copy of the model trained per rank."""
    world = job_size()
    if framework_size is None or framework_size == world:
        return
    raise SentinelUsageError(
        f"nansentinel: the job has a process group of {world} ranks, but {framework} runs this "
        f"process as {framework_size} of {framework_size} (rank {job_rank()}): every rank would "
        f"train its own copy of the model, unsynchronised. On CPU ranks pass {fix}; on GPUs "
        "check that each rank sees its device."
    )


def refuse_misprepared(optimizer: Any) -> None:
    """The framework checks for an optimizer a framework prepared (Accelerate's
    ``AcceleratedOptimizer``): the same errors as its own helper raises."""
    module = type(optimizer).__module__
    if module.startswith("accelerate.") and "accelerate.state" in sys.modules:
        state = sys.modules["accelerate.state"].PartialState()
        require_one_world(int(state.num_processes), "Accelerate", "Accelerator(cpu=True)")
