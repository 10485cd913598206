"""The detection path: what runs only when the exchange flagged a rank (or the cluster mean).

A healthy step ends with the totals: counts and sums, the same on every rank, no name. When
the totals say a rank was blamed or spiked, every rank runs this path at the same point of the
step (``step()`` on the host gate, the next sentinel call on the device gate), in the same
order, because its inputs (the totals) are the same everywhere:

1. who is flagged: the exchange's sum of indices names a single flagged rank outright;
   several are found with one byte per rank (:meth:`Peers.flagged`);
2. their rows and identities, and those of a healthy rank to replay a blamed batch on: only
   those ranks speak (:meth:`Peers.gather_from`), so one bad rank costs the same at any scale;
3. where a named rank's first non-finite value was its forward and its forward ran a
   collective (origins.needs_trace), and a replay function is given: the trace (trace.py),
   every rank replaying its forward with each collective's input checked, names the rank
   where it began and the ranks it reached; the origins (and the replay's peer, chosen
   among the others) send their rows;
4. one small max-reduce: whether some host had no blamed rank (a global cause strikes no
   host), and the min and max of the loss and gradient norm, for the report.

Then, for blamed or spiking ranks, :meth:`Detector.evidence` takes what the decision and the
report need before the gradients are discarded (the parameter naming, the replay and its
verdict), and after the decision :meth:`Detector.record` writes the incident. The step flow
(sentinel.py) calls these three and nothing else of the rare path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nansentinel.checks.quarantine import Quarantine, Signature
from nansentinel.decide import origins
from nansentinel.decide.policy import APPLY, Decision, is_blamed
from nansentinel.decide.spikes import Spikes
from nansentinel.engines import GradPath, KeptNorms
from nansentinel.rare import incident, live_trace
from nansentinel.rare import trace as tracing
from nansentinel.rare.curves import Curves
from nansentinel.rare.incident import Case, IncidentWriter
from nansentinel.rare.replay import Replayer, ReplayFn, blame
from nansentinel.result import RankIdentity, StepResult
from nansentinel.wire.context import Context
from nansentinel.wire.schema import SIGNALS, OwnRow, Totals
from nansentinel.wire.view import ClusterView, RankHealth

log = logging.getLogger("nansentinel")

_EXACT_INDICES = 2**24


class Detector:
    """The rare path of a step, run by every rank together when the totals flag something.

    Owns what the rare path keeps between steps: the last steps' curves the reports show, and
    the quarantine of batches a ``data`` verdict blamed.

    Args:
        ctx: the run (peers, identity, whether a loss scale makes gradient overflow nobody's
            fault, the deadline armed around the rare path's collectives).
        gradients: the gradient path, which names the poisoned parameters.
        incidents: writes the report and the poisoned batch.
        replayer: the module and the user's replay function (None: no replay).
        quarantine: batches known to be bad; a ``data`` verdict adds one.
    """

    def __init__(self, ctx: Context, gradients: GradPath, incidents: IncidentWriter,
                 replayer: Replayer, quarantine: Quarantine) -> None:
        self.ctx, self.peers, self.identity = ctx, ctx.peers, ctx.identity
        self.gradients, self.incidents, self.quarantine = gradients, incidents, quarantine
        self.replayer = replayer
        self.module, self.replay = replayer.module, replayer.fn
        #: The last steps' loss and gradient norm, this rank's and the cluster's (reports).
        self.curves = Curves()
        #: At most one warn-level spike report per this many steps (``spike_window``).
        self.spike_report_every = ctx.config.spike_window
        self._last_spike_report: int | None = None
        #: Told about each warn-level spike logged without a report (the metrics counter).
        self.suppressed: Callable[[], None] | None = None

    @staticmethod
    def replayer_for(ctx: Context, gradients: GradPath, module: torch.nn.Module,
                 replay: ReplayFn | None) -> Replayer:
        """What this run's detections replay with, from its config: off where the gradient
        path says why (``caps.replay``: under FSDP2 its backward would reduce-scatter through
        the gradient path being judged)."""
        config = ctx.config
        off = gradients.caps.replay
        if off is not None and replay is not None and config.replay and ctx.rank == 0:
            log.info("nansentinel: replay is off under %s (%s); detections get verdict none",
                     gradients.caps.label, off)  # said once, by rank 0, as the gate choice is
        on = config.replay and off is None
        return Replayer(module, replay if on else None, ctx.peers, config.replay_anomaly)

    @property
    def amp(self) -> bool:
        return self.ctx.amp

    @property
    def guarded(self) -> Callable[[], Any]:
        return self.ctx.guarded

    def view(
        self, step: int, totals: Totals, own: OwnRow, ratios: dict[str, float],
        forward_groups: tuple[str, ...] = (), batch: Any = None,
    ) -> ClusterView:
        """The cluster view of a flagged step, the same on every rank (collectives: see the
        module docstring). ``ratios``: this rank's spike ratios (sent if it spiked);
        ``forward_groups``: the process groups that ran a collective in its forward (sent if
        it is named, so that a rank reached through one is told from the origin: origins.py);
        ``batch``: this rank's batch, replayed when a forward collective must be traced.
        """
        world = self.peers.world_size
        # fp32 holds every index exactly up to 2**24 ranks; beyond that, ask every rank.
        single = totals.single_flagged if world <= _EXACT_INDICES else None
        flagged = [single] if single is not None else (
            self.peers.flagged(own.flagged) if totals.flagged else []
        )
        candidate = replay_candidate(flagged, world)
        speakers = sorted({*flagged, *([candidate] if candidate is not None else [])})
        row = RankHealth.of(self.identity, own, ratios, forward_groups)
        record = row.to_wire() if self.peers.rank in speakers else None
        with paused_gc():
            rows = self.peers.gather_from(speakers, record)
            raw = [_health(rank, world, rows.get(rank)) for rank in speakers]
            named = origins.weigh(raw)
        chosen = set(flagged)
        traced = None
        live = getattr(self.gradients, "first_forward_send", None)  # engines/prehook.py
        if world > 1 and origins.needs_trace(named):
            if live is not None:  # the step's own forward collectives (live_trace.py)
                traced, named, candidate = self._trace(raw, named, row, batch, candidate,
                                                       live=live(step))
                chosen.update(traced.origins)
            elif self.replay is None:  # said in the report; nothing to run
                traced = origins.Trace(reason=(
                    "no replay function (replay= not given, NANSENTINEL_REPLAY=0, or FSDP2): "
                    "the forward's collectives could not be traced"))
            else:
                traced, named, candidate = self._trace(raw, named, row, batch, candidate)
                chosen.update(traced.origins)
        grads = getattr(self.gradients, "first_gradient_send", None)  # engines/prehook.py
        if traced is None and grads is not None and world > 1 and \
                origins.needs_gradient_trace(named):
            # The first gradient collective whose send was non-finite on some rank decides
            # (every rank runs this: ``named`` is the same everywhere).
            traced, mine = live_trace.locate(self.peers, grads(step))
            traced = dataclasses.replace(traced, op=self._origin_op(traced, mine))
            named = origins.regrade(named, traced)
        flagged_rows = tuple(r for r in named if r.rank in chosen)
        blamed_hosts = {r.identity.hostname for r in flagged_rows if is_blamed(r, amp=self.amp)}
        values = [own.value(s) for s in SIGNALS]
        finite = [v if v is not None and math.isfinite(v) else None for v in values]
        maxima = self.peers.max_floats([
            float(self.identity.hostname not in blamed_hosts),
            *(x for v in finite for x in ((v, -v) if v is not None else (-math.inf, -math.inf))),
        ])
        extremes = {
            s: (-maxima[2 + 2 * i], maxima[1 + 2 * i])
            for i, s in enumerate(SIGNALS) if math.isfinite(maxima[1 + 2 * i])
        }
        peer = next((r for r in named if r.rank == candidate), None)
        if traced is not None and traced.origins:  # a rank the NaN reached is a healthy peer
            replay_peer = peer.rank if peer is not None else None
        else:
            replay_peer = peer.rank if peer is not None and peer.healthy else None
        return ClusterView(
            step, world, totals, flagged_rows, named,
            every_host_bad=bool(blamed_hosts) and maxima[0] == 0.0,
            extremes=extremes, replay_peer=replay_peer,
            origin_trace=traced.to_json() if traced is not None else None,
        )

    def _origin_op(self, traced: origins.Trace, mine: str | None) -> str:
        """What the first origin's first non-finite collective was, on every rank: it sends
        it in a gather where only it speaks (two small all-reduces, nothing per rank)."""
        if not traced.origins:
            return traced.op
        with paused_gc():
            sent = self.peers.gather_from([traced.origins[0]], mine)
        op = sent.get(traced.origins[0])
        return op if isinstance(op, str) else traced.op

    def _trace(
        self, raw: list[RankHealth], named: tuple[RankHealth, ...], row: RankHealth,
        batch: Any, candidate: int | None, *, live: Any = False,
    ) -> tuple[origins.Trace, tuple[RankHealth, ...], int | None]:
        """Trace the forward's collectives (trace.py) and apply what it found: ``(trace,
        named, the replay's peer)``. With origins, the peer is a rank half the world away that
        is none of them (a rank the NaN only reached has a healthy device), and the origins
        and the peer send their rows (the first origin with what its first non-finite
        collective was): one gather in which only they speak. ``live``: this rank's first
        non-finite forward send of the step (live_trace.py), in place of a replay."""
        if live is not False:
            traced, op = live_trace.locate(self.peers, live)
        else:
            assert self.replay is not None, "traced only with a replay function"
            traced, op = tracing.locate(self.peers, self.module, batch, self.replay)
        if not traced.origins:
            return traced, named, candidate
        world = self.peers.world_size
        candidate = replay_candidate(list(traced.origins), world)
        speakers = sorted({*traced.origins, *([candidate] if candidate is not None else [])})
        mine = [row.to_wire(), op] if self.peers.rank in speakers else None
        with paused_gc():
            sent = self.peers.gather_from(speakers, mine)
        rows = {r: _health(r, world, s[0] if isinstance(s, list) else None)
                for r, s in sent.items()}
        first = sent.get(traced.origins[0])
        if isinstance(first, list) and isinstance(first[1], str):
            traced = dataclasses.replace(traced, op=first[1])
        retraced = origins.weigh(origins.retrace(raw, traced, rows))
        if candidate is not None and all(r.rank != candidate for r in retraced):
            retraced = tuple(sorted((*retraced, rows[candidate]), key=lambda r: r.rank))
        return traced, retraced, candidate


    def evidence(
        self, view: ClusterView, bad: tuple[RankHealth, ...], spikes: Spikes, *, batch: Any,
        kept: KeptNorms | None = None, discard: Callable[[], None] | None = None,
    ) -> tuple[str | None, dict[str, Any]]:
        """The replay's verdict and this rank's share of the report: the names of its
        non-finite parameters, its replay and the peer's.

        The parameters are named from the poisoned gradients, or from the per-parameter norms
        ``kept`` before their reduction (the device gate: the gradients are the user's again
        by then); then, when a rank is blamed (no policy applies such a step) and a replay is
        to run, ``discard()`` frees the poisoned gradients first: the replay takes a set of
        gradients of its own, and a detection then needs no more memory than a training
        step."""
        detail = self.naming(bad, kept)
        if bad and self.replay is not None and discard is not None:
            discard()
        if not (bad or spikes):
            return None, detail
        with self.guarded():
            verdict, replayed = blame(view, list(bad), spikes, batch, self.replayer)
        detail.update(replayed)
        return verdict, detail

    def naming(self, bad: tuple[RankHealth, ...], kept: KeptNorms | None = None
               ) -> dict[str, Any]:
        """This rank's share of the report where a blamed rank's gradients were non-finite:
        the names of its poisoned parameters (see :meth:`evidence`); the same collectives on
        every rank. Alone where the cause is known without a replay (the model's own state,
        rare/state.py)."""
        if not any("grad" in r.kinds for r in bad):
            return {}
        poisoned = any(r.rank == self.peers.rank and "grad" in r.kinds for r in bad)
        with self.guarded():
            return self.gradients.naming_detail(poisoned, self.peers, kept)

    def record(self, case: Case) -> StepResult:
        """Write the incident (report on rank 0, the poisoned batch, log lines); a ``data``
        verdict adds the batch's signature to the quarantine. Returns the case's result with
        its parameters and report path.

        A warn-level spike (nothing blamed, the step applied) on an unstable run can come
        every few steps, and a report each time is noise: at most one is written per
        ``spike_report_every`` steps; the others are one log line on rank 0 and a count
        (``nansentinel_spike_reports_suppressed_total``). Every rank keeps the same count
        from the same decisions, so every rank skips the report's gather alike."""
        view, decision, result = case.view, case.decision, case.result
        if not self._worth_a_report(view.step, decision, case.spikes):
            if self.peers.rank == 0:
                log.warning("%s (no report: one warn-level spike report per %d steps)",
                            incident.describe(view, decision, result, case.spikes),
                            self.spike_report_every)
            if self.suppressed is not None:
                self.suppressed()
            return result
        result, details = self.incidents.write(case, self.curves)
        if result.verdict == "data":
            for d in details.values():
                if d.get("signature"):
                    self.quarantine.add(Signature.from_json(d["signature"]), view.step)
        return result

    def _worth_a_report(self, step: int, decision: Decision, spikes: Spikes) -> bool:
        if decision.bad or decision.action != APPLY or not (spikes or spikes.collapsed):
            return True
        last = self._last_spike_report
        if last is not None and step - last < self.spike_report_every:
            return False
        self._last_spike_report = step
        return True


def replay_candidate(flagged: list[int], world: int) -> int | None:
    """A rank not flagged, half the world away from the first flagged rank: with ranks laid
    out host by host (as torchrun does), on another host. None when every rank is flagged."""
    if not flagged or len(flagged) >= world:
        return None
    taken = set(flagged)
    rank = (flagged[0] + world // 2) % world
    while rank in taken:
        rank = (rank + 1) % world
    return rank


def _health(rank: int, world: int, record: Any) -> RankHealth:
    """A named rank's row from its record (a rank that sent nothing: its number alone)."""
    if not isinstance(record, list):
        return RankHealth(RankIdentity(rank, 0, world, "?", "?"), (), False, None, None)
    return RankHealth.from_wire(record, world)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a detection builds its named rows.

    Building 131,072 rows allocates millions of objects, none in a cycle, and each
    allocation threshold crossed starts a collection that walks the training process's
    whole heap (the model's modules, the optimizer's state): paused, the parse and the rows
    take 2.5 times less. Reference counting still frees everything; the collector resumes
    as it was, also on an error.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
