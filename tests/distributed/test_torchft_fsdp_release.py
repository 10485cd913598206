"""What a sentinel leaves on an FSDP2 model when it is refused or closed, and how a replica
group with a rank on an excluded host refuses: real gloo ranks, a real torchft lighthouse.

One run of three processes (tests/distributed/harness.py): replica group g0 is two ranks
with a process group of their own, FSDP2 shard degree 2 and torchft's all-reduce hooks (the
layout torchtitan's fault-tolerant mode builds); g1 is one process on nansentinel's torchft
DDP. In order, on g0:

1. the core Sentinel on a plain FSDP2 model: closed, a second one watches the same modules and
   skips a NaN step, naming rank 1 (each module's reduce-scatter is FSDP's own again between);
2. ``policy="drop"`` refused under FSDP2 with the hooks: every hook is the same object after;
3. ``node0r1`` is in the exclusion file: both ranks of g0 refuse (the healthy rank too),
   naming the host and the file, the hooks untouched; then g1, which shares the file, trains
   on without a word;
4. g0 started again on healthy hosts: a construction refused after it wrapped the hooks (the
   exporter's port is taken) gives them back; a torchft sentinel closed gives back the user's
   hooks (the same objects) and FSDP's reduce-scatters, and a second one vetoes a NaN step.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torchft")

from tests.distributed.harness import run_ranks, values

pytestmark = pytest.mark.timeout(120)

EXCLUDED = "node0r1"


def _group_state(module: Any) -> tuple[list[Any], list[Any]]:
    """Every FSDP parameter group's all-reduce hook and reduce-scatter, as objects."""
    from torch.distributed.fsdp import FSDPModule

    from nansentinel.common import torch_insides as insides

    groups = [g for m in module.modules() if isinstance(m, FSDPModule)
              for g in insides.fsdp_param_groups(m)]
    return ([insides.fsdp_all_reduce_hook(g) for g in groups],
            [insides.fsdp_reduce_scatter(g) for g in groups])


def _same(before: tuple[list[Any], list[Any]], after: tuple[list[Any], list[Any]]) -> bool:
    return all(a is b for a, b in zip(before[0] + before[1], after[0] + after[1], strict=True))


