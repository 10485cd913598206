"""Two modules sharded in one ``fully_shard([...])`` call, as torchtitan shards ``norm`` and
``lm_head``: they share one FSDP state (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import nansentinel
from nansentinel.demo import VOCAB, synthetic_batch
from tests.distributed.workers_fsdp import PoisonableTransformer


def shared_state(rank: int, world: int, *, report_dir: str) -> dict[str, Any]:
    """The layers, then ``embed`` and ``head`` together, then the root; a healthy step, then
    rank 1 poisons the embedding's gradient alone (a parameter of the shared group) in
    backward; then a second Sentinel on the same model."""
    torch.manual_seed(0)
    model = PoisonableTransformer()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard([model.embed, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = nn.CrossEntropyLoss()
    records = []
    with nansentinel.Sentinel(model, opt, report_dir=report_dir) as watcher:
        for step in range(2):
            batch = watcher.check_batch(synthetic_batch(rank, step))
            model.poison = "embed" if (step, rank) == (1, 1) else None
            logits = model(batch["tokens"], batch["scale"])
            loss = loss_fn(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))
            watcher.check_loss(loss)
            loss.backward()
            r = watcher.step()
            opt.zero_grad(set_to_none=True)
            records.append({"outcome": r.outcome, "bad_ranks": r.bad_ranks,
                            "parameters": r.parameters})
        groups = list(watcher.gradients.groups)
        try:
            nansentinel.Sentinel(model, opt, report_dir=report_dir)
            second = "no error"
        except nansentinel.SentinelUsageError as exc:
            second = str(exc)
    return {"records": records, "groups": groups, "second": second}
