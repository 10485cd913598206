"""The DeepSpeed gradient path: each ZeRO stage's local gradients, checked before DeepSpeed
reduces them.

DeepSpeed checks for overflow after its reduction (a MAX of one flag over the data-parallel
group), when a NaN from one rank is on every rank and the rank is gone. So the check sits
where each stage reduces, on this rank's own gradients, one step earlier:

- ``allreduce`` (ZeRO-0, and ZeRO-1 without ``overlap_comm``): DeepSpeed all-reduces the
  gradients after backward, from ``engine.backward``'s epilogue, when
  ``engine.enable_backward_allreduce`` is set. The path clears that switch at construction and,
  at the accumulation boundary's ``step()``, checks every local gradient, then calls
  ``engine.allreduce_gradients()`` itself: the reduction DeepSpeed would have run, in the same
  place relative to ``engine.step()``. Both are public.
- ``bucket`` (ZeRO-2, and ZeRO-1 with ``overlap_comm``): DeepSpeed's gradient hooks copy the
  local gradients into an IPG bucket during backward and reduce each bucket, when it is full
  and the last one from the backward's epilogue, in ``DeepSpeedZeroOptimizer.reduce_ipg_grads``.
  The path wraps that method on the engine's optimizer instance: a check of the bucket's local
  gradients (``IPGBucket.grads``), then DeepSpeed's reduction unchanged. Under gradient
  accumulation this runs for every micro-batch, as DeepSpeed reduces every micro-batch.
- ``partition`` (ZeRO-3): the hooks gather full local gradients into an IPG bucket, which
  ``DeepSpeedZeroOptimizer_Stage3.__reduce_and_partition_ipg_grads`` reduce-scatters into the
  ranks' partitions. The path wraps it the same way (the bucket's ``params``, each ``.grad``
  still this rank's full local gradient).

The last two are private seams, read from DeepSpeed 0.19.8, the version
nansentinel.engines.deepspeed_step accepts; :func:`seam_refusal` says what is missing when a
release moves them.

Each check is one foreach norm over the bucket's gradients (a single read of their bytes; NaN
and Inf propagate), kept per parameter with the parameters' names so that a detection names
them without a second read, and the bucket's norm goes to the sink. Nothing is read on the host
on a healthy step. The health exchange leaves beside DeepSpeed's last reduction of the step:
``allreduce`` just before ``allreduce_gradients()``; ``bucket`` from the backward's epilogue
(``reduce_ipg_grads()`` for every dtype at the accumulation boundary) before its last buckets
are reduced; ``partition`` at ``step()``, one small all-reduce after backward as with FSDP2
(ZeRO-3's epilogue may run once per phase of a reentrant checkpointed backward, so the last
bucket is not known before the backward returns).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from nansentinel import checks
from nansentinel.engines.base import Capabilities, GradientSink, KeptNorms

#: The seam per ZeRO setup (see the module docstring).
ALLREDUCE, BUCKET, PARTITION = "allreduce", "bucket", "partition"
#: ZeRO-3's bucket reduction, name-mangled (``__reduce_and_partition_ipg_grads``).
_Z3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


def is_engine(model: Any) -> bool:
    """True for a ``deepspeed.DeepSpeedEngine``, without importing DeepSpeed: an engine exists
    only in a process that imported it already."""
    ds = sys.modules.get("deepspeed")
    engine = getattr(ds, "DeepSpeedEngine", None) if ds is not None else None
    return engine is not None and isinstance(model, engine)


def seam_of(engine: Any) -> str:
    """Where this engine reduces its gradients: ``allreduce``, ``bucket`` or ``partition``."""
    stage = int(engine.zero_optimization_stage())
    if stage >= 3:
        return PARTITION
    opt = engine.optimizer
    if stage >= 1 and (getattr(opt, "partition_gradients", False)
                       or getattr(opt, "overlap_comm", False)):
        return BUCKET  # reduced inside backward, by the gradient hooks
    return ALLREDUCE


def seam_refusal(engine: Any) -> str | None:
    """What this engine's optimizer lacks of the private seam its stage needs (None: all there):
    a DeepSpeed release that moved them is refused by name, not checked too late."""
    seam = seam_of(engine)
    opt = engine.optimizer
    if seam == ALLREDUCE:
        if not engine.enable_backward_allreduce:
            return ("engine.enable_backward_allreduce is off already (another Sentinel on this "
                    "engine, not closed?); construct one Sentinel per engine")
        return None
    method = "reduce_ipg_grads" if seam == BUCKET else _Z3_REDUCE
    if method in vars(opt):
        return (f"{type(opt).__name__}.{method} is wrapped already (another Sentinel on this "
                "engine, not closed?); construct one Sentinel per engine")
    needed = ["ipg_buckets", "reduce_ipg_grads" if seam == BUCKET else _Z3_REDUCE]
    missing = [n for n in needed if not hasattr(opt, n)]
    if seam == PARTITION and not missing and any(
            not hasattr(b, "params") for b in opt.ipg_buckets.values()):
        missing.append("IPGBucketZ3.params")
    if seam == BUCKET and not missing and any(
            not hasattr(b, "grads") for b in opt.ipg_buckets.values()):
        missing.append("IPGBucket.grads")
    if not missing:
        return None
    return f"{type(opt).__name__} has no {', '.join(missing)}"


class DeepSpeedPath:
    """Checks a DeepSpeed engine's local gradients at its stage's seam (see module docstring)."""

    CAPS = Capabilities(
        label="DeepSpeed", steps_optimizer=True, wraps=True,
        device_gate="engine.step() takes DeepSpeed's own overflow decision on the host",
        replay=("a replay's backward would run DeepSpeed's gradient hooks and reduce the "
                "gradients being judged"),
        drop=("DeepSpeed reduces the gradients inside its engine, where no rank's "
              "contribution can be replaced before the reduction"),
        rollback=("ZeRO partitions the weights and optimizer state that a snapshot would have "
                  "to hold"),
        fingerprints="DeepSpeed (ZeRO partitions what replicas hold alike: not measured there)",
    )
    caps = CAPS
    recognizes = staticmethod(is_engine)

    keep_norms = False  # its per-parameter norms are always kept (self.norms)

    def __init__(self, engine: Any, sink: GradientSink) -> None:
        self.engine = engine
        self.sink = sink
        self.optimizer = engine.optimizer
        self.seam = seam_of(engine)
        self.names = {id(p): n for n, p in engine.module.named_parameters()}
        #: (parameter names, their local gradients' norms) for every check of the step.
        self.norms: list[tuple[list[str], torch.Tensor]] = []
        #: ZeRO-3 all-gathers parameters in the forward over its partition group: that carries
        #: no batch's NaN into another rank's loss (origins.py), as FSDP2's all-gathers.
        self.mesh_groups: list[Any] = []
        #: The optimizer methods wrapped, and the engine's switch as found (:meth:`release`).
        self._wrapped: list[str] = []
        self._launched = False  # this step's exchange left from the epilogue (``bucket``)
        self._allreduce = engine.enable_backward_allreduce
        if self.seam == ALLREDUCE:
            engine.enable_backward_allreduce = False  # public: the reduction runs at step()
        elif self.seam == BUCKET:
            self._wrap("reduce_ipg_grads", self._bucket_grads)
        else:
            self._wrap(_Z3_REDUCE, self._partition_grads)
            group = getattr(self.optimizer, "dp_process_group", None)
            self.mesh_groups = [group] if group is not None else []

    def _wrap(self, method: str, grads_of: Callable[[tuple[Any, ...]], Iterable[Any]]) -> None:
        """Replace ``method`` on the optimizer instance by: check the grads ``grads_of`` finds
        for the call's arguments, then DeepSpeed's own method with the same arguments."""
        original = getattr(self.optimizer, method)

        def checked(*args: Any, **kwargs: Any) -> Any:
            values = (*args, *kwargs.values())
            with self._ordered():
                self.check_bucket(grads_of(values))
            if (self.seam == BUCKET and not any(v is not None for v in values)
                    and not self._launched and self.engine.is_gradient_accumulation_boundary()):
                # ``reduce_ipg_grads()`` for every dtype: the backward's epilogue flushing the
                # last buckets at the boundary. Every bucket of the step is checked now, so the
                # exchange leaves here, beside DeepSpeed's last reduction, not after it.
                self._launched = True
                self.sink.launch_exchange()
            return original(*args, **kwargs)

        setattr(self.optimizer, method, checked)
        self._wrapped.append(method)

    @contextlib.contextmanager
    def _ordered(self) -> Iterator[None]:
        """On CUDA, the check's kernels go where the bucket's bytes are ready and before
        DeepSpeed's reduction can change them, with no host sync. ZeRO-3 copies the gradients
        into its bucket on its ``reduce_and_partition_stream`` and reduce-scatters there: the
        norms are taken on that stream, between the two. ZeRO-1/2 copy on the streams that ran
        the gradient hooks (``IPGBucket.copy_streams`` under ``overlap_comm``) and reduce on a
        stream that waits for the current one: the current stream waits for those copies."""
        opt = self.optimizer
        if not torch.cuda.is_available():
            yield
            return
        if self.seam == PARTITION:
            stream = getattr(opt, "reduce_and_partition_stream", None)
            if isinstance(stream, torch.cuda.Stream):
                with torch.cuda.stream(stream):
                    yield
                return
        else:
            current = torch.cuda.current_stream()
            for bucket in opt.ipg_buckets.values():
                for producer in getattr(bucket, "copy_streams", ()):
                    if isinstance(producer, torch.cuda.Stream) and producer != current:
                        current.wait_stream(producer)
        yield

    def _bucket_grads(self, args: tuple[Any, ...]) -> Iterable[tuple[Any, torch.Tensor]]:
        """ZeRO-1/2: the buckets ``reduce_ipg_grads(comm_dtype=None)`` is about to reduce (one
        dtype's, or all), as (parameter, local gradient) pairs."""
        opt = self.optimizer
        dtypes = [args[0]] if args and args[0] is not None else list(opt.ipg_buckets)
        for dtype in dtypes:
            bucket = opt.ipg_buckets[dtype]
            for (group, index, _), grad in zip(bucket.params, bucket.grads, strict=True):
                yield opt.bit16_groups[group][index], grad

    def _partition_grads(self, args: tuple[Any, ...]) -> Iterable[tuple[Any, torch.Tensor]]:
        """ZeRO-3: the bucket of ``communication_data_type`` about to be reduce-scattered."""
        for param in self.optimizer.ipg_buckets[args[0]].params:
            yield param, param.grad

    def check_bucket(self, pairs: Iterable[tuple[Any, torch.Tensor]]) -> None:
        """One bucket's local gradients, just before DeepSpeed reduces them: a due grad drill
        is written into the step's first one, then one norm per parameter, one per bucket."""
        started = time.perf_counter()
        pairs = [(p, g) for p, g in pairs if g is not None]
        if not pairs:
            return
        if not self.norms:
            self.sink.before_reduction(pairs[0][1])
        self.sink.reducing()
        self._record([self.names.get(id(p), "<unnamed>") for p, _ in pairs],
                     [g for _, g in pairs])
        self.sink.spent(time.perf_counter() - started)

    def _record(self, names: list[str], grads: list[torch.Tensor]) -> None:
        for idx, norms in checks.grouped_norms(grads):
            norm = torch.linalg.vector_norm(norms)
            if norms.is_cuda:
                # Made on the current stream (ZeRO-3: its reduce stream), read on the default
                # stream at step(): the allocator must not reuse them before that.
                for kept in (norms, norm):
                    kept.record_stream(torch.cuda.default_stream(norms.device))
            self.norms.append(([names[i] for i in idx], norms))
            self.sink.add_grad_norm(norm)

    def check_now(self) -> None:
        """At ``step()`` (the accumulation boundary), when the exchange has not left yet.
        ``allreduce``: check every local gradient, launch the exchange, then run DeepSpeed's
        all-reduce. The bucket seams checked each bucket already; when none was reduced (no
        backward) there is nothing DeepSpeed will reduce either, and ``step()`` launches the
        exchange."""
        if self.seam != ALLREDUCE:
            return
        started = time.perf_counter()
        opt = self.optimizer
        local = getattr(opt, "get_gradient_for_reduction", None)  # ZeRO-1: grad or grad_accum
        pairs = [(n, local(p) if local is not None else p.grad)
                 for n, p in self.engine.module.named_parameters() if p.requires_grad]
        pairs = [(n, g) for n, g in pairs if g is not None]
        if pairs:
            self.sink.before_reduction(pairs[0][1])
            self.sink.reducing()
            self._record([n for n, _ in pairs], [g for _, g in pairs])
        self.sink.spent(time.perf_counter() - started)
        self.sink.launch_exchange()  # beside DeepSpeed's all-reduce, not after it
        self.engine.allreduce_gradients()  # public; DeepSpeed's own cost, not the sentinel's

    def take_norms(self) -> KeptNorms | None:
        return None  # its own per-parameter norms name the parameters; it keeps the host gate

    def naming_detail(self, poisoned: bool, peers: Any,
                      kept: KeptNorms | None = None) -> dict[str, Any]:
        """A poisoned rank's parameters whose local gradients were non-finite before the
        reduction, from the norms the checks kept (one host copy, after a detection only; no
        collective)."""
        if not poisoned or not self.norms:
            return {}
        flags = torch.cat([(~torch.isfinite(n)).to(torch.int32) for _, n in self.norms])
        names = [name for names, _ in self.norms for name in names]
        bad = [names[i] for i in flags.nonzero().flatten().tolist()]
        bad = list(dict.fromkeys(bad))  # a parameter of several micro-batches: once
        return {"parameters": bad} if bad else {}

    def reset(self) -> None:
        self.norms = []
        self._launched = False

    def release(self) -> None:
        """Give the engine back as DeepSpeed made it (at ``Sentinel.close``): its own
        all-reduce in backward, its optimizer's own methods. Idempotent."""
        self.engine.enable_backward_allreduce = self._allreduce
        for method in self._wrapped:
            vars(self.optimizer).pop(method, None)
        self._wrapped = []
