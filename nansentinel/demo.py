"""The demo job: CPU ranks (gloo) train a small transformer on synthetic data, with a fault.

``nansentinel demo`` starts it under torchrun (4 ranks by default) with one injected fault, and
rank 0 prints a line per step and the incident. It is also a readable template of the three
calls a training loop needs, and of checkpoint/resume as torchrun scripts do it, which is how
the job goes on after a faulty host is excluded (``nansentinel run`` restarts the workers),
and of the checkpoint-and-stop on SIGTERM at a step every rank agrees on.

Run one worker directly under torchrun::

    torchrun --standalone --nproc-per-node=4 -m nansentinel.demo --steps 20
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import nansentinel
from nansentinel.common.exitcodes import (
    EXIT_EXCHANGE_TIMEOUT,
    EXIT_HOST_EXCLUDED,
    EXIT_NONFINITE_ABORT,
)
from nansentinel.common.report import write_new

_SUMMARY = "The nansentinel demo job (one worker; run it under torchrun)."
VOCAB, SEQ, DIM = 64, 16, 32


class TinyTransformer(nn.Module):
    """Two encoder layers over token embeddings; learns ``next = (token + 1) % VOCAB``."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        layer = nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) * scale + self.pos
        return self.head(self.encoder(h))


def synthetic_batch(rank: int, step: int, batch: int = 16) -> dict[str, torch.Tensor]:
    """A deterministic batch per (rank, step): tokens, targets and a float input scale."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return {"tokens": tokens, "targets": (tokens + 1) % VOCAB, "scale": torch.ones(batch, 1, 1)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m nansentinel.demo", description=_SUMMARY)
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sleep", type=float, default=0.0,
                   help="pause after each step, seconds (to watch the metrics live)")
    p.add_argument("--checkpoint-dir", help="save a checkpoint here and resume from it")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--out", help="rank 0 writes the final weights here (torch.save)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 (fully_shard on each layer, then the root) "
                   "instead of DDP")
    args = p.parse_args(argv)
    problem = demo_arg_problem(args.steps, args.sleep)
    if problem:
        p.error(problem)
    if args.checkpoint_every < 1:
        p.error(f"--checkpoint-every={args.checkpoint_every}: must be 1 or more")
    if args.fsdp and args.checkpoint_dir:
        p.error("--checkpoint-dir saves rank 0's whole model; under --fsdp each rank holds a "
                "shard, which this demo does not checkpoint (use torch.distributed.checkpoint)")
    if args.fsdp and "WORLD_SIZE" not in os.environ:
        p.error("--fsdp needs ranks: run it under torchrun or `nansentinel demo --fsdp`")
    return args


def demo_arg_problem(steps: int, sleep: float) -> str | None:
    """What is wrong with ``--steps`` and ``--sleep``, in one line (None: nothing): checked by
    ``nansentinel demo`` before it starts any rank, and by each worker run directly."""
    if steps < 0:
        return f"--steps={steps}: must be 0 or more"
    if not 0 <= sleep <= 3600:  # NaN fails too; time.sleep refuses a negative pause
        return f"--sleep={sleep}: must be a number of seconds from 0 to 3600"
    return None


def main(argv: list[str] | None = None) -> int:
    """One demo worker; a stop the sentinel decided (abort, exclusion, a rank that did not
    answer) is one line on this rank, not a traceback: the launcher's summary after it
    names every rank, the step and the report, and its exit code says which stop it was."""
    try:
        return _train(parse_args(argv))
    except (nansentinel.NonFiniteError, nansentinel.ExchangeTimeoutError) as exc:
        rank = os.environ.get("RANK", "0")
        # One write: the ranks share the terminal, and print's two writes interleave.
        sys.stderr.write(f"rank {rank}: stopped: {str(exc).removeprefix('nansentinel: ')}\n")
        sys.stderr.flush()
        # The code the launcher gives for the same stop (common/exitcodes.py), so that the
        # demo under plain torchrun says which stop it was too.
        if isinstance(exc, nansentinel.HostExcludedError):
            return EXIT_HOST_EXCLUDED
        if isinstance(exc, nansentinel.ExchangeTimeoutError):
            return EXIT_EXCHANGE_TIMEOUT
        return EXIT_NONFINITE_ABORT


def _train(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        # Long enough for the sentinel to name a missing rank first (exchange_timeout 300 s).
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)  # identical initial weights on every rank
    model: nn.Module = TinyTransformer()
    if distributed and args.fsdp:
        # FSDP2 warns that the root returns a view (the head's matmul output): harmless here,
        # nothing writes into the logits in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
        model = _shard(model)  # the sentinel checks each group before its reduce-scatter
    elif distributed:
        model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    def step_loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = module(batch["tokens"], batch["scale"])
        return loss_fn(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))

    # replay=: after a detection, the batch is replayed to tell data, host and transient apart.
    sentinel = nansentinel.Sentinel(model, optimizer, replay=step_loss)
    start = _resume(args, model, optimizer, sentinel)
    # A PendingResult under NANSENTINEL_GATE=device: decided when its fields are read.
    results: list[nansentinel.StepResult | nansentinel.PendingResult] = []
    # Closed on every rank at the end (a common point: a finished job exits 0), or
    # abandoned without a collective if this rank's loop raised.
    with sentinel:
        for step in range(start, args.steps):
            batch = sentinel.check_batch(synthetic_batch(rank, step))
            loss = step_loss(model, batch)
            sentinel.check_loss(loss)
            loss.backward()
            result = sentinel.step()
            assert result is not None  # None only on a DeepSpeed micro-batch
            results.append(result)
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                bad = (f" bad ranks {result.bad_ranks} hosts {result.bad_hosts} kinds "
                       f"{result.kinds} verdict {result.verdict or 'none'}")
                print(
                    f"step {result.step:3d} {result.outcome:8s} loss {result.local_loss:.4f} "
                    f"grad_norm {result.local_grad_norm:.4f}" + (bad if result.bad_ranks else ""),
                    flush=True,
                )
            # SIGTERM (a time limit, scancel) or Ctrl-C reached some rank: every rank's result
            # says so after the same step. Checkpoint it, then close(), which ends the process
            # with 128 + the signal (143, 130) on every rank (docs/training-loop.md).
            stopping = result.stop_requested
            if args.checkpoint_dir and ((step + 1) % args.checkpoint_every == 0 or stopping):
                _save(args, model, optimizer, sentinel, rank)
            if stopping:
                if rank == 0:
                    print(f"stopping after step {result.step}: signal {result.stop_signal} "
                          "asked the run to stop", flush=True)
                sentinel.close()  # raises nansentinel.StopRequested
            if args.sleep:
                time.sleep(args.sleep)
        # Whole tensors (FSDP2 shards are gathered: a collective every rank makes).
        weights = {k: _whole(t) for k, t in _module(model).state_dict().items()}
        checked = weights_check(weights, distributed)
        if rank == 0:
            print(summary(results, checked, sentinel.world_size), flush=True)
        if checked != "ok":
            raise RuntimeError(f"rank {rank}: after training, the weights are {checked}")
        if rank == 0 and args.out:
            write_new(Path(args.out), lambda tmp: torch.save(weights, tmp))
    if distributed:
        dist.destroy_process_group()  # safe after close(): every rank has passed its barrier
    return 0


def weights_check(weights: dict[str, torch.Tensor], distributed: bool) -> str:
    """``ok`` when every rank's weights are finite and equal to rank 0's, bit for bit;
    otherwise what is wrong. Checked, not assumed: rank 0's weights are broadcast and each
    rank compares, then one all-reduce tells every rank the worst answer."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in weights.values()])
    problems = torch.zeros(2)  # [ranks with non-finite weights, ranks that differ]
    problems[0] = float(not bool(torch.isfinite(flat).all()))
    if distributed:
        reference = flat.clone()
        dist.broadcast(reference, src=0)
        problems[1] = float(not torch.equal(reference, flat))
        dist.all_reduce(problems)
    if problems[0]:
        return f"not finite on {int(problems[0])} rank(s)"
    if problems[1]:
        return f"different from rank 0's on {int(problems[1])} rank(s)"
    return "ok"


