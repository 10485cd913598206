"""Where this rank's gradients are checked: always on the local gradients, before they are
reduced across ranks, because after the reduction a NaN from one rank is on every rank.

One path is chosen once, at construction, from the model the user hands the Sentinel:

- ``ddp``: a ``DistributedDataParallel`` model. On NCCL, one callback at the end of backward
  (DDP's own C++ all-reduce untouched) checks the local gradients and launches the health
  exchange; elsewhere, or where every reduction must pass through the sentinel, its
  communication hook checks each bucket and averages it as DDP's default does, the last
  bucket launching the exchange (engines/ddp_seam.py).
- ``fsdp``: an FSDP2 (``fully_shard``) model, 1-D or HSDP. A custom reduce-scatter checks each
  FSDP group's flat, padded, unsharded gradient buffer, then runs FSDP's own reduce-scatter
  unchanged; the exchange leaves at ``step()``.
- ``fsdp1``: an FSDP1 (``FullyShardedDataParallel``) model, every sharding strategy. FSDP1's
  communication hook checks each unit's flat, unsharded gradient, then reduces it exactly as
  FSDP1's default does (engines/fsdp1.py); the exchange leaves at ``step()``.
- ``deepspeed``: a ``deepspeed.DeepSpeedEngine``. Each ZeRO stage's local gradients, before
  DeepSpeed reduces them: all of them before its all-reduce (ZeRO-0/1), each IPG bucket before
  its reduce (ZeRO-2), each bucket before its reduce-scatter into partitions (ZeRO-3).
- ``prehook``: any other model in a job of several ranks, on torch >= 2.14: each gradient
  collective's send buffer, checked in a process-group pre-hook as it leaves (a loop's own
  all-reduce or reduce-scatter, an engine outside this registry); the exchange leaves at
  ``step()``.
- ``local``: anything else (one process, pipeline stages, tensor parallel, or torch < 2.14
  where users who reduce gradients by hand call ``check_grads()`` before their reduction):
  one fused norm per (device, dtype) group of the local ``.grad`` tensors.

Each path talks to the sentinel through the few methods of :class:`GradientSink`, so it can be
read (and replaced) without the rest of the step. The types they share are in engines/base.py;
which path takes a model, in engines/paths.py (its :func:`recognize`).
"""

from nansentinel.engines.base import (
    EXCHANGE,
    PIPELINE_DROP,
    PIPELINE_GATE,
    PIPELINE_REPLICAS,
    Capabilities,
    Given,
    GradientSink,
    GradPath,
    KeptNorms,
)
from nansentinel.engines.paths import (
    adapter_of,
    attach,
    exchange_group,
    recognize,
    registry,
    sharded_in_place,
    steps_of,
    takes_replay,
    wrapper_of,
)

__all__ = [
    "EXCHANGE", "PIPELINE_DROP", "PIPELINE_GATE", "PIPELINE_REPLICAS", "Capabilities", "Given",
    "GradPath", "GradientSink", "KeptNorms", "adapter_of", "attach", "exchange_group",
    "recognize", "registry", "sharded_in_place", "steps_of", "takes_replay", "wrapper_of",
]
