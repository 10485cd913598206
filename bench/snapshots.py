"""Host memory of a rollback snapshot per rank: the old full copy against today's sharded one.

W gloo ranks on the CPU train a transformer encoder (about 55 M parameters by default) under
DDP with AdamW for one step, so that the optimizer's state exists, then each rank measures two
ways of keeping the last good state:

``before``
    what ``MemorySnapshots`` did until issue 20, item 10: every save built a fresh host copy
    of the whole model and optimizer state (``to_cpu(state_dict(), copy=True)``) while the
    previous copy was still held, so a save held two copies at its peak.
``after``
    ``MemorySnapshots`` as the Sentinel builds it under DDP: this rank's 1/W of the replicated
    weights and optimizer state (small tensors whole), in host buffers allocated once.

Bytes held are counted from the tensors (exact); beside them, the process's resident memory
(RSS, psutil) grown since just before a save, with glibc told to map every allocation of 64 KiB
or more on its own (``MALLOC_MMAP_THRESHOLD_``), so that freed memory leaves the RSS at once.
The second save of ``after`` must allocate nothing (its buffers' addresses are compared), and a
rollback through the gathered slices must restore exactly what was saved (checked, and timed).

    python bench/snapshots.py                       # W = 1, 2, 4; ~55 M parameters; ~1 min
    python bench/snapshots.py --worlds 1,2 --d-model 128 --layers 2 --vocab 1024 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import pickle
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _model(args: dict[str, Any]) -> Any:
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            d = args["d_model"]
            self.embed = nn.Embedding(args["vocab"], d)
            layer = nn.TransformerEncoderLayer(d, args["heads"], 4 * d, dropout=0.0,
                                               batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, args["layers"], enable_nested_tensor=False)
            self.head = nn.Linear(d, args["vocab"])

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.encoder(self.embed(tokens)))

    torch.manual_seed(0)
    return Encoder()


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _train_step(model: Any, opt: Any, rank: int, step: int, args: dict[str, Any]) -> None:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, args["vocab"], (args["batch"], args["seq"]), generator=g)
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _live(net: Any, opt: Any) -> list[Any]:
    out = [t.detach().clone() for t in net.state_dict().values()]
    for state in opt.state.values():
        out += [v.detach().clone() for v in state.values()]
    return out


def one_rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Both variants on this rank; bytes and RSS growth of each."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nansentinel.common.report import to_cpu
    from nansentinel.effects.recovery import MemorySnapshots
    from nansentinel.wire.collectives import Peers
    from nansentinel.wire.context import Watched

    torch.set_num_threads(1)
    net = _model(args)
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _train_step(model, opt, rank, 0, args)
    params = sum(p.numel() for p in net.parameters())
    gc.collect()

    # after: the sharded snapshot, as the Sentinel builds it under DDP.
    peers = Peers(None, torch.device("cpu"))
    snaps = MemorySnapshots(Watched(net, net, opt), peers=peers, replicas=peers)
    rss0 = _rss()
    snaps.save(1)
    first_growth = _rss() - rss0
    pointers = [b.data_ptr() for b in snaps._buffers]
    saved = _live(net, opt)
    _train_step(model, opt, rank, 1, args)
    rss1 = _rss()
    snaps.save(2)
    second_growth = _rss() - rss1
    reused = [b.data_ptr() for b in snaps._buffers] == pointers
    saved = _live(net, opt)
    _train_step(model, opt, rank, 2, args)
    started = time.perf_counter()
    snaps.load()
    restore_s = time.perf_counter() - started
    exact = all(torch.equal(a, b) for a, b in zip(_live(net, opt), saved, strict=True))
    after = {"bytes": snaps.bytes, "unsharded_bytes": snaps.unsharded_bytes,
             "first_save_rss_growth": first_growth, "second_save_rss_growth": second_growth,
             "buffers_reused": reused, "restore_exact": exact, "restore_s": restore_s}
    del snaps, saved
    gc.collect()

    # before: a fresh full copy per save, the previous one still held during the save.
    rss0 = _rss()
    old = {"model": to_cpu(net.state_dict(), copy=True),
           "optimizer": to_cpu(opt.state_dict(), copy=True)}
    first_growth = _rss() - rss0
    held = _tensor_bytes(old)
    _train_step(model, opt, rank, 3, args)
    rss1 = _rss()
    new = {"model": to_cpu(net.state_dict(), copy=True),
           "optimizer": to_cpu(opt.state_dict(), copy=True)}
    during = _rss() - rss0  # both copies alive: the save's peak
    peak_bytes = held + _tensor_bytes(new)
    old = new
    del new
    gc.collect()
    before = {"bytes": held, "save_peak_bytes": peak_bytes, "first_save_rss_growth": first_growth,
              "save_peak_rss_growth": during, "second_save_rss_growth": _rss() - rss1}
    del old
    return {"rank": rank, "world": world, "params": params, "before": before, "after": after}


def _entry(rank: int, world: int, port: int, out: str, args: dict[str, Any]) -> None:
    import torch.distributed as dist

    path = Path(out) / f"rank{rank}.pkl"
    try:
        timeout = datetime.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
        payload: dict[str, Any] = {"ok": True, "value": one_rank(rank, world, args)}
    except BaseException:  # reported by the parent, whatever it was
        payload = {"ok": False, "traceback": traceback.format_exc()}
    path.write_bytes(pickle.dumps(payload))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def run_world(world: int, args: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """``world`` gloo ranks in spawned processes, killed if they outlive ``timeout``; each
    rank's figures. The parent owns the rendezvous store, on a port the OS chose."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(world, store.port, out, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"W = {world}: ranks still running after {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        payloads = [pickle.loads((Path(out) / f"rank{r}.pkl").read_bytes())
                    for r in range(world)]
    for rank, payload in enumerate(payloads):
        if not payload["ok"]:
            raise RuntimeError(f"W = {world}: rank {rank} failed:\n{payload['traceback']}")
    return [p["value"] for p in payloads]


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """Rank 0's figures per world size, as markdown (MB = 10**6 bytes)."""
    lines = [
        "| W | before: held MB | before: peak of a save MB (RSS growth) | after: held MB "
        "(RSS growth) | after: second save allocates | after / before | restore exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, a = r["before"], r["after"]
        lines.append(
            f"| {r['world']} | {_mb(b['bytes'])} | {_mb(b['save_peak_bytes'])} "
            f"({_mb(b['save_peak_rss_growth'])}) | {_mb(a['bytes'])} "
            f"({_mb(a['first_save_rss_growth'])}) | "
            f"{'nothing' if a['buffers_reused'] else 'new buffers'} "
            f"({_mb(a['second_save_rss_growth'])} MB RSS) | {a['bytes'] / b['bytes']:.3f} | "
            f"{'yes' if a['restore_exact'] else 'NO'} ({a['restore_s'] * 1000:.0f} ms) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per world size")
    parser.add_argument("--json", type=Path, help="write every rank's figures here")
    ns = parser.parse_args(argv)
    args = {"d_model": ns.d_model, "layers": ns.layers, "heads": ns.heads, "vocab": ns.vocab,
            "batch": ns.batch, "seq": ns.seq}
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # glibc then maps every allocation of 64 KiB or more on its own and unmaps it when freed,
    # so that RSS follows the bytes alive (else freed heap memory is reused unseen).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    worlds = [int(w) for w in ns.worlds.split(",")]
    ranks = {w: run_world(w, args, ns.timeout) for w in worlds}
    rows = [ranks[w][0] for w in worlds]
    print(f"{rows[0]['params']:,} parameters, AdamW (fp32); rank 0 of each W")
    print(table(rows))
    if ns.json is not None:
        ns.json.parent.mkdir(parents=True, exist_ok=True)
        ns.json.write_text(json.dumps({"model": args, "params": rows[0]["params"], "rows": rows,
                                       "ranks": {str(w): r for w, r in ranks.items()}},
                                      indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
