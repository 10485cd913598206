"""The core promise on 4 gloo ranks: a fault on one rank is named on every rank, that step is
skipped everywhere, every other step is applied, and the weights stay finite and identical."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers import late_loss_check, train

WORLD = 4
# {batch, loss, grad} x {nan, inf, -inf}, each on its own rank and step, with healthy steps
# between them so that every fault is judged on its own.
MATRIX = [
    ("batch", "nan", 1, 1), ("batch", "inf", 2, 3), ("batch", "-inf", 3, 5),
    ("loss", "nan", 0, 7), ("loss", "inf", 1, 9), ("loss", "-inf", 2, 11),
    ("grad", "nan", 3, 13), ("grad", "inf", 0, 15), ("grad", "-inf", 1, 17),
]
STEPS = 19
SPEC = ";".join(f"kind={k},rank={r},step={s},value={v}" for k, v, r, s in MATRIX)


def _check_matrix(outs: list[dict], matrix: list[tuple[str, str, int, int]]) -> None:
    faults = {s: (k, r) for k, _, r, s in matrix}
    for out in outs:
        assert out["error"] is None, out["error"]
        assert len(out["records"]) == STEPS
        for rec in out["records"]:
            step = rec["step"]
            if step in faults:
                kind, rank = faults[step]
                assert not rec["applied"] and rec["outcome"] == "skipped", rec
                assert rec["bad_ranks"] == [rank], rec
                assert kind in rec["kinds"], rec
                assert rec["injected"]
            else:
                assert rec["applied"] and rec["outcome"] == "applied", rec
                assert rec["bad_ranks"] == [] and rec["kinds"] == []
    weights = [out["weights"] for out in outs]
    assert all(torch.isfinite(w).all() for w in weights)
    for w in weights[1:]:
        assert torch.equal(w, weights[0]), "weights differ across ranks"


@pytest.mark.timeout(150)
def test_fault_matrix_ddp(tmp_path: Path) -> None:
    outs = values(run_ranks(train, WORLD, tmp_path, steps=STEPS, inject=SPEC,
                            report_dir=str(tmp_path / "reports"), timeout=120))
    _check_matrix(outs, MATRIX)
    # Grad faults name the parameter on the poisoned rank; rank 0 wrote one report per fault.
    rec13 = outs[0]["records"][13]
    assert rec13["parameters"] and list(rec13["parameters"]) == [3]
    reports = sorted((tmp_path / "reports").glob("incident-*.json"))
    assert len([p for p in reports if "-rank" not in p.name]) == len(MATRIX)
    report = json.loads(next(p for p in reports if "step00000013" in p.name).read_text())
    assert report["bad_ranks"] == [3] and report["injected"] is True
    assert report["poisoned"][0]["parameters"] and report["poisoned"][0]["kinds"] == ["grad"]
    batch_file = Path(report["poisoned"][0]["batch_path"])
    assert torch.load(batch_file)["tokens"].shape[0] == 16
    # A healthy rank's loss stays finite in the view while the poisoned one's does not.
    rec7 = outs[0]["records"][7]
    assert rec7["bad_ranks"] == [0] and math.isnan(outs[0]["records"][7]["local_loss"])
    assert math.isfinite(outs[1]["records"][7]["local_loss"])


@pytest.mark.timeout(150)
def test_fault_matrix_without_ddp_user_reduces(tmp_path: Path) -> None:
    """No DDP: the loop calls check_grads() before its own all-reduce; the exchange is one
    small collective and blame still names the right rank."""
    subset = [m for m in MATRIX if m[3] in (1, 7, 13, 15)]
    spec = ";".join(f"kind={k},rank={r},step={s},value={v}" for k, v, r, s in subset)
    outs = values(run_ranks(train, WORLD, tmp_path, steps=STEPS, inject=spec, ddp=False,
                            manual_reduce=True, report_dir=str(tmp_path / "r"), timeout=120))
    _check_matrix(outs, subset)


@pytest.mark.timeout(120)
def test_gradient_accumulation_with_no_sync(tmp_path: Path) -> None:
    """A fault in the first micro-batch (under no_sync) is still caught at the step."""
    spec = "kind=batch,rank=2,step=2,value=nan"
    outs = values(run_ranks(train, 2 + 1, tmp_path, steps=4, accumulate=2, inject=spec,
                            report_dir=str(tmp_path / "r"), timeout=100))
    for out in outs:
        assert [r["applied"] for r in out["records"]] == [True, True, False, True]
        assert out["records"][2]["bad_ranks"] == [2]


@pytest.mark.timeout(120)
def test_abort_raises_on_every_rank_at_the_same_step(tmp_path: Path) -> None:
    outs = values(run_ranks(train, WORLD, tmp_path, steps=6, policy="abort",
                            inject="kind=loss,rank=2,step=3,value=nan",
                            report_dir=str(tmp_path / "r"), timeout=100))
    for out in outs:
        err = out["error"]
        assert err and err["type"] == "NonFiniteError" and err["step"] == 3
        for word in ("step 3", "rank(s) 2", out["hostname"], "loss"):
            assert word in err["message"], err["message"]
        assert [r["applied"] for r in out["records"]] == [True, True, True]
    assert outs[0]["error"]["report_path"] and Path(outs[0]["error"]["report_path"]).exists()
    w = [o["weights"] for o in outs]
    assert all(torch.equal(x, w[0]) for x in w) and torch.isfinite(w[0]).all()


@pytest.mark.timeout(120)
def test_skips_escalate_to_abort(tmp_path: Path) -> None:
    outs = values(run_ranks(train, 2, tmp_path, steps=10, max_consecutive_skips=2,
                            inject="kind=grad,rank=1,steps=2-9,value=inf",
                            report_dir=str(tmp_path / "r"), timeout=100))
    for out in outs:
        assert out["error"]["step"] == 4  # steps 2 and 3 skipped, the third in a row aborts
        assert "2 steps skipped in a row" in out["error"]["message"]


@pytest.mark.timeout(120)
def test_check_after_backward_is_a_clear_error(tmp_path: Path) -> None:
    msgs = values(run_ranks(late_loss_check, 2, tmp_path, report_dir=str(tmp_path), timeout=90))
    for msg in msgs:
        assert "before loss.backward()" in msg and "step 0" in msg


@pytest.mark.timeout(120)
def test_no_rank_raises_before_rank_0s_report_is_on_disk(tmp_path: Path) -> None:
    """The abort's barrier is read on the host (on NCCL a synchronous all-reduce alone does not
    block it): with rank 0 two seconds slow to write its report, rank 1 still finds the report
    on disk when it raises, so torchrun's teardown after a fast rank cannot lose it."""
    from tests.distributed.workers import slow_report

    outs = values(run_ranks(slow_report, 2, tmp_path, report_dir=str(tmp_path / "r"),
                            timeout=90))
    for out in outs:
        assert out["step"] == 1
        assert out["reports_on_disk"] == ["incident-local-step00000001.json"], out
