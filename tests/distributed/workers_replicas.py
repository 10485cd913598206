"""Training loops for the replica fingerprint tests (importable by spawned gloo ranks).

A tiny MLP under DDP or HSDP (replicate x shard); the test flips one mantissa bit of one
weight element itself (not the drill) after a chosen rank's step, or runs the drill.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel.effects.metrics import SentinelMetrics
from nansentinel.rare.replicas import replicated_state


def build(mesh: str, world: int, replicate: int, frozen: bool = False
          ) -> tuple[nn.Module, nn.Module]:
    """``(model, module)``: the wrapped model and the module whose state is replicated;
    ``frozen``: with a frozen parameter the forward does not use (a frozen, unused embedding
    row: a NaN there shows in no loss and no gradient)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if frozen:
        module.register_parameter("frozen", nn.Parameter(torch.ones(4), requires_grad=False))
    if mesh == "ddp":
        return DDP(module), module
    dims = init_device_mesh("cpu", (replicate, world // replicate),
                            mesh_dim_names=("replicate", "shard"))
    for layer in (module[0], module[2]):
        fully_shard(layer, mesh=dims)
    fully_shard(module, mesh=dims)
    return module, module


def flip_one_bit(module: nn.Module) -> None:
    """The test's own fault: bit 12 of the first weight's first element (fp32: ~0.05%)."""
    with torch.no_grad():
        p = next(module.parameters())
        local = p.to_local() if hasattr(p, "to_local") else p.data
        local.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 12)


def run(rank: int, world: int, *, mesh: str, steps: int, report_dir: str, replicate: int = 1,
        flip: tuple[int, int] | None = None, one_host_each: bool = False,
        poison: tuple[list[int], int] | None = None, **overrides: Any) -> dict[str, Any]:
    """Train ``steps`` steps; return each step's result, the final replicated state (local
    tensors, by name), the divergence counter, and the error that stopped the run.
    ``one_host_each``: rank R runs on host ``hostR``; ``poison``: (ranks, step) whose frozen,
    unused parameter turns NaN after that step."""
    model, module = build(mesh, world, replicate, frozen=poison is not None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if one_host_each:
        overrides["hostname"] = f"host{rank}"
    # The counters are read from a registry of the test's (no exporter): no scraper to wait
    # for after an abort or an exclusion (metrics_linger).
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir,
                                    **{"metrics_linger": 0, **overrides})
    registry = CollectorRegistry()
    sentinel.metrics = SentinelMetrics(sentinel.identity, registry=registry)
    records, error = [], None
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            sentinel.check_batch(x)
            loss = nn.functional.mse_loss(model(x), y)
            sentinel.check_loss(loss)
            loss.backward()
            r = sentinel.step()
            opt.zero_grad(set_to_none=True)
            records.append({"step": r.step, "outcome": str(r.outcome), "bad_ranks": r.bad_ranks,
                            "bad_hosts": r.bad_hosts, "kinds": r.kinds, "verdict": r.verdict,
                            "parameters": r.parameters, "reason": r.reason,
                            "report_path": r.report_path, "local_kinds": r.local_kinds,
                            "poisoned_state": r.poisoned_state,
                            "state_action": r.state_action})
            if flip is not None and (rank, step) == flip:
                flip_one_bit(module)
            if poison is not None and rank in poison[0] and step == poison[1]:
                with torch.no_grad():
                    module.frozen[1] = float("nan")
    except nansentinel.NonFiniteError as exc:
        error = {"type": type(exc).__name__, "message": str(exc), "step": exc.result.step,
                 "bad_ranks": exc.result.bad_ranks, "verdict": exc.result.verdict}
    state = {name: t.detach().clone() for name, t in replicated_state(module, opt)}
    sentinel.metrics = None
    sentinel.close()
    dist.barrier()
    return {"records": records, "state": state, "error": error,
            "divergences": registry.get_sample_value("nansentinel_replica_divergence_total"),
            "found": [(s, [f.to_json() for f in fs]) for s, fs in
                      (sentinel.replicas.found if sentinel.replicas else [])]}


def ddp_scenarios(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """DDP on 4 ranks: the test's own flip, then the drill, in one process group."""
    return {
        "flip": run(rank, world, mesh="ddp", steps=10, report_dir=report_dir, flip=(2, 5),
                    fingerprint_every=2),
        "drill": run(rank, world, mesh="ddp", steps=6, report_dir=report_dir,
                     fingerprint_every=2, inject="kind=bitflip,rank=1,step=2"),
    }


def pair_scenarios(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """Two replicas that disagree: repair cannot choose (aborts); warn names both. A NaN in a
    frozen parameter no loss reads: on one of the two, repaired from the finite one (no
    majority is needed); on both, the run stops naming it."""
    return {
        "repair": run(rank, world, mesh="ddp", steps=6, report_dir=report_dir, flip=(1, 2),
                      fingerprint_every=1),
        "warn": run(rank, world, mesh="ddp", steps=6, report_dir=report_dir, flip=(1, 2),
                    fingerprint_every=1, divergence_action="warn"),
        "nan_one": run(rank, world, mesh="ddp", steps=6, report_dir=report_dir,
                       poison=([1], 2), fingerprint_every=2, one_host_each=True),
        "nan_both": run(rank, world, mesh="ddp", steps=6, report_dir=report_dir,
                        poison=([0, 1], 2), fingerprint_every=2, one_host_each=True),
    }
