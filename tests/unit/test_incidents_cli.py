"""``nansentinel incidents``: the listing, ``show``'s explanation, the page's data and HTML,
and bad input (a missing or empty directory, a malformed report, an unknown id: exit 2)."""

from __future__ import annotations

import copy
import json
import math
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from nansentinel import cli
from nansentinel.common.exitcodes import EXIT_CONFIG
from nansentinel.common.report import incident_stem
from nansentinel.config import KNOWN_ENV
from nansentinel.reading import incidents, page

REPO = Path(__file__).resolve().parents[2]
T0 = 1_764_590_000.0


def rank_entry(rank: int, host: str, *, bad: bool) -> dict[str, Any]:
    """A rank as incident.py's payload names it."""
    entry: dict[str, Any] = {
        "rank": rank, "hostname": host, "local_rank": rank % 8, "device": f"cuda:{rank % 8}",
        "gpu_uuid": f"GPU-{rank:04d}-aaaa", "kinds": ["grad"] if bad else [],
        "injected": False, "loss": 2.31, "grad_norm": "nan" if bad else 0.88,
    }
    if bad:
        entry.update(parameters=["layers.3.mlp.weight", "head.bias"],
                     batch_path=f"/r/incident-job-rank{rank}-batch.pt",
                     replay={"finite": True, "loss": 2.31, "first_module": None})
    return entry


def sample_report(step: int = 120, job: str = "job-a", *, bad: int = 2, host: str = "node3",
                  verdict: str | None = "transient", t: float = T0) -> dict[str, Any]:
    """A realistic version-2 report (the demo's fields) of one blamed rank, without the new
    ``history`` fields (see :func:`with_history`)."""
    return {
        "version": 2, "message": "nansentinel: non-finite values at step …", "job_id": job,
        "time": t, "step": step, "outcome": "skipped", "reason": "", "policy": "skip",
        "bad_ranks": [bad], "bad_hosts": [host], "kinds": ["grad"], "injected": False,
        "overflow": False, "excluded_host": None, "consecutive_skips": 1, "world_size": 8,
        "verdict": verdict, "spikes": {}, "rolled_back_to": None, "lr_factor": 1.0,
        "first_nonfinite_module": "layers.3.mlp", "first_nonfinite_parameter": None,
        "poisoned": [rank_entry(bad, host, bad=True)],
        "ranks": {str(bad): rank_entry(bad, host, bad=True),
                  "0": {**rank_entry(0, "node0", bad=False), "replayed_for": bad,
                        "peer_replay": {"finite": True, "loss": 2.31}}},
        "ranks_not_listed": 0,
        "cluster": {"world_size": 8, "nonfinite": {"batch": 0, "loss": 0, "grad": 1},
                    "blamed": 1, "loss": {"ranks": 8, "mean": 2.3, "std": 0.05, "min": 2.2,
                                          "max": 2.4},
                    "grad_norm": {"ranks": 7, "mean": 0.9, "std": 0.03, "min": 0.85,
                                  "max": 0.95}},
    }


def with_history(report: dict[str, Any], n: int = 200) -> dict[str, Any]:
    """``report`` with the cluster's and the blamed ranks' history of the last ``n`` steps:
    the grad norm climbs on the bad rank, then is NaN at the incident step; one step has no
    finite rank (null)."""
    report = copy.deepcopy(report)
    step = report["step"]
    steps = list(range(max(0, step - n + 1), step + 1))
    rng = random.Random(step)
    loss = [2.3 + math.exp(-s / 60) + rng.gauss(0, 0.01) for s in steps]
    grad = [0.9 + rng.gauss(0, 0.01) for _ in steps]
    report["history"] = {
        "steps": steps,
        "loss": {"mean": loss, "std": [0.05] * len(steps)},
        "grad_norm": {"mean": [*grad[:-2], None, grad[-1]],
                      "std": [0.03] * (len(steps) - 1) + ["nan"]},
    }
    for rank in report["bad_ranks"]:
        own = [g * (1 + 3 * max(0, k - len(steps) + 10) / 10) for k, g in enumerate(grad)]
        report["ranks"][str(rank)]["history"] = {
            "steps": steps, "loss": [x + 0.02 for x in loss], "grad_norm": [*own[:-1], "nan"]}
        report["ranks"][str(rank)]["sample_ids"] = [17, [3, 1024]]
    report["skip_list"] = "/data/skip-list.jsonl"
    return report


