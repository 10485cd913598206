"""Incident messages (first, describe, describe_abort, payload) and IncidentWriter.write alone."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from nansentinel.config import SentinelConfig
from nansentinel.decide.policy import (
    ABORT,
    APPLY,
    EXCLUDE,
    NONFINITE,
    ROLLBACK,
    SKIP,
    SPIKE,
    Decision,
)
from nansentinel.decide.spikes import CLUSTER, Spikes
from nansentinel.rare.incident import (
    Case,
    IncidentWriter,
    describe,
    describe_abort,
    first,
    payload,
)
from nansentinel.result import Outcome, RankIdentity, StepResult
from nansentinel.wire import context
from nansentinel.wire.schema import Totals
from nansentinel.wire.view import ClusterView, RankHealth

NAN, INF = float("nan"), float("inf")


def ident(rank: int, host: str, world: int = 2) -> RankIdentity:
    return RankIdentity(rank, rank % 2, world, host, f"cuda:{rank % 2}", gpu_uuid=f"GPU-{rank}")


def two_ranks(step: int = 7, *, injected: bool = False) -> ClusterView:
    """Rank 0 on node-a healthy (named as the replay's peer), rank 1 on node-b with a
    non-finite loss and gradients."""
    healthy = RankHealth(ident(0, "node-a"), (), False, 2.5, 1.0)
    bad = RankHealth(ident(1, "node-b"), ("loss", "grad"), injected, NAN, INF)
    totals = Totals(bad_loss=1, bad_grad=1, blamed=1, flagged=1, flagged_rank=1.0,
                    injected=int(injected), loss_n=1, loss_sum=2.5, loss_sq=6.25, grad_n=1,
                    grad_sum=1.0, grad_sq=1.0)
    return ClusterView(step, 2, totals, (bad,), (healthy, bad), replay_peer=0,
                       extremes={"loss": (2.5, 2.5), "grad_norm": (1.0, 1.0)})


def result(outcome: Outcome, **kw: Any) -> StepResult:
    fields: dict[str, Any] = dict(
        step=7, applied=outcome == Outcome.APPLIED, outcome=outcome, bad_ranks=[1],
        bad_hosts=["node-b"], kinds=["loss", "grad"], local_kinds=[], local_loss=2.5,
        local_grad_norm=1.0, consecutive_skips=1,
    )
    fields.update(kw)
    return StepResult(**fields)


def skip_decision(view: ClusterView, **kw: Any) -> Decision:
    return Decision(SKIP, tuple(view.bad()), cause=NONFINITE, **kw)


def test_first_names_at_most_n_and_counts_the_rest() -> None:
    assert first([], 5) == ""
    assert first(["a", "b"], 5) == "a, b"
    assert first(list("abcde"), 5) == "a, b, c, d, e"
    assert first(list("abcdefg"), 5) == "a, b, c, d, e, … (2 more)"


def test_describe_names_rank_host_local_rank_device_kinds_params_and_next() -> None:
    v = two_ranks()
    r = result(Outcome.SKIPPED, parameters={1: [f"layer{i}.weight" for i in range(7)]})
    assert describe(v, skip_decision(v), r, Spikes()) == (
        "nansentinel: non-finite values at step 7: rank 1 (host node-b, local rank 1, cuda:1): "
        "loss, grad [layer0.weight, layer1.weight, layer2.weight, layer3.weight, "
        "layer4.weight, … (2 more)] — step skipped on every rank, gradients discarded"
    )


def test_describe_exclusion_with_injection_verdict_and_reason() -> None:
    v = two_ranks(injected=True)
    d = Decision(EXCLUDE, tuple(v.bad()), "host node-b blamed 3 times within 100 steps",
                 NONFINITE, exclude_host="node-b", strikes=3)
    r = result(Outcome.EXCLUDED, verdict="host")
    assert describe(v, d, r, Spikes()) == (
        "nansentinel: non-finite values at step 7 (injected by NANSENTINEL_INJECT): "
        "rank 1 (host node-b, local rank 1, cuda:1): loss, grad; verdict: host "
        "— excluding host node-b (host node-b blamed 3 times within 100 steps)"
    )


def test_describe_spikes_on_cluster_mean_and_a_rank_with_rollback() -> None:
    spiking = RankHealth(ident(0, "node-a"), (), False, 3.0, 40.0, spikes={"grad_norm": 40.04})
    v = ClusterView(12, 2, Totals(spike_grad=1, spike_any=1, flagged=1), (spiking,), (spiking,))
    spikes = Spikes({"grad_norm": [0], "loss": [CLUSTER]},
                    {"grad_norm": {0: 40.04}, "loss": {CLUSTER: 12.34}})
    d = Decision(ROLLBACK, (), "spike in loss, grad_norm: restoring step 50", SPIKE)
    r = result(Outcome.ROLLED_BACK, bad_ranks=[], bad_hosts=[], kinds=[], rolled_back_to=50,
               lr_factor=0.25)
    # Signals in SIGNALS order (loss first), whatever order the dict was built in.
    assert describe(v, d, r, spikes) == (
        "nansentinel: spike at step 12: loss spike on cluster mean: 12.3x its running median; "
        "grad_norm spike on rank 0 (host node-a): 40.0x its running median "
        "— rolled back on every rank to step 50, learning rate x0.25 "
        "(spike in loss, grad_norm: restoring step 50)"
    )


@pytest.mark.parametrize(
    ("outcome", "nxt"),
    [
        (Outcome.ABORTED, "aborting on every rank"),
        (Outcome.APPLIED, "step applied (warn only)"),
        (Outcome.OVERFLOW, "step left to GradScaler"),
    ],
)
def test_describe_says_what_happens_next_by_outcome(outcome: Outcome, nxt: str) -> None:
    v = two_ranks()
    assert describe(v, skip_decision(v), result(outcome), Spikes()).endswith(f"— {nxt}")


def test_describe_abort_without_bad_ranks_gives_the_reason() -> None:
    d = Decision(ABORT, (), "3 rollbacks to the snapshot of step 50 did not help", SPIKE)
    r = result(Outcome.ABORTED, step=9, bad_ranks=[], bad_hosts=[], kinds=[])
    assert describe_abort(d, r) == (
        "nansentinel: aborting at step 9: 3 rollbacks to the snapshot of step 50 did not help."
    )


def test_describe_abort_names_ranks_hosts_kinds_verdict_and_report() -> None:
    v = two_ranks()
    d = Decision(ABORT, tuple(v.bad()), "policy is abort", NONFINITE)
    r = result(Outcome.ABORTED, bad_ranks=[1, 3], bad_hosts=["node-b", "node-d"])
    assert describe_abort(d, r) == (
        "nansentinel: aborting at step 7: non-finite loss, grad on rank(s) 1, 3 "
        "(host(s) node-b, node-d); policy is abort."
    )
    r = dataclasses.replace(r, verdict="data", report_path="/r/incident.json")
    excl = dataclasses.replace(d, action=EXCLUDE, exclude_host="node-b", reason="3 strikes")
    assert describe_abort(excl, r) == (
        "nansentinel: excluding host node-b at step 7: non-finite loss, grad on rank(s) 1, 3 "
        "(host(s) node-b, node-d); 3 strikes. Verdict: data. Report: /r/incident.json"
    )


def test_payload_is_strict_json_with_every_rank_and_the_poisoned_one() -> None:
    v = two_ranks()
    d = skip_decision(v, reason="")
    r = result(Outcome.SKIPPED, verdict="host", consecutive_skips=2)
    spikes = Spikes({"loss": [0]}, {"loss": {0: 11.23456}})
    details = {
        0: {"note": "r0"},
        1: {"batch_path": "/r/b.pt", "replay": {"first_module": "mlp.fc1", "first_parameter": "w"}},
    }
    content = payload(Case(v, d, r, spikes), details, "the message", job_id="job-7",
                      policy="skip")
    text = json.dumps(content, allow_nan=False)  # JSON has no NaN: it must not need one
    back = json.loads(text)
    assert isinstance(back["time"], float)
    expected_head = {
        "version": 2, "message": "the message", "job_id": "job-7", "step": 7,
        "outcome": "skipped", "reason": "", "policy": "skip", "bad_ranks": [1],
        "bad_hosts": ["node-b"], "kinds": ["loss", "grad"], "injected": False,
        "overflow": False, "excluded_host": None, "excluded_hosts": [], "consecutive_skips": 2,
        "world_size": 2,
        "verdict": "host", "spikes": {"loss": {"0": 11.235}}, "rolled_back_to": None,
        "lr_factor": 1.0, "buffers_restored": 0, "first_nonfinite_module": "mlp.fc1",
        "first_nonfinite_parameter": "w", "origin_trace": None, "poisoned_state": {},
        "state_action": None,
    }
    assert {k: back[k] for k in expected_head} == expected_head
    poisoned = {
        "rank": 1, "hostname": "node-b", "local_rank": 1, "device": "cuda:1",
        "gpu_uuid": "GPU-1", "kinds": ["loss", "grad"], "injected": False, "loss": "nan",
        "grad_norm": "inf", "batch_path": "/r/b.pt",
        "replay": {"first_module": "mlp.fc1", "first_parameter": "w"},
    }
    assert back["poisoned"] == [poisoned]
    # The named ranks by rank (the blamed one and the replay's peer), not one row per rank.
    assert back["ranks"]["1"] == poisoned
    assert back["ranks"]["0"] == {
        "rank": 0, "hostname": "node-a", "local_rank": 0, "device": "cuda:0",
        "gpu_uuid": "GPU-0", "kinds": [], "injected": False, "loss": 2.5, "grad_norm": 1.0,
        "note": "r0",
    }
    assert back["ranks_not_listed"] == 0
    assert back["cluster"] == {
        "world_size": 2, "nonfinite": {"batch": 0, "loss": 1, "grad": 1}, "blamed": 1,
        "reached": 0, "spiking": {"loss": 0, "grad_norm": 0, "any": 0, "with_their_batch": 0},
        "quarantined": 0, "injected": 0,
        "loss": {"ranks": 1, "mean": 2.5, "std": 0.0, "min": 2.5, "max": 2.5},
        "grad_norm": {"ranks": 1, "mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0},
    }
    assert back["reached"] == [] and back["reached_not_listed"] == 0
    assert set(back) == {*expected_head, "time", "poisoned", "ranks", "ranks_not_listed",
                         "cluster", "reached", "reached_not_listed", "recovery"}


def test_payload_without_replay_has_no_first_nonfinite_names() -> None:
    v = two_ranks()
    content = payload(Case(v, skip_decision(v), result(Outcome.SKIPPED), Spikes()), {}, "m",
                      job_id=None, policy="abort")
    assert content["first_nonfinite_module"] is None
    assert content["first_nonfinite_parameter"] is None
    assert content["spikes"] == {} and content["job_id"] is None


# -- IncidentWriter, a world of one --------------------------------------------------------


def alone(step: int = 3, kinds: tuple[str, ...] = ("loss",)) -> ClusterView:
    """One rank, blamed for ``kinds`` (none: it spiked on its loss instead)."""
    me = RankIdentity(0, 0, 1, "node-a", "cpu")
    mine = RankHealth(me, kinds, False, NAN if kinds else 2.0, 0.5,
                      spikes={} if kinds else {"loss": 12.0})
    return ClusterView(step, 1, Totals(flagged=1), (mine,), (mine,))


def alone_result(view: ClusterView, outcome: Outcome = Outcome.SKIPPED) -> StepResult:
    bad = [r.rank for r in view.bad()]
    (mine,) = view.flagged
    return StepResult(
        step=view.step, applied=False, outcome=outcome, bad_ranks=bad,
        bad_hosts=["node-a"] if bad else [], kinds=list(mine.kinds),
        local_kinds=list(mine.kinds), local_loss=mine.loss,
        local_grad_norm=0.5, consecutive_skips=1,
    )


def writer(report_dir: Path, **cfg: Any) -> IncidentWriter:
    config = SentinelConfig(report_dir=str(report_dir), **cfg)
    ctx = context.alone(config, RankIdentity(0, 0, 1, "node-a", "cpu"), "job-7")
    assert ctx.peers.alone and ctx.world_size == 1  # no process group: no collective runs
    return IncidentWriter(ctx)


def write(
    w: IncidentWriter,
    view: ClusterView,
    decision: Decision,
    *,
    batch: Any = None,
    replay: dict[str, Any] | None = None,
    seen: list[dict[int, dict[str, Any]]] | None = None,
) -> StepResult:
    """``w.write`` with this rank's share: the gradient path's naming (``names``, and the
    parameters when blamed) and the replay's ``replay``; ``seen`` gets the gathered shares."""
    detail: dict[str, Any] = {"names": "mine", **(replay or {})}
    if decision.bad:
        detail["parameters"] = ["block.0.weight", "block.0.bias"]
    result, details = w.write(
        Case(view, decision, alone_result(view, decision.outcome), Spikes(), detail, batch))
    if seen is not None:
        seen.append(details)
    return result


def test_write_saves_report_and_the_poisoned_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    w = writer(tmp_path / "reports")
    v = alone()
    seen: list[dict[int, dict[str, Any]]] = []
    replay = {"replay": {"first_module": "block.0", "first_parameter": "block.0.weight"}}
    with caplog.at_level(logging.WARNING, logger="nansentinel"):
        out = write(w, v, skip_decision(v), batch={"x": torch.tensor([1.0, NAN])},
                    replay=replay, seen=seen)
    report_path = tmp_path / "reports" / "incident-job-7-step00000003.json"
    batch_path = tmp_path / "reports" / "incident-job-7-step00000003-rank0-batch.pt"
    assert out.report_path == str(report_path)
    assert out.parameters == {0: ["block.0.weight", "block.0.bias"]}
    assert seen == [{0: {"names": "mine", "parameters": ["block.0.weight", "block.0.bias"],
                         **replay, "batch_path": str(batch_path)}}]
    text = report_path.read_text()
    assert '"loss": "nan"' in text
    content = json.loads(text)
    assert (content["step"], content["outcome"], content["bad_ranks"]) == (3, "skipped", [0])
    assert (content["job_id"], content["policy"], content["world_size"]) == ("job-7", "skip", 1)
    assert content["first_nonfinite_module"] == "block.0"
    assert content["poisoned"][0]["batch_path"] == str(batch_path)
    assert content["poisoned"][0]["names"] == "mine"
    assert content["message"] == (
        "nansentinel: non-finite values at step 3: rank 0 (host node-a, local rank 0, cpu): "
        "loss [block.0.weight, block.0.bias] — step skipped on every rank, gradients discarded"
    )
    saved = torch.load(batch_path)
    assert saved.keys() == {"x"} and saved["x"][0] == 1.0 and math.isnan(saved["x"][1])
    assert sorted(p.name for p in report_path.parent.iterdir()) == [
        batch_path.name, report_path.name,
    ]
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.WARNING, f"{content['message']}; report: {report_path}") in messages
    assert (logging.WARNING, (
        "nansentinel: rank 0 on host node-a (local rank 0, cpu): non-finite loss at step 3; "
        f"parameters: block.0.weight, block.0.bias; batch saved to {batch_path}"
    )) in messages


