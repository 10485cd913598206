"""Blame by replay: was it the data, the host, or the model?

Runs only after a detection, never on the normal step. The poisoned rank's batch is replayed
with the same (unchanged: the step was not applied) weights:

- on the poisoned rank again: finite now → ``transient`` (a flipped bit: hardware suspect);
- on a healthy rank on another host (the detection picks it): non-finite there too →
  ``data`` (the batch is quarantined); finite there → ``host`` (a strike against the
  poisoned rank's host);
- every rank non-finite or spiking together → ``divergence`` (learning rate or model: no
  replay needed, rollback with a lower learning rate is the remedy).

Every rank replays, in lockstep: the user's forward and loss may hold collectives
(SyncBatchNorm, a token count all-reduced to normalise the loss, ``sync_dist`` logging, MoE
dispatch), and a collective run by two ranks alone pairs with whatever the others run next.
So the peer replays the poisoned batch while every other rank replays its own, forward and
backward, and each rank's collectives meet the same ones everywhere. Only the poisoned rank
and the peer look at the result (with hooks); the others' replays are discarded.

While replaying, forward hooks on every module and gradient hooks on every parameter find the
first module whose output went non-finite and the first parameter gradient that did, and, when
asked, ``torch.autograd.set_detect_anomaly`` names the backward operation. Anomaly mode stops
at the first bad operation on the ranks that have one, so it runs only when no rank's replay
issued a collective (counted with a dispatch mode during the replay), on the two ranks alone.
These tools cost 2-3x a step and more, which is why they live here and not on the normal step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nansentinel import checks
from nansentinel.checks.quarantine import signature
from nansentinel.common import torch_insides as insides
from nansentinel.decide.spikes import Spikes
from nansentinel.result import NanSentinelError
from nansentinel.wire.collective_inputs import InputFlags, is_collective
from nansentinel.wire.collectives import Peers, plain
from nansentinel.wire.view import ClusterView, RankHealth

ReplayFn = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``fn(module, batch) -> loss``: the forward and loss of one step, on the unwrapped module."""


@dataclasses.dataclass(slots=True)
class ReplayResult:
    """What one replay of a batch found."""

    finite: bool
    loss: float | None = None
    first_module: str | None = None
    first_parameter: str | None = None
    anomaly: str | None = None
    error: str | None = None
    collectives: int = 0
    first_collective: int | None = None
    """With ``watch``: the first collective (its place in the replay's issue order, the same
    count on every rank) whose input on this rank was non-finite."""
    first_collective_op: str | None = None
    """What that collective was (``allreduce on group 0``)."""

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["loss"] is not None and not torch.isfinite(torch.tensor(d["loss"])):
            d["loss"] = str(d["loss"])
        return d


@dataclasses.dataclass(frozen=True, slots=True)
class Mode:
    """How a :func:`replay` runs.

    Args:
        localise: localisation hooks on every module and parameter gradient (False: none, a
            rank that replays only so that the collectives inside its function pair up).
        watch: each collective's input is flagged as it is issued (collective_inputs.py).
        backward: forward and backward (False: the forward and loss alone, under
            ``torch.no_grad()``: what the trace of a forward collective needs).
        anomaly: a second pass under anomaly mode when the first was not finite (alone only:
            see the module docstring).
    """

    localise: bool = True
    watch: bool = False
    backward: bool = True
    anomaly: bool = False


