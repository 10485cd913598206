"""The stop path: how a rank ends the run when the cluster decided so, or when the step's
collectives never completed.

Kept apart from the step flow because it is the one place with process-wide side effects —
the exclusion record, the verdict file for ``nansentinel run``, the final scrape, the exit —
and because each of them must happen in a fixed order: the record and rank 0's report are on
disk before any rank raises, and torchrun tears the job down only after that.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from nansentinel.config import SentinelConfig
from nansentinel.exchange import HealthExchange, diagnosis_grace
from nansentinel.policy import EXCLUDE, Decision
from nansentinel.result import (
    HostExcludedError,
    NonFiniteError,
    RankIdentity,
    StepResult,
)
from nansentinel.verdicts import EXCHANGE_TIMEOUT, RankVerdict, write_verdict

log = logging.getLogger("nansentinel")


def leave_verdict(
    config: SentinelConfig, identity: RankIdentity, step: int, outcome: str, message: str,
    **details: Any,
) -> None:
    """Leave this rank's verdict where ``nansentinel run`` looks for it (if launched so);
    ``details``: the other fields of :class:`~nansentinel.verdicts.RankVerdict`."""
    if not config.run_dir:
        return
    verdict = RankVerdict(
        rank=identity.rank, outcome=str(outcome), step=step, message=message,
        hostname=identity.hostname, local_rank=identity.local_rank, **details,
    )
    write_verdict(config.run_dir, verdict)


def stop(
    decision: Decision,
    result: StepResult,
    message: str,
    *,
    config: SentinelConfig,
    identity: RankIdentity,
    exchange: HealthExchange,
    job_id: str | None,
    guarded: Callable[[], Any],
    lingering: bool,
) -> None:
    """Raise :class:`NonFiniteError` (or :class:`HostExcludedError`) on this rank, after the
    exclusion record (rank 0), this rank's verdict and a barrier, so that every rank raises
    with everything on disk. ``guarded()`` is a context manager arming the watchdog around the
    barrier; ``lingering`` keeps the exporter up ``config.metrics_linger`` seconds first."""
    if config.exclusion_file and decision.exclude_host and identity.rank == 0:
        from nansentinel.exclusion import ExclusionRecord, ExclusionStore

        ExclusionStore(config.exclusion_file).add(
            ExclusionRecord(
                host=decision.exclude_host,
                reason=decision.reason,
                step=result.step,
                evidence={
                    "bad_ranks": result.bad_ranks,
                    "kinds": result.kinds,
                    "strikes": decision.strikes,
                    "report_path": result.report_path,
                },
                time=time.time(),
                job_id=job_id,
            )
        )
    leave_verdict(
        config, identity, result.step, result.outcome, message, bad_ranks=result.bad_ranks,
        bad_hosts=result.bad_hosts, kinds=result.kinds, excluded_host=decision.exclude_host,
        report_path=result.report_path,
    )
    # Rank 0's report and the exclusion record are on disk before anyone raises.
    with guarded():
        exchange.peers.barrier()
    if lingering and config.metrics_linger > 0:
        log.info(
            "nansentinel: rank %d keeps its exporter up %g s for the final scrape",
            identity.rank, config.metrics_linger,
        )
        time.sleep(config.metrics_linger)
    error = HostExcludedError if decision.action == EXCLUDE else NonFiniteError
    raise error(message, result)


def on_timeout(
    step: int,
    *,
    config: SentinelConfig,
    identity: RankIdentity,
    exchange: HealthExchange,
) -> None:
    """Watchdog thread: the step's collectives are stuck (a rank froze or died where no
    Python timeout reaches). Name the missing ranks, leave a verdict for the launcher and
    end the process, as NCCL's watchdog does; torchrun restarts or ends the job."""
    error = exchange.diagnose(step, None)
    log.error("%s", error)
    leave_verdict(config, identity, step, EXCHANGE_TIMEOUT, str(error), missing=error.missing)
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    if identity.rank == 0:
        # Without torchrun's agent store, rank 0 hosts the rendezvous store: linger so the
        # other live ranks can finish their own diagnosis before it goes away.
        time.sleep(diagnosis_grace(config.exchange_timeout))
    from nansentinel.exitcodes import EXIT_EXCHANGE_TIMEOUT

    os._exit(EXIT_EXCHANGE_TIMEOUT)
