"""The device gate on gloo ranks: a fused optimizer skips a poisoned step on the device, and the
skip is an exact no-op (weights, moments, step counters bit-identical) on every rank, with the
same results, reports and aborts as the host gate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from nansentinel.common import torch_insides as insides
from tests.distributed.harness import run_ranks, values
from tests.distributed.test_fault_matrix import MATRIX, STEPS, _check_matrix
from tests.distributed.workers import train
from tests.distributed.workers_gate import OPTIMIZERS, every_optimizer, gated

WORLD = 2
# A skipped first step (fused SGD with momentum would leave garbage buffers), then two more.
FAULTS = "kind=grad,rank=1,step=0,value=nan;kind=loss,rank=0,step=3,value=nan;" \
         "kind=batch,rank=1,step=4,value=inf"
SKIPPED = {0, 3, 4}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ bit for bit (or exist on one side only)."""
    diff = sorted(set(a) ^ set(b))
    diff += [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
    return diff


def _skips_on_device(optimizer: str) -> bool:
    cls, kwargs = OPTIMIZERS[optimizer]
    return insides.skips_on_device(cls([torch.zeros(1, requires_grad=True)], fused=True, **kwargs))


def _comparable(rec: dict[str, Any]) -> dict[str, Any]:
    """A result's fields as compared across the gates. The device gate takes a bucket's norm
    as the norm of its per-parameter norms (kept to name the parameters after the user has
    zeroed the gradients), the host gate as one norm of the flat bucket: the same value up
    to fp32 rounding, so this rank's gradient norm is left to :func:`_norms_agree`."""
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in rec.items() if k != "local_grad_norm"}