def old_report(step: int = 40) -> dict[str, Any]:
    """A version-1 report: ``ranks`` a list, no ``cluster``, no history."""
    r = sample_report(step, "old-job")
    r["version"] = 1
    r["ranks"] = list(r["ranks"].values())
    for key in ("cluster", "ranks_not_listed", "first_nonfinite_module"):
        del r[key]
    return r


def put(directory: Path, report: dict[str, Any]) -> Path:
    """Write ``report`` where the sentinel would, under its file name."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{incident_stem(report['job_id'], report['step'])}.json"
    path.write_text(json.dumps(report, indent=2))
    return path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in KNOWN_ENV:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def reports(tmp_path: Path) -> Path:
    """Two incidents of one job, with history, beside a batch, a temp file and a run dir."""
    d = tmp_path / "r"
    put(d, with_history(sample_report(120, t=T0)))
    put(d, with_history(sample_report(300, bad=5, host="node7", verdict="host", t=T0 + 60)))
    (d / "incident-job-a-step00000120-rank2-batch.pt").write_bytes(b"batch")
    (d / ".incident-job-a-step00000300.json.tmp1").write_text("{")
    (d / "runs").mkdir()
    return d


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["incidents", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_listing_is_newest_first_with_the_facts_and_path(
        reports: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, str(reports))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "TIME", "JOB", "STEP", "OUTCOME", "RANKS", "HOSTS",
                                "KINDS", "VERDICT", "REPORT"]
    assert len(lines) == 3  # the batch, the temp file and runs/ are not reports
    assert lines[1].split()[:1] + lines[1].split()[3:] == [
        "300", "job-a", "300", "skipped", "5", "node7", "grad", "host",
        str(reports / "incident-job-a-step00000300.json")]
    assert lines[2].split()[0] == "120" and "node3" in lines[2] and "transient" in lines[2]


def test_json_lists_the_same_for_scripts(reports: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, str(reports), "--json")
    rows = json.loads(out)
    assert code == 0 and [r["id"] for r in rows] == ["300", "120"]
    assert rows[1] == {
        "id": "120", "time": T0, "time_text": incidents.when(T0), "job": "job-a", "step": 120,
        "outcome": "skipped", "bad_ranks": [2], "bad_hosts": ["node3"], "kinds": ["grad"],
        "verdict": "transient", "injected": False,
        "path": str(reports / "incident-job-a-step00000120.json"),
    }


def test_the_directory_defaults_to_the_report_dir_variable(
        reports: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANSENTINEL_REPORT_DIR", str(reports))
    code, out, _ = run(capsys)
    assert code == 0 and len(out.splitlines()) == 3
    code, out, _ = run(capsys, "show", "300")
    assert code == 0 and "step 300" in out


def test_show_explains_what_where_what_was_done_and_next(
        reports: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "show", "120", "--dir", str(reports))
    assert code == 0 and err == ""
    titles = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert titles == ["Incident", "What was non-finite", "Where", "What the sentinel did",
                      "Verdict", 'What to do next (runbook.md, "NanSentinelBadHost")',
                      "Numbers"]
    assert "Incident at step 120 of job job-a" in out
    assert "Non-finite values in the local gradients (before their all-reduce) on 1 of 8 " \
           "rank(s): rank 2 (host node3)." in out
    assert "rank 2: host node3, local rank 2, device cuda:2, GPU GPU-0002-aaaa" in out
    assert "parameters with non-finite gradients: layers.3.mlp.weight, head.bias" in out
    assert "first module with a non-finite output (replay): layers.3.mlp" in out
    assert "by sample id: 17, [3, 1024]" in out and "skip list /data/skip-list.jsonl" in out
    assert "skipped the step on every rank" in out and "policy skip" in out
    assert "transient: the poisoned rank replayed its own batch" in out
    assert "1. Is it always the same rank" in out
    assert "rank 2: loss 2.31, grad_norm nan, replay loss 2.31" in out
    assert "cluster grad_norm: mean 0.9, std 0.03, min 0.85, max 0.95 over 7 rank(s)" in out
    assert "(the replay's peer: rank 2's batch gave loss 2.31)" in out


@pytest.mark.parametrize(("changes", "section", "words"), [
    ({"verdict": "host"}, "NanSentinelBadHost", "Drain/cordon the host"),
    ({"verdict": "data"}, "Causes of non-finite values", "fix the sample or shard"),
    ({"verdict": "divergence"}, "NanSentinelStepsSkipped", "Lower the learning rate"),
    ({"verdict": None, "outcome": "overflow", "bad_ranks": [], "overflow": True},
     "Causes of non-finite values", "AMP fp16 overflow"),
    ({"verdict": None, "kinds": ["batch"]}, "Causes of non-finite values", "saved batch"),
    ({"verdict": None}, "NanSentinelNonFiniteDetected", "usually a bad batch"),
    ({"verdict": None, "bad_ranks": [], "bad_hosts": [], "spikes": {"grad_norm": {"3": 42.0}}},
     "Causes of non-finite values", "Exploding gradients"),
    ({"verdict": "state", "kinds": ["loss", "grad", "state"], "state_action": "repaired",
      "poisoned_state": {"2": ["weight fc.weight (1 of 64 elements non-finite)"]}},
     "NanSentinelStateNonFinite", "suspect that host's GPU memory"),
    ({"verdict": "state", "outcome": "aborted", "kinds": ["state"], "state_action": "aborted",
      "poisoned_state": {"2": ["weight fc.weight (1 of 64 elements non-finite)"]}},
     "NanSentinelStateNonFinite", "Restore an earlier checkpoint"),
    ({"verdict": None, "bad_ranks": [], "bad_hosts": [], "kinds": ["hyperparameter"]},
     "NanSentinelHyperparameterNonFinite", "a warm-up dividing by a zero step count"),
])
def test_what_to_do_next_comes_from_a_runbook_section_that_exists(
        changes: dict[str, Any], section: str, words: str, tmp_path: Path) -> None:
    incident = incidents.load(put(tmp_path, {**sample_report(), **changes}))
    todo = incidents.advice(incident)
    assert todo.section == section and any(words in s for s in todo.steps), todo
    runbook = REPO / "nansentinel" / "files" / "monitoring" / incidents.RUNBOOK
    headings = re.findall(r"^## (.+)$", runbook.read_text(), re.M)
    assert section in headings
    text = incidents.render(incidents.explain(incident))
    assert f'"{section}"' in text and words in text


def test_a_poisoned_state_is_named_with_its_tensor_and_what_was_done(tmp_path: Path) -> None:
    incident = incidents.load(put(tmp_path, {
        **sample_report(), "verdict": "state", "kinds": ["loss", "grad", "state"],
        "state_action": "repaired",
        "poisoned_state": {"2": ["weight fc.weight (1 of 64 elements non-finite)"]}}))
    text = incidents.render(incidents.explain(incident))
    assert "rank 2's own state: weight fc.weight (1 of 64 elements non-finite)" in text
    assert "repaired in place from a finite replica" in text
    assert "the model's own state held a non-finite value" in text


def test_a_drill_says_so(tmp_path: Path) -> None:
    incident = incidents.load(put(tmp_path, {**sample_report(), "injected": True}))
    text = incidents.render(incidents.explain(incident))
    assert "(a fire drill: injected by NANSENTINEL_INJECT)" in text
    assert "fires this by design" in text


def test_a_step_of_two_jobs_is_told_apart_by_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    put(tmp_path, sample_report(120, "job-a"))
    put(tmp_path, sample_report(120, "job-b", t=T0 + 5))
    code, out, _ = run(capsys, str(tmp_path))
    assert code == 0 and [line.split()[0] for line in out.splitlines()[1:]] == [
        "job-b:120", "job-a:120"]
    code, out, err = run(capsys, "show", "120", "--dir", str(tmp_path))
    assert code == EXIT_CONFIG and out == ""
    assert err == (f"nansentinel incidents show: error: incident id '120' matches 2 reports in "
                   f"{tmp_path}: job-b:120, job-a:120; give one of these\n")
    code, out, _ = run(capsys, "show", "job-a:120", "--dir", str(tmp_path))
    assert code == 0 and "of job job-a" in out


def test_show_takes_a_file(reports: Path, capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = reports / "incident-job-a-step00000300.json"
    code, out, _ = run(capsys, "show", str(path), "--dir", "/nonexistent")
    assert code == 0 and "rank 5: host node7" in out
    monkeypatch.chdir(reports)  # a bare file name in the working directory
    code, out, _ = run(capsys, "show", path.name, "--dir", "/nonexistent")
    assert code == 0 and "step 300" in out


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code == EXIT_CONFIG == 2, (out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_missing_directory_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = one_line_error(capsys, str(tmp_path / "nope"))
    assert err == (f"nansentinel incidents: error: no report directory {tmp_path / 'nope'} "
                   "(give DIR, or set NANSENTINEL_REPORT_DIR)\n")
    assert "no report directory" in one_line_error(capsys, "show", "5", "--dir",
                                                   str(tmp_path / "nope"))


def test_an_empty_directory_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "incident-job-step00000005-rank2-batch.pt").write_bytes(b"x")
    err = one_line_error(capsys, str(tmp_path))
    assert err == f"nansentinel incidents: error: no incident reports in {tmp_path}\n"


def test_a_malformed_report_is_named_and_the_others_still_listed(
        reports: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = reports / "incident-job-a-step00000007.json"
    bad.write_text('{"step": 7,')
    code, out, err = run(capsys, str(reports))
    assert code == EXIT_CONFIG and len(out.splitlines()) == 3
    assert err == (f"nansentinel incidents: error: {bad}: malformed report, not valid JSON: "
                   "it ends before the JSON does (a torn write?)\n")
    assert str(bad) in one_line_error(capsys, "show", str(bad))


@pytest.mark.parametrize(("content", "words"), [
    ("[1, 2]", "a JSON list instead of an object"),
    ('{"step": "five"}', "field 'step' is 'five'"),
    ('{"step": 7, "bad_ranks": ["2"]}', "field 'bad_ranks' is ['2'], not a list of int"),
])
def test_a_report_of_the_wrong_shape_is_malformed(
        content: str, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "incident-j-step00000007.json"
    path.write_text(content)
    err = one_line_error(capsys, "show", str(path))
    assert str(path) in err and words in err


def test_an_unknown_id_is_one_line_and_exit_2(
        reports: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for spec in ("999", "job-z:120", "nothing-like-it"):
        err = one_line_error(capsys, "show", spec, "--dir", str(reports))
        assert err == (f"nansentinel incidents show: error: no incident {spec!r} in {reports} "
                       "(ids there: 300, 120)\n")
    err = one_line_error(capsys, "show", str(reports / "gone.json"))
    assert err == f"nansentinel incidents show: error: no report file {reports / 'gone.json'}\n"


def test_an_old_report_still_shows_what_it_has(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = put(tmp_path, old_report())
    code, out, _ = run(capsys, str(tmp_path))
    assert code == 0 and out.splitlines()[1].split()[:4] == ["40", incidents.when(T0).split()[0],
                                                             incidents.when(T0).split()[1],
                                                             "old-job"]
    code, out, _ = run(capsys, "show", "40", "--dir", str(tmp_path))
    assert code == 0 and "rank 2: host node3, local rank 2" in out and "version: 1" in out
    assert "cluster loss" not in out and "first module" not in out
    c = page.curve(incidents.load(path), "grad_norm")
    assert not c.history and c.steps == [40] and c.ranks["2"][2] == [40]  # nan at the step
    # Even a bare minimum (the step from the file name) lists and explains.
    bare = tmp_path / "incident-bare-step00000009.json"
    bare.write_text("{}")
    incident = incidents.load(bare)
    assert (incident.step, incident.job, incident.outcome) == (9, "bare", "unknown")
    assert "Incident at step 9 of job bare" in incidents.render(incidents.explain(incident))


def test_the_curves_read_numbers_nulls_and_nonfinite_strings(tmp_path: Path) -> None:
    incident = incidents.load(put(tmp_path, with_history(sample_report(120))))
    c = page.curve(incident, "grad_norm")
    assert c.history and c.steps == list(range(121)) and len(c.mean) == len(c.std) == 121
    assert math.isnan(c.mean[-2]) and math.isnan(c.std[-1]) and math.isfinite(c.mean[-1])
    steps, values, bad = c.ranks["2"]
    assert steps == c.steps and bad == [120] and math.isnan(values[-1])
    assert values[-2] > 2 * c.mean[-3]  # the climb before the NaN is kept


def test_the_page_is_self_contained_and_names_rank_host_step(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    incident = incidents.load(put(tmp_path, with_history(sample_report(120))))
    text = page.html_page(incident, incidents.explain(incident))
    assert text.startswith("<!DOCTYPE html>") and text.count("<svg") == 1
    assert "<h1>Incident at step 120: rank 2 on host node3</h1>" in text
    assert "cluster mean ± std (ranks with a finite value)" in text  # the band says what it is
    assert "incident, step 120" in text and "rank 2 (host node3)" in text
    # Nothing to fetch: no script, stylesheet, image or font from anywhere.
    assert not re.search(r"<script|<link|<img|<iframe|url\((?!#)|@import", text)
    assert not re.search(r"(src|href)=['\"]?(https?:)?//", text), "a network reference"
    assert "has no history" not in text
    old = incidents.load(put(tmp_path, old_report()))
    assert "has no history" in page.html_page(old, incidents.explain(old))


def test_the_page_is_a_new_file_in_an_existing_folder(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    incident = incidents.load(put(tmp_path, with_history(sample_report(120))))
    mine = tmp_path / "page.html"
    mine.write_text("the user's own file")
    with pytest.raises(incidents.ReportError, match="already exists"):
        page.write(incident, incidents.explain(incident), mine)
    assert mine.read_text() == "the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir() if "page" in p.name) == ["page.html"]
    with pytest.raises(incidents.ReportError, match="no directory"):
        page.write(incident, incidents.explain(incident), tmp_path / "nope" / "p.html")
    written = page.write(incident, incidents.explain(incident), tmp_path / "new.html")
    assert "<svg" in written.read_text() and (written.stat().st_mode & 0o777) == 0o600


def test_html_without_matplotlib_names_the_extra(
        reports: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    err = one_line_error(capsys, "show", "120", "--dir", str(reports), "--html",
                         str(tmp_path / "p.html"))
    assert err == ("nansentinel incidents show: error: --html draws with matplotlib, which is "
                   "not installed: pip install 'nansentinel[report]'\n")
    assert not (tmp_path / "p.html").exists()


def test_the_usage_names_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert "\n  incidents  list the incident reports" in cli.USAGE
    assert cli.main(["incidents", "show", "--help"]) == 0  # returned, not exited
    assert "ID|FILE" in capsys.readouterr().out
