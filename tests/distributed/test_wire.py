"""Nothing another rank sends is unpickled: batches for replay travel as plain data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks, values
from tests.distributed.workers_wire import send_batch, send_hostile


@pytest.mark.timeout(120)
def test_a_batch_travels_as_plain_data_without_the_users_objects(tmp_path: Path) -> None:
    _, got = values(run_ranks(send_batch, 2, tmp_path))
    assert torch.equal(got["x"], torch.arange(4.0))
    assert got["ids"] == [1, 2] and got["name"] == "ok"
    assert "meta" not in got  # a user's class is dropped, not unpickled
    assert got["pair"] == (1, "b") and type(got["pair"]) is tuple


@pytest.mark.timeout(120)
def test_a_hostile_payload_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _, out = values(run_ranks(send_hostile, 2, tmp_path, marker=str(marker)))
    assert out == {"got": None, "marker_exists": False}
    assert not marker.exists()
