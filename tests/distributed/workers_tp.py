"""FSDP2 x tensor parallel on 4 gloo ranks, as torchtitan builds it (importable by spawned ranks).

The mesh is (dp 2, tp 2): ranks 0, 1 form one TP group and ranks 2, 3 the other, each TP group
on one host (``tp-host-0``, ``tp-host-1``), since TP lives inside a node. The model is a small
transformer-like MLP: a plain input projection, one residual block whose ``up`` is
``ColwiseParallel`` and whose ``down`` is ``RowwiseParallel`` (an all-reduce over the TP group
in the forward), and an output head that is ``ColwiseParallel`` too. ``parallelize_module`` on
the tp dimension first, then ``fully_shard`` of the block and the root on the dp dimension.

Two ways the loss is made (``loss_kind``):

- ``loss_parallel``: the head's logits stay a DTensor sharded on the vocabulary and the cross
  entropy runs under ``loss_parallel()``, as torchtitan's default: the loss is a DTensor;
- ``sharded``: the logits and labels are sharded by rows over tp, and the mean cross entropy
  is a ``Partial(avg)`` DTensor on torch 2.13 (each rank checks the mean of its own rows), a
  ``Replicate()`` one from torch 2.14 (each rank checks the mean of every row);
- ``local``: the head gathers its output into a plain tensor (``use_local_output=True``): a
  plain loss, the case that always worked.

Faults come from the drill (``inject=``: batch, loss, grad) and from the test itself
(``made``: NaN written into this rank's batch by the loop, not by the injector).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

import nansentinel
from tests.distributed.workers_fsdp import full_weights  # gathers over dp and tp alike
from tests.support import gathers_dtensors

IN, DIM, HIDDEN, VOCAB, BATCH = 8, 16, 32, 12, 4
TP = 2


class Block(nn.Module):
    """An MLP block with a residual: up (colwise), down (rowwise, all-reduced)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.block = Block()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.inp(x)))


def host_of(rank: int) -> str:
    """The host of ``rank``'s TP group: TP peers share one."""
    return f"tp-host-{rank // TP}"


def tp_peers(rank: int) -> list[int]:
    """The ranks of ``rank``'s TP group (the mesh is row-major: tp is the inner dimension)."""
    first = rank - rank % TP
    return list(range(first, first + TP))


def build(loss_kind: str) -> tuple[nn.Module, Any]:
    """The model, tensor-parallel on tp then sharded on dp (torchtitan's order)."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, TP), mesh_dim_names=("dp", "tp"))
    model = Model()
    output = {"loss_parallel": Shard(-1), "local": Replicate(), "sharded": Shard(0)}[loss_kind]
    parallelize_module(model, mesh["tp"], {
        "block.up": ColwiseParallel(),
        "block.down": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=output, use_local_output=loss_kind == "local"),
    })
    fully_shard(model.block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def batch_of(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's batch at ``step`` (the same on both TP peers, as TP needs)."""
    g = torch.Generator().manual_seed(1000 * dp_rank + step)
    return torch.randn(BATCH, IN, generator=g), torch.randint(0, VOCAB, (BATCH,), generator=g)


def train(rank: int, world: int, *, steps: int, loss_kind: str, report_dir: str,
          inject: str = "", made: dict[int, int] | None = None, sentinel: bool = True,
          skip: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Train ``steps`` steps; return each step's result and the full final weights.

    ``made``: step -> the rank whose batch the loop itself poisons; ``sentinel=False`` trains
    without a sentinel, leaving out the batches of the steps in ``skip`` (the reference: what
    the watched run must equal once its poisoned steps were skipped)."""
    made = made or {}
    model, mesh = build(loss_kind)
    dp_rank = mesh["dp"].get_local_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    watcher = (nansentinel.Sentinel(model, opt, report_dir=report_dir, inject=inject or None,
                                    hostname=host_of(rank), metrics_port=0,
                                    host_strikes=100)  # every host is hit 7 times
               if sentinel else None)
    records, loss_types = [], set()
    try:
        for step in range(steps):
            if watcher is None and step in skip:
                continue
            x, y = batch_of(dp_rank, step)
            if made.get(step) == rank:  # row 1: in tp rank 0's share of a row-sharded loss
                x[1, 2] = math.nan
            if watcher is not None:
                watcher.check_batch(x)
            logits = model(x)
            parallel = loss_kind == "loss_parallel"
            with loss_parallel() if parallel else contextlib.nullcontext():
                if loss_kind == "sharded":  # rows sharded over tp (Partial(avg) on torch 2.13)
                    tp = mesh["tp"]
                    mine = y.chunk(TP)[tp.get_local_rank()]
                    loss = F.cross_entropy(logits, DTensor.from_local(mine, tp, [Shard(0)]))
                else:
                    loss = F.cross_entropy(logits, y)
                loss_types.add(f"{type(loss).__name__}{getattr(loss, 'placements', '')}")
                if watcher is not None:
                    watcher.check_loss(loss)
                loss.backward()
            if watcher is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
                continue
            r = watcher.step()
            opt.zero_grad(set_to_none=True)
            records.append({"step": r.step, "applied": r.applied, "outcome": str(r.outcome),
                            "bad_ranks": r.bad_ranks, "bad_hosts": r.bad_hosts,
                            "reached": r.reached,
                            "kinds": r.kinds, "local_kinds": r.local_kinds,
                            "injected": r.injected, "local_loss": r.local_loss})
    finally:
        if watcher is not None:
            watcher.close()
    # Whole weights where torch's gloo gathers DTensors (not 2.9-2.12: FSDP2 over TP's
    # dimension makes strided shards); this rank's own shards always.
    whole = full_weights(model) if gathers_dtensors() else None
    local = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    return {"records": records, "weights": whole, "local": local,
            "loss_types": sorted(loss_types),
            "path": watcher.gradients.caps.label if watcher is not None else None}


#: Each rank in turn, each drill kind at its own step, a healthy step after each (and step 0).
DRILLS = [(1 + 2 * i, rank, kind) for i, (rank, kind) in enumerate(
    (r, k) for k in ("batch", "loss", "grad") for r in range(4))]
#: The loop's own faults (step -> rank): a NaN written into one rank's batch.
MADE = {25: 3, 27: 0}
STEPS = 29


def drill_spec() -> str:
    return ";".join(f"kind={kind},rank={rank},step={step}" for step, rank, kind in DRILLS)


def scenarios(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """Every TP scenario in one process group: for each way of making the loss, the fault
    matrix with the sentinel, and the reference run without it."""
    faulty = frozenset({s for s, _, _ in DRILLS} | set(MADE))
    runs: dict[str, Any] = {}
    for kind in ("loss_parallel", "sharded", "local"):
        try:
            runs[kind] = train(rank, world, steps=STEPS, loss_kind=kind, inject=drill_spec(),
                               made=MADE, report_dir=f"{report_dir}/{kind}")
            runs[f"{kind}-reference"] = train(rank, world, steps=STEPS, loss_kind=kind,
                                              sentinel=False, skip=faulty, report_dir=report_dir)
        except RuntimeError as exc:  # raised on every rank alike, before the collective
            if GLOO_GAP not in str(exc):
                raise
            runs[kind] = runs[f"{kind}-reference"] = {"unsupported": str(exc)}
    torch.distributed.barrier()  # leave together: see workers_fsdp.scenarios
    return runs


#: torch 2.9-2.12's gloo lacks the coalesced all-gather that DTensor's redistributions call
#: (a TP module's output layouts): such a TP model cannot run its forward on CPU ranks there.
GLOO_GAP = "does not support allgather_into_tensor_coalesced"
