"""A few "hosts" on one machine: network namespaces joined by a bridge.

Multi-node behaviour (c10d rendezvous across hosts, gloo over a real interface, one host
leaving the job) cannot be tested with processes that share one network stack and one
hostname. This harness gives each host its own namespace, interface ``eth0``, address on a
private /24, hostname (a UTS namespace) and an ``/etc/hosts`` that maps every host name to its
address (a bind mount in a private mount namespace), because torchrun's c10d rendezvous
hands out host *names*. Traffic never leaves the bridge; the machine's own network is not
touched.

Usage::

    with NetnsCluster(3, workdir=tmp_path) as cluster:
        procs = [cluster.start(h, [sys.executable, "-m", "..."]) for h in cluster.hosts]
        codes = cluster.wait(procs, timeout=60)

Every name (bridge, namespaces, veths) carries a random suffix, so concurrent runs do not
collide, and everything is torn down in ``__exit__`` even when the test fails: processes are
killed by process group and by namespace, then the namespaces and the bridge are deleted.
Needs root and iproute2 (``ip``) and util-linux (``unshare``); :func:`unavailable_reason`
says why not, for a clear skip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

_IP_TIMEOUT_S = 10
# Runs inside the host's namespaces: give it its /etc/hosts and hostname, then exec argv.
_ENTER = 'mount --bind "$HOSTS_FILE" /etc/hosts && hostname "$HOST_NAME" && exec "$@"'


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be built here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed"
    probe = f"nsprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          timeout=_IP_TIMEOUT_S, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_IP_TIMEOUT_S,
                   check=False)
    return None


@dataclasses.dataclass(frozen=True)
class Host:
    """One namespace host."""

    name: str
    """Hostname inside the namespace (``node1``...), resolvable by every host."""
    ip: str
    """Address of its ``eth0``."""
    netns: str
    """Name of its network namespace."""


class NetnsCluster:
    """``n`` hosts on a private bridge; a context manager that always cleans up.

    Args:
        n: number of hosts.
        workdir: where the shared hosts file and the per-process logs go.
        names: host names (default ``node1``..``nodeN``).
    """

    def __init__(self, n: int, workdir: str | os.PathLike[str],
                 names: Sequence[str] | None = None) -> None:
        if names is not None and len(names) != n:
            raise ValueError(f"{len(names)} names for {n} hosts")
        self.workdir = Path(workdir)
        self.suffix = secrets.token_hex(3)
        self.bridge = f"nsb{self.suffix}"
        subnet = random.randrange(0, 256)
        names = list(names) if names is not None else [f"node{i}" for i in range(1, n + 1)]
        self.hosts = [
            Host(name, f"10.231.{subnet}.{10 + i}", f"nsn{self.suffix}{i}")
            for i, name in enumerate(names, start=1)
        ]
        self.hosts_file = self.workdir / "hosts"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._made_netns: list[str] = []
        self._made_bridge = False

    def __enter__(self) -> NetnsCluster:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def host(self, name: str) -> Host:
        """The host called ``name``."""
        return next(h for h in self.hosts if h.name == name)

    def start(self, host: Host, argv: Sequence[str], env: Mapping[str, str] | None = None,
              log_name: str | None = None, *, keep_sys: bool = False) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` (stdout and stderr to ``workdir/<log_name>.log``).

        The process inherits this process's environment plus ``env``; it runs in its own
        process group so that :meth:`close` can stop it and all its children. ``keep_sys``
        enters the namespace with ``nsenter`` instead of ``ip netns exec``, which mounts a
        fresh /sys without the cgroup hierarchy (slurmd will not start there).
        """
        enter = (["nsenter", f"--net=/run/netns/{host.netns}"] if keep_sys
                 else ["ip", "netns", "exec", host.netns])
        full_env = {**os.environ, **(env or {}),
                    "HOSTS_FILE": str(self.hosts_file), "HOST_NAME": host.name}
        log = open(self.workdir / f"{log_name or host.name}.log", "wb")  # noqa: SIM115
        self._logs.append(log)
        proc = subprocess.Popen(
            [*enter, "unshare", "--uts", "--mount", "sh", "-c", _ENTER, "sh", *argv],
            env=full_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def wait(self, procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> list[int | None]:
        """Exit codes of ``procs``; None for any still running after ``timeout`` seconds
        in total (those are left for :meth:`close` to kill)."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def pids(self, host: Host) -> list[int]:
        """Every process still living in ``host``'s network namespace."""
        return [int(p) for p in _ip("netns", "pids", host.netns, check=False).stdout.split()]

    def cut(self, host: Host) -> None:
        """Take ``host``'s link to the bridge down: a partition. Its sockets stay open and
        nothing is reset; packets just stop, as when a switch port dies."""
        _ip("link", "set", self.veth(host), "down")

    def veth(self, host: Host) -> str:
        """The bridge-side end of ``host``'s link."""
        return f"nsv{self.suffix}{self.hosts.index(host) + 1}"

    def log(self, name: str) -> str:
        """The output of the process started with ``log_name`` (or on host) ``name``."""
        for log in self._logs:
            log.flush()
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        """Kill what we started, delete the namespaces and the bridge. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        for netns in self._made_netns:
            # Anything still living in a namespace we made is ours (e.g. a worker that
            # escaped its process group).
            pids = _ip("netns", "pids", netns, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", netns, check=False)
        self._made_netns.clear()
        if self._made_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._made_bridge = False
        for log in self._logs:
            log.close()
        self._logs.clear()
        self._procs.clear()

    def _build(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{h.ip} {h.name}\n" for h in self.hosts)
        )
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            veth = self.veth(host)
            _ip("netns", "add", host.netns)
            self._made_netns.append(host.netns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True,
                          timeout=_IP_TIMEOUT_S, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
