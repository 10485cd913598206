"""The exclusion guard: torchrun's rendezvous handler, wrapped so an excluded host leaves.

Every way torchrun's agent re-enters the job -- a restart after a failure, or a healthy agent
making room for a node waiting to join -- goes through its rendezvous handler's
``next_rendezvous()``. :func:`install_guard` routes the launch through a backend named
``nansentinel`` (registered in torch's public handler registry) that wraps the backend the
user asked for. Before each round the guard asks whether this host is excluded: by its own
ranks' verdicts, which are on local disk and cannot race, or by the shared exclusion file.
If so the agent does not rejoin (:class:`HostExcludedExit`), and on the way out the handler
only removes this node from the current round instead of closing the rendezvous, which
would end the job for every host. The launcher's module docstring tells the whole story and
its limits.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from nansentinel.common import torch_insides as insides
from nansentinel.common.bounded import OneAtATime
from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore
from nansentinel.common.verdicts import (
    STORE_GONE,
    RankVerdict,
    archive_verdicts,
    read_verdicts,
    write_stop_cause,
)
from nansentinel.launcher.console import say
from nansentinel.result import NanSentinelError

#: The rendezvous backend name under which the exclusion guard is registered.
GUARD_BACKEND = "nansentinel"
_INNER_BACKEND_KEY = "nansentinel_inner_backend"
_GUARD_KEY = "nansentinel_guard"
#: Seconds the excluded host waits for rank 0's exclusion record before writing its own.
RECORD_WAIT_S = 5.0
#: Seconds the agent's poll of the rendezvous (``num_nodes_waiting``, every monitor
#: interval) may take before it counts as "nobody waiting": a store across a partition
#: answers after its read timeout (60 s), then again, and the agent would not see its own
#: workers end for as long.
POLL_BOUND_S = 5.0
#: Seconds beyond the rendezvous's close timeout that ``shutdown()`` may take.
SHUTDOWN_MARGIN_S = 5.0
#: Seconds a launcher that found the rendezvous store gone waits, beyond two monitor
#: intervals (and :data:`POLL_BOUND_S` where the store stopped answering rather than
#: refused), before its agent stops the workers: every other launcher finds it gone too in
#: that time (each polls the store every monitor interval) and tells its own ranks why,
#: before any rank hears of a stop.
STORE_GONE_GRACE_S = 2.0


class HostExcludedExit(NanSentinelError):
    """Raised inside torchrun's agent when this host must not join the next rendezvous."""

    def __init__(self, record: ExclusionRecord) -> None:
        super().__init__(f"host {record.host} is excluded: {record.reason}")
        self.record = record


class TooFewHostsExit(NanSentinelError):
    """Raised inside torchrun's agent when the hosts excluded at one step leave fewer than
    ``--nnodes``'s minimum: the next round could only wait out its join timeout."""


class RendezvousStoreGone(NanSentinelError):
    """Raised inside torchrun's agent when the rendezvous store died or stopped answering:
    no restart, no exclusion and no new host can happen without it, so the job stops."""


