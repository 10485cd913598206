"""The spike playbook, measured: unstable runs, guarded or not, against a stable one.

A small causal transformer learns a synthetic language on the CPU (an order-2 Markov source
over 32 symbols with one numeric column per token, seeded: the same corpus for every arm),
300 optimizer steps of AdamW with warm-up and cosine decay, held-out loss at the end. Each
*case* is an instability users meet, each *arm* a way of guarding against it, run from the
same seed so that the difference is the guard's:

cases
  stable      no fault: the reference, and where false alarms are counted.
  lr_spike    the learning rate x100 for 20 iterations from step 150: a schedule error (a
              warm-up restarted by a resume, a typo in a per-phase schedule). nanoGPT on real
              text went 2.36 -> 7.76 under it and never recovered.
  lr_long     the learning rate x100 for 60 iterations from step 150: the same schedule error,
              lasting past the rollback's discard windows (10 batches, then 20 on a repeat),
              so that the run resumes while the schedule still asks for the blown-up rate.
  bad_shard   20 batches from step 150 whose numeric column is not normalised (x1000): a shard
              preprocessed without its scaler, extreme but finite.
  fp16        the residual stream kept in float16 (as a half-precision forward keeps it) under
              a GradScaler; 5 batches from step 150 carry a column large enough to overflow it:
              the forward's inf, which the scaler turns into a skipped step, not a repair.
  slow_climb  the learning rate raised linearly from step 100 to x300 at the end (over a
              cosine decay): no single jump, the loss climbs for tens of steps once the
              learning rate passes what the model takes (a scaled-up batch with its LR raised
              by a rule past the edge of stability).
  lr_typo     the peak learning rate 30x from the first step, and no warm-up (a typo in the
              config, a recipe copied from a smaller model): no good state ever existed.
  degenerate data (issue 60): a shard whose rows take a growing share of each batch (one more
              sixteenth a step, RAMP) and are easy to fit, so the loss collapses towards 0,
              then real data returns and the loss jumps against weights that learned it:
  constant    every label the same token, 24 steps from step 150 (a label column filled by
              a bug).
  constant_early  the same, 20 steps from step 60 (while the loss still descends).
  padding     a shard of padding (inputs and labels all the pad token), 28 steps from 150.
  padding_late  the same, 30 steps from step 220 (little time left to recover).
  copied      the inputs copied into the labels (a shift forgotten), 24 steps from 150.
  degenerate data (issue 70), whole batches from the first step unless said:
  constant_burst  every label one token, 15 steps from step 40 (early, short: the loss still
              falls fast).
  constant_late_long  the same, 45 steps from step 200 (late, long).
  half        every label one token in half of each batch, 50 steps from step 150 (the rows
              cannot be told apart: the loss first rises, then sits near its level).
  stuck       a loader serving one real batch again and again, 40 steps from step 150: the
              loss sinks as the weights memorise it (a slow collapse).
  stuck_early the same, 25 steps from step 60.
  boilerplate one real sequence in half of each batch (a header every document repeats), 40
              steps from step 100: a partial collapse.
  constant_past_bound  every label one token, 80 steps from step 120: longer than a rollback
              may undo (max_lost_steps, 60).

arms
  none      the loop as it is (the fp16 case keeps its GradScaler).
  clip      clip_grad_norm_(1.0) every step.
  skip      the sentinel, loss and gradient-norm spikes skip the step (defaults: 10x and 6 sigma).
  rollback  the sentinel, policy and spikes roll back, LR cooldown x0.5 (defaults); an abort
            (max_rollbacks) ends the run there: the steps left are lost.
  recover   the sentinel with spikes="recover" (config.SPIKE_PRESETS["recover"]).
  recover_nojump  recover without the jump rule (lr_jump_ratio=0): what the rollback's own
            learning-rate rules (the known-good cap, the quiet window, clean snapshots) do.
  recover_skip_collapse  recover with collapse_action="skip": the collapsed steps skipped
            rather than only marked (issue 60 chose marking from this arm's figures).
  olmo      OLMo-core's SkipStepOptimizer: skip when the loss or the grad norm is 6 sigma above
            the mean of the last 128 steps (after 20).
  zclip     ZClip: clip the grad norm at its EMA mean + 2.5 EMA std (alpha 0.97, 25 warm-up).
  spam      SPAM: per-coordinate clipping of gradients above sqrt(5000 v) (Adam's second
            moment), and Adam's moments reset when the grad norm is 6 sigma out.
  palm      PaLM's remedy: on a loss 6 sigma out, restart from a checkpoint ~20 steps back and
            skip the next 30 batches (PaLM: ~100 steps back, 200-500 batches).
  oracle    the degenerate cases only: skip exactly the stretch's steps, as if its data had
            never come (what issue 70 asks of recover; no guard could know the stretch's
            bounds this well). Elsewhere the loop as it is.

(The model's causal mask is a boolean buffer: a floating one holding -inf is a non-finite
state to the sentinel since issue 68, which refuses it at construction.)

Reported per case and arm, median and spread (min-max) over seeds: the held-out loss relative
to the stable reference of the same seed (+% worse), steps whose update was lost (skipped,
rolled back over, or never applied), OLMo-core's spike score (the share of steps whose loss is
more than 7 sigma above the mean of the 50 before it), and the guard's actions on the stable
case (false alarms) and the learning-rate steps the jump rule held there (issue 52). Run:
``python bench/recovery.py`` (about 12 minutes on 2 idle cores), ``--smoke`` (six short
runs, seconds), ``--json FILE``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import nansentinel

V, SEQ, BATCH, D_MODEL, LAYERS, HEADS = 32, 32, 16, 48, 2, 4
STEPS, WARMUP, LR = 300, 20, 3e-3
FAULT_AT = 150


class Stretch(NamedTuple):
    """A stretch of degenerate data: what its rows hold, its first step, its length, and the
    share of each batch it takes (None: a growing share, one more ``1 / RAMP`` a step, as a
    loader interleaving shards brings a new one in)."""

    kind: str
    start: int
    length: int
    share: float | None = None


#: The degenerate-data family (issues 60 and 70): the loss collapses on these stretches (an
#: easy target), or sinks as the weights memorise them, then real data returns.
DEGENERATE = {
    "constant": Stretch("constant", FAULT_AT, 24),
    "constant_early": Stretch("constant", 60, 20),
    "padding": Stretch("padding", FAULT_AT, 28),
    "padding_late": Stretch("padding", 220, 30),
    "copied": Stretch("copied", FAULT_AT, 24),
    # issue 70: whole batches at once, early and short, or late and long; part of each batch;
    # a loader re-serving one real batch; repeated boilerplate; a stretch past max_lost_steps.
    "constant_burst": Stretch("constant", 40, 15, 1.0),
    "constant_late_long": Stretch("constant", 200, 45, 1.0),
    "half": Stretch("constant", FAULT_AT, 50, 0.5),
    "stuck": Stretch("stuck", FAULT_AT, 40, 1.0),
    "stuck_early": Stretch("stuck", 60, 25, 1.0),
    "boilerplate": Stretch("boilerplate", 100, 40, 0.5),
    "constant_past_bound": Stretch("constant", 120, 80, 1.0),
}
RAMP = 16  # steps until a degenerate shard fills whole batches
CASES = ("stable", "lr_spike", "lr_long", "bad_shard", "fp16", "slow_climb", "lr_typo",
         *DEGENERATE)
ARMS = ("none", "clip", "skip", "rollback", "recover", "recover_nojump", "recover_skip_collapse",
        "olmo", "zclip", "spam", "palm", "oracle")


# --- the corpus --------------------------------------------------------------------------------

def corpus(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` tokens of an order-2 Markov source (a bigram table and a weaker skip-gram one:
    each context has a few likely successors)
    and one numeric column per token (a normalised value tied to the token, plus noise)."""
    g = torch.Generator().manual_seed(1000 + seed)
    # the last token says most (a bigram table), the one before it some more
    logits = (torch.randn(1, V, V, generator=g) * 3.0 + torch.randn(V, 1, V, generator=g) * 1.5)
    probs = torch.softmax(logits, dim=-1)
    tokens = torch.empty(n, dtype=torch.long)
    tokens[:2] = torch.randint(0, V, (2,), generator=g)
    draws = torch.rand(n, generator=g)
    cdf = probs.cumsum(-1)
    for i in range(2, n):
        row = cdf[tokens[i - 2], tokens[i - 1]]
        tokens[i] = min(int(torch.searchsorted(row, draws[i])), V - 1)
    column = (tokens.float() / (V - 1) - 0.5) * 2 + 0.1 * torch.randn(n, generator=g)
    return tokens, column


