"""The torchft gradient path: each bucket checked before it leaves the replica group, and the
replica groups' health summed through torchft's own managed all-reduce.

torchft (``torchft.Manager``) lets replica groups leave and rejoin a running job, but its veto
is per group: ``should_commit()`` agrees within a group only. A NaN that one group all-reduces
into the others is committed by them, and at the next quorum the poisoned group heals *from*
them and takes the NaN weights too. So the check must come before the gradients leave the
group (only there can a group be named), and the health must travel to every group through
the same managed process group as the gradients, so that every group vetoes the same step.

Two pieces here, where torchft reaches the gradients (what the groups tell each other is
in wire/group_rows.py, how they decide a step together in step/group_scope.py):

- :class:`DistributedDataParallel`: torchft's DDP, whose one communication hook (DDP allows
  one, and torchft's registers it in its constructor) checks each bucket once a sentinel
  watches it, and turns a failed all-reduce into torchft's regroup instead of torchft's
  ``assert fut._fut``, which crashes the survivors' backward when a peer dies.
- :class:`TorchFTPath`: the gradient path the sentinel attaches to it (engines/__init__.py):
  one norm of each bucket before it leaves, and under the groups' ``policy="drop"`` zeros in
  place of a poisoned group's buckets (:func:`withhold`).

torchft's private attributes are read here only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torchft.ddp import DistributedDataParallel as _TorchFTDDP
from torchft.optim import OptimizerWrapper

from nansentinel import checks
from nansentinel.common import torch_insides as insides
from nansentinel.engines.base import Capabilities, GradientSink
from nansentinel.engines.local import BucketNorms, BucketPath, check_local_grads
from nansentinel.result import SentinelUsageError


class _HookState:
    """What the communication hook reads: the manager, and the path once a sentinel watches."""

    __slots__ = ("manager", "path")

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.path: TorchFTPath | None = None


class TorchFTPath(BucketPath):
    """Checks the buckets of :class:`DistributedDataParallel` in its communication hook."""

    CAPS = Capabilities(
        label="torchft DDP", wraps=True,
        device_gate="torchft decides a step on the host, at Manager.should_commit()",
        replay=("a replay's backward would reach torchft's reducer, whose hook all-reduces "
                "across the replica groups"),
        drop=("policy='drop' is carried out across the replica groups by "
              "nansentinel.torchft.Sentinel, not by the group's own decision"),
        rollback=("a rollback would restore one replica group's snapshot; torchft heals a "
                  "group from a healthy peer instead"),
        fingerprints="torchft heals a replica group from a peer's weights at each quorum",
    )
    mesh_groups: tuple[Any, ...] = ()

    @staticmethod
    def recognizes(model: Any) -> bool:
        return isinstance(model, DistributedDataParallel)

    def __init__(self, model: DistributedDataParallel, sink: GradientSink) -> None:
        self.model, self.sink = model, sink
        self.manager = model.manager
        self.caps = self.CAPS
        self.keep_norms = False
        self.buckets = 0
        #: Under the groups' ``policy="drop"``: this group's 0-d flag (batch or loss
        #: non-finite), set by the integration; taken at the step's first bucket.
        self.drop_flag: Callable[[], torch.Tensor] | None = None
        #: The flag this step's buckets were withheld by (None: not dropping).
        self.withheld: torch.Tensor | None = None
        #: The replica groups' scope whose health row leaves with the last bucket (its
        #: ``row()``, and ``carried`` where the summed row comes back); None: it does not.
        self.rider: Any = None
        self._norms = BucketNorms(model)
        model._hook_state.path = self

    def before_reduction(self, bucket: Any) -> None:
        """One norm of the bucket's local gradients, on the device, before they leave."""
        buffer = bucket.buffer()
        if self.buckets == 0:
            self.sink.before_reduction(buffer)
            self.withheld = self.drop_flag() if self.drop_flag is not None else None
        self.buckets += 1
        self.sink.add_grad_norm(self._norms.norm(bucket, self.keep_norms))
        if self.withheld is not None:
            withhold(buffer, self.withheld)

    def check_now(self) -> None:
        """No bucket was reduced this step: check the local gradients as they are."""
        check_local_grads(self.model.parameters(), self.sink)

    def take_withheld(self) -> bool:
        """Whether this step's buckets went as zeros (one host read of the flag); forgets it."""
        flag, self.withheld = self.withheld, None
        return flag is not None and bool(flag)

    def release(self) -> None:
        """The sentinel is closed: the hook reduces as torchft's does again."""
        self.model._hook_state.path = None


