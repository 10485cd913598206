"""A full disk for reports: training goes on, each failure is one line and a count, nothing
already written is damaged, and save_batches=False keeps the user's data off disk."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

import nansentinel
from tests.unit.test_sentinel import one_step


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def make(report_dir: Path, registry: CollectorRegistry, **kw: object
         ) -> tuple[torch.nn.Module, nansentinel.Sentinel]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("metrics_port", 0)
    s = nansentinel.Sentinel(model, opt, report_dir=str(report_dir), env={}, registry=registry,
                             metrics_addr="127.0.0.1", **kw)
    return model, s


def nan_batch() -> torch.Tensor:
    x = torch.randn(8, 4)
    x[0, 0] = math.nan
    return x


@pytest.mark.timeout(60)
def test_full_disk_training_goes_on_and_failures_are_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, free_port: Callable[[], int]
) -> None:
    registry = CollectorRegistry()
    with small_tmpfs(tmp_path / "disk", "64k") as disk:
        # The exporter on, as in production: its counter is what the failures reach.
        model, s = make(disk / "reports", registry, metrics_port=free_port())
        first = one_step(model, s, nan_batch())  # written while there is room
        kept = {p: p.read_bytes() for p in (disk / "reports").iterdir()}
        assert first.report_path and len(kept) == 2  # the report and the batch
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as fh:  # fill it up
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="nansentinel"):
            outcomes = [one_step(model, s, nan_batch() if i % 2 == 0 else None).outcome
                        for i in range(6)]
        assert outcomes == ["skipped", "applied"] * 3  # the loop never saw an exception
        lines = [r.getMessage() for r in caplog.records if "could not write" in r.getMessage()]
        assert len(lines) == 6, lines  # one per failed file: 3 batches, 3 reports
        assert all("No space left on device" in line
                   for line in lines), lines
        sample = registry.get_sample_value
        assert sample("nansentinel_report_failures_total", {"file": "batch"}) == 3
        assert sample("nansentinel_report_failures_total", {"file": "report"}) == 3
        for p, data in kept.items():  # nothing already written was damaged
            assert p.read_bytes() == data
        assert sorted(os.listdir(disk / "reports")) == sorted(p.name for p in kept)  # no debris
        s.close()


def test_save_batches_false_keeps_the_batch_off_disk(tmp_path: Path) -> None:
    model, s = make(tmp_path / "r", CollectorRegistry(), save_batches=False)
    r = one_step(model, s, nan_batch())
    rep = json.loads(Path(r.report_path or "").read_text())
    assert rep["poisoned"][0]["batch_not_saved"] == "save_batches=False"
    assert "batch_path" not in rep["poisoned"][0]
    assert [p.suffix for p in (tmp_path / "r").iterdir()] == [".json"]
    s.close()
