"""A real Slurm cluster on one machine: slurmctld, munge and one slurmd per namespace host.

The Slurm files (nansentinel/files/slurm/) are only proven on a real Slurm: sbatch's directives,
srun's exit code, ``scontrol update ... state=drain`` with a user's rights, an Epilog run as
root, a time limit's SIGTERM. Debian's ``slurm-wlm`` 22.05 and ``munge`` run a whole cluster
here in seconds: one ``munged`` with its own key and socket, ``slurmctld`` on the bridge's own
address, and one ``slurmd -D -N nodeI`` in each host of a :class:`~tests.e2e.netns.NetnsCluster`
(entered with ``nsenter``, because ``ip netns exec`` mounts a /sys without cgroups and slurmd
22.05 will not start there). Everything is private: ports, state and spool folders, the
munge key and socket, and a ``slurm.conf`` that clients find through ``SLURM_CONF``; the
machine's own Slurm and munge configuration is never read or touched. Accounting is off, so
``MinJobAge`` keeps finished jobs visible to ``scontrol show job``.

Usage::

    with SlurmCluster(tmp, epilog=PATH) as slurm:
        job = slurm.sbatch(["--nodes=3", "script.sbatch"])
        info = slurm.wait_job(job, timeout=120)      # {'JobState': 'COMPLETED', ...}

Every wait is bounded; a daemon that does not come up raises :class:`SlurmError` with its log.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .netns import NetnsCluster
from .netns import unavailable_reason as netns_unavailable

#: Seconds for the daemons to come up and the nodes to register on a loaded 2-core machine.
START_TIMEOUT = 60.0
#: Seconds one Slurm client command may take.
CLIENT_TIMEOUT = 30.0
#: KillWait: seconds between a job's SIGTERM (time limit, scancel) and its SIGKILL.
KILL_WAIT_S = 20
_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
          "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


class SlurmError(RuntimeError):
    """A daemon did not start, or a client command failed; the message carries the output."""


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be built here, or None when it can."""
    reason = netns_unavailable()
    if reason:
        return reason
    for tool in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "nsenter"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"{tool!r} is not installed (Debian: apt-get install slurm-wlm munge)"
    return None


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """A 3-node (by default) Slurm on namespace hosts; a context manager that always cleans up.

    Args:
        workdir: private folder for the key, state, spool, logs and slurm.conf.
        n: number of compute nodes (``node1``..``nodeN``).
        epilog: the ``Epilog=`` program (run as root by each slurmd at a job's end), or None.
        cpus: CPUs each node declares (jobs asking for more pend).
    """

    def __init__(self, workdir: str | os.PathLike[str], n: int = 3, *,
                 epilog: str | os.PathLike[str] | None = None, cpus: int = 2) -> None:
        self.workdir = Path(workdir)
        self.n = n
        self.epilog = None if epilog is None else Path(epilog)
        self.cpus = cpus
        self.net = NetnsCluster(n, self.workdir / "net")
        self.conf = self.workdir / "slurm.conf"
        self.munge_socket = self.workdir / "munge" / "munge.socket"
        self._daemons: list[subprocess.Popen[bytes]] = []
        self._slurmd: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Path] = []
        self.env: dict[str, str] = {}
        """What a Slurm client needs (``SLURM_CONF``): add it to a client's environment."""

    # -- lifetime ---------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def nodes(self) -> list[str]:
        return [h.name for h in self.net.hosts]

    @property
    def controller_address(self) -> str:
        return self.net.hosts[0].ip.rsplit(".", 1)[0] + ".1"

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.net.__enter__()
        subprocess.run(["ip", "addr", "add", f"{self.controller_address}/24", "dev",
                        self.net.bridge], check=True, capture_output=True, timeout=10)
        for sub in ("munge", "state", "log"):
            (self.workdir / sub).mkdir(mode=0o700, exist_ok=True)
        # slurmstepd writes the job's script here; a job of another user must read it.
        (self.workdir / "spool").mkdir(mode=0o755, exist_ok=True)
        key = self.workdir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._daemon(
            [_bin("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={self.workdir / 'munge' / 'munged.pid'}",
             f"--seed-file={self.workdir / 'munge' / 'seed'}",
             f"--log-file={self.workdir / 'log' / 'munged.log'}"], "munged-out")
        self._wait(lambda: self.munge_socket.exists(), "munged to open its socket", "munged")
        self.conf.write_text(self._slurm_conf())
        self.env = {"SLURM_CONF": str(self.conf)}
        self._daemon([_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld-out")
        self._wait(self._controller_answers, "slurmctld to answer", "slurmctld")
        for host in self.net.hosts:
            log = self.workdir / "log" / f"slurmd-{host.name}-out.log"
            self._logs.append(log)
            self._slurmd[host.name] = self.net.start(
                host, [_bin("slurmd"), "-D", "-N", host.name, "-f", str(self.conf)],
                env=self.env, log_name=f"slurmd-{host.name}", keep_sys=True)
        self._wait(lambda: self.idle_nodes() == set(self.nodes), "every node to be idle",
                   "slurmd-node1")

    def close(self) -> None:
        """Stop the slurmds (and whatever runs in their hosts), slurmctld and munged;
        remove the namespaces and the bridge. Idempotent."""
        self.net.close()  # slurmd, slurmstepd and every job process live in its namespaces
        for proc in reversed(self._daemons):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._daemons:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        self._daemons.clear()

    # -- clients ----------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = True,
            timeout: float = CLIENT_TIMEOUT) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client (``sbatch``, ``scontrol``...) against this cluster."""
        done = subprocess.run(list(argv), env={**os.environ, **(env or {}), **self.env},
                              capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} exited {done.returncode}: "
                             f"{done.stdout}{done.stderr}")
        return done

    def sbatch(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> str:
        """Submit a batch job; returns its id."""
        out = self.run(["sbatch", "--parsable", *argv], env=env).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (``JobState``, ``ExitCode``, ``NodeList``...)."""
        text = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait until the job is over; returns its final ``scontrol show job``.

        Raises :class:`SlurmError` (with the job's record) when it is still running after
        ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            state = info.get("JobState", "")
            # COMPLETING: the epilog may still be running; wait for the end of it.
            if state in _FINAL:
                return info
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} still {state} after {timeout:.0f} s: {info}")
            time.sleep(0.5)

    def node(self, name: str) -> dict[str, str]:
        """``scontrol show node`` as a dict (``State``, ``Reason``...); the reason, which
        holds spaces, whole."""
        text = self.run(["scontrol", "show", "node", "-o", name]).stdout
        info = dict(re.findall(r"(\w+)=(\S*)", text))
        reason = re.search(r"Reason=(.*?) \[[^\]]*\]\s*(?:\w+=|$)", text)
        if reason:
            info["Reason"] = reason.group(1)
        return info

    def drain_reasons(self) -> dict[str, str]:
        """``sinfo -R``: node -> reason, for every drained or down node."""
        out = self.run(["sinfo", "-R", "-h", "-N", "-o", "%N|%E"]).stdout
        return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)

    def idle_nodes(self) -> set[str]:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
        return {name for name, state in (line.split() for line in out.splitlines()
                                         if len(line.split()) == 2) if state == "idle"}

    def resume(self, *nodes: str) -> None:
        """Bring drained nodes back (``scontrol update ... state=resume``) and wait until
        every node is idle (no job's processes left on it)."""
        for node in nodes:
            self.run(["scontrol", "update", f"nodename={node}", "state=resume"])
        self._wait(lambda: self.idle_nodes() == set(self.nodes), "every node to be idle",
                   "slurmctld")

    def strays(self) -> dict[str, list[str]]:
        """Processes left in each node's namespace besides its slurmd: node -> command lines
        (nothing of a finished job may be among them)."""
        found: dict[str, list[str]] = {}
        for host in self.net.hosts:
            for cmd in self.processes(host.name).values():
                found.setdefault(host.name, []).append(cmd)
        return found

    def processes(self, node: str) -> dict[int, str]:
        """The processes in ``node``'s namespace besides its slurmd: pid -> command line."""
        host = next(h for h in self.net.hosts if h.name == node)
        found = {}
        pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True,
                              text=True, timeout=10, check=False).stdout.split()
        for pid in map(int, pids):
            if pid == self._slurmd[host.name].pid:
                continue
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                found[pid] = cmd.decode(errors="replace")
        return found

    def log(self, name: str) -> str:
        """A daemon's log (``slurmctld``, ``slurmd-node2``, ``munged``)."""
        for path in (self.workdir / "log" / f"{name}.log", self.net.workdir / f"{name}.log",
                     self.workdir / "log" / f"{name}-out.log"):
            if path.exists():
                return path.read_text(errors="replace")
        return ""

    # -- internals --------------------------------------------------------------------

    def _slurm_conf(self) -> str:
        log = self.workdir / "log"
        port = _free_port(self.controller_address)
        lines = [
            f"ClusterName=ns{self.net.suffix}",
            f"SlurmctldHost={socket.gethostname()}({self.controller_address})",
            f"SlurmctldPort={port}",
            # Each slurmd is alone in its namespace: one port number serves them all.
            f"SlurmdPort={port + 1 if port < 65000 else port - 1}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.workdir / 'state'}",
            f"SlurmdSpoolDir={self.workdir / 'spool'}/%n",
            f"SlurmctldPidFile={self.workdir / 'state' / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.workdir / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={log / 'slurmctld.log'}",
            f"SlurmdLogFile={log}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "MinJobAge=3600",
            f"KillWait={KILL_WAIT_S}",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "GresTypes=gpu",
        ]
        if self.epilog is not None:
            lines.append(f"Epilog={self.epilog}")
        for host in self.net.hosts:
            lines.append(f"NodeName={host.name} NodeAddr={host.ip} CPUs={self.cpus} "
                         "RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _daemon(self, argv: Sequence[str], log_name: str) -> None:
        log = self.workdir / "log" / f"{log_name}.log"
        self._logs.append(log)
        with open(log, "wb") as out:
            self._daemons.append(subprocess.Popen(
                list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env}, start_new_session=True))

    def _controller_answers(self) -> bool:
        return self.run(["scontrol", "ping"], check=False, timeout=10).returncode == 0

    def _wait(self, ready: object, what: str, log: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():  # type: ignore[operator]
            for proc in self._daemons:
                if proc.poll() is not None:
                    raise SlurmError(f"{proc.args!r} exited {proc.returncode} while waiting for "
                                     f"{what}:\n{self._tail()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"waited {START_TIMEOUT:.0f} s for {what}:\n{self._tail()}")
            time.sleep(0.3)

    def _tail(self) -> str:
        parts = []
        for name in ("munged", "slurmctld", *(f"slurmd-{n}" for n in self.nodes)):
            text = self.log(name)
            if text:
                parts.append(f"--- {name}\n{text[-1500:]}")
        return "\n".join(parts)