def _norms_agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
    x, y = a["local_grad_norm"], b["local_grad_norm"]
    if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
        return repr(x) == repr(y)
    return math.isclose(x, y, rel_tol=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    """Every optimizer under both gates, all in one 2-rank process group."""
    tmp = tmp_path_factory.mktemp("gate")
    return values(run_ranks(every_optimizer, WORLD, tmp, steps=6, inject=FAULTS,
                            report_dir=str(tmp / "reports"), timeout=300))


@pytest.mark.timeout(360)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_device_skip_is_an_exact_noop(runs: list[dict[str, dict[str, Any]]],
                                      optimizer: str) -> None:
    dev = [r[f"{optimizer}/device"] for r in runs]
    host = [r[f"{optimizer}/host"] for r in runs]
    for rank, (d, h) in enumerate(zip(dev, host, strict=True)):
        assert d["error"] is None and h["error"] is None, (d["error"], h["error"])
        assert h["gates"] == ["host"] * 6
        # Fused SGD with momentum joins the device gate once its buffers exist: after its
        # first applied step (step 1, since step 0 is skipped). An optimizer whose torch does
        # not say it skips on the device (fused Adagrad before torch 2.13) keeps the host gate.
        hosts = 2 if optimizer == "sgd_momentum" else 0
        if not _skips_on_device(optimizer):
            hosts = 6
        assert d["gates"] == ["host"] * hosts + ["device"] * (6 - hosts), d["gates"]
        assert [r["applied"] for r in d["records"]] == [s not in SKIPPED for s in range(6)]
        # Same results, field for field, as the host gate.
        assert [_comparable(r) for r in d["records"]] == [_comparable(r) for r in h["records"]]
        assert all(_norms_agree(a, b) for a, b in zip(d["records"], h["records"], strict=True))
        for s in SKIPPED - {0}:
            assert not _same(d["before"][s], d["after"][s]), (rank, s)
        w0 = {k: v for k, v in d["after"][0].items() if k.startswith("w/")}
        assert not _same({k: v for k, v in d["before"][0].items() if k.startswith("w/")}, w0)
        # The whole trajectory is the host gate's, bit for bit: the skipped first step left
        # nothing behind that a later step could read.
        assert not _same(d["final"], h["final"]), (rank, _same(d["final"], h["final"]))
        for s in range(6):
            if s not in SKIPPED:
                assert _same(d["before"][s], d["after"][s]), f"step {s} did not apply"
    assert not _same(dev[0]["final"], dev[1]["final"])


@pytest.mark.timeout(150)
@pytest.mark.parametrize("read_late", [True, False])
def test_device_gate_abort_on_every_rank_naming_the_step(tmp_path: Path,
                                                         read_late: bool) -> None:
    """Read or unread, the step is decided at the next sentinel call, the one fixed point
    where every rank runs a detection's collectives: the abort is raised there, on every rank,
    naming the step it judged. Read at once, ``applied`` already says the step was skipped."""
    outs = values(run_ranks(gated, WORLD, tmp_path, optimizer="adamw", steps=5,
                            gate="device", policy="abort", read_late=read_late,
                            inject="kind=loss,rank=1,step=2,value=nan",
                            report_dir=str(tmp_path / "r"), timeout=120))
    for out in outs:
        err = out["error"]
        assert err and err["type"] == "NonFiniteError" and err["step"] == 2, err
        assert err["where"] == "check_batch 3", err
        for word in ("step 2", "rank(s) 1", out["hostname"], "loss"):
            assert word in err["message"], err["message"]
        assert [r["applied"] if r else None for r in out["records"]] == [True, True, None]
        assert not _same(out["before"][2], out["after"][2])
    assert outs[0]["error"]["report_path"] and Path(outs[0]["error"]["report_path"]).exists()
    assert not _same(outs[0]["final"], outs[1]["final"])


@pytest.mark.timeout(240)
def test_fault_matrix_with_the_device_gate(tmp_path: Path) -> None:
    """The 4-rank fault matrix, unchanged, with fused AdamW on the device gate: blame,
    parameter naming and reports as with the host gate."""
    outs = values(run_ranks(train, 4, tmp_path, steps=STEPS, fused=True, gate="device",
                            inject=";".join(f"kind={k},rank={r},step={s},value={v}"
                                            for k, v, r, s in MATRIX),
                            report_dir=str(tmp_path / "reports"), timeout=200))
    _check_matrix(outs, MATRIX)
    assert all(o["gate"] == "device" for o in outs)
    rec13 = outs[0]["records"][13]
    assert rec13["parameters"] and list(rec13["parameters"]) == [3]
    reports = sorted((tmp_path / "reports").glob("incident-*.json"))
    assert len([p for p in reports if "-rank" not in p.name]) == len(MATRIX)


@pytest.mark.timeout(150)
def test_reading_at_other_points_never_runs_a_collective(tmp_path: Path) -> None:
    """Rank 0 reads its results, and saves state_dict() alone right after the poisoned step,
    while the others read nothing; every rank then all-reduces a metric. No hang, no
    mismatched collective: the detection runs at the next sentinel call on every rank."""
    from tests.distributed.workers_gate import read_points

    poisoned, steps = 2, 5
    outs = values(run_ranks(read_points, WORLD, tmp_path, report_dir=str(tmp_path / "r"),
                            poisoned=poisoned, steps=steps, timeout=120))
    rank0 = outs[0]
    assert [e[:2] for e in rank0["early"]] == [
        ("pending" if s == poisoned else "outcome", s) for s in range(steps)]
    pending = rank0["early"][poisoned]
    assert pending[2] is False and "next sentinel call" in pending[3]  # applied: exact
    # state_dict() on rank 0 alone: the history before the pending detection, no collective.
    assert rank0["saved"]["step"] == poisoned + 1 and rank0["saved"]["strikes"] == {}
    for out in outs:
        assert out["metrics"] == [[float(0 + s + 1 + s)] * 3 for s in range(steps)]
        rec = out["records"][poisoned]
        assert rec["outcome"] == "skipped" and rec["bad_ranks"] == [1] and rec["has_report"] is (
            out is rank0)
        assert [r["applied"] for r in out["records"]] == [s != poisoned for s in range(steps)]
    assert [r["outcome"] for r in outs[0]["records"]] == [r["outcome"] for r in outs[1]["records"]]
    assert not _same(outs[0]["final"], outs[1]["final"])