def replay(module: torch.nn.Module, batch: Any, fn: ReplayFn, mode: Mode = Mode(),
           peers: Peers | None = None) -> ReplayResult:
    """Replay ``fn(module, batch)`` forward and backward with localisation hooks (``mode``).

    Leaves no trace: gradients are taken with ``torch.autograd.grad`` (nothing accumulates
    into ``.grad``, and DDP's reducer, which hooks gradient accumulation, never sees the
    replay), buffers (e.g. BatchNorm statistics) and the RNG state are restored, hooks removed.
    Any exception from ``fn`` is recorded, not raised. ``collectives`` counts the collectives
    the replay issued.

    The hooks keep one 0-d flag per module output and parameter gradient on the device, and
    the host reads them, with the loss, once at the end: a replay costs one host sync however
    many modules it passes, not one per hook. ``peers``: every rank replays in lockstep, and a
    rank whose ``fn`` fails (an out-of-memory error, say) makes every rank stop its replay at
    the same point (:class:`_Lockstep`), so that no rank's next collective pairs with another
    rank's collective inside ``fn``.

    With ``mode.watch`` each collective's input flag is read in the same host read, and the
    first non-finite one is ``first_collective``. ``mode.backward=False`` keeps no activations
    and takes no second set of gradients: less memory than a training step.
    """
    localise, watch, backward = mode.localise, mode.watch, mode.backward
    seen: list[tuple[str, str, torch.Tensor]] = []  # (what, name, 0-d "finite" flag), in order

    def forward_hook(name: str) -> Callable[..., None]:
        def hook(_mod: torch.nn.Module, _inp: Any, out: Any) -> None:
            norms = [checks.tensor_norm(t) for t in checks.float_tensors(out)]
            if norms:
                flag = torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms])).all()
                seen.append(("module", name or type(module).__name__, flag))

        return hook

    def grad_hook(name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            seen.append(("parameter", name, torch.isfinite(checks.tensor_norm(grad))))

        return hook

    params = [p for _, p in module.named_parameters() if p.requires_grad]
    handles = []
    if localise:
        handles = [m.register_forward_hook(forward_hook(n)) for n, m in module.named_modules()]
        handles += [p.register_hook(grad_hook(n)) for n, p in module.named_parameters()
                    if p.requires_grad]
    result = ReplayResult(finite=False)
    watched = InputFlags() if watch else None
    counter = _Lockstep(peers, watched)
    failure: BaseException | None = None
    values: list[float] = []
    grad_mode = contextlib.nullcontext() if backward else torch.no_grad()
    try:
        with _preserved(module), counter, grad_mode:
            loss = fn(module, batch)
            detached = loss.detach().float()
            grads_ok = torch.ones((), dtype=torch.bool, device=detached.device)
            if backward and loss.requires_grad and params:
                grads = torch.autograd.grad(loss.float().sum(), params, allow_unused=True)
                if not localise:
                    norms = [checks.tensor_norm(g).to(detached.device) for g in grads
                             if g is not None]
                    if norms:
                        grads_ok = torch.isfinite(torch.stack(norms)).all()
            dev = detached.device
            flags = [f.to(dev) for _, _, f in seen]
            inputs = watched.flags(dev) if watched is not None else []
            # The replay's one host read: loss mean, loss finite, gradients finite, the hooks,
            # the collectives' inputs.
            values = torch.stack([detached.mean(), torch.isfinite(detached).all().float(),
                                  grads_ok.float(), *(f.float() for f in flags),
                                  *inputs]).tolist()
    except Exception as exc:  # the user's replay function may fail in any way
        failure = exc
    finally:
        for h in handles:
            h.remove()
        counter.finish(failure is None)  # every rank leaves the replay at the same round
    if counter.aborted_by_peer:
        result.error = "stopped: another rank's replay failed (every rank stops together)"
    elif failure is not None:
        result.error = f"{type(failure).__name__}: {failure}"
    else:
        result.loss = values[0]
        hooked = values[3:3 + len(seen)]
        firsts: dict[str, str] = {}
        for (what, name, _), ok in zip(seen, hooked, strict=True):
            if not ok:
                firsts.setdefault(what, name)
        result.first_module = firsts.get("module")
        result.first_parameter = firsts.get("parameter")
        result.finite = bool(values[1]) and bool(values[2]) and not firsts
        entered = watched.first(values[3 + len(seen):]) if watched is not None else None
        if entered is not None:
            result.first_collective, result.first_collective_op = entered
    result.collectives = counter.count
    if mode.anomaly and not result.finite and result.error is None:
        # A second pass: anomaly mode raises at the first bad backward op, before the
        # parameter hooks above could see anything, so it cannot share their pass.
        result.anomaly = _anomaly_trace(module, batch, fn, params)
    return result


class _PeerFailed(NanSentinelError):
    """Raised inside a rank's replay when another rank's replay failed: stop here too."""


class _Lockstep(insides.TorchDispatchMode):
    """Counts the collectives (``c10d`` operations) a replay runs, forward and backward, and
    keeps every rank's replay in step when one of them fails.

    Every rank runs the user's function at once, and the function may hold collectives. A rank
    whose function raises (an out-of-memory error, a bug on one rank's data) would otherwise
    go straight to the detection's next small collective, which would pair with another
    rank's collective inside the function. So, with peers, each collective of the replay is
    preceded by a round: a sum of ``[ok, done]`` over every rank (``ok`` 0: this rank failed;
    ``done`` 1: it finished). A rank that finished or failed keeps answering rounds until one
    says so for all: every rank ends at the same round, the first where some rank failed or
    every rank is done, and a rank inside its function at that round stops there
    (:class:`_PeerFailed`). A healthy replay pays one extra tiny all-reduce per collective,
    on the rare path only. Ranks whose functions issue different numbers of collectives would
    not pair in training either; they are not helped here.

    With ``watched``, each collective's input is flagged on the device before it runs, under
    its place in this count (:class:`~nansentinel.wire.collective_inputs.InputFlags`): the rounds
    keep the count in step on every rank, so collective #k is the same one everywhere.
    """

    def __init__(self, peers: Peers | None = None, watched: InputFlags | None = None) -> None:
        super().__init__()
        self.watched = watched
        self.count = 0
        self.peers = peers if peers is not None and not peers.alone else None
        self.ended = False
        self.aborted_by_peer = False

    def _round(self, ok: bool, done: bool) -> tuple[bool, bool]:
        """One round: (every rank ok, every rank done)."""
        assert self.peers is not None
        total = self.peers.sum_floats([float(ok), float(done)])
        world = self.peers.world_size
        every_ok, every_done = total[0] == world, total[1] == world
        if not every_ok or every_done:
            self.ended = True
        return every_ok, every_done

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if is_collective(func):
            self.count += 1
            if self.watched is not None:
                self.watched.record(self.count, func, args, kwargs or {})
            if self.peers is not None and not self.ended:
                every_ok, _ = self._round(True, False)
                if not every_ok:
                    self.aborted_by_peer = True
                    raise _PeerFailed("another rank's replay failed")
        return func(*args, **(kwargs or {}))

    def finish(self, ok: bool) -> None:
        """This rank's replay is over: answer rounds until every rank's is (or one failed)."""
        if self.peers is None:
            return
        while not self.ended:
            every_ok, _ = self._round(ok and not self.aborted_by_peer, True)
            if not every_ok:
                self.aborted_by_peer = self.aborted_by_peer or ok


def _anomaly_trace(
    module: torch.nn.Module, batch: Any, fn: ReplayFn, params: list[torch.nn.Parameter]
) -> str | None:
    """The backward operation that produced NaN, with the forward stack anomaly mode records."""
    with _preserved(module), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                loss = fn(module, batch)
                if loss.requires_grad and params:
                    torch.autograd.grad(loss.float().sum(), params, allow_unused=True)
        except RuntimeError as exc:
            trace = "\n".join(str(w.message) for w in caught if "Traceback" in str(w.message))
            return str(exc) + ("\n" + trace if trace else "")
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Replayer:
    """What a detection replays with: the unwrapped module, the user's replay function (None:
    no replay), the peers every rank replays in lockstep with, and whether a non-finite replay
    runs once more under anomaly mode."""

    module: torch.nn.Module
    fn: ReplayFn | None
    peers: Peers
    anomaly: bool = False


def blame(view: ClusterView, blamed: list[RankHealth], spikes: Spikes, batch: Any,
          replayer: Replayer) -> tuple[str | None, dict[str, Any]]:
    """The verdict of one step, the same on every rank, and this rank's replay detail (for
    the incident report's gather).

    ``divergence`` when every rank is bad or the spike is cluster-wide (no replay needed).
    Otherwise, with a replay function, the first blamed rank's batch goes to the view's
    healthy peer (another host, where ranks are laid out host by host), point to point, and
    every rank replays in lockstep: the blamed rank and every other rank their own batch, the
    peer the blamed one. Small collectives (a sum of one flag, then of six) check that every
    rank has a batch to replay and make the outcome common knowledge; a replay that failed on
    any rank (an out-of-memory error, say) gives no verdict on every rank. Called on every
    rank, after a detection only.

    The rank replayed is the origin the view's trace found (trace.py), else the first blamed.
    A collective in the replay mixes the subject's values into the peer's (the subject replays
    too, in lockstep), so each collective's input is watched: when one went non-finite, the two
    replays are judged by who was non-finite *first*, at that collective, before anything
    could have reached them (:func:`judged`).
    """
    peers, module, fn, anomaly = replayer.peers, replayer.module, replayer.fn, replayer.anomaly
    world = peers.world_size
    if world > 1 and (len(blamed) == world or spikes.cluster_wide):
        return "divergence", {}
    if not blamed or fn is None:
        return None, {}
    traced = set((view.origin_trace or {}).get("origins", ()))
    subject = next((r for r in blamed if r.rank in traced), blamed[0])
    peer = view.replay_peer
    mine, detail = batch, {}
    if peers.rank == subject.rank and batch is not None:
        detail = _signed(batch)
    if peer is not None:
        outgoing = None
        if peers.rank == subject.rank and batch is not None:
            # Only plain data travels (the peer loads it with weights_only=True): say what not.
            outgoing, dropped = plain(batch)
            if dropped:
                detail["replay_sent_without"] = dropped
        sent = peers.send_object(outgoing, subject.rank, peer)
        if peers.rank == peer and sent is not None:
            mine, detail = sent, {"replayed_for": subject.rank}
        elif peers.rank == peer:  # it still replays (its own batch): the collectives pair up
            detail = {"peer_replay_skipped": f"no plain data came from rank {subject.rank} "
                      "(see its replay_sent_without)", "replayed_for": subject.rank}
    # Every rank replays or none does: a rank without a batch would leave the others'
    # collectives unmatched.
    holding = peers.sum_floats([float(mine is not None)])[0]
    if holding < world:
        detail["replay_skipped"] = (
            f"{world - int(holding)} of {world} ranks had no batch to replay (check_batch "
            "was not called with it); every rank replays in lockstep or none does"
        )
        return None, detail
    ours = peers.rank == subject.rank
    theirs = peers.rank == peer and "peer_replay_skipped" not in detail
    result = replay(module, mine, fn, Mode(localise=ours or theirs, watch=True), peers)
    if ours:
        detail["replay"] = result.to_json()
    elif theirs:
        detail["peer_replay"] = result.to_json()
    flags = peers.sum_floats([
        float(ours and result.error is None),
        float(ours and result.finite),
        float(theirs and result.error is None),
        float(theirs and result.finite),
        float(result.collectives),
        float(result.error is not None),
    ])
    if flags[5]:
        # Some rank's replay failed (its own error, or stopped with the others at the same
        # round): no verdict on every rank alike, however the two ranks at stake fared.
        if ours or theirs:
            detail["replay_failed"] = (
                f"the replay failed on {int(flags[5])} of {world} rank(s) (an error or an "
                "out-of-memory error on some rank); every rank stopped at the same point "
                "and the step has no verdict"
            )
        return None, detail
    # Where a collective's input first went non-finite: the place, and whether the subject's
    # and the peer's were among the first (one MIN of three numbers; none when the replay
    # issued no collective, which every rank knows from the sum above).
    at = result.first_collective if result.first_collective is not None else NO_COLLECTIVE
    firsts = (peers.min_ints([at, at if ours else NO_COLLECTIVE, at if theirs else NO_COLLECTIVE])
              if flags[4] else [NO_COLLECTIVE] * 3)
    if anomaly and (ours or theirs) and not result.finite and result.error is None:
        key = "replay" if ours else "peer_replay"
        if flags[4]:
            detail[key]["anomaly_skipped"] = (
                f"the replay function issues collectives ({int(flags[4])} over all ranks); "
                "anomaly mode stops at the first bad operation on this rank alone, which "
                "would leave the others waiting"
            )
        else:
            params = [p for p in module.parameters() if p.requires_grad]
            detail[key]["anomaly"] = _anomaly_trace(module, mine, fn, params)
    if not flags[0]:
        return None, detail
    own, peer_finite = judged(firsts, bool(flags[1]), bool(flags[3]) if flags[2] else None)
    if firsts[0] < NO_COLLECTIVE and (ours or theirs):
        detail["replay_first_collective"] = firsts[0]
        if theirs and firsts[2] != firsts[0] and not result.finite:
            detail["peer_replay_reached"] = (
                f"its inputs to collectives #1..#{firsts[0]} were finite: what went "
                "non-finite later came through a collective, not from the batch it replayed")
    if own is None:
        if ours or theirs:
            detail["replay_undecided"] = (
                f"another rank's input to collective #{firsts[0]} went non-finite before rank "
                f"{subject.rank}'s: what rank {subject.rank} replayed was reached by it, and its "
                "own values cannot be told")
        return None, detail
    return verdict_of(own, peer_finite), detail


#: ``first_collective`` of a replay whose collectives' inputs were all finite.
NO_COLLECTIVE = 2**40


def judged(firsts: list[int], own_finite: bool, peer_finite: bool | None
           ) -> tuple[bool | None, bool | None]:
    """The subject's and the peer's replays as :func:`verdict_of` reads them, when a
    collective may have mixed one into the other.

    ``firsts``: the first collective whose input went non-finite on any rank, on the subject,
    on the peer (``NO_COLLECTIVE``: none). No collective input non-finite: what each replay
    computed was its own, as without collectives. Otherwise a replay counts as non-finite when
    its input to that first collective was (it went wrong before anything could reach it) and
    as finite when it was not: the peer's later NaN came from the subject through the
    collective (a faulty device: ``host``), not from the batch it replayed. A subject not
    among the first but non-finite was reached by another rank: (None, None), no verdict.
    """
    first, own, peer = firsts
    if first >= NO_COLLECTIVE:
        return own_finite, peer_finite
    if own != first:
        return (True, peer_finite) if own_finite else (None, None)
    return False, (None if peer_finite is None else peer != first)


def _signed(batch: Any) -> dict[str, Any]:
    """The blamed batch's fingerprint and signature (for the quarantine), or why not: local
    work before the replay's collectives, so it must not raise."""
    try:
        sig = signature(batch)
    except Exception as exc:  # a batch the signature cannot read must not stop the replay
        return {"signature_error": f"{type(exc).__name__}: {exc}"}
    return {"fingerprint": sig.fingerprint, "signature": sig.to_json()}


def verdict_of(own_finite: bool, peer_finite: bool | None) -> str:
    """The verdict from the two replays (``peer_finite`` None: there was no healthy peer)."""
    if own_finite:
        return "transient"
    if peer_finite is None or not peer_finite:
        return "data"
    return "host"


@contextlib.contextmanager
def _preserved(module: torch.nn.Module) -> Iterator[None]:
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for n, b in module.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
