"""nansentinel on torchft: one veto on every replica group, and a poisoned group leaves live.

torchft's ``Manager.should_commit()`` agrees within one replica group only. A NaN in group
1's gradients is all-reduced into every group; group 1 does not commit, the others commit the
NaN-averaged gradients, and at the next quorum group 1 heals *from* them: the run is lost on
every group. :func:`Sentinel` closes that hole (the recipe: docs/torchft.md): it builds the
core Sentinel with one more agreement scope, torchft's replica groups
(step/group_scope.py), whose health travels through ``Manager.allreduce``
(wire/group_rows.py); each group's batch, loss and gradients are checked before they
leave it (engines/torchft.py's hook). Its results are :class:`FTStepResult` (result.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from nansentinel import engines
from nansentinel.result import FTStepResult, PoisonedGroup, SentinelUsageError
from nansentinel.step.group_scope import ReplicaGroups
from nansentinel.step.sentinel import Sentinel as _Sentinel

try:
    from nansentinel.engines import torchft as _ft
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("nansentinel.torchft needs torchft: pip install torchft==0.2.0") from exc

DistributedDataParallel = _ft.DistributedDataParallel

__all__ = ["DistributedDataParallel", "FTStepResult", "PoisonedGroup", "ReplicaGroups",
           "Sentinel", "groups_of"]


def _manager_of(model: torch.nn.Module, manager: Any) -> Any:
    """The manager the sentinel decides with: the DDP's, or the one given with a plain module;
    torchft's own DDP (or any other DDP) is refused, naming what to build instead."""
    if isinstance(model, DistributedDataParallel):
        if manager is not None and manager is not model.manager:
            raise SentinelUsageError("nansentinel.torchft.Sentinel: manager= is not the "
                                     "manager the DistributedDataParallel was built with")
        return model.manager
    if engines.recognize(model).CAPS.wraps or manager is None:  # another DDP, an engine
        raise SentinelUsageError(
            "nansentinel.torchft.Sentinel watches nansentinel.torchft.DistributedDataParallel"
            f"(manager, module), or a plain module with manager=, not "
            f"{type(model).__module__}.{type(model).__name__}"
            f"{'' if manager is not None else ' without manager='}: torchft's own DDP "
            "registers the one communication hook DDP allows, and its hook fails an assert "
            "when a peer dies. Build the model with nansentinel's.")
    return manager


def Sentinel(model: torch.nn.Module, optimizer: Any, *, manager: Any = None,
             **kwargs: Any) -> _Sentinel:
    """The sentinel of one rank of a torchft replica group: :class:`nansentinel.Sentinel`
    with torchft's replica groups as a wider agreement scope (see the module's docstring);
    its ``step()`` returns an :class:`FTStepResult`.

    Args:
        model: a :class:`DistributedDataParallel` (nansentinel's, built like torchft's), or
            a plain module whose gradients you reduce with ``manager.allreduce`` yourself:
            call ``check_grads()`` after ``backward()`` and before that all-reduce.
        optimizer: the optimizer, or torchft's ``OptimizerWrapper`` (its inner optimizer is
            stepped; call its ``zero_grad()`` as usual, never its ``step()``).
        manager: the torchft ``Manager`` (a plain module only: the DDP brings its own).
        **kwargs: as :class:`nansentinel.Sentinel` (``policy``, ``host_strikes``, ...;
            keyword > env > default). ``policy="drop"`` is carried out across the groups (on
            nansentinel's DDP only); rollbacks and a GradScaler are refused on torchft.
    """
    manager = _manager_of(model, manager)
    if kwargs.get("scaler") is not None:
        raise SentinelUsageError(
            "nansentinel.torchft.Sentinel takes no GradScaler: an fp16 overflow would be "
            "decided by each group's scaler apart from should_commit(); use bf16")
    groups = ReplicaGroups(manager, group=_ft.replica_id(manager),
                           group_rank=_ft.group_rank(manager),
                           rollback=str(_ft.TorchFTPath.CAPS.rollback),
                           by_hand=not isinstance(model, DistributedDataParallel),
                           carrier=None if isinstance(model, DistributedDataParallel)
                           else _ft.AllReduceHookRider.of(model))
    groups.peers = kwargs.get("group")  # the group's ranks' exchange, if not the default
    scopes = (*kwargs.pop("scopes", ()), groups)
    try:
        return _Sentinel(model, _ft.stepped(optimizer), scopes=scopes, **kwargs)
    except Exception as exc:  # refused on this rank before the group's gather: its peers
        environ = os.environ if kwargs.get("env") is None else kwargs["env"]
        groups.refused(exc, kwargs.get("hostname"), environ)
        raise  # are told (they refuse too, naming it), not left waiting in the gather


def groups_of(sentinel: _Sentinel) -> ReplicaGroups:
    """The replica groups' scope of a sentinel :func:`Sentinel` built: its ``manager``, its
    ``group`` id, its ``group_rank``."""
    found = [s for s in sentinel.scopes if isinstance(s, ReplicaGroups)]
    if not found:
        raise SentinelUsageError("nansentinel.torchft.groups_of: this Sentinel was not built "
                                 "by nansentinel.torchft.Sentinel (it has no replica groups)")
    return found[0]
