"""Reports are atomic and never overwrite what is there."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from nansentinel.common import report


def test_write_json_never_overwrites(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "incident.json"
    first = report.write_json(target, {"n": 1})
    second = report.write_json(target, {"n": 2})
    assert first == target and second == tmp_path / "sub" / "incident-1.json"
    assert json.loads(first.read_text()) == {"n": 1}
    assert json.loads(second.read_text()) == {"n": 2}
    assert sorted(p.name for p in target.parent.iterdir()) == ["incident-1.json", "incident.json"]


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        report.write_json(tmp_path / "x.json", {"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_non_finite_numbers_anywhere_are_written_as_strings(tmp_path: Path) -> None:
    """Issue 26 item 1: a NaN batch's quarantine sums sat deep in the report and JSON has no
    NaN; the write failed and the exception left step()."""
    content = {"poisoned": [{"signature": {"stats": (1.0, float("nan"), -float("inf"))}}],
               "ranks": {"1": {"loss": float("inf"), "ok": 2.5}}}
    path = report.write_json(tmp_path / "x.json", content)
    back = json.loads(path.read_text())
    assert back["poisoned"][0]["signature"]["stats"] == [1.0, "nan", "-inf"]
    assert back["ranks"]["1"] == {"loss": "inf", "ok": 2.5}


def test_any_failure_to_write_is_one_line_and_a_count_never_an_exception(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failed: list[str] = []
    path, reason = report.attempt(
        "report", lambda: report.write_json(tmp_path / "x.json", {"bad": object()}),
        rank=3, step=7, failed=failed.append,
    )
    assert path is None and reason and reason.startswith("TypeError")
    assert failed == ["report"]
    assert "rank 3 could not write the incident report of step 7" in caplog.text


def test_save_batch_roundtrip(tmp_path: Path) -> None:
    path = report.save_batch(tmp_path / "b.pt", {"x": torch.ones(2), "meta": ("a", 1)})
    loaded = torch.load(path)
    assert torch.equal(loaded["x"], torch.ones(2)) and loaded["meta"] == ("a", 1)
    assert report.incident_stem("job/1", 5) == "incident-job_1-step00000005"


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_reports_are_private_to_the_user(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a common, permissive umask: the sentinel still keeps data private
    try:
        path = report.save_batch(tmp_path / "a" / "b" / "batch.pt", {"x": torch.ones(2)})
        js = report.write_json(tmp_path / "a" / "b" / "incident.json", {"n": 1})
    finally:
        os.umask(old)
    assert _mode(path) == 0o600 and _mode(js) == 0o600
    assert _mode(tmp_path / "a") == 0o700 and _mode(tmp_path / "a" / "b") == 0o700


def test_a_stricter_umask_and_an_existing_directory_are_respected(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o750)  # the user's own choice for an existing directory stays
    old = os.umask(0o277)
    try:
        js = report.write_json(shared / "incident.json", {"n": 1})
    finally:
        os.umask(old)
    assert _mode(js) == 0o400 and _mode(shared) == 0o750


def test_a_failed_write_is_one_line_and_a_count(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failures: list[str] = []
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    path, error = report.attempt(
        "report", lambda: report.write_json(blocker / "x.json", {"n": 1}), rank=3, step=7,
        failed=failures.append,
    )
    assert path is None and error and error.startswith(("NotADirectoryError", "FileExistsError"))
    assert failures == ["report"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "rank 3" in line and "step 7" in line and "training goes on" in line
