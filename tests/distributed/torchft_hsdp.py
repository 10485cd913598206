"""torchft replica groups of several ranks each, every rank its own (spawned) process, as
torchtitan's fault-tolerant mode builds them: inside a group FSDP2 shards the model over the
group's own gloo process group and reduce-scatters; across the groups each FSDP module's
all-reduce hook averages its shard through torchft's ``ManagedProcessGroup`` (torchft's FSDP2
recipe). A lighthouse runs in the test's process; each group has its own TCPStore there.

With ``rejoin``, group 1 comes back after it left, as its launcher would restart it, but in
the same two processes (a launch costs more than the rest of the test): a new model with
other initial weights, a new manager (a new replica to the lighthouse) over a store of its
own and a new sentinel, on node1r0 and on a healthy host in place of the struck-out node1r1
(its start there, tried first, must be refused on both ranks, node1r0's too); it heals every
rank's own shards from group 0 at its first quorum and trains on beside it until both stop
at the same torchft step.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue as queue_module
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

#: Steps every group runs unless it leaves (group 0 trains on after group 1 left).
STEPS = 7
#: Where a NaN is made by default: group 1's rank 1, at torchft step 3.
NAN_AT = (1, 1, 3)
#: Steps the group that rejoined trains beside group 0 after its first (healing) step.
AFTER_HEAL = 3
#: The healthy host the rejoining group 1 runs its rank 1 on (node1r1 is struck out).
NEW_HOST = "node3r1"
#: Seconds the rejoin may take, from the first group 1's end to the last step together.
REJOIN_S = 60.0


def _local(p: Any) -> Any:
    """This rank's shard of a parameter (FSDP2), or the parameter (DDP)."""
    return p.to_local() if hasattr(p, "to_local") else p


