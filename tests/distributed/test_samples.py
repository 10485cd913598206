"""Sample provenance and the skip list (issue 19): a NaN in sample 137 of rank 1's batch is
named by id in the report and the log, appended to the job's skip list, and after a restart
from the checkpoint the sampler never yields it again while training goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nansentinel import skip_list
from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_samples import BAD_ID, train


@pytest.mark.timeout(150)
def test_a_bad_sample_is_named_skip_listed_and_never_seen_after_a_restart(
    tmp_path: Path,
) -> None:
    reports, ckpt = tmp_path / "r", str(tmp_path / "ckpt.pt")
    first = values(run_ranks(train, 2, tmp_path, report_dir=str(reports), checkpoint=ckpt,
                             steps=12, resume=False, timeout=120))
    bad_step = next(i for i, r in enumerate(first[0]["records"]) if not r["applied"])
    assert all(r["applied"] for i, r in enumerate(first[0]["records"]) if i != bad_step)
    assert BAD_ID in first[1]["seen"] and first[1]["records"][bad_step]["bad_ranks"] == [1]
    report = json.loads(Path(first[0]["records"][bad_step]["report_path"]).read_text())
    assert report["ranks"]["1"]["sample_ids"] == [BAD_ID]
    assert report["skipped_ids"] == {"1": [BAD_ID]}
    history = report["ranks"]["1"]["history"]
    assert history["steps"][-1] == bad_step and history["loss"][-1] == "nan"
    assert report["history"]["steps"] == list(range(bad_step + 1))
    assert any(f"samples: {BAD_ID}" in line for line in first[1]["log"]), first[1]["log"]
    listed = skip_list.default_path(reports, "samples")
    assert skip_list.load(listed) == {BAD_ID} and report["skip_list"] == str(listed)
    assert (listed.stat().st_mode & 0o777) == 0o600

    again = values(run_ranks(train, 2, tmp_path, report_dir=str(reports), checkpoint=ckpt,
                             steps=30, resume=True, timeout=120))
    for out in again:
        assert out["skip"] == [BAD_ID]
        assert BAD_ID not in out["seen"] and len(out["seen"]) > 8 * 12
        assert all(r["applied"] for r in out["records"]), out["records"]
    assert torch.equal(again[0]["weights"], again[1]["weights"])
    assert torch.isfinite(again[0]["weights"]).all()