def test_write_with_save_batches_false_keeps_the_batch_off_disk(tmp_path: Path) -> None:
    w = writer(tmp_path, save_batches=False)
    v = alone()
    out = write(w, v, skip_decision(v), batch=torch.ones(3))
    assert out.report_path is not None
    assert [p.name for p in tmp_path.iterdir()] == ["incident-job-7-step00000003.json"]
    entry = json.loads(Path(out.report_path).read_text())["poisoned"][0]
    assert entry["batch_not_saved"] == "save_batches=False"
    assert "batch_path" not in entry


def test_write_never_overwrites_an_earlier_report(tmp_path: Path) -> None:
    w = writer(tmp_path)
    v = alone()
    one = write(w, v, skip_decision(v), batch=torch.ones(1))
    before = Path(str(one.report_path)).read_text()
    abort = Decision(ABORT, tuple(v.bad()), "policy is abort", NONFINITE)
    two = write(w, v, abort, batch=torch.zeros(1))
    assert one.report_path == str(tmp_path / "incident-job-7-step00000003.json")
    assert two.report_path == str(tmp_path / "incident-job-7-step00000003-1.json")
    assert Path(one.report_path).read_text() == before  # untouched
    assert json.loads(Path(two.report_path).read_text())["outcome"] == "aborted"
    assert torch.equal(torch.load(tmp_path / "incident-job-7-step00000003-rank0-batch.pt"),
                       torch.ones(1))
    assert torch.equal(torch.load(tmp_path / "incident-job-7-step00000003-rank0-batch-1.pt"),
                       torch.zeros(1))