class DistributedDataParallel(_TorchFTDDP):
    """``torchft.ddp.DistributedDataParallel`` with a communication hook the sentinel can watch.

    Build it exactly as torchft's (``DistributedDataParallel(manager, module)``). Until a
    ``nansentinel.torchft.Sentinel`` watches it, it reduces as torchft's does, except that a
    failed all-reduce (a dead peer, an errored manager) leaves the step to torchft's
    ``should_commit()`` (False) and the next quorum, where torchft's hook fails an assert.
    """

    #: The gradient path that takes it (engines.recognize).
    gradient_path = TorchFTPath
    #: The health exchange inside the replica group: the default process group when one is
    #: initialised (a group of several ranks), else none (a group of one process).
    sentinel_group = None

    def __init__(self, manager: Any, module: torch.nn.Module, **kwargs: Any) -> None:
        object.__setattr__(self, "_hook_state", _HookState(manager))
        super().__init__(manager, module, **kwargs)

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """torchft's constructor registers its own hook (state: the manager): ours instead."""
        super().register_comm_hook(self._hook_state, _comm_hook)

    @property
    def manager(self) -> Any:
        return self._hook_state.manager


def _comm_hook(state, bucket):
    """Check the bucket (once a sentinel watches), then average it over the quorum through
    ``Manager.allreduce``, as torchft's hook does. An error is reported to the manager (its
    ``should_commit()`` is then False and the next quorum regroups) and the bucket comes back
    as it is, never an exception in the backward.

    Deliberately unannotated: DDP inspects the annotations of a comm hook."""
    path: TorchFTPath | None = state.path
    buffer = bucket.buffer()
    started = time.perf_counter()
    sent = buffer
    if path is not None:
        path.before_reduction(bucket)
        if bucket.is_last():  # the step's health leaves with its last gradients
            path.sink.launch_exchange()
            if path.rider is not None:  # and the replica groups' row rides in their all-reduce
                sent = torch.cat([buffer.reshape(-1), path.rider.row().to(buffer)])
    spent = time.perf_counter() - started
    work = state.manager.allreduce(sent)
    work.wait()  # torchft's hook waits too; a failure is reported to the manager here
    future = work.get_future()
    inner = getattr(future, "_fut", future)  # _ManagedFuture: the torch future inside
    reduced = buffer
    if sent is not buffer:
        path.rider.carried = None  # type: ignore[union-attr]
        if inner is not None:
            summed = inner.wait()  # averaged over the participants
            # DDP copies a hook's result into the gradients itself: the bucket's part is
            # handed over as a view, not copied back into the bucket first.
            reduced = summed[:buffer.numel()]
            path.rider.carried = summed[buffer.numel():]  # type: ignore[union-attr]
        inner = None
    if inner is None:  # the all-reduce failed before torchft chained it (a regroup), or the
        inner = torch.futures.Future()  # row was split off the bucket
        inner.set_result(reduced)
    if path is not None:
        path.sink.spent(spent)
    return inner


def withhold(buffer: torch.Tensor, flag: torch.Tensor) -> None:
    """Zeros in place of this group's bucket where the 0-d bool ``flag`` is set, before it
    leaves: on the CPU from the host value (no kernel on a healthy step), elsewhere a select on
    the device in stream order (no host sync; NaN x 0 is NaN, a select is not)."""
    if flag.device.type == "cpu" and buffer.device.type == "cpu":
        if bool(flag):
            buffer.zero_()
        return
    buffer.masked_fill_(flag.to(buffer.device), 0)


def replica_id(manager: Any) -> str:
    """The replica group's id as the user gave it (torchft appends a uuid for the lighthouse)."""
    return str(getattr(manager, "_replica_id", None) or "0")


def group_rank(manager: Any) -> int:
    """This process's rank inside its replica group."""
    return int(getattr(manager, "_group_rank", 0))


def stepped(optimizer: Any) -> Any:
    """What the sentinel steps: the optimizer inside torchft's ``OptimizerWrapper`` (whose own
    ``step()`` would ask ``should_commit()`` a second time), else the optimizer itself."""
    return optimizer.optim if isinstance(optimizer, OptimizerWrapper) else optimizer


