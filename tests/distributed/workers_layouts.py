"""DDP loops over every gradient layout a model can hold (importable by spawned gloo ranks; the
test is in test_layouts.py).

Each scenario trains a small model (SGD with momentum, the replica fingerprints every second
step) under the sentinel for four steps: a healthy one, a grad
drill on rank 1 (``NANSENTINEL_INJECT``, written into DDP's first bucket), a NaN the test
writes into one parameter's local gradient on rank 2 inside the backward (a tensor hook: for
a sparse gradient, into its stored values), and a healthy one. Then a plain DDP copy with the
same initial weights applies the two healthy steps' batches, so the sentinel's weights can be
compared with plain DDP's bit for bit (its comm hook averages as DDP's default does, a sparse
gradient included). ``sparse_drop`` is the sparse model under ``policy="drop"`` with rank 1's
loss non-finite at step 1, against plain DDP with that rank's loss zeroed and the gradient
rescaled to the kept ranks' mean. ``sparse_rollback`` is the sparse model under
``policy="rollback"`` (a snapshot every step, no batches discarded) with only the hook's NaN:
the step rolls back to a snapshot holding SGD's sparse momentum.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel

STEPS = 4
DRILL_STEP, HOOK_STEP = 1, 2
DRILL_RANK, HOOK_RANK = 1, 2
LR = 0.1
#: SGD's momentum buffer of a sparse gradient is sparse: the replica fingerprints read it.
MOMENTUM = 0.9
VOCAB = 40
SCENARIOS = ("dense", "channels_last", "bucket_view", "sparse", "sparse_view", "sparse_alone",
             "complex", "sparse_drop", "sparse_rollback")


class Sparse(nn.Module):
    """An embedding and an embedding bag with sparse gradients beside a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 4, sparse=True)
        self.bag = nn.EmbeddingBag(VOCAB, 4, mode="sum", sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = self.emb(batch["ids"]).mean(0, keepdim=True)
        bags = self.bag(batch["bags"]).mean(0, keepdim=True)
        return self.head(torch.cat([tokens, bags], dim=1))


class Bag(nn.Module):
    """An embedding bag alone: DDP's first bucket (the drill's) is its sparse gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(VOCAB, 4, mode="sum", sparse=True)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.bag(batch["bags"])


def build(name: str) -> tuple[nn.Module, dict[str, Any], str]:
    """The scenario's model (seeded: every rank and the plain copy start alike), its DDP
    keywords, and the parameter the test poisons."""
    torch.manual_seed(0)
    if name in ("dense", "bucket_view"):
        net: nn.Module = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        return net, {"gradient_as_bucket_view": name == "bucket_view"}, "0.weight"
    if name == "channels_last":
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 2, 1))
        return net.to(memory_format=torch.channels_last), {}, "0.weight"
    if name == "complex":
        return nn.Linear(3, 2).to(torch.complex64), {}, "weight"
    if name == "sparse_alone":
        return Bag(), {}, "bag.weight"
    return Sparse(), {"gradient_as_bucket_view": name == "sparse_view"}, "emb.weight"


def _batch(name: str, rank: int, step: int) -> Any:
    g = torch.Generator().manual_seed(100 * rank + step)
    if name in ("dense", "bucket_view"):
        return torch.randn(4, 6, generator=g)
    if name == "channels_last":
        return torch.randn(2, 3, 5, 5, generator=g).contiguous(memory_format=torch.channels_last)
    if name == "complex":
        return torch.randn(4, 3, dtype=torch.complex64, generator=g)
    # Few distinct ids: repeats make the embeddings' gradients uncoalesced.
    return {"ids": torch.randint(0, 8, (6,), generator=g),
            "bags": torch.randint(0, 8, (3, 4), generator=g)}


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.abs().pow(2).mean()  # real for a complex output too


def _poison(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with its first stored value NaN (a sparse gradient through its values)."""
    if grad.layout == torch.sparse_coo:
        values = grad._values().clone()
        values[0] = math.nan
        return torch.sparse_coo_tensor(grad._indices(), values, grad.shape)
    grad = grad.clone()
    grad[(0,) * grad.dim()] = math.nan
    return grad


def _weights(net: nn.Module) -> torch.Tensor:
    return torch.cat([torch.view_as_real(p.detach()).reshape(-1) if p.is_complex()
                      else p.detach().reshape(-1) for p in net.parameters()])


def _watched(rank: int, name: str, report_dir: str) -> dict[str, Any]:
    """Four steps under the sentinel: each step's result, the gradients' layouts seen, the
    weights."""
    net, ddp_kwargs, poisoned = build(name)
    model = DDP(net, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    drop, rollback = name == "sparse_drop", name == "sparse_rollback"
    env = dict(os.environ)
    if not (drop or rollback):
        env["NANSENTINEL_INJECT"] = f"kind=grad,rank={DRILL_RANK},step={DRILL_STEP}"
    policy: dict[str, Any] = ({"policy": "drop"} if drop else {
        "policy": "rollback", "snapshot_every": 1, "rollback_skip_batches": 0} if rollback
        else {"policy": "skip"})
    s = nansentinel.Sentinel(model, opt, env=env, report_dir=report_dir,
                             hostname=f"node{rank}", metrics_port=0, replay=_replay,
                             fingerprint_every=2, **policy)
    param = dict(net.named_parameters())[poisoned]
    seen: list[tuple[str, bool | None]] = []

    def look(grad: torch.Tensor) -> None:
        sparse = grad.layout != torch.strided
        seen.append((str(grad.layout), grad.is_coalesced() if sparse else None))

    records = []
    for step in range(STEPS):
        batch = _batch(name, rank, step)
        s.check_batch(batch)
        loss = _loss(model(batch))
        if drop and step == DRILL_STEP and rank == DRILL_RANK:
            loss = loss * math.nan
        s.check_loss(loss)
        hooks = [param.register_hook(look)]
        if not drop and step == HOOK_STEP and rank == HOOK_RANK:
            hooks.append(param.register_hook(_poison))
        loss.backward()
        for h in hooks:
            h.remove()
        layouts = {n: (str(p.grad.layout), p.grad.is_contiguous())
                   for n, p in net.named_parameters() if p.grad is not None}
        view = bool(ddp_kwargs.get("gradient_as_bucket_view")) and all(
            p.grad._base is not None for p in net.parameters())
        r = s.step()
        opt.zero_grad()
        records.append({"applied": r.applied, "outcome": str(r.outcome.value),
                        "bad_ranks": r.bad_ranks, "kinds": r.kinds, "injected": r.injected,
                        "parameters": r.parameters, "grad_norm": r.local_grad_norm,
                        "layouts": layouts, "bucket_views": view})
    s.close()
    return {"records": records, "weights": _weights(net), "seen": seen}


def _replay(module: nn.Module, batch: Any) -> torch.Tensor:
    """The replay's forward and loss (on the unwrapped module)."""
    return _loss(module(batch))


def _plain(rank: int, world: int, name: str, applied: list[int]) -> torch.Tensor:
    """Plain DDP from the same weights on the steps the sentinel applied (``sparse_drop``:
    the dropped step with rank 1's loss zeroed and the sum divided by the kept ranks)."""
    net, ddp_kwargs, _ = build(name)
    model = DDP(net, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in applied:
        loss = _loss(model(_batch(name, rank, step)))
        dropped = name == "sparse_drop" and step == DRILL_STEP
        if dropped and rank == DRILL_RANK:
            loss = loss * 0.0
        loss.backward()
        if dropped:
            for p in net.parameters():
                p.grad.mul_(world / (world - 1))
        opt.step()
        opt.zero_grad()
    return _weights(net)


def _by_hand(rank: int, world: int, report_dir: str) -> dict[str, Any]:
    """The sparse model without DDP: ``check_grads()``, then the loop's own all-reduce of
    each gradient (gloo sums a sparse one into it in place) and its mean, then ``step()``;
    the same drill (into the first local gradient, the embedding's sparse one) and poison."""
    net, _, poisoned = build("sparse")
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    env = {**os.environ, "NANSENTINEL_INJECT": f"kind=grad,rank={DRILL_RANK},step={DRILL_STEP}"}
    s = nansentinel.Sentinel(net, opt, env=env, report_dir=report_dir, hostname=f"node{rank}",
                             metrics_port=0, replay=_replay)
    records = []
    for step in range(STEPS):
        batch = _batch("sparse", rank, step)
        s.check_batch(batch)
        loss = _loss(net(batch))
        s.check_loss(loss)
        hooks = []
        if step == HOOK_STEP and rank == HOOK_RANK:
            hooks.append(dict(net.named_parameters())[poisoned].register_hook(_poison))
        loss.backward()
        for h in hooks:
            h.remove()
        s.check_grads()
        for p in net.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        r = s.step()
        opt.zero_grad()
        records.append({"applied": r.applied, "bad_ranks": r.bad_ranks, "kinds": r.kinds,
                        "parameters": r.parameters, "grad_norm": r.local_grad_norm})
    s.close()
    return {"records": records, "weights": _weights(net)}


def every_layout(rank: int, world: int, *, report_dir: str,
                 names: tuple[str, ...] = SCENARIOS) -> dict[str, Any]:
    """Each scenario under the sentinel, then plain DDP on the steps it applied, then the
    sparse model reduced by hand, on one process group; every rank ends at one barrier."""
    out: dict[str, Any] = {}
    for name in names:
        watched = _watched(rank, name, f"{report_dir}/{name}")
        applied = [i for i, r in enumerate(watched["records"]) if r["applied"]]
        watched["plain"] = _plain(rank, world, name, applied)
        out[name] = watched
    out["by_hand"] = _by_hand(rank, world, f"{report_dir}/by_hand")
    dist.barrier()
    return out