def test_write_of_a_stopping_decision_logs_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    v = alone()
    abort = Decision(ABORT, tuple(v.bad()), "policy is abort", NONFINITE)
    with caplog.at_level(logging.WARNING, logger="nansentinel"):
        out = write(writer(tmp_path), v, abort)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "nansentinel: non-finite values at step 3: rank 0 (host node-a, local rank 0, cpu): "
        "loss [block.0.weight, block.0.bias] — aborting on every rank (policy is abort); "
        f"report: {out.report_path}"
    ]


def test_write_of_a_spike_saves_no_batch(tmp_path: Path) -> None:
    v = alone(kinds=())
    d = Decision(APPLY, ())
    out = write(writer(tmp_path), v, d, batch=torch.ones(2))
    assert out.parameters == {}
    assert [p.name for p in tmp_path.iterdir()] == ["incident-job-7-step00000003.json"]
    content = json.loads(Path(str(out.report_path)).read_text())
    assert content["poisoned"] == [] and content["ranks"]["0"]["loss"] == 2.0
    assert content["outcome"] == "applied"


def test_write_on_an_unwritable_dir_reports_failures_and_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    w = writer(blocker / "reports")
    blocker.write_text("not a directory")  # after the start: the config refuses it at once
    failed: list[str] = []
    w.failed = failed.append
    v = alone()
    seen: list[dict[int, dict[str, Any]]] = []
    out = write(w, v, skip_decision(v), batch=torch.ones(1), seen=seen)
    assert out.report_path is None
    assert failed == ["batch", "report"]
    (detail,) = seen[0].values()
    assert detail["batch_error"].startswith("NotADirectoryError: ")
    assert "batch_path" not in detail