def degenerate(kind: str, x: torch.Tensor, col: torch.Tensor, y: torch.Tensor,
               fixed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of degenerate data, as pipelines make it: every label the same token
    (``constant``: a label column filled by a bug), a shard of padding (``padding``: inputs and
    labels all the pad token, its column zero), the inputs copied into the labels
    (``copied``: a shift forgotten), or ``fixed`` rows in every batch (``stuck``: a loader
    re-serving one real batch; ``boilerplate``: one real sequence in every row, a header every
    document repeats). Each is easy to fit: the loss falls far below its level, at once or as
    the weights memorise the rows."""
    if kind == "constant":
        return x, col, torch.full_like(y, 3)
    if kind == "padding":
        return torch.zeros_like(x), torch.zeros_like(col), torch.zeros_like(y)
    if kind == "copied":
        return x, col, x.clone()
    if kind in ("stuck", "boilerplate") and fixed is not None:
        return fixed
    raise ValueError(f"unknown degenerate data {kind!r}")


class Data:
    """Train batches by step (the same for every arm), and a fixed held-out set."""

    def __init__(self, seed: int) -> None:
        tokens, column = corpus(seed, 60_000)
        split = 50_000
        self.train = (tokens[:split], column[:split])
        self.val = (tokens[split:], column[split:])
        self.seed = seed

    def batch(self, step: int, case: str) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + step)
        tokens, column = self.train
        starts = torch.randint(0, len(tokens) - SEQ - 1, (BATCH,), generator=g)
        idx = starts[:, None] + torch.arange(SEQ + 1)
        x, col = tokens[idx[:, :-1]], column[idx[:, :-1]].clone()
        if case == "bad_shard" and FAULT_AT <= step < FAULT_AT + 20:
            col *= 1000.0  # the column of a shard preprocessed without its scaler
        if case == "fp16" and FAULT_AT <= step < FAULT_AT + 5:
            col *= 1e5  # enough to overflow a float16 residual stream
        y = tokens[idx[:, 1:]]
        if case in DEGENERATE:
            kind, start, length, share = DEGENERATE[case]
            if start <= step < start + length:
                # the shard's rows take a growing share of the batch as the others run out,
                # or a fixed one
                rows = (min(BATCH, BATCH * (step - start + 1) // RAMP) if share is None
                        else round(BATCH * share))
                bx, bcol, by = degenerate(kind, x, col, y, self._fixed(kind, start, case))
                x, col, y = x.clone(), col.clone(), y.clone()
                x[:rows], col[:rows], y[:rows] = bx[:rows], bcol[:rows], by[:rows]
        return {"x": x, "col": col, "y": y}

    def _fixed(self, kind: str, start: int, case: str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The rows served again and again: the stretch's first real batch (``stuck``), or
        one real sequence in every row (``boilerplate``)."""
        if kind == "stuck":
            first = self.batch(start - 1, "stable")  # any real batch: the one before
            return first["x"], first["col"], first["y"]
        if kind == "boilerplate":
            tokens, column = self.train
            idx = torch.arange(SEQ + 1).expand(BATCH, -1)
            return tokens[idx[:, :-1]], column[idx[:, :-1]], tokens[idx[:, 1:]]
        return None

    def val_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        tokens, column = self.val
        n = (len(tokens) - 1) // SEQ
        for i in range(0, n - BATCH, BATCH):
            idx = (torch.arange(i, i + BATCH) * SEQ)[:, None] + torch.arange(SEQ + 1)
            yield {"x": tokens[idx[:, :-1]], "col": column[idx[:, :-1]],
                   "y": tokens[idx[:, 1:]]}


# --- the model ---------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(),
                                 nn.Linear(4 * D_MODEL, D_MODEL))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class TinyGPT(nn.Module):
    """A causal transformer over tokens and their numeric column."""

    def __init__(self, half_residual: bool = False) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D_MODEL), nn.Embedding(SEQ, D_MODEL)
        self.col = nn.Linear(1, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln, self.head = nn.LayerNorm(D_MODEL), nn.Linear(D_MODEL, V)
        self.half_residual = half_residual
        # A boolean mask (True: not attended), which attention turns into the same -inf: a
        # floating buffer holding -inf is refused as a non-finite state (issue 68).
        self.register_buffer("mask", torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1))

    def forward(self, x: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos.weight[: x.shape[1]] + self.col(col[..., None])
        for block in self.blocks:
            if self.half_residual:  # what a half-precision forward keeps between blocks
                h = h.half().float()
            h = block(h, self.mask)
        return self.head(self.ln(h))


def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["x"], batch["col"])
    return nn.functional.cross_entropy(logits.reshape(-1, V), batch["y"].reshape(-1))