def _shard(module: Any, mesh: Any, manager: Any) -> Any:
    """FSDP2 over the group's ranks, the groups averaged through torchft's managed group."""
    from torch.distributed.fsdp import fully_shard

    for layer in module:
        if isinstance(layer, __import__("torch").nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return _hook(module, manager)


def _hook(module: Any, manager: Any) -> Any:
    """Every FSDP module's all-reduce hook averages its shard through ``manager``'s group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchft.process_group import ManagedProcessGroup

    replicate = ManagedProcessGroup(manager)

    def across_groups(output: Any) -> None:
        dist.all_reduce(output, group=replicate, op=dist.ReduceOp.AVG)

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(across_groups)
    return module


def rank_main(address: str, ports: list[int], gid: int, grank: int, tmp: str, layout: str,
              sentinel: dict[Any, Any] | None, queue: Any, target: Any = None) -> None:
    """One rank of replica group ``gid`` (``layout``: "fsdp2", or "ddp": nansentinel's torchft
    DDP, the group's ranks sharing the sentinel's exchange only): STEPS steps (fewer where it
    leaves); what every step decided, the error it ended with, whether its weights stayed
    finite and what it served a healing peer go to ``queue``. ``sentinel``: its keywords for
    every group ("all") and per group, and ``nan_at`` (group, rank, torchft step): that rank's
    batch goes NaN there; None: no sentinel (the same fault). ``target`` (a rejoin, a shared
    int): once group 1 has left, its ranks come back in this process as a restarted group
    would (a second record); group 0 and they stop at the torchft step it holds, which they
    set after their first step."""
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.device_mesh import DeviceMesh
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    import nansentinel.torchft as nft
    from nansentinel.config import ConfigError
    from nansentinel.result import HostExcludedError, SentinelUsageError

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    store = TCPStore("localhost", ports[gid], is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=PrefixStore("group", store), rank=grank,
                            world_size=2, timeout=timedelta(seconds=30))
    keywords = ({**sentinel.get(gid, {}), **sentinel.get("all", {})}
                if sentinel is not None else {})
    nan_at = (sentinel or {}).get("nan_at", NAN_AT)
    # Each rank serves and heals its own shards, from the sharded parameters taken once
    # after fully_shard: torchft serves a healing peer from its quorum thread while this
    # rank's forward runs, when FSDP2 has the unsharded parameters in the module.
    shards: dict[str, Any] = {}
    served: list[tuple[int, bool]] = []
    managers: list[Any] = []  # the one in use last

    def local_state() -> dict[str, Any]:
        state = {n: _local(p).detach().clone() for n, p in shards.items()}
        served.append((managers[-1].current_step(), all(
            bool(torch.isfinite(t).all()) for t in state.values())))
        return state

    def heal(state: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, p in shards.items():
                _local(p).copy_(state[n])

    def new_manager(port: int) -> Any:
        managers.append(Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=15)), min_replica_size=1,
            load_state_dict=heal, state_dict=local_state,
            replica_id=f"g{gid}", store_addr="localhost", store_port=port, rank=grank,
            world_size=2, lighthouse_addr=address, timeout=timedelta(seconds=15),
            quorum_timeout=timedelta(seconds=20), connect_timeout=timedelta(seconds=10)))
        return managers[-1]

    def incarnation(back: bool) -> dict[str, Any]:
        """This rank's group as started (``back``: started again, as its launcher would,
        with a store of its own, other initial weights and, for rank 1, on a healthy host
        after the struck-out one was refused), trained to its end; its record."""
        out: dict[str, Any] = {"gid": gid, "rank": grank, "back": back, "steps": [],
                               "error": None, "finite": True}
        served.clear()
        mine = len(managers)
        port = ports[2] if back else ports[gid]
        # Started first with rank 1 on the struck-out host (FSDP2): refused on both ranks
        # before the group joins, the managers of that try over a store of their own.
        tried = back and bool(keywords.get("exclusion_file")) and layout == "fsdp2"
        torch.manual_seed(7 if back else 0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                     torch.nn.Linear(8, 2))
        out["initial"] = [p.detach().tolist() for p in module.parameters()]
        manager = new_manager(ports[3] if tried else port)
        guard = None
        try:
            model = (_shard(module, DeviceMesh("cpu", [0, 1]), manager) if layout == "fsdp2"
                     else nft.DistributedDataParallel(manager, module))
            shards.clear()
            shards.update(module.named_parameters())
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            host = NEW_HOST if back and grank == 1 else f"node{gid}r{grank}"
            if tried:
                # Every rank of the group refuses, node1r0's too (one all-gather inside the
                # group at construction); then on healthy hosts (the hooks on a new manager).
                try:
                    nft.Sentinel(model, opt, manager=manager,
                                 hostname="node1r1" if grank == 1 else host,
                                 metrics_port=0, report_dir=f"{tmp}/reports", **keywords)
                except HostExcludedError as exc:
                    out["refused"] = str(exc)
                else:
                    raise AssertionError("group 1 was let in with a rank on node1r1")
                manager = new_manager(port)
                _hook(module, manager)
            if layout == "fsdp2" and keywords and not back:
                # What FSDP2 groups cannot do is refused at construction, on every rank.
                def refusal(**extra: Any) -> str:
                    try:
                        nft.Sentinel(model, opt, manager=manager, hostname=host,
                                     metrics_port=0, report_dir=f"{tmp}/reports",
                                     **{**keywords, **extra})
                    except (ConfigError, SentinelUsageError) as exc:
                        return f"{type(exc).__name__}: {exc}"
                    raise AssertionError(f"nansentinel.torchft.Sentinel took {extra} on FSDP2")

                model[0].set_all_reduce_hook(None)  # a hook on some FSDP modules only
                out["refusals"] = [refusal()]
                _hook(module, manager)
                out["refusals"].append(refusal(policy="drop"))  # the hooks left as they were
            own = {"manager": manager} if layout == "fsdp2" else {}
            guard = (nft.Sentinel(model, opt, **own, hostname=host, metrics_port=0,
                                  report_dir=f"{tmp}/reports", **keywords)
                     if sentinel is not None else None)
            # Whether the health row leaves with the gradients (no round trip of its own).
            out["riding"] = guard is not None and nft.groups_of(guard).riding
            generator = torch.Generator().manual_seed(100 * gid + grank + 10 * back)
            deadline = time.monotonic() + REJOIN_S
            done = 0
            while True:
                if target is None or (gid == 1 and not back):
                    if done >= STEPS:
                        break
                elif target.value >= 0 and manager.current_step() >= target.value:
                    if done >= STEPS or back:
                        break
                elif done >= STEPS:  # group 0 waits for the group that comes back
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"group 1 did not come back and train "
                                           f"{AFTER_HEAL} steps beside group 0 in {REJOIN_S} s")
                    if target.value < 0:
                        time.sleep(0.02)
                opt.zero_grad()
                manager.start_quorum()
                step = manager.current_step()
                x = torch.randn(8, 4, generator=generator)
                if nan_at == (gid, grank, step) and not back:
                    x[0, 0] = float("nan")
                if guard is not None:
                    guard.check_batch(x)
                loss = model(x).pow(2).mean()
                if guard is not None:
                    guard.check_loss(loss)
                loss.backward()
                if guard is None:
                    out["steps"].append((step, bool(manager.should_commit()), []))
                    if out["steps"][-1][1]:
                        opt.step()
                else:
                    r = guard.step()
                    out["steps"].append((r.torchft_step, r.committed, [
                        (p.group, p.rank, p.host, p.leaving) for p in r.poisoned]))
                    if any(p.leaving and p.group == f"g{gid}" for p in r.poisoned):
                        break  # the group's launcher stops its other ranks when one leaves
                done += 1
                if back and target.value < 0:  # its first step, where it healed
                    target.value = out["steps"][0][0] + 1 + AFTER_HEAL
                out["finite"] &= all(bool(torch.isfinite(_local(p)).all())
                                     for p in model.parameters())
            if guard is not None:
                guard.close()
        except BaseException as exc:  # read by the test
            out["error"] = (type(exc).__name__, str(exc))
            out["trace"] = traceback.format_exc()
            if guard is not None:
                guard.abandon()
            result = getattr(exc, "result", None)
            if result is not None and hasattr(result, "torchft_step"):
                out["steps"].append((result.torchft_step, result.committed, [
                    (p.group, p.rank, p.host, p.leaving) for p in result.poisoned]))
        finally:
            out["finite"] &= all(bool(torch.isfinite(_local(p)).all())
                                 for p in module.parameters())
            out["weights"] = [_local(p).detach().tolist() for p in module.parameters()]
            out["served"] = list(served)
            for m in managers[mine:]:
                m.shutdown(wait=False)
        return out

    queue.put(incarnation(back=False))
    if target is not None and gid == 1:
        queue.put(incarnation(back=True))


def run(tmp: Path, layout: str, sentinel: dict[Any, Any] | None, timeout: float = 100,
        rejoin: bool = False) -> dict[Any, dict[str, Any]]:
    """Two replica groups of two ranks (four processes) and a lighthouse; each rank's record,
    keyed (group, rank). ``rejoin``: once group 1 has left, its processes bring it back (their
    second records keyed ("back", rank)); group 0 trains on until they have trained
    AFTER_HEAL steps beside it after their first."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    house = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000,
                             heartbeat_timeout_ms=500)
    stores = [TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
              for _ in range(4 if rejoin else 2)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = [s.port for s in stores]
    target = ctx.Value("i", -1) if rejoin else None
    procs = [ctx.Process(target=rank_main, daemon=True, args=(
        house.address(), ports, g, r, str(tmp), layout, sentinel, queue, target))
        for g in (0, 1) for r in (0, 1)]
    keys: list[Any] = [(g, r) for g in (0, 1) for r in (0, 1)]
    keys += [("back", r) for r in (0, 1)] if rejoin else []
    try:
        for p in procs:
            p.start()
        records: dict[Any, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(records) < len(keys):
            try:
                o = queue.get(timeout=1)
                records[("back", o["rank"]) if o["back"] else (o["gid"], o["rank"])] = o
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a rank died without a record (exit codes {dead})"
                missing = [k for k in keys if k not in records]
                ended = [(k, o["error"], o["steps"][-1:]) for k, o in records.items()]
                assert time.monotonic() < deadline, (
                    f"{layout}, sentinel {sentinel is not None}: ranks {missing} hung; the "
                    f"others ended with {ended}")
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        house.shutdown()
    return records
