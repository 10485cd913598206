"""``policy="drop"``: keep a poisoned step by leaving the poisoned ranks out of its reduction.

Under ``skip`` one rank's bad sample costs every rank its step. But a rank whose batch or loss
is non-finite is known before its gradients leave: ``check_batch`` and ``check_loss`` run before
``backward``, so at the step's first gradient reduction the rank's health already holds a 0-d
flag on the device (``LocalHealth.poisoned``). Under ``drop``:

1. **Withhold** (:func:`withhold`, from the gradient path, every reduction of the step): a
   flagged rank's contribution — each DDP bucket, each FSDP2 group's reduce-scatter input — is
   replaced by zeros before the collective, so the reduction sums the other ranks' gradients
   and stays finite. The flag is fixed at the step's first reduction (``LocalHealth.dropped``),
   so a rank is left out of all of the step's reductions or none. Under ``no_sync``
   accumulation the flag covers every micro-batch checked before the synchronised backward: a
   poisoned micro-batch leaves the rank out of that optimizer step.
2. **Count**: the flag travels in the step's health exchange (``schema.T.dropped``, one more
   float of the fixed-size sum that already leaves beside the last bucket), so every rank
   learns how many ranks were left out from the same numbers. No collective of its own.
3. **Decide** (policy.py, pure): the step is ``dropped`` when every blamed rank was left out,
   they are at most ``max_dropped`` of the ranks (:func:`policy.max_dropped_ranks`), not every
   rank, and the cause is not global (a ``divergence`` verdict); otherwise it is skipped as
   under ``skip``.
4. **Rescale** (:func:`rescale`, on every rank, only on a dropped step, after the decision's one
   host read): the reduced gradients are the kept ranks' sum divided by the world W (DDP's and
   FSDP2's own averaging, unchanged), so multiplying them by W/n makes them the mean over the n
   kept ranks, on the device, before the optimizer steps. Equal, to floating-point rounding, to a
   hand all-reduce of the kept ranks' gradients divided by n.

Why a healthy step costs nothing more: no collective is added (four bytes more in the exchange);
the rescale never runs; and the withhold costs no kernel where the flag lives in host memory (a
CPU device: reading it waits for nothing), one ``masked_fill_`` per bucket on an accelerator
(one read and write of the bucket on the device, no host sync: a select is the one operation
that turns NaN into 0, since NaN x 0 is NaN). A healthy step's gradients are never touched, so
its weights are bit-identical to ``skip``'s. The count does not ride beside every bucket: on
gloo that is a copy of each bucket (measured 1.055x a step for the exchange vector, DESIGN.md)
or a second collective per bucket, and a divide pass over every bucket of every step.

What it changes: between ``backward`` and ``step()`` a dropped step's gradients are the kept
ranks' sum over W (n/W of their mean; ``step()`` rescales them), so a ``clip_grad_norm_`` in
that window clips a gradient W/n too small and lets the applied one be up to W/n above the
threshold; the effective global batch of the step is the kept ranks' micro-batches.

The rule for a NaN made inside the backward (batch and loss finite, a gradient non-finite):
that rank was not flagged before its first bucket left, and some of its finite buckets are
already summed into every rank's gradients, so leaving out the rest would apply a gradient
whose layers average different sets of ranks. Such a step is skipped, as under ``skip``; the
weights stay finite and identical on every rank.

Refused (:func:`refusal`, at construction): where a data-parallel replica is several ranks
(tensor or pipeline parallel, a DDP or FSDP group smaller than the job), DeepSpeed (its engine
reduces where no rank's contribution can be replaced), and gradients reduced by hand on more
than one rank (the reduction is the user's); torchtitan's trainer refuses it too (torchtitan.py:
it clips before the rescale). A world of one never drops: its one rank is every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nansentinel.checks import local
from nansentinel.checks.health import LocalHealth
from nansentinel.common import torch_insides as insides
from nansentinel.config import ConfigError
from nansentinel.wire.collectives import job_size

if TYPE_CHECKING:
    from nansentinel.engines import Capabilities


def flag_of(health: LocalHealth) -> torch.Tensor:
    """This step's 0-d bool withhold flag, from the batches and losses checked so far
    (``LocalHealth.poisoned``), taken once, at the step's first reduction.

    Under FSDP2 that is on FSDP's reduce-scatter stream, and the flag is read again on the
    default stream when the exchange is packed at ``step()``: the allocator is told, so that
    its memory is not handed to the next step's reduce-scatter before that read (as
    engines/fsdp.py does for the norms it keeps)."""
    flag = health.poisoned()
    if flag.is_cuda:
        flag.record_stream(torch.cuda.default_stream(flag.device))
    return flag


def withhold(local_grads: torch.Tensor, flag: torch.Tensor) -> None:
    """Replace ``local_grads`` (this rank's contribution, about to be reduced) by zeros where
    the 0-d bool ``flag`` is set; in place, no host sync.

    On a CPU device the flag is a host value already computed (CPU kernels run synchronously),
    and reading it waits for nothing: a healthy step then runs no kernel at all (a broadcast
    ``masked_fill_`` on CPU is a scalar loop, measured 6x a ``mul_`` over the same bucket). On
    an accelerator the select runs on the device, in stream order before the collective, on
    a sparse gradient's stored values (a sparse tensor has no ``masked_fill_``)."""
    if flag.device.type == "cpu" and local_grads.device.type == "cpu":
        if bool(flag):
            local_grads.zero_()
        return
    insides.stored_values(local_grads).masked_fill_(flag.to(local_grads.device), 0)


def rescale(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Multiply the gradients of ``optimizer``'s parameters by ``factor`` (W/n on a dropped
    step), in place and on their devices; a DTensor gradient through its local shard, which is
    what FSDP2's reduce-scatter produced."""
    grads = [local(p.grad) for group in optimizer.param_groups for p in group["params"]
             if p.grad is not None]
    if grads:
        with torch.no_grad():
            insides.foreach_mul_(grads, factor)


def refusal(caps: Capabilities, *, world_size: int) -> str | None:
    """Why ``policy="drop"`` cannot leave a rank out here (None: it can).

    Args:
        caps: the run's gradient path's capabilities (``caps.drop``: the path's own reason).
        world_size: the ranks of the sentinel's exchange (its decision's world).
    """
    if caps.drop is not None:
        return caps.drop
    job = job_size()
    if world_size != job:
        return (f"the sentinel's process group holds {world_size} of the job's {job} ranks: "
                "the others are another parallel dimension, whose ranks would decide apart")
    return None


def refuse_unsupported(caps: Capabilities, *, world_size: int, rank: int) -> None:
    """Raise a :class:`ConfigError` naming why ``policy="drop"`` cannot run here."""
    why = refusal(caps, world_size=world_size)
    if why is not None:
        raise ConfigError(
            f"policy='drop' is refused on rank {rank}: {why}. Use policy='skip' "
            "(NANSENTINEL_POLICY=skip), which skips such a step on every rank instead.",
            field="policy",
        )