@torch.no_grad()
def val_loss(model: nn.Module, data: Data) -> float:
    model.eval()
    losses = [loss_of(model, b).item() for b in data.val_batches()]
    model.train()
    return sum(losses) / len(losses)


def lr_at(step: int, case: str, steps: int) -> float:
    """Warm-up then cosine to a tenth; the case's schedule error on top."""
    if step < WARMUP and case != "lr_typo":
        lr = LR * (step + 1) / WARMUP
    else:
        lr = LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (steps - WARMUP))))
    if case == "lr_spike" and FAULT_AT <= step < FAULT_AT + 20:
        lr *= 100
    if case == "lr_long" and FAULT_AT <= step < FAULT_AT + 60:
        lr *= 100
    if case == "lr_typo":
        lr *= 30
    if case == "slow_climb" and step >= 100:
        lr *= 1 + 299 * (step - 100) / max(1, steps - 100)
    return lr


# --- the peers' rules, written here ------------------------------------------------------------

class Window:
    """Mean and std of the last ``size`` values (OLMo-core's rolling statistics)."""

    def __init__(self, size: int = 128, warmup: int = 20) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.warmup = warmup

    def outlier(self, x: float, z: float = 6.0) -> bool:
        if not math.isfinite(x):
            return True
        if len(self.values) < self.warmup:
            return False
        mean = statistics.fmean(self.values)
        std = statistics.pstdev(self.values)
        return x > mean + z * max(std, 1e-8)

    def add(self, x: float) -> None:
        if math.isfinite(x):
            self.values.append(x)