def summary(results: list[nansentinel.StepResult | nansentinel.PendingResult], checked: str,
            world_size: int) -> str:
    """The demo's closing lines: steps by outcome, each incident, and the weights check."""
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    counted = ", ".join(f"{n} {outcome.replace('_', ' ')}" for outcome, n in outcomes.items())
    lines = [f"summary: {len(results)} steps: {counted or 'none run'}"]
    for r in results:
        if not (r.bad_ranks or r.spikes):
            continue
        where = ""
        if r.bad_ranks:
            ranks, hosts = r.bad_ranks, r.bad_hosts
            where = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:8]))}"
                     f"{' …' if len(ranks) > 8 else ''} on host{'s' if len(hosts) > 1 else ''} "
                     f"{', '.join(hosts[:8])}{' …' if len(hosts) > 8 else ''}")
        lines.append(
            f"  incident at step {r.step}: {where or 'spike'}; non-finite {', '.join(r.kinds)}"
            f"; verdict {r.verdict or 'none'}; step {r.outcome.replace('_', ' ')}"
            + (f"; report {r.report_path}" if r.report_path else "")
        )
    lines.append(
        f"  weights: finite and identical on all {world_size} rank(s) (checked)" if checked == "ok"
        else f"  weights: {checked}"
    )
    return "\n".join(lines)


def _module(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def _shard(model: nn.Module) -> nn.Module:
    """FSDP2 over every rank, as torchtitan applies it: each encoder layer, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.encoder.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # in place: the same module, its class now FSDP's
    return model


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor as a whole: a DTensor (FSDP2 shard) gathered from every rank."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _checkpoint_path(args: argparse.Namespace) -> Path:
    return Path(args.checkpoint_dir) / "demo-checkpoint.pt"


def _save(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
          sentinel: nansentinel.Sentinel, rank: int) -> None:
    """Rank 0 saves model, optimizer and sentinel state atomically (temp file + rename)."""
    if rank != 0:
        return
    path = _checkpoint_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"model": _module(model).state_dict(), "optimizer": optimizer.state_dict(),
         "sentinel": sentinel.state_dict()},
        tmp,
    )
    os.replace(tmp, path)
    print(f"checkpoint saved to {path} after step {sentinel.step_index - 1} (a restart resumes "
          "from it)", flush=True)


def _resume(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer,
            sentinel: nansentinel.Sentinel) -> int:
    if not args.checkpoint_dir or not _checkpoint_path(args).exists():
        return 0
    # Plain data only (tensors, dicts, numbers, strings): nothing in a file is executed.
    state = torch.load(_checkpoint_path(args), weights_only=True)
    _module(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sentinel.load_state_dict(state["sentinel"])
    if sentinel.rank == 0:
        print(f"resumed from {_checkpoint_path(args)} at step {sentinel.step_index}", flush=True)
    return sentinel.step_index


if __name__ == "__main__":
    sys.exit(main())
