"""torchft replica groups of several ranks each, every rank its own (spawned) process, as
torchtitan's fault-tolerant mode builds them: inside a group FSDP2 shards the model over the
group's own gloo process group and reduce-scatters; across the groups each FSDP module's
all-reduce hook averages its shard through torchft's ``ManagedProcessGroup`` (torchft's FSDP2
recipe). A lighthouse runs in the test's process; each group has its own TCPStore there.
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


def _local(p: Any) -> Any:
    """This rank's shard of a parameter (FSDP2), or the parameter (DDP)."""
    return p.to_local() if hasattr(p, "to_local") else p


def _shard(module: Any, mesh: Any, manager: Any) -> Any:
    """FSDP2 over the group's ranks, the groups averaged through torchft's managed group."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchft.process_group import ManagedProcessGroup

    for layer in module:
        if isinstance(layer, __import__("torch").nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    replicate = ManagedProcessGroup(manager)

    def across_groups(output: Any) -> None:
        dist.all_reduce(output, group=replicate, op=dist.ReduceOp.AVG)

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(across_groups)
    return module


def rank_main(address: str, ports: list[int], gid: int, grank: int, tmp: str, layout: str,
              sentinel: dict[Any, Any] | None, queue: Any) -> None:
    """One rank of replica group ``gid`` (``layout``: "fsdp2", or "ddp": nansentinel's torchft
    DDP, the group's ranks sharing the sentinel's exchange only): STEPS steps (fewer where it
    leaves); what every step decided, the error it ended with, and whether its weights stayed
    finite go to ``queue``. ``sentinel``: its keywords for every group ("all") and per group,
    and ``nan_at`` (group, rank, torchft step): that rank's batch goes NaN there; None: no
    sentinel (the same fault)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.device_mesh import DeviceMesh
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    import nansentinel.torchft as nft

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"gid": gid, "rank": grank, "steps": [], "error": None,
                           "finite": True}
    store = TCPStore("localhost", ports[gid], is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=PrefixStore("group", store), rank=grank,
                            world_size=2, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def local_state() -> dict[str, Any]:  # each rank serves and heals its own shards
        return {n: _local(p).detach().clone() for n, p in module.named_parameters()}

    def heal(state: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, p in module.named_parameters():
                _local(p).copy_(state[n])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=15)), min_replica_size=1,
        load_state_dict=heal, state_dict=local_state,
        replica_id=f"g{gid}", store_addr="localhost", store_port=ports[gid], rank=grank,
        world_size=2, lighthouse_addr=address, timeout=timedelta(seconds=15),
        quorum_timeout=timedelta(seconds=20), connect_timeout=timedelta(seconds=10))
    try:
        model = (_shard(module, DeviceMesh("cpu", [0, 1]), manager) if layout == "fsdp2"
                 else nft.DistributedDataParallel(manager, module))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        own = {"manager": manager} if layout == "fsdp2" else {}
        guard = (nft.Sentinel(model, opt, **own, hostname=f"node{gid}r{grank}",
                              metrics_port=0, report_dir=f"{tmp}/reports",
                              **sentinel.get(gid, {}), **sentinel.get("all", {}))
                 if sentinel is not None else None)
        nan_at = (sentinel or {}).get("nan_at", NAN_AT)
        # Whether the health row leaves with the gradients (no round trip of its own).
        out["riding"] = guard is not None and nft.groups_of(guard).riding
        generator = torch.Generator().manual_seed(100 * gid + grank)
        for _ in range(STEPS):
            opt.zero_grad()
            manager.start_quorum()
            step = manager.current_step()
            x = torch.randn(8, 4, generator=generator)
            if nan_at == (gid, grank, step):
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
            out["finite"] &= all(bool(torch.isfinite(_local(p)).all())
                                 for p in model.parameters())
        if guard is not None:
            guard.close()
    except BaseException as exc:  # read by the test
        out["error"] = (type(exc).__name__, str(exc))
        if not isinstance(exc, Exception):
            out["trace"] = traceback.format_exc()
        result = getattr(exc, "result", None)
        if result is not None and hasattr(result, "torchft_step"):
            out["steps"].append((result.torchft_step, result.committed, [
                (p.group, p.rank, p.host, p.leaving) for p in result.poisoned]))
    finally:
        out["finite"] &= all(bool(torch.isfinite(_local(p)).all())
                             for p in module.parameters())
        out["weights"] = [_local(p).detach().tolist() for p in module.parameters()]
        manager.shutdown(wait=False)
    queue.put(out)


def run(tmp: Path, layout: str, sentinel: dict[Any, Any] | None, timeout: float = 100
        ) -> dict[tuple[int, int], dict[str, Any]]:
    """Two replica groups of two ranks (four processes) and a lighthouse; each rank's record,
    keyed (group, rank)."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    house = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000,
                             heartbeat_timeout_ms=500)
    stores = [TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
              for _ in range(2)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = [s.port for s in stores]
    procs = [ctx.Process(target=rank_main, daemon=True, args=(
        house.address(), ports, g, r, str(tmp), layout, sentinel, queue))
        for g in (0, 1) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        records: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(records) < len(procs):
            try:
                records.append(queue.get(timeout=1))
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a rank died without a record (exit codes {dead})"
                missing = sorted({(g, r) for g in (0, 1) for r in (0, 1)}
                                 - {(o["gid"], o["rank"]) for o in records})
                ended = [(o["gid"], o["rank"], o["error"], o["steps"][-1:]) for o in records]
                assert time.monotonic() < deadline, (
                    f"{layout}, sentinel {sentinel is not None}: ranks (group, rank) {missing} "
                    f"hung; the others ended with {ended}")
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        house.shutdown()
    return {(o["gid"], o["rank"]): o for o in records}
