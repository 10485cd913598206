"""Sample ids and the skip list: validation, rows at fault, appends, loading, the sampler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

from nansentinel import skip_list
from nansentinel.rare.incident import sample_detail, skipped_ids


def test_ids_must_match_the_batch_rows_and_the_error_says_where() -> None:
    batch = {"x": torch.zeros(4, 3)}
    assert skip_list.check_ids([1, 2, 3, 4], batch, rank=0, step=0) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"3 sample ids .* leading dimension is 4 \(rank 2, "
                                         r"step 7\)"):
        skip_list.check_ids(torch.arange(3), batch, rank=2, step=7)
    with pytest.raises(TypeError, match="got int"):
        skip_list.check_ids(5, batch, rank=0, step=0)


def test_the_rows_at_fault_and_pairs_of_ids() -> None:
    x = torch.zeros(4, 2, 3)
    x[2, 1, 0] = float("inf")
    y = torch.zeros(4)
    y[0] = float("nan")
    pairs = [(0, 10), (0, 11), (1, 0), (1, 1)]
    detail = sample_detail({"x": x, "y": y, "ids": torch.arange(4)}, pairs, verdict=None)
    assert detail == {"sample_ids": [(0, 10), (1, 0)]}
    finite = sample_detail({"x": torch.zeros(2, 2)}, torch.tensor([5, 6]), verdict="data")
    assert finite == {"sample_ids": [], "batch_ids": [5, 6]}  # the batch made NaN as a whole
    assert skipped_ids({1: finite, 2: {"sample_ids": [[1, 0]]}}, "data") == {
        1: [5, 6], 2: [(1, 0)]}
    assert skipped_ids({1: finite}, "host") == {}  # a finite batch on a faulty host: not data


def test_appended_lines_load_and_a_malformed_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "skip.jsonl"
    assert skip_list.load(path) == set()
    skip_list.append(path, {"step": 3, "ids": [137, 4]})
    skip_list.append(path, {"step": 9, "ids": [[0, 12]]})
    assert skip_list.load(path) == {137, 4, (0, 12)}
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    with path.open("a") as fh:
        fh.write("{not json\n")
    with pytest.raises(ValueError, match=rf"{path}, line 3 is not a skip record"):
        skip_list.load(path)


def test_the_path_comes_from_the_environment() -> None:
    assert skip_list.path_from_env({"NANSENTINEL_SKIP_LIST": "/x/s.jsonl"}) == Path("/x/s.jsonl")
    assert skip_list.path_from_env({"NANSENTINEL_REPORT_DIR": "/r",
                                    "TORCHELASTIC_RUN_ID": "j1"}) == Path("/r/skip-list-j1.jsonl")


def test_the_sampler_leaves_out_the_ids_and_passes_the_rest_through() -> None:
    inner = DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler = skip_list.SkipSampler(inner, {3, 5, 7})
    sampler.set_epoch(2)  # DistributedSampler's own, through the wrapper
    assert inner.epoch == 2
    kept = list(sampler)
    assert kept == [i for i in inner if i not in (3, 5, 7)] and len(kept) < len(inner)
    assert len(sampler) == len(kept)
    rows = [{"id": (0, i)} for i in range(4)]
    assert list(skip_list.without(rows, {(0, 1)}, key=lambda s: s["id"])) == [
        rows[0], rows[2], rows[3]]


def test_a_skip_list_that_cannot_be_written_is_counted_and_training_goes_on(
    tmp_path: Path,
) -> None:
    from prometheus_client import CollectorRegistry

    from nansentinel.config import SentinelConfig
    from nansentinel.effects.metrics import SentinelMetrics
    from nansentinel.rare.incident import IncidentWriter
    from nansentinel.result import RankIdentity
    from nansentinel.wire.context import alone

    identity = RankIdentity(0, 0, 1, "node0", "cpu")
    blocked = tmp_path / "file"
    config = SentinelConfig(report_dir=str(tmp_path), skip_list=str(blocked / "skip.jsonl"))
    blocked.write_text("not a directory")  # after the start: the config refuses it at once
    writer = IncidentWriter(alone(config, identity, "j"))
    metrics = SentinelMetrics(identity, registry=CollectorRegistry())
    writer.failed = metrics.observe_report_failure
    out = writer._skip(3, {0: [137]}, "data")
    assert "skip_list_error" in out
    assert metrics.registry.get_sample_value(
        "nansentinel_report_failures_total", {"file": "skip_list"}) == 1.0