class ZClip:
    """ZClip: the grad norm clipped at its EMA mean + z EMA std once warm."""

    def __init__(self, alpha: float = 0.97, z: float = 2.5, warmup: int = 25) -> None:
        self.alpha, self.z, self.warmup = alpha, z, warmup
        self.seen: list[float] = []
        self.mean = self.var = 0.0

    def clip(self, params: list[nn.Parameter], norm: float) -> bool:
        if not math.isfinite(norm):
            return False
        if len(self.seen) < self.warmup:
            self.seen.append(norm)
            if len(self.seen) == self.warmup:
                self.mean = statistics.fmean(self.seen)
                self.var = statistics.pvariance(self.seen)
            return False
        std = math.sqrt(max(self.var, 1e-12))
        clipped = norm > self.mean + self.z * std
        if clipped:
            target = self.mean + self.z * std
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(target / norm)
            norm = target
        self.mean = self.alpha * self.mean + (1 - self.alpha) * norm
        self.var = self.alpha * self.var + (1 - self.alpha) * (norm - self.mean) ** 2
        return clipped


def spam_clip(opt: torch.optim.Optimizer, theta: float = 5000.0) -> None:
    """SPAM's spike-aware clipping: a coordinate whose g^2 exceeds theta x Adam's v is cut
    to sign(g) sqrt(theta v)."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if p.grad is None or not state or "exp_avg_sq" not in state:
                continue
            bound = (theta * state["exp_avg_sq"]).sqrt()
            p.grad.copy_(torch.where(p.grad.abs() > bound, p.grad.sign() * bound, p.grad))


def reset_moments(opt: torch.optim.Optimizer) -> None:
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key].zero_()


# --- one run -----------------------------------------------------------------------------------

def sentinel_kwargs(arm: str) -> dict[str, Any] | None:
    if arm == "skip":
        return {"loss_spike_action": "skip", "grad_spike_action": "skip"}
    if arm == "rollback":
        return {"policy": "rollback", "loss_spike_action": "rollback",
                "grad_spike_action": "rollback"}
    if arm == "recover":
        return {"spikes": "recover"}
    if arm == "recover_nojump":
        return {"spikes": "recover", "lr_jump_ratio": 0}
    if arm == "recover_skip_collapse":
        return {"spikes": "recover", "collapse_action": "skip"}
    return None


def run(case: str, arm: str, seed: int, steps: int = STEPS) -> dict[str, Any]:
    """One training run; its held-out loss, losses, lost steps and the guard's actions."""
    torch.manual_seed(seed)
    data = Data(seed)
    model = TinyGPT(half_residual=case == "fp16")
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if case == "fp16" else None
    kwargs = sentinel_kwargs(arm)
    losses: list[float] = []
    applied: list[int] = []  # the steps whose update the final weights hold
    actions = held = 0
    olmo_loss, olmo_grad, palm_window = Window(), Window(), Window()
    zclip = ZClip()
    palm_skip, checkpoints = 0, deque(maxlen=3)
    aborted = None
    with tempfile.TemporaryDirectory() as reports, contextlib.ExitStack() as stack:
        sentinel = None
        if kwargs is not None:
            sentinel = stack.enter_context(nansentinel.Sentinel(
                model, opt, scaler=scaler, env={}, report_dir=reports, metrics_port=0,
                metrics_linger=0, replay=False, **kwargs))
        for step in range(steps):
            for g in opt.param_groups:  # the loop sets its schedule itself, every iteration
                g["lr"] = lr_at(step, case, steps)
            batch = data.batch(step, case)
            if arm == "palm" and palm_skip > 0:
                palm_skip -= 1
                continue
            if arm == "palm" and step % 10 == 0:
                checkpoints.append((step, copy.deepcopy(model.state_dict()),
                                    copy.deepcopy(opt.state_dict())))
            if sentinel is not None:
                batch = sentinel.check_batch(batch)
            loss = loss_of(model, batch)
            losses.append(float(loss.detach()))
            if sentinel is not None:
                sentinel.check_loss(loss)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if sentinel is not None:
                try:
                    result = sentinel.step()
                except nansentinel.NonFiniteError:  # the run stops here: the rest is lost
                    aborted = step
                    break
                assert result is not None
                if result.applied:
                    applied.append(step)
                if result.rolled_back_to is not None:  # the state before that step's update
                    applied = [s for s in applied if s < result.rolled_back_to]
                if result.outcome != "applied" or result.spikes or result.collapsed:
                    actions += 1
                held += bool(getattr(result, "lr_held", False))  # a jump held (issue 52)
                opt.zero_grad(set_to_none=True)
                continue
            if scaler is not None:
                scaler.unscale_(opt)
            norm = float(torch.nn.utils.get_total_norm(
                [p.grad for p in params if p.grad is not None]))
            skip = False
            if arm == "clip":
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            elif arm == "zclip":
                actions += zclip.clip(params, norm)
            elif arm == "olmo":
                skip = olmo_loss.outlier(losses[-1]) or olmo_grad.outlier(norm)
                olmo_loss.add(losses[-1])
                olmo_grad.add(norm)
            elif arm == "spam":
                if olmo_grad.outlier(norm):
                    reset_moments(opt)
                    actions += 1
                olmo_grad.add(norm)
                spam_clip(opt)
            elif arm == "oracle" and case in DEGENERATE:
                start, length = DEGENERATE[case].start, DEGENERATE[case].length
                skip = start <= step < start + length
            elif arm == "palm":
                if palm_window.outlier(losses[-1]) and len(checkpoints) > 1:
                    back, state, opt_state = checkpoints[0]
                    model.load_state_dict(state)
                    opt.load_state_dict(opt_state)
                    checkpoints.clear()
                    applied = [s for s in applied if s < back]
                    palm_skip = 30
                    actions += 1
                    skip = True
                else:
                    palm_window.add(losses[-1])
            if skip:
                actions += arm != "palm"
                if scaler is not None:  # unscaled: the scaler must be told the step is over
                    scaler.update()
            elif scaler is not None:
                scale = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                if scaler.get_scale() >= scale:  # not GradScaler's own skip
                    applied.append(step)
            else:
                opt.step()
                applied.append(step)
            opt.zero_grad(set_to_none=True)
    return {"case": case, "arm": arm, "seed": seed, "val": val_loss(model, data),
            "losses": losses, "lost": steps - len(applied), "actions": actions,
            "held": held, "aborted": aborted}