def store_failure(exc: BaseException) -> str | None:
    """What a rendezvous call's error says of the store, in one line (no C++ stack), or None
    when it is no failure to reach the store (a closed rendezvous, a join timeout...)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    if not isinstance(exc, DistError | RendezvousConnectionError):
        return None
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, DistError):  # the store's own error: its first words
            text = str(seen).split("Exception raised from", 1)[0].strip()
            return (text.splitlines()[0].strip() if text else type(seen).__name__).rstrip(".")
        seen = seen.__cause__ or seen.__context__
    return "the connection to it failed"


class ExclusionGuard:
    """Decides, before each rendezvous round, whether this host may (re)join.

    Args:
        hostname: this host's identity, as the sentinel names hosts.
        run_dir: where this host's ranks write their verdicts.
        store: the shared exclusion store, or None when no file is configured.
        job_id: written into a record this guard has to add itself.
        min_nodes: ``--nnodes``'s minimum: fewer hosts than this cannot go on.
    """

    def __init__(
        self, hostname: str, run_dir: Path, store: ExclusionStore | None, job_id: str | None,
        min_nodes: int = 1,
    ) -> None:
        self.hostname = hostname
        self.run_dir = run_dir
        self.store = store
        self.job_id = job_id
        self.min_nodes = min_nodes
        self.store_grace = STORE_GONE_GRACE_S
        """Seconds to wait before the workers are stopped for a lost store (install_guard
        adds two monitor intervals)."""
        self.excluded: ExclusionRecord | None = None
        self.others_excluded: set[str] = set()
        self.nodes: int | None = None
        """The hosts of the last round this agent joined (None before the first)."""
        self._rounds = 0

    def __repr__(self) -> str:  # shown in torchrun's "rdzv_configs" log line
        return f"ExclusionGuard(host={self.hostname!r}, store={self.store!r})"

    def check(self) -> ExclusionRecord | None:
        """The record that keeps this host out, or None when it may join."""
        for verdict in read_verdicts(self.run_dir).values():
            if self.hostname in verdict.excludes:
                return self._record_from_verdict(verdict)
        if self.store is not None:
            mine = self.store.records_for(self.hostname)
            if mine:
                return mine[-1]
        return None

    def before_round(self) -> None:
        """Called by the handler wrapper before each ``next_rendezvous()``."""
        record = self.check()
        if record is not None:
            self.excluded = record
            raise HostExcludedExit(record)
        if self._rounds > 0:
            verdicts = read_verdicts(self.run_dir).values()
            leaving = {host for verdict in verdicts for host in verdict.excludes}
            self.others_excluded |= leaving
            left = None if self.nodes is None else self.nodes - len(leaving)
            if leaving and left is not None and left < self.min_nodes:
                step = next((v.step for v in verdicts if v.excludes), "?")
                raise TooFewHostsExit(
                    f"host(s) {', '.join(sorted(leaving))} excluded by the sentinel at step "
                    f"{step} leave {left} of the {self.nodes} host(s), fewer than --nnodes's "
                    f"minimum of {self.min_nodes}: the job cannot go on and ends on every "
                    "host (lower the minimum, e.g. the batch script's MIN_NODES, to go on "
                    "with fewer hosts)")
            archived = archive_verdicts(self.run_dir)
            if archived is not None:
                say(f"verdicts of the failed attempt kept in {archived}")
        self._rounds += 1

    def joined(self, info: Any) -> None:
        """Called with what a round returned: remembers how many hosts it holds."""
        nodes = getattr(info, "world_size", None)
        if nodes is None and isinstance(info, tuple) and len(info) >= 3:
            nodes = info[2]  # torch before RendezvousInfo: (store, rank, world_size)
        if isinstance(nodes, int):
            self.nodes = nodes

    def _record_from_verdict(self, verdict: RankVerdict) -> ExclusionRecord:
        """Prefer rank 0's record (it carries the cluster's evidence); if it does not show
        up in the shared file within RECORD_WAIT_S (or the verdict says rank 0 could not
        write it: no wait), write one from this verdict, so a launcher started later on this
        host still refuses to join."""
        if self.store is not None and verdict.record_error is None:
            deadline = time.monotonic() + RECORD_WAIT_S
            while True:
                mine = self.store.records_for(self.hostname)
                if mine:
                    return mine[-1]
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.2)
        record = ExclusionRecord(
            host=self.hostname,
            reason=verdict.message or "excluded by the sentinel",
            step=verdict.step,
            evidence={
                "source": "launcher (from this host's verdicts)",
                "bad_ranks": verdict.bad_ranks,
                "kinds": verdict.kinds,
                "report_path": verdict.report_path,
            },
            job_id=self.job_id,
        )
        if self.store is not None:
            try:
                self.store.add(record)
            except OSError as exc:
                say(f"could not record the exclusion in {self.store.path}: {exc}")
        return record


class GuardedRendezvousHandler:
    """torchrun's rendezvous handler with an exclusion check before every round.

    Implements torch's ``RendezvousHandler`` interface by delegation. Deliberately not a
    subclass: torch's registry only checks :meth:`get_backend`, and delegation keeps every
    attribute of the real handler reachable (``__getattr__``).
    """

    def __init__(self, inner: Any, guard: ExclusionGuard, *, store_host: bool = False,
                 endpoint: str = "") -> None:
        self._inner = inner
        self._guard = guard
        #: This agent serves the c10d rendezvous store (``--rdzv-endpoint`` is this host).
        self.store_host = store_host
        #: The rendezvous store's ``HOST:PORT`` (``--rdzv-endpoint``), for messages.
        self.endpoint = endpoint
        #: Why the store is gone, once it is (nothing is asked of it after that).
        self.store_gone: str | None = None
        self._poll = OneAtATime(lambda: self._inner.num_nodes_waiting(),
                                "nansentinel-rdzv-poll")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_backend(self) -> str:
        return GUARD_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return bool(self._inner.use_agent_store)

    def next_rendezvous(self) -> Any:
        self._guard.before_round()
        try:
            info = self._inner.next_rendezvous()
        except Exception as exc:
            self._store_gone(exc, workers=False)
            raise
        self._guard.joined(info)
        return info

    def is_closed(self) -> bool:
        return bool(self._inner.is_closed())

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """The inner handler's answer, or 0 when the store has not answered within
        :data:`POLL_BOUND_S` (a host cut off from it): the agent then goes on watching its
        workers instead of waiting minutes on the store."""
        try:
            answered, value = self._poll(POLL_BOUND_S)
        except Exception as exc:
            self._store_gone(exc, workers=True)
            raise
        return int(value) if answered and value is not None else 0

    def _store_gone(self, exc: BaseException, *, workers: bool) -> None:
        """Raise :class:`RendezvousStoreGone` naming the store when ``exc`` says it cannot be
        reached (else return: the caller re-raises ``exc``). ``workers``: this agent's workers
        run; the agent stops them (SIGTERM) once this raises, so first leave them the cause
        for their verdicts and give every other launcher the time to find the store gone and
        do the same (:data:`STORE_GONE_GRACE_S`): no rank then names a signal."""
        detail = store_failure(exc)
        if detail is None:
            return
        timed_out = "timeout" in detail.lower() or "timed out" in detail.lower()
        how = ("stopped answering (its process is frozen, or this host is cut off from it)"
               if timed_out else "is gone (its process died or was killed)")
        self.store_gone = (
            f"the rendezvous store at {self.endpoint or '--rdzv-endpoint'} {how}: "
            f"{detail}. Without it no host can restart, leave or join, so the launchers "
            "stopped the run; every rank stopped after a common step (exit 5). Start the "
            "store and the job again; it resumes from its last checkpoint")
        if workers:
            try:
                write_stop_cause(self._guard.run_dir, STORE_GONE, self.store_gone)
            except OSError as err:
                say(f"could not tell the workers why they stop ({err}); their verdicts will "
                    "name the signal")
            time.sleep(self._guard.store_grace + (POLL_BOUND_S if timed_out else 0.0))
        raise RendezvousStoreGone(self.store_gone) from exc

    def get_run_id(self) -> str:
        return str(self._inner.get_run_id())

    def shutdown(self) -> bool:
        """Close the rendezvous on a normal exit; on exclusion only leave it.

        torchrun's ``launch_agent`` calls ``shutdown()`` whenever the agent exits other than
        by a signal, and for the dynamic (c10d, etcd) handler that *closes* the rendezvous:
        every other agent would then fail its next round with ``RendezvousClosedError``.
        """
        if self.store_gone is not None:
            return False  # nothing to close, and nobody to tell
        if self._guard.excluded is None:
            return self._bounded_shutdown()
        if self.store_host:
            # The store leaves with this process: the others cannot go on. Close the
            # rendezvous so that they end now, with a clear cause, instead of timing out.
            say(
                f"host {self._guard.hostname} is excluded but it runs the rendezvous store "
                "(--rdzv-endpoint): the job cannot continue without it and ends on every "
                "host. Run the store on a host that trains nothing (see the README, "
                "'Where to run the rendezvous store')."
            )
            return self._bounded_shutdown()
        _leave_rendezvous(self._inner)
        return True

    def _bounded_shutdown(self) -> bool:
        """The inner ``shutdown()``, given up after the rendezvous's close timeout and a
        margin: on a host cut off from the store it would block on each store request for
        the store's read timeout, again and again, and the launcher would never exit."""
        close = getattr(getattr(getattr(self._inner, "settings", None), "timeout", None),
                        "close", None)
        bound = (close.total_seconds() if close is not None else 30.0) + SHUTDOWN_MARGIN_S
        answered, value = OneAtATime(self._inner.shutdown, "nansentinel-rdzv-close")(bound)
        if not answered:
            say(f"could not close the rendezvous: its store did not answer within {bound:g} s "
                f"(is host {self._guard.hostname} cut off from it?); leaving without")
            return False
        return bool(value)


