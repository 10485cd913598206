"""Hostile incident reports: each malformed one is named and skipped (the rest listed), ``show``
of one says what is wrong with it, control characters never reach the terminal, and ids stay
short when several jobs share a step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nansentinel import cli
from nansentinel.reading import incidents

GOOD = {"step": 9, "time": 1700000000, "job_id": "job", "bad_ranks": [1], "kinds": ["grad"],
        "bad_hosts": ["\x1b[31mred"], "outcome": "skipped"}
BAD = {
    1: '{"step": 1, "time": NaN, "job_id": "job"}',
    2: '{"step": 2, "time": 1e300, "job_id": "job"}',
    3: '{"step": 3, "time": 1700000000, "job_id": "job", "cluster": "oops"}',
    4: "[" * 100_000,
    5: '{"step": 5, "time": 1700000000, "job_id": "job", "ranks": {"1": {"kinds": 5}}}',
    6: '{"step": 6, "time": Infinity, "job_id": "job"}',
}


def _dir(tmp_path: Path) -> Path:
    for step, text in BAD.items():
        (tmp_path / f"incident-job-step{step:08d}.json").write_text(text)
    (tmp_path / "incident-job-step00000009.json").write_text(json.dumps(GOOD))
    return tmp_path


def test_each_bad_report_is_named_and_the_good_one_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["incidents", str(_dir(tmp_path))]) == 2
    out, err = capsys.readouterr()
    assert "incident-job-step00000009.json" in out and "\x1b" not in out + err
    for step in BAD:
        assert f"step{step:08d}.json" in err and f"step{step:08d}.json" not in out
    assert "Traceback" not in err and len(err.splitlines()) == len(BAD)


@pytest.mark.parametrize("step", sorted(BAD))
def test_show_of_a_malformed_report_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], step: int
) -> None:
    assert cli.main(["incidents", "show", str(step), "--dir", str(_dir(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "cannot be shown" in err and f"step{step:08d}.json" in err, err
    assert len(err.splitlines()) == 1


def test_ids_of_uuid_jobs_sharing_a_step_are_short_and_resolve(tmp_path: Path) -> None:
    jobs = ["11111111-2222-3333-4444-555555555555", "11111111-9999-3333-4444-555555555555",
            "abcdef12-0000-0000-0000-000000000000"]
    for n, job in enumerate(jobs):
        report = {"step": 5, "time": 1700000000 + n, "job_id": job}
        (tmp_path / f"incident-{job}-step00000005.json").write_text(json.dumps(report))
    found, errors = incidents.scan(tmp_path)
    assert not errors
    short = incidents.ids(found)
    assert sorted(short) == ["11111111-2:5", "11111111-9:5", "abcdef12:5"]
    for ident, incident in zip(short, found, strict=True):
        assert incidents.find(ident, tmp_path).path == incident.path
        assert incidents.find(incident.key, tmp_path).path == incident.path