class AllReduceHookRider:
    """torchft's FSDP2 recipe (torchtitan's fault-tolerant mode): inside a replica group FSDP2
    reduce-scatters, and each FSDP module's all-reduce hook (``set_all_reduce_hook``) averages
    its reduced shard across the groups through a ``ManagedProcessGroup``. The step's health
    leaves in its last hook call: the exchange inside the group is launched there (every
    gradient of the step was checked by then), and that call's shard goes to the user's hook
    with the replica groups' row appended (the hook must all-reduce the tensor it is given in
    place with ``AVG``, as torchft's recipe and torchtitan's hook do), and comes back split.

    The last call is the one that completes the count of FSDP parameter groups with a hook:
    every group runs the same model, so every group's rows leave in the same collective. On a
    shard group of one FSDP2 reduce-scatters nothing (the gradient path checks nothing before
    the hooks), and a hook's input is this rank's own gradients: they are checked here, before
    the hook sends them to the other groups.

    The user's hooks are wrapped only once the sentinel is built (:meth:`install`, at the
    scope's ``bind``: a construction refused before leaves them as they were) and given back
    at ``close()`` (:meth:`release`), so that a later sentinel can watch the model again.
    """

    def __init__(self, groups: list[Any]) -> None:
        self.groups = groups
        self.calls = 0
        #: The step in progress (a ``GradientSink``), once a sentinel watches the model.
        self.sink: Any = None
        #: As :attr:`TorchFTPath.rider`: the scope whose row rides along, once bound.
        self.rider: Any = None
        #: Per group: the user's hook as found, and the wrapper in its place once installed.
        self._hooks: list[tuple[Callable[[torch.Tensor], None], Any]] = []
        for group in groups:
            hook = insides.fsdp_all_reduce_hook(group)
            assert hook is not None, "the rider takes the groups that have a hook (of)"
            self._hooks.append((hook, None))

    def install(self) -> None:
        """Each group's hook wrapped (once; the sentinel is built, nothing can refuse it now).
        A hook replaced since :meth:`of` found it is wrapped as it is now."""
        if any(wrapper is not None for _, wrapper in self._hooks):
            return
        installed = []
        for group in self.groups:
            hook = insides.fsdp_all_reduce_hook(group)
            assert hook is not None, "a hook taken off between of() and install()"
            alone = getattr(getattr(group, "mesh_info", None), "shard_mesh_size", 2) == 1
            wrapper = self._wrapped(hook, alone)
            insides.set_fsdp_all_reduce_hook(group, wrapper)
            installed.append((hook, wrapper))
        self._hooks = installed

    def release(self) -> None:
        """The sentinel is closed (or its construction failed after :meth:`install`): each
        group's hook is the user's own again, the same object, where our wrapper still holds
        its place (a hook the user set since is left alone). Idempotent."""
        for group, (hook, wrapper) in zip(self.groups, self._hooks, strict=True):
            if wrapper is not None and insides.fsdp_all_reduce_hook(group) is wrapper:
                insides.set_fsdp_all_reduce_hook(group, hook)
        self._hooks = [(hook, None) for hook, _ in self._hooks]
        self.sink = self.rider = None
        self.calls = 0

    @classmethod
    def of(cls, model: torch.nn.Module) -> AllReduceHookRider | None:
        """The rider of a ``fully_shard``-ed model whose FSDP modules have all-reduce hooks;
        None where none has one (the gradients are reduced across the groups by hand). Hooks
        on some FSDP modules only are refused: the others' gradients would not be averaged
        across the groups, and the groups' weights would part."""
        from torch.distributed.fsdp import FSDPModule

        # Several modules sharded in one call (torchtitan's ``fully_shard([norm, lm_head])``)
        # share one group: wrapped and counted once.
        found = [(name, g) for name, m in model.named_modules() if isinstance(m, FSDPModule)
                 for g in insides.fsdp_param_groups(m)]
        hooked = {id(g): g for _, g in found if insides.fsdp_all_reduce_hook(g) is not None}
        bare = sorted({name or "the root" for name, g in found if id(g) not in hooked})
        if hooked and bare:
            raise SentinelUsageError(
                f"nansentinel.torchft.Sentinel: FSDP module(s) {', '.join(bare[:5])} have no "
                "all-reduce hook while others have one: their gradients would not be "
                "averaged across the replica groups, and the groups' weights would part. Set "
                "the hook on every FSDPModule (set_all_reduce_hook), then build the sentinel.")
        return cls(list(hooked.values())) if hooked else None

    def _wrapped(self, hook: Callable[[torch.Tensor], None], alone: bool
                 ) -> Callable[[torch.Tensor], None]:
        def ride(output: torch.Tensor) -> None:
            sink = self.sink
            if sink is None or sink.inferring:
                hook(output)
                return
            started = time.perf_counter()
            self.calls += 1
            if alone:  # this rank's own gradients, about to leave the group unchecked
                if self.calls == 1:
                    sink.before_reduction(output)
                sink.add_grad_norm(checks.tensor_norm(output))
            sent = output
            if self.calls == len(self.groups):  # the step's last call
                self.calls = 0
                sink.launch_exchange()
                if self.rider is not None:
                    sent = torch.cat([output.reshape(-1), self.rider.row().to(output)])
            sink.spent(time.perf_counter() - started)
            hook(sent)
            if sent is not output:
                output.copy_(sent[:output.numel()].view_as(output))
                self.rider.carried = sent[output.numel():]
        return ride

    def reset(self) -> None:
        """A step ended: the next backward's calls are counted from zero."""
        self.calls = 0
