"""``policy="drop"`` loops on gloo ranks, each beside a hand reference (importable by spawned
ranks; the tests are in test_drop.py).

Every rank trains the model under the sentinel (DDP, FSDP2 or HSDP) and, beside it, a plain
copy with the same initial weights on the same batches with the same faults: its local
gradients, zeroed on the ranks the test expects left out, summed by a hand ``all_reduce`` and
divided by the number of the others, then an SGD step (linear in the gradient, so a wrong
divisor shows in the weights; Adam would hide it). After each step both the gradient the
sentinel left for the optimizer and the weights are compared with the reference's.

Faults are the model's and the data's (as in workers_fsdp): ``batch`` writes NaN into the
batch's float input, ``loss`` multiplies the loss by NaN, ``backward`` writes NaN into a
gradient inside the backward (forward and loss finite). Each step has two micro-batches, the
first without gradient sync (DDP ``no_sync``, FSDP ``set_requires_gradient_sync(False)``);
a fault sits in the micro-batch the plan says.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel.demo import VOCAB, synthetic_batch
from tests.distributed.workers_fsdp import PoisonableTransformer, build, full_weights

#: step -> {rank: (kind, micro-batch)}
Plan = dict[int, dict[int, tuple[str, int]]]
MICRO = 2
ROWS = 4  # rows per micro-batch: small, the arithmetic is not what is tested
LR = 0.05
MAX_DROPPED = 0.5  # 2 of 4 ranks

#: The DDP plan: one rank (batch, then loss), two ranks, three (above max_dropped), every
#: rank (global), a NaN made inside the backward; healthy steps around them.
DDP_PLAN: Plan = {
    1: {1: ("batch", 0)},
    2: {2: ("loss", 1)},
    3: {0: ("batch", 1), 3: ("loss", 0)},
    4: {0: ("batch", 0), 1: ("batch", 1), 2: ("loss", 0)},
    5: {r: ("loss", 1) for r in range(4)},
    6: {1: ("backward", 0)},
}
DDP_STEPS = 8
#: FSDP2 / HSDP: one rank, two ranks, three, a NaN inside the backward.
FSDP_PLAN: Plan = {
    1: {1: ("batch", 1)},
    2: {0: ("loss", 0), 2: ("batch", 0)},
    3: {0: ("loss", 1), 1: ("loss", 1), 3: ("batch", 0)},
    4: {2: ("backward", 1)},
}
FSDP_STEPS = 6
HSDP_STEPS = 3


def expected(plan: Plan, step: int, world: int) -> tuple[str, list[int]]:
    """The outcome the test expects, and the ranks left out (or blamed)."""
    faults = plan.get(step, {})
    if not faults:
        return "applied", []
    ranks = sorted(faults)
    droppable = all(kind in ("batch", "loss") for kind, _ in faults.values())
    if droppable and len(ranks) <= int(MAX_DROPPED * world) and len(ranks) < world:
        return "dropped", ranks
    return "skipped", ranks


def _micro_batch(rank: int, step: int, micro: int, fault: tuple[str, int] | None
                 ) -> tuple[dict[str, torch.Tensor], str | None]:
    batch = synthetic_batch(rank, step * MICRO + micro, batch=ROWS)
    kind = fault[0] if fault is not None and fault[1] == micro else None
    if kind == "batch":
        batch["scale"][0, 0, 0] = math.nan
    return batch, kind


def _loss(model: nn.Module, poisonable: PoisonableTransformer, batch: dict[str, torch.Tensor],
          kind: str | None) -> torch.Tensor:
    poisonable.poison = "backward" if kind == "backward" else None
    logits = model(batch["tokens"], batch["scale"])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))
    poisonable.poison = None
    return (loss * math.nan if kind == "loss" else loss) / MICRO


class Reference:
    """The plain model the sentinel's must match: a hand all-reduce of the kept ranks'."""

    def __init__(self, rank: int, world: int) -> None:
        torch.manual_seed(0)
        self.model = PoisonableTransformer()
        self.rank, self.world = rank, world

    def step(self, plan: Plan, step: int) -> list[torch.Tensor] | None:
        """One step; returns the mean gradient applied (per parameter), None for a skip."""
        fault = plan.get(step, {}).get(self.rank)
        for micro in range(MICRO):
            batch, kind = _micro_batch(self.rank, step, micro, fault)
            _loss(self.model, self.model, batch, kind).backward()
        outcome, left_out = expected(plan, step, self.world)
        params = list(self.model.parameters())
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        for p in params:
            p.grad = None
        if outcome == "skipped":
            return None
        if self.rank in left_out:
            flat = torch.zeros_like(flat)
        dist.all_reduce(flat)  # the hand reduction: a sum of the kept ranks' gradients
        flat /= self.world - len(left_out)
        grads = [g.view_as(p) for g, p in zip(flat.split([p.numel() for p in params]), params,
                                               strict=True)]
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= LR * g
        return grads

    def weights(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]


def train(rank: int, world: int, *, path: str, plan: Plan, steps: int, report_dir: str,
          policy: str = "drop", reference: bool = True) -> dict[str, Any]:
    """Train under the sentinel on ``path`` (``ddp``, ``fsdp``, ``hsdp``) beside the hand
    reference; per step the result and the largest differences from the reference."""
    if path == "ddp":
        torch.manual_seed(0)
        inner = PoisonableTransformer()
        model: nn.Module = DDP(inner, bucket_cap_mb=0.05)  # several buckets
    else:
        model = inner = build(world, hsdp=path == "hsdp")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sentinel = nansentinel.Sentinel(model, opt, report_dir=report_dir, env={}, policy=policy,
                                    max_dropped=MAX_DROPPED, hostname=f"host{rank // 2}",
                                    host_strikes=99, metrics_port=0, save_batches=False)
    ref = Reference(rank, world) if reference else None
    records = []
    for step in range(steps):
        fault = plan.get(step, {}).get(rank)
        for micro in range(MICRO):
            last = micro == MICRO - 1
            batch, kind = _micro_batch(rank, step, micro, fault)
            if path == "ddp":
                sync = nullcontext() if last else model.no_sync()
            else:
                model.set_requires_gradient_sync(last)
                sync = nullcontext()
            sentinel.check_batch(batch, ids=[sample_id(rank, step, micro, i)
                                             for i in range(ROWS)])
            with sync:
                loss = _loss(model, inner, batch, kind)
                sentinel.check_loss(loss)
                loss.backward()
        r = sentinel.step()
        applied = [p.grad for p in model.parameters()] if r.applied else None
        opt.zero_grad(set_to_none=True)
        record = {"step": r.step, "outcome": str(r.outcome), "applied": r.applied,
                  "bad_ranks": r.bad_ranks, "kinds": r.kinds, "reason": r.reason,
                  "consecutive_skips": r.consecutive_skips, "parameters": r.parameters}
        if ref is not None:
            want = ref.step(plan, step)
            record["grad_diff"] = _diff(applied, want)
            record["weight_diff"] = _diff([p.detach() for p in model.parameters()],
                                          ref.weights())
        records.append(record)
    sentinel.close()
    skip_list = sorted(Path(report_dir).glob("skip-list*"))
    return {"records": records, "weights": _weights(model, path),
            "path": sentinel.gradients.caps.label,
            "gate": "host" if sentinel.device_gate is None else "device",
            "strikes": dict(sentinel.history.strikes),
            "skip_list": [json.loads(line) for f in skip_list
                          for line in f.read_text().splitlines()],
            "reports": sorted(json.loads(f.read_text())["outcome"]
                              for f in Path(report_dir).glob("incident-*[0-9].json"))}


def sample_id(rank: int, step: int, micro: int, row: int) -> int:
    """The dataset index of a row: unique per rank, step, micro-batch and row."""
    return ((rank * 100 + step) * 10 + micro) * 10 + row


def _weights(model: nn.Module, path: str) -> torch.Tensor:
    if path == "ddp":
        return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
    return full_weights(model)


def _diff(got: list[torch.Tensor] | None, want: list[torch.Tensor] | None) -> float | None:
    """The largest absolute difference between this rank's tensors (an FSDP2 DTensor: its
    local shard) and the reference's whole ones (their part on this rank): no collective.
    inf when one side applied a step and the other did not."""
    if got is None or want is None:
        return None if got is None and want is None else math.inf
    return max((float((_local(g) - _shard_of(w, g)).abs().max())
                for g, w in zip(got, want, strict=True) if _local(g).numel()), default=0.0)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _shard_of(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The part of ``whole`` that ``like`` holds on this rank: all of it for a plain tensor,
    FSDP2's ``torch.chunk`` along each ``Shard`` mesh dimension for a DTensor."""
    from torch.distributed.tensor import Shard

    part = whole
    for mesh_dim, placement in enumerate(getattr(like, "placements", ())):
        if isinstance(placement, Shard):
            chunks = part.chunk(like.device_mesh.size(mesh_dim), dim=placement.dim)
            index = like.device_mesh.get_local_rank(mesh_dim)
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
    return part