def spike_score(losses: list[float], window: int = 50, z: float = 7.0) -> float:
    """OLMo-core's spike score: the share of losses more than ``z`` std above the mean of the
    ``window`` before them (a non-finite loss counts)."""
    hits, n = 0, 0
    for i in range(window, len(losses)):
        prev = [v for v in losses[i - window:i] if math.isfinite(v)]
        if len(prev) < 2:
            continue
        n += 1
        x = losses[i]
        hits += not math.isfinite(x) or x > statistics.fmean(prev) + z * statistics.pstdev(prev)
    return hits / n if n else 0.0


# --- the table ---------------------------------------------------------------------------------

def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    reference = {r["seed"]: r["val"] for r in runs if r["case"] == "stable" and r["arm"] == "none"}
    rows = []
    for case in CASES:
        for arm in ARMS:
            mine = [r for r in runs if r["case"] == case and r["arm"] == arm]
            if not mine:
                continue
            rel = [100 * (r["val"] / reference[r["seed"]] - 1) if math.isfinite(r["val"])
                   else math.inf for r in mine if r["seed"] in reference]
            rows.append({
                "case": case, "arm": arm, "seeds": len(mine),
                "val_vs_stable_pct": statistics.median(rel) if rel else math.nan,
                "spread_pct": [min(rel), max(rel)] if rel else None,
                "lost_steps": statistics.median(r["lost"] for r in mine),
                "spike_score_pct": 100 * statistics.median(spike_score(r["losses"]) for r in mine),
                "actions": statistics.median(r["actions"] for r in mine),
                "held": statistics.median(r.get("held", 0) for r in mine),
                "aborted": sum(r["aborted"] is not None for r in mine),
            })
    return rows


