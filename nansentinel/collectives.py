"""The small collectives a detection needs beside the step's exchange.

After a detection (never on a healthy step) ranks share details for the report, the replay
moves one batch between two ranks and sums its flags, and the stop path waits for everyone's
files to be on disk. :class:`Peers` runs those on the exchange's process group; the exchange
itself (exchange.py) keeps only the health vector of each step and its failure diagnosis.
"""

from __future__ import annotations

import io
import json
import logging

import torch
import torch.distributed as dist

log = logging.getLogger("nansentinel")


class Peers:
    """This rank among its peers in one process group (or alone, without one).

    Args:
        group: the process group; None means the default group when one is initialised,
            else no collective at all (world size 1).
        device: this rank's device; the collectives run there for NCCL, on CPU for gloo.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        nccl = self.distributed and "nccl" in str(dist.get_backend(group))
        #: Where collective tensors live: the CUDA device under NCCL, else the CPU.
        self.comm_device = device if nccl and device.type == "cuda" else torch.device("cpu")
        #: The gradient averaging can use ReduceOp.AVG (NCCL) instead of scale-then-sum.
        self.supports_avg = bool(nccl and device.type == "cuda")

    @property
    def alone(self) -> bool:
        """No peer to talk to: every collective is the identity."""
        return not (self.distributed and self.world_size > 1)

    def barrier(self) -> None:
        """A tiny collective used after an incident, so that rank 0's report is on disk
        before any rank raises and torchrun tears the job down."""
        if not self.alone:
            flag = torch.zeros(1, device=self.comm_device)
            dist.all_reduce(flag, group=self.group)

    def gather_json(self, payload: object) -> list[object]:
        """All-gather one JSON-able object per rank (used once at start and after incidents).

        Built on tensors rather than ``all_gather_object`` (which needs numpy on some CPU
        builds) so that it runs wherever the training does.
        """
        text = json.dumps(payload).encode()
        if self.alone:
            return [json.loads(text)]
        data = torch.tensor(list(text), dtype=torch.uint8, device=self.comm_device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=self.comm_device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        lengths = [int(s) for s in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self.comm_device)
        padded[: data.numel()] = data
        out = [torch.zeros_like(padded) for _ in range(self.world_size)]
        dist.all_gather(out, padded, group=self.group)
        return [json.loads(bytes(t[:n].tolist())) for t, n in zip(out, lengths, strict=True)]

    def send_object(self, obj: object, src: int, dst: int) -> object | None:
        """Move one batch-like object from rank ``src`` to rank ``dst``; other ranks do nothing.
        Used only by the replay after a detection.

        What travels is :func:`plain` of ``obj`` (tensors, strings, numbers, and dicts, lists
        and tuples of them), and the receiver loads it with ``weights_only=True``: a rank never
        executes what another rank sends. Bytes that are not such data are refused (logged,
        None returned), so the replay is skipped rather than anything run.
        """
        if self.alone or src == dst:
            return obj if self.rank == dst else None
        if self.rank not in (src, dst):
            return None
        other = dst if self.rank == src else src
        peer = dist.get_global_rank(self.group, other) if self.group is not None else other
        if self.rank == src:
            buf = io.BytesIO()
            torch.save(plain(obj)[0], buf)
            self._send_bytes(buf.getvalue(), peer)
            return None
        payload = self._recv_bytes(peer)
        try:
            return torch.load(io.BytesIO(payload), weights_only=True)
        except Exception as exc:  # UnpicklingError and whatever a hostile payload raises
            log.warning(
                "nansentinel: rank %d refused the batch rank %d sent for replay (not plain data: "
                "%s: %s); the replay is skipped", self.rank, src, type(exc).__name__,
                str(exc).splitlines()[0] if str(exc) else "",
            )
            return None

    def _send_bytes(self, data: bytes, peer: int) -> None:
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        size = torch.tensor([tensor.numel()], dtype=torch.int64)
        dist.send(size.to(self.comm_device), peer, group=self.group)
        dist.send(tensor.to(self.comm_device), peer, group=self.group)

    def _recv_bytes(self, peer: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64, device=self.comm_device)
        dist.recv(size, peer, group=self.group)
        data = torch.empty(int(size), dtype=torch.uint8, device=self.comm_device)
        dist.recv(data, peer, group=self.group)
        return bytes(data.cpu().contiguous().untyped_storage())

    def sum_floats(self, values: list[float]) -> list[float]:
        """Element-wise sum of a short float list across ranks (identity alone)."""
        t = torch.tensor(values, dtype=torch.float32, device=self.comm_device)
        if not self.alone:
            dist.all_reduce(t, group=self.group)
        return t.tolist()


#: Leaf types that travel between ranks and load with ``torch.load(weights_only=True)``.
_PLAIN_LEAVES = (torch.Tensor, str, bytes, int, float, bool, type(None))


def plain(obj: object, where: str = "batch") -> tuple[object, list[str]]:
    """``obj`` reduced to plain data (tensors, strings, numbers, None, and dicts with string
    or integer keys, lists and tuples of them), and the places of what was left out.

    Anything else (a user's class, a named tuple's type) would need unpickling code on the
    receiving rank: it is dropped (a dict entry removed, a list item replaced by None) and its
    place and type named, so the report can say what the replay ran without.
    """
    dropped: list[str] = []

    def walk(x: object, path: str) -> object:
        if isinstance(x, _PLAIN_LEAVES):
            return x
        if type(x) is dict:
            out = {}
            for k, v in x.items():
                sub = f"{path}[{k!r}]"
                if not isinstance(k, str | int) or isinstance(k, bool):
                    dropped.append(f"{sub} (key of type {type(k).__name__})")
                    continue
                value = walk(v, sub)
                if value is not _DROPPED:
                    out[k] = value
            return out
        if type(x) in (list, tuple):
            items = [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]  # type: ignore[attr-defined]
            return type(x)(None if v is _DROPPED else v for v in items)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple: values kept
            dropped.append(f"{path} (the {type(x).__name__} type; sent as a plain tuple)")
            return tuple(None if v is _DROPPED else v for v in (walk(v, f"{path}.{f}")
                         for f, v in zip(x._fields, x, strict=True)))
        dropped.append(f"{path} ({type(x).__module__}.{type(x).__qualname__})")
        return _DROPPED

    out = walk(obj, where)
    return (None if out is _DROPPED else out), dropped


_DROPPED = object()