def _leave_rendezvous(handler: Any) -> None:
    """Remove this node from the current round of a dynamic rendezvous, so the others
    complete the next round without waiting for our keep-alive to expire.

    Uses torch internals (``_stop_heartbeats``, ``_op_executor``, ``_RendezvousExitOp``);
    when they are missing the result is the same, only later: the node stops sending
    keep-alives when this process exits and the others drop it after
    ``keep_alive_interval * keep_alive_max_attempt`` seconds.
    """
    try:
        close = getattr(getattr(handler, "settings", None), "timeout", None)
        seconds = close.close.total_seconds() if close is not None else 30.0
        insides.leave_rendezvous(handler, seconds)
    except Exception as exc:  # any failure has the same fallback
        say(
            f"could not leave the rendezvous cleanly ({type(exc).__name__}: {exc}); "
            "the other hosts drop this one when its keep-alive expires"
        )


def _create_guarded_handler(params: Any) -> GuardedRendezvousHandler:
    """Rendezvous backend creator registered under :data:`GUARD_BACKEND`."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    extra = dict(params.config)
    guard = extra.pop(_GUARD_KEY)
    inner_params = RendezvousParameters(
        backend=extra.pop(_INNER_BACKEND_KEY),
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        **extra,
    )
    handler = rdzv_registry.get_rendezvous_handler(inner_params)
    store = insides.rendezvous_store(handler)  # the c10d backend's TCPStore, bound by now
    return GuardedRendezvousHandler(handler, guard, store_host=serves_store(inner_params, store),
                                    endpoint=str(params.endpoint))


def serves_store(params: Any, store: Any = None) -> bool:
    """Whether this agent serves the c10d rendezvous store.

    torch's c10d backend *intends* to serve it when ``is_host`` is set in ``--rdzv-conf`` or
    the endpoint names this machine, but when several agents share that address the first to
    bind the port serves it and the others fall back to clients, each still matching the
    hostname. So, given the ``store`` the handler made (a ``TCPStore``), the fact decides:
    this process holds a listening socket on its port (psutil). The intent decides only
    where no such store is at hand or the sockets cannot be read; a file store has no server.
    """
    if params.backend != "c10d":
        return False
    if str(params.get("store_type", "tcp")).strip().lower() == "file":
        return False
    configured = params.get_as_bool("is_host")
    if configured is not None:
        return bool(configured)  # torch raises rather than fall back when it is configured
    port = getattr(store, "port", None)
    if isinstance(port, int):
        listens = listens_here(port)
        if listens is not None:
            return listens
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, _ = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    return insides.names_this_machine(host)


def listens_here(port: int) -> bool | None:
    """Whether this process holds a listening TCP socket on ``port`` (the TCPStore server
    runs in a thread of the process that bound it); None where the sockets cannot be read."""
    import psutil

    proc = psutil.Process()
    connections = getattr(proc, "net_connections", None) or proc.connections
    try:
        sockets = connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in sockets)


def install_guard(launch_config: Any, guard: ExclusionGuard) -> bool:
    """Route ``launch_config``'s rendezvous through the guard; False for static."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    if launch_config.rdzv_backend == "static":
        return False
    # The guard implements RendezvousHandler by delegation, deliberately not as a subclass
    rendezvous_handler_registry.register(
        GUARD_BACKEND, _create_guarded_handler)  # type: ignore[arg-type]
    launch_config.rdzv_configs[_INNER_BACKEND_KEY] = launch_config.rdzv_backend
    launch_config.rdzv_configs[_GUARD_KEY] = guard
    guard.min_nodes = launch_config.min_nodes
    guard.store_grace = STORE_GONE_GRACE_S + 2 * float(launch_config.monitor_interval)
    launch_config.rdzv_backend = GUARD_BACKEND
    return True
