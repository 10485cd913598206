"""The invariants of DESIGN.md, in every combination users make (issue 26).

Policy (skip, rollback, abort, drop) x gate x optimizer x GradScaler x BatchNorm x gradient
accumulation x replay x replica fingerprints x rank 0 alone reading results, crossed with
faults of four kinds (batch, loss, forward activation, backward) on one rank and on two, on 3
gloo ranks under DDP. A CI run takes a random sample of the combinations; its seed is printed, and
``NANSENTINEL_MATRIX_SEED=S`` reruns the same sample. ``NANSENTINEL_MATRIX=all`` runs every
combination (thousands: hours), ``NANSENTINEL_MATRIX=N`` a sample of N.

After each combination:
- every rank took the same decision at every step, and the run ended on every rank alike
  (to the end, or ``NonFiniteError`` at the same step under ``policy="abort"``); under
  ``policy="drop"`` a batch, loss or forward fault on one rank is ``dropped`` (applied, that
  rank named), and the rank left out puts its floating buffers back;
- weights and optimizer state are finite and bit-identical across replicas, floating buffers
  finite; and where the policy promises it (every faulty step skipped, or an abort), weights,
  buffers, optimizer state and the scale equal, bit for bit, a run that never saw the faulty
  steps;
- one valid report per incident, and the skip list holds the poisoned rows of batch faults;
- the optimizer and the scaler take one more step afterwards.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_invariants import (
    FAULT_STEPS,
    STEPS,
    drops,
    every_combo,
    faults_of,
    finite,
    run_combos,
    same,
    sample_id,
)

WORLD = 3
#: Combinations a CI run takes (each ~0.5-1 s on 3 gloo ranks: ~25 s).
SAMPLE = 32
#: Combinations handed to one set of ranks (the rest go to the next set).
CHUNK = 48


def _sample() -> tuple[list[dict[str, Any]], int | None]:
    combos = every_combo()
    wanted = os.environ.get("NANSENTINEL_MATRIX", "")
    if wanted == "all":
        return combos, None
    seed = int(os.environ.get("NANSENTINEL_MATRIX_SEED") or random.SystemRandom().randrange(10**6))
    n = int(wanted) if wanted else SAMPLE
    return random.Random(seed).sample(combos, n), seed


def check(combo: dict[str, Any], ranks: list[dict[str, Any]], where: str) -> None:
    faulty = [r["faulty"] for r in ranks]
    reference = [r["reference"] for r in ranks]
    # Every rank decided the same at every step, and ended alike.
    first = faulty[0]
    for out in faulty[1:]:
        assert [o["outcome"] for o in out["outcomes"]] == [
            o["outcome"] for o in first["outcomes"]], f"{where}: decisions differ across ranks"
        assert out["error"] == first["error"], f"{where}: ranks ended differently"
    faults = faults_of(combo, WORLD)
    outcomes = {o["step"]: o for o in first["outcomes"]}
    # Under GradScaler, non-finite gradients alone are fp16 overflow: GradScaler's to skip.
    overflow = combo["scaler"] != "none" and combo["fault"] == "backward"
    aborts = combo["policy"] == "abort" and not overflow
    if overflow:
        assert all(outcomes[s]["outcome"] == "overflow" for s in faults), f"{where}: {outcomes}"
    if aborts:
        assert first["error"] and first["error"]["type"] == "NonFiniteError", where
        assert first["error"]["step"] == FAULT_STEPS[0], f"{where}: {first['error']}"
    else:
        assert first["error"] is None, f"{where}: {first['error']}"
        assert sorted(outcomes) == list(range(STEPS)), where
        for step, o in outcomes.items():
            if step in faults and drops(combo):
                assert o["outcome"] == "dropped" and o["applied"], f"{where}: {o}"
                assert o["bad_ranks"] == faults[step], f"{where}: {o}"
            elif step in faults:
                assert o["outcome"] in ("skipped", "rolled_back", "overflow"), f"{where}: {o}"
                assert not o["applied"] or o["outcome"] == "overflow", f"{where}: {o}"
            elif step - 1 in faults and outcomes[step - 1]["outcome"] == "rolled_back":
                # rollback_skip_batches=1: the batch after a rollback is discarded
                assert o["outcome"] == "skipped" and not o["bad_ranks"], f"{where}: {o}"
            else:
                assert o["applied"], f"{where}: healthy step {step} not applied: {o}"
    # Finite and identical across replicas.
    for key in ("params", "optimizer"):
        tensors = [out["state"][key] for out in faulty]
        assert all(finite(t) for t in tensors), f"{where}: {key} not finite"
        assert all(same(t, tensors[0]) for t in tensors), f"{where}: {key} differ across ranks"
    assert all(finite(out["state"]["buffers"]) for out in faulty), f"{where}: buffers not finite"
    # Equal to the run that never saw the faulty steps, where the policy promises it.
    promised = aborts or all(outcomes[s]["outcome"] == "skipped" for s in faults)
    if promised:
        for rank, (mine, ref) in enumerate(zip(faulty, reference, strict=True)):
            # After an abort the last forward's DDP broadcast is what differs: every replica
            # holds rank 0's buffers from before the step, where the reference kept its own.
            keys = ("params", "optimizer") if rank and aborts else (
                "params", "buffers", "optimizer")
            for key in keys:
                assert same(mine["state"][key], ref["state"][key]), (
                    f"{where}: {key} differ from the run without the faulty steps (rank {rank})")
            assert mine["state"]["scale"] == ref["state"]["scale"], f"{where}: scale differs"
    # Restored buffers are said so: every rank's on a skip, the left-out rank's on a drop.
    if combo["batchnorm"] and combo["policy"] in ("skip", "drop"):
        for step in faults:
            if outcomes[step]["outcome"] == "skipped":
                assert outcomes[step]["buffers_restored"] == 2, f"{where}: {outcomes[step]}"
            if outcomes[step]["outcome"] == "dropped":
                restored = [{o["step"]: o for o in out["outcomes"]}[step]["buffers_restored"]
                            for out in faulty]
                want = [2 if r in faults[step] else 0 for r in range(WORLD)]
                assert restored == want, f"{where}: step {step} restored {restored}"
    # One valid report per incident.
    incidents = [o for o in first["outcomes"] if o["bad_ranks"]]
    reports = first["reports"]
    assert all(r["content"] is not None for r in reports), f"{where}: invalid report JSON"
    if not aborts:
        assert len(reports) == len(incidents), f"{where}: {len(reports)} reports, {incidents}"
        assert {r["content"]["step"] for r in reports} == {o["step"] for o in incidents}, where
    else:
        assert len(reports) == 1 and reports[0]["content"]["step"] == FAULT_STEPS[0], where
    # The skip list: the poisoned rows of batch faults (row 0 of every micro-batch: the drill
    # writes into each), nothing else.
    listed = sorted(i for line in first["skip_list"] for i in line["ids"])
    if combo["fault"] == "batch":
        steps = FAULT_STEPS[:1] if aborts else list(faults)
        want = sorted(sample_id(r, s, m, 0) for s in steps for r in faults[s]
                      for m in range(combo["accumulate"]))
        assert listed == want, f"{where}: skip list {listed}, expected {want}"
    else:
        assert listed == [], f"{where}: skip list {listed}"
    # The optimizer and the scaler work the next step.
    if first["error"] is None:
        assert all(out["next"] for out in faulty), f"{where}: the next step did not apply"


@pytest.mark.timeout(600)
def test_every_invariant_in_every_combination(tmp_path: Path, capsys: Any) -> None:
    combos, seed = _sample()
    with capsys.disabled():
        print(f"\ninvariant matrix: {len(combos)} combination(s), seed "
              f"{seed if seed is not None else '(all)'} "
              f"(rerun: NANSENTINEL_MATRIX_SEED={seed} NANSENTINEL_MATRIX={len(combos)})")
    for start in range(0, len(combos), CHUNK):
        chunk = combos[start:start + CHUNK]
        outs = values(run_ranks(
            run_combos, WORLD,
            tmp_path, combos=chunk, report_dir=str(tmp_path / f"r{start}"),
            timeout=60 + 20 * len(chunk),
        ))
        for i, combo in enumerate(chunk):
            where = f"seed {seed}, combination {start + i}: {combo}"
            check(combo, [outs[r][i] for r in range(WORLD)], where)
