"""Reports are atomic and never overwrite what is there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nansentinel import report


def test_write_json_never_overwrites(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "incident.json"
    first = report.write_json(target, {"n": 1})
    second = report.write_json(target, {"n": 2})
    assert first == target and second == tmp_path / "sub" / "incident-1.json"
    assert json.loads(first.read_text()) == {"n": 1}
    assert json.loads(second.read_text()) == {"n": 2}
    assert sorted(p.name for p in target.parent.iterdir()) == ["incident-1.json", "incident.json"]


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        report.write_json(tmp_path / "x.json", {"bad": float("nan")})
    assert list(tmp_path.iterdir()) == []


def test_save_batch_roundtrip(tmp_path: Path) -> None:
    path = report.save_batch(tmp_path / "b.pt", {"x": torch.ones(2), "meta": ("a", 1)})
    loaded = torch.load(path)
    assert torch.equal(loaded["x"], torch.ones(2)) and loaded["meta"] == ("a", 1)
    assert report.incident_stem("job/1", 5) == "incident-job_1-step00000005"
