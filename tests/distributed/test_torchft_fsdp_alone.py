"""torchft's FSDP2 recipe with one rank a replica group (torchtitan's fault-tolerant mode at
``data_parallel_shard_degree=1``): FSDP2 reduce-scatters nothing on a shard group of one, so
the only place this rank's gradients can be checked before they leave the group is the
all-reduce hook (engines/torchft.AllReduceHookRider). A NaN made inside one group's backward
(batch and loss finite) must be vetoed on every group and blamed on that group alone: checked
after the hooks, every group would find the averaged NaN in its own gradients and strike its
own, healthy, host.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import time
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torchft")

pytestmark = pytest.mark.timeout(120)

#: Group 1 makes its gradients NaN at torchft step NAN_STEP; both groups stop once it is
#: decided (both are in every quorum: the lighthouse waits for two, so no group trains alone).
NAN_STEP = 2


def _group(address: str, gid: int, tmp: str, queue: Any) -> None:
    """One replica group of one rank: its steps up to NAN_STEP; what each decided, or its
    error."""
    import logging

    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchft.manager import Manager
    from torchft.process_group import ManagedProcessGroup, ProcessGroupGloo

    import nansentinel.torchft as nft

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"gid": gid, "steps": [], "error": None}
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = None
    try:
        dist.init_process_group("gloo", store=PrefixStore("group", store), rank=0,
                                world_size=1)
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=15)), min_replica_size=2,
            load_state_dict=module.load_state_dict, state_dict=module.state_dict,
            replica_id=f"g{gid}", store_addr="localhost", store_port=store.port, rank=0,
            world_size=1, lighthouse_addr=address, timeout=timedelta(seconds=15),
            quorum_timeout=timedelta(seconds=30))
        mesh = DeviceMesh("cpu", [0])
        for layer in module:
            fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        across = ManagedProcessGroup(manager)
        for m in module.modules():
            if isinstance(m, FSDPModule):
                m.set_all_reduce_hook(
                    lambda o: dist.all_reduce(o, group=across, op=dist.ReduceOp.AVG))
        opt = torch.optim.SGD(module.parameters(), lr=0.05)
        guard = nft.Sentinel(module, opt, manager=manager, hostname=f"node{gid}",
                             host_strikes=1, metrics_port=0, report_dir=f"{tmp}/reports")
        out["riding"] = nft.groups_of(guard).riding
        generator = torch.Generator().manual_seed(gid)
        while not out["steps"] or out["steps"][-1][0] < NAN_STEP:
            opt.zero_grad()
            manager.start_quorum()
            step = manager.current_step()
            x = guard.check_batch(torch.randn(8, 4, generator=generator))
            hidden = module[0](x)
            if gid == 1 and step == NAN_STEP:  # the loss stays finite, the backward makes NaN
                hidden.register_hook(lambda g: g * float("nan"))
            loss = module[1](hidden).pow(2).mean()
            guard.check_loss(loss)
            loss.backward()
            r = guard.step()
            out["steps"].append((r.torchft_step, r.committed,
                                 [(p.group, p.host, p.leaving) for p in r.poisoned]))
        out["finite"] = all(bool(torch.isfinite(p.to_local()).all())
                            for p in module.parameters())
        guard.close()
    except Exception as exc:  # read by the test
        out["error"] = (type(exc).__name__, str(exc))
        result = getattr(exc, "result", None)
        if result is not None and hasattr(result, "torchft_step"):
            out["steps"].append((result.torchft_step, result.committed,
                                 [(p.group, p.host, p.leaving) for p in result.poisoned]))
    finally:
        if manager is not None:
            manager.shutdown(wait=False)
    queue.put(out)


def test_a_nan_made_in_one_groups_backward_is_blamed_on_that_group_alone(tmp_path) -> None:
    from torchft._torchft import LighthouseServer

    house = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=5000,
                             heartbeat_timeout_ms=500)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_group, daemon=True,
                         args=(house.address(), g, str(tmp_path), queue)) for g in (0, 1)]
    records: dict[int, dict[str, Any]] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 100
        while len(records) < len(procs):
            try:
                out = queue.get(timeout=1)
                records[out["gid"]] = out
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not dead, f"a group died without a record (exit codes {dead})"
                assert time.monotonic() < deadline, f"groups hung; records so far {records}"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        house.shutdown()
    healthy, culprit = records[0], records[1]
    assert healthy["riding"] and culprit["riding"], records
    # The healthy group is never struck: every step but the poisoned one committed, that one
    # vetoed and blamed on g1's host alone, its weights finite.
    assert healthy["error"] is None, records
    assert healthy["finite"], records
    assert [s[:2] for s in healthy["steps"]] == [
        (s, s != NAN_STEP) for s in range(NAN_STEP + 1)], healthy["steps"]
    vetoed = healthy["steps"][-1:]
    assert vetoed[0][2] == [("g1", "node1", True)], healthy["steps"]
    # The culprit's host is struck (host_strikes=1) and its group leaves at that same step.
    assert culprit["error"] is not None and culprit["error"][0] == "HostExcludedError", records
    assert culprit["steps"][-1] == vetoed[0], culprit["steps"]
    assert "node0" not in culprit["error"][1], culprit["error"]