def refused(rank: int, world: int, *, report_dir: str) -> dict[str, str]:
    """The setups ``policy="drop"`` refuses at construction, with their messages."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    torch.manual_seed(0)
    by_hand = PoisonableTransformer()  # gradients reduced by the loop itself
    sub = PoisonableTransformer()  # FSDP2 over half the job: a dp x tp mesh's dp dimension
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    fully_shard(sub, mesh=mesh["dp"])
    for name, model in (("local", by_hand), ("fsdp-sub-mesh", sub)):
        try:
            nansentinel.Sentinel(model, torch.optim.SGD(model.parameters(), lr=LR),
                                 report_dir=report_dir, env={}, policy="drop", metrics_port=0)
            out[name] = "no error"
        except nansentinel.ConfigError as exc:
            out[name] = str(exc)
    return out


def scenarios(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """Every scenario in one process group (spawning ranks is the slow part on CI)."""
    runs: dict[str, Any] = {}
    runs["ddp"] = train(rank, world, path="ddp", plan=DDP_PLAN, steps=DDP_STEPS,
                        report_dir=f"{report_dir}/ddp")
    runs["fsdp"] = train(rank, world, path="fsdp", plan=FSDP_PLAN, steps=FSDP_STEPS,
                         report_dir=f"{report_dir}/fsdp")
    # HSDP: the replicate all-reduce after the shard group's reduce-scatter; one and two ranks.
    runs["hsdp"] = train(rank, world, path="hsdp", plan=FSDP_PLAN, steps=HSDP_STEPS,
                         report_dir=f"{report_dir}/hsdp")
    for path in ("ddp", "fsdp"):  # healthy steps: bit for bit what policy="skip" does
        for policy in ("skip", "drop"):
            runs[f"healthy-{path}-{policy}"] = train(
                rank, world, path=path, plan={}, steps=2, policy=policy, reference=False,
                report_dir=f"{report_dir}/healthy")
    runs["refused"] = refused(rank, world, report_dir=report_dir)
    return runs