def fmt(x: float) -> str:
    return "diverged" if not math.isfinite(x) else f"{x:+.1f}%"


def markdown(rows: list[dict[str, Any]], steps: int) -> str:
    by = {(r["case"], r["arm"]): r for r in rows}
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    cases = [c for c in CASES if any(r["case"] == c for r in rows)]
    lines = [
        "held-out loss vs the stable run (median over seeds, [min, max]); lost steps; "
        "OLMo spike score",
        "",
        "| case | " + " | ".join(arms) + " |",
        "|---|" + "---|" * len(arms),
    ]
    for case in cases:
        cells = []
        for arm in arms:
            r = by.get((case, arm))
            if r is None:
                cells.append("")
                continue
            lo, hi = r["spread_pct"] or (math.nan, math.nan)
            extra = (f"{r['actions']:g} alarms, {r['held']:g} held" if case == "stable"
                     else f"{r['lost_steps']:g} lost")
            if r["aborted"]:
                extra += f", aborted {r['aborted']}/{r['seeds']}"
            cells.append(f"{fmt(r['val_vs_stable_pct'])} [{fmt(lo)}, {fmt(hi)}]<br>{extra}, "
                         f"spikes {r['spike_score_pct']:.1f}%")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    stable = [r for r in rows if r["case"] == "stable"]
    if stable:
        lines.append("")
        lines.append(f"false alarms on the stable case ({steps} steps a seed): " + ", ".join(
            f"{r['arm']} {r['actions']:g}" for r in stable))
        lines.append("learning-rate steps held on the stable case: " + ", ".join(
            f"{r['arm']} {r['held']:g}" for r in stable))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--smoke", action="store_true",
                   help="lr_spike: none, recover and recover_nojump, one seed, a short run")
    p.add_argument("--json", help="write every run and the summary here")
    args = p.parse_args(argv)
    unknown = sorted(set(args.cases.split(",")) - set(CASES)) + sorted(
        set(args.arms.split(",")) - set(ARMS))
    if unknown:
        p.error(f"unknown case or arm: {', '.join(unknown)} (cases: {', '.join(CASES)}; "
                f"arms: {', '.join(ARMS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("nansentinel").setLevel(logging.ERROR)  # the incidents: in the table
    cases, arms = args.cases.split(","), args.arms.split(",")
    steps, seeds = args.steps, range(args.seeds)
    if args.smoke:
        cases, arms, seeds, steps = (["stable", "lr_spike"], ["none", "recover", "recover_nojump"],
                                     range(1), 200)
    global FAULT_AT
    FAULT_AT = min(FAULT_AT, steps // 2)
    runs = []
    started = time.perf_counter()
    jobs = [(c, a, s) for s in seeds for c in cases for a in arms]
    if "stable" not in cases or "none" not in arms:
        jobs = [("stable", "none", s) for s in seeds] + jobs
    for i, (case, arm, seed) in enumerate(jobs):
        t = time.perf_counter()
        r = run(case, arm, seed, steps)
        runs.append(r)
        stop = f" aborted at {r['aborted']}" if r["aborted"] is not None else ""
        print(f"[{i + 1}/{len(jobs)}] {case:10s} {arm:8s} seed {seed}: val {r['val']:.4f} "
              f"lost {r['lost']:3d} actions {r['actions']:3d} held {r['held']:3d}{stop} "
              f"({time.perf_counter() - t:.1f} s)",
              file=sys.stderr, flush=True)
    rows = summarise(runs)
    print(markdown(rows, steps))
    print(f"\n{len(runs)} runs in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