def _fsdp(seed: int) -> Any:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    mesh = DeviceMesh("cpu", [0, 1])
    fully_shard(module[0], mesh=mesh)
    fully_shard(module[2], mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _hook(module: Any, manager: Any) -> None:
    """torchft's FSDP2 recipe: each FSDP module's shard averaged across the groups."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torchft.process_group import ManagedProcessGroup

    across = ManagedProcessGroup(manager)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(
                lambda o: dist.all_reduce(o, group=across, op=dist.ReduceOp.AVG))


def _manager(address: str, port: int, gid: int, grank: int, size: int) -> Any:
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=15)), min_replica_size=1,
        load_state_dict=lambda _: None, state_dict=dict, replica_id=f"g{gid}",
        store_addr="localhost", store_port=port, rank=grank, world_size=size,
        lighthouse_addr=address, timeout=timedelta(seconds=15),
        quorum_timeout=timedelta(seconds=20), connect_timeout=timedelta(seconds=10))


def _step(guard: Any, model: Any, manager: Any, poison: bool) -> Any:
    import torch

    model.zero_grad()
    if manager is not None:
        manager.start_quorum()
    x = torch.randn(8, 4)
    if poison:
        x[0, 0] = float("nan")
    guard.check_batch(x)
    loss = model(x).pow(2).mean()
    guard.check_loss(loss)
    loss.backward()
    return guard.step()


def _g0(grank: int, address: str, ports: list[int], exclusion: str, tmp: str,
        store: Any) -> dict[str, Any]:
    import torch

    import nansentinel
    import nansentinel.torchft as nft
    from nansentinel.config import ConfigError
    from nansentinel.effects.exporter import MetricsPortError
    from nansentinel.result import HostExcludedError, SentinelUsageError

    out: dict[str, Any] = {}
    common = {"metrics_port": 0, "report_dir": f"{tmp}/reports"}
    # 1. The core Sentinel on FSDP2: closed, then another on the same modules.
    module = _fsdp(0)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    bare = _group_state(module)
    guard = nansentinel.Sentinel(module, opt, hostname=f"node0r{grank}", **common)
    out["core_first"] = _step(guard, module, None, False).applied
    guard.close()
    out["core_released"] = _same(bare, _group_state(module))
    guard = nansentinel.Sentinel(module, opt, hostname=f"node0r{grank}", **common)
    result = _step(guard, module, None, grank == 1)
    out["core_second"] = (result.applied, result.bad_ranks, result.kinds)
    guard.close()
    out["core_finite"] = all(bool(torch.isfinite(p.to_local()).all())
                             for p in module.parameters())
    # 2-3. torchft's FSDP2 recipe; refused constructions leave the hooks as they were.
    module = _fsdp(1)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    manager = _manager(address, ports[0], 0, grank, 2)
    _hook(module, manager)
    hooked = _group_state(module)
    try:
        nft.Sentinel(module, opt, manager=manager, hostname=f"node0r{grank}", policy="drop",
                     **common)
    except ConfigError as exc:
        out["drop"] = str(exc)
    out["drop_untouched"] = _same(hooked, _group_state(module))
    try:  # rank 1 names a directory: refused there before the group's gather, and so on
        # rank 0 too, naming it (not left waiting, or paired with the next construction's)
        nft.Sentinel(module, opt, manager=manager, hostname=f"node0r{grank}",
                     exclusion_file=tmp if grank == 1 else exclusion, **common)
    except (ConfigError, SentinelUsageError) as exc:
        out["unread"] = f"{type(exc).__name__}: {exc}"
    try:
        let_in = nft.Sentinel(module, opt, manager=manager, hostname=f"node0r{grank}",
                              exclusion_file=exclusion, **common)
    except HostExcludedError as exc:
        out["excluded"] = (str(exc), exc.result.excluded_hosts, exc.result.bad_ranks)
    else:  # wrongly let in: left without a collective, so that the run goes on to say so
        let_in.abandon()
        manager.shutdown(wait=False)
    out["excluded_untouched"] = _same(hooked, _group_state(module))
    store.set(f"g0-refused-{grank}", "1")
    store.wait(["g1-done"], timedelta(seconds=60))
    # 4. Started again on healthy hosts (a manager over a store of its own, fresh hooks).
    manager = _manager(address, ports[1], 0, grank, 2)
    _hook(module, manager)
    hooked = _group_state(module)
    host = f"node0r{grank}" if grank == 0 else "node0r9"
    # Refused after the hooks were wrapped (the exporter's port is taken): given back.
    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    try:
        nft.Sentinel(module, opt, manager=manager, hostname=host, report_dir=f"{tmp}/reports",
                     metrics_port=busy.getsockname()[1] - grank)  # + LOCAL_RANK
    except MetricsPortError as exc:
        out["busy"] = str(exc)
    finally:
        busy.close()
    out["busy_untouched"] = _same(hooked, _group_state(module))
    guard = nft.Sentinel(module, opt, manager=manager, hostname=host,
                         exclusion_file=exclusion, **common)
    out["ft_wrapped"] = not any(a is b for a, b in zip(hooked[0], _group_state(module)[0],
                                                        strict=True))
    out["ft_first"] = _step(guard, module, manager, False).committed
    guard.close()
    out["ft_released"] = _same(hooked, _group_state(module))
    guard = nft.Sentinel(module, opt, manager=manager, hostname=host,
                         exclusion_file=exclusion, **common)
    result = _step(guard, module, manager, grank == 1)
    out["ft_second"] = (result.committed, [(p.group, p.rank, p.host) for p in result.poisoned])
    guard.close()
    out["ft_finite"] = all(bool(torch.isfinite(p.to_local()).all())
                           for p in module.parameters())
    manager.shutdown(wait=False)
    return out


def _g1(address: str, port: int, exclusion: str, tmp: str, store: Any) -> dict[str, Any]:
    """The other replica group (one process, no process group): it shares the exclusion file
    and starts once g0 was refused; it trains on."""
    import torch

    import nansentinel.torchft as nft

    store.wait(["g0-refused-0", "g0-refused-1"], timedelta(seconds=60))
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    manager = _manager(address, port, 1, 0, 1)
    try:
        model = nft.DistributedDataParallel(manager, module)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        guard = nft.Sentinel(model, opt, hostname="node1", exclusion_file=exclusion,
                             metrics_port=0, report_dir=f"{tmp}/reports")
        committed = []
        for _ in range(2):
            committed.append(_step(guard, model, manager, False).committed)
        guard.close()
    finally:
        manager.shutdown(wait=False)
        store.set("g1-done", "1")
    return {"committed": committed}


def _rank(rank: int, world: int, *, address: str, ports: list[int], exclusion: str,
          workdir: str) -> dict[str, Any]:
    """g0's ranks 0 and 1, g1 as rank 2: the harness's group of three is left for each
    replica group's own (g1: none)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    dist.destroy_process_group()
    torch.set_num_threads(1)
    control = TCPStore("localhost", ports[0], is_master=False, timeout=timedelta(seconds=30))
    sync = PrefixStore("test", control)
    if rank == 2:
        return _g1(address, ports[2], exclusion, workdir, sync)
    dist.init_process_group("gloo", store=PrefixStore("group", control), rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    return _g0(rank, address, ports, exclusion, workdir, sync)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore

    tmp = tmp_path_factory.mktemp("ft_release")
    exclusion = tmp / "excluded.jsonl"
    ExclusionStore(str(exclusion)).add(ExclusionRecord(
        host=EXCLUDED, reason="blamed 3 times within 100 steps", step=7, job_id="earlier"))
    house = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=3000,
                             heartbeat_timeout_ms=500)
    stores = [TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
              for _ in range(3)]
    try:
        return values(run_ranks(_rank, 3, tmp, timeout=100, address=house.address(),
                                ports=[s.port for s in stores], exclusion=str(exclusion),
                                workdir=str(tmp)))
    finally:
        house.shutdown()


def test_a_closed_fsdp2_sentinel_gives_the_modules_back_and_a_second_one_watches(
        ranks: list[dict[str, Any]]) -> None:
    """Core Sentinel and torchft's: close() puts back every reduce-scatter (and the user's
    all-reduce hooks), the same objects; a new sentinel on the same modules is not refused as
    "already watched" and catches a NaN on rank 1."""
    for out in ranks[:2]:
        assert out["core_first"] and out["core_released"], out
        assert out["core_second"] == (False, [1], ["batch", "loss", "grad"]), out
        assert out["core_finite"], out
        assert out["ft_wrapped"] and out["ft_first"] and out["ft_released"], out
        assert out["ft_second"] == (False, [("g0", 1, "node0r9")]), out
        assert out["ft_finite"], out


def test_a_refused_torchft_sentinel_leaves_the_all_reduce_hooks_as_they_were(
        ranks: list[dict[str, Any]]) -> None:
    for out in ranks[:2]:
        assert "policy='drop' is refused on torchft under FSDP2" in out.get("drop", ""), out
        assert out["drop_untouched"] and out["excluded_untouched"], out
        # Refused once the hooks were wrapped (the exporter's port taken): unwrapped again.
        assert "in use" in out.get("busy", ""), out
        assert out["busy_untouched"], out


def test_every_rank_of_a_group_with_a_rank_on_an_excluded_host_refuses(
        ranks: list[dict[str, Any]]) -> None:
    """Both ranks of g0 raise HostExcludedError naming node0r1 (rank 1) and the file, the
    healthy rank 0 saying it leaves with its group; g1, sharing the file, trains on."""
    for grank, out in enumerate(ranks[:2]):
        assert "excluded" in out, f"g0's rank {grank} on a healthy host was let in"
        message, hosts, bad = out["excluded"]
        assert hosts == [EXCLUDED] and bad == [1], out["excluded"]
        assert f"host {EXCLUDED} is excluded (" in message and "excluded.jsonl" in message
        assert "replica group g0 does not join the torchft quorum (rank 1 on node0r1" in message
        assert f"--clear {EXCLUDED}" in message, message
        assert ("this rank, 0 on node0r0, leaves with its group" in message) == (grank == 0)
    assert ranks[2] == {"committed": [True, True]}, ranks[2]


def test_a_construction_refused_on_one_rank_only_refuses_the_group_on_every_rank(
        ranks: list[dict[str, Any]]) -> None:
    """Rank 1's exclusion_file is a directory (refused by its config, before the group's
    gather): rank 1 raises that ConfigError, rank 0 a SentinelUsageError naming rank 1 and
    the reason; both went on to the next construction in step (the exclusion above)."""
    refused, told = ranks[1].get("unread", ""), ranks[0].get("unread", "")
    assert refused.startswith("ConfigError: exclusion_file="), ranks[1]
    assert told.startswith("SentinelUsageError: nansentinel: replica group g0 does not join "
                           "the torchft quorum: its construction failed on rank 1 on node0r1: "
                           "ConfigError: exclusion_file="), ranks[0]
    assert "is not a regular file" in told, told
