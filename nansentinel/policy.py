"""The decision: a pure function of the cluster view, the history and the config.

Every rank holds the same view (the exchange guarantees it), the same history (built from the
same views) and the same config, so every rank reaches the same decision without another
collective: no rank can step the optimizer while another skips.
"""

from __future__ import annotations

import dataclasses

from nansentinel.config import SentinelConfig
from nansentinel.exchange import ClusterView, RankHealth
from nansentinel.result import KINDS

APPLY, SKIP, OVERFLOW, ABORT, EXCLUDE = "apply", "skip", "overflow", "abort", "exclude"


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What every rank does with this step, and why."""

    action: str
    bad: tuple[RankHealth, ...]
    """Blamed ranks (for AMP runs: ranks whose batch or loss was non-finite)."""
    reason: str = ""
    overflow: bool = False
    """Gradients overflowed under GradScaler on some rank: counted, not blamed."""
    exclude_host: str | None = None
    strikes: int = 0
    """Strikes against ``exclude_host`` (or the most-struck blamed host) in the window."""

    @property
    def bad_ranks(self) -> list[int]:
        return sorted(r.rank for r in self.bad)

    @property
    def bad_hosts(self) -> list[str]:
        return sorted({r.identity.hostname for r in self.bad})

    @property
    def kinds(self) -> list[str]:
        seen = {k for r in self.bad for k in r.kinds}
        return [k for k in KINDS if k in seen]


@dataclasses.dataclass(slots=True)
class History:
    """What the policy remembers between steps; identical on every rank."""

    consecutive_skips: int = 0
    strikes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    excluded: list[str] = dataclasses.field(default_factory=list)

    def record(self, view: ClusterView, decision: Decision, config: SentinelConfig) -> None:
        """Advance the history by one decided step."""
        if decision.action in (SKIP, ABORT, EXCLUDE):
            self.consecutive_skips += 1
        else:
            self.consecutive_skips = 0
        for host in blamed_hosts(view, decision):
            self.strikes.setdefault(host, []).append(view.step)
        horizon = view.step - config.strike_window
        for host in list(self.strikes):
            self.strikes[host] = [s for s in self.strikes[host] if s > horizon]
            if not self.strikes[host]:
                del self.strikes[host]
        if decision.exclude_host and decision.exclude_host not in self.excluded:
            self.excluded.append(decision.exclude_host)


def blamed_hosts(view: ClusterView, decision: Decision) -> list[str]:
    """Hosts that earn a strike: those with a bad rank, but only while some host is healthy.

    When every host is bad the cause is global (learning rate, model, overflow), not a host,
    and excluding hosts one by one would only shrink the job.
    """
    bad = set(decision.bad_hosts)
    if not bad or bad >= set(view.hosts):
        return []
    return sorted(bad)


def decide(
    view: ClusterView, history: History, config: SentinelConfig, *, amp: bool = False
) -> Decision:
    """Decide ``apply | skip | overflow | abort | exclude`` for one step.

    Args:
        view: the cluster view of this step (the same on every rank).
        history: the history before this step (not modified here).
        config: the sentinel config (the same on every rank).
        amp: a GradScaler is in use, so non-finite gradients alone are fp16 overflow that the
            scaler handles by skipping and lowering its scale, not a rank's fault.
    """
    blame_kinds = ("batch", "loss") if amp else KINDS
    bad = tuple(view.bad(blame_kinds))
    overflow = amp and bool(view.bad(("grad",)))
    if not bad:
        return Decision(OVERFLOW if overflow else APPLY, (), overflow=overflow)

    provisional = Decision(SKIP, bad, overflow=overflow)
    for host in blamed_hosts(view, provisional):
        horizon = view.step - config.strike_window
        strikes = sum(1 for s in history.strikes.get(host, ()) if s > horizon) + 1
        if strikes >= config.host_strikes and host not in history.excluded:
            return dataclasses.replace(
                provisional,
                action=EXCLUDE,
                exclude_host=host,
                strikes=strikes,
                reason=f"host {host} blamed {strikes} times within {config.strike_window} steps",
            )
    if config.policy == "abort":
        return dataclasses.replace(provisional, action=ABORT, reason="policy is abort")
    if history.consecutive_skips >= config.max_consecutive_skips:
        return dataclasses.replace(
            provisional,
            action=ABORT,
            reason=(
                f"{history.consecutive_skips} steps skipped in a row "
                f"(max_consecutive_skips={config.max_consecutive_skips})"
            ),
        )
    return provisional
