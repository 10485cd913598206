"""An exclusion file with hostile records: each bad record is skipped with a warning naming
the file and line, the good ones still count, ``--clear`` always removes a host (even from a
record nothing else can read), ``--json`` prints valid JSON, and a listing never writes a
host name's control characters to the terminal."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from nansentinel import cli
from nansentinel.common import exitcodes
from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore

GOOD = '{"host": "good", "reason": "r", "step": 3, "time": 1700000000}'
BAD = [
    '{"host": "bad-step", "reason": "r", "step": 1e999, "time": 1700000000}',
    '{"host": "bad-time", "reason": "r", "step": 2, "time": 1e300}',
    '{"host": "nan-time", "reason": "r", "step": 2, "time": NaN}',
    '{"host": "str-step", "reason": "r", "step": "x", "time": 1}',
    "[" * 100_000,
]


def _file(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "excluded.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_bad_records_are_skipped_with_a_warning_and_the_good_one_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _file(tmp_path, *BAD, GOOD)
    with caplog.at_level(logging.WARNING, logger="nansentinel"):
        records = ExclusionStore(path).records()
    assert [r.host for r in records] == ["good"]
    for lineno in range(1, len(BAD) + 1):
        assert f"line {lineno}: skipping" in caplog.text


@pytest.mark.parametrize("line", BAD[:4])
def test_clear_removes_a_host_whose_record_cannot_be_read(tmp_path: Path, line: str) -> None:
    path = _file(tmp_path, line, GOOD)
    host = json.loads(line)["host"]
    argv = ["excluded", "--exclusion-file", str(path), "--clear", host]
    assert cli.main(argv) == exitcodes.EXIT_OK
    assert host not in path.read_text() and "good" in path.read_text()


def test_json_listing_is_valid_json_and_a_nan_is_a_string(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ExclusionStore(tmp_path / "x.jsonl")
    store.add(ExclusionRecord("h", "r", 1, evidence={"norm": float("nan"), "x": [float("inf")]}))
    assert "NaN" not in store.path.read_text()
    assert cli.main(["excluded", "--exclusion-file", str(store.path), "--json"]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out, parse_constant=lambda c: pytest.fail(f"bare {c} in --json"))
    assert rows[0]["evidence"] == {"norm": "nan", "x": ["inf"]}


def test_a_listing_escapes_control_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = ExclusionStore(tmp_path / "x.jsonl")
    store.add(ExclusionRecord("\x1b[31mred\x1b[0m", "two\nlines\x07", 1, job_id="j\x1b[2J"))
    assert cli.main(["excluded", "--exclusion-file", str(store.path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[31mred" in out


def test_clear_removes_the_temporary_file_of_a_killed_clear(tmp_path: Path) -> None:
    store = ExclusionStore(tmp_path / "x.jsonl")
    store.add(ExclusionRecord("h", "r", 1))
    orphan = tmp_path / ".x.jsonl.abcd_123"
    orphan.write_text("half")
    old = time.time() - 10
    os.utime(orphan, (old, old))
    assert store.clear("h") == 1
    assert not orphan.exists()


def test_a_report_write_removes_hour_old_orphans_only(tmp_path: Path) -> None:
    from nansentinel.common.report import write_json

    old, fresh = tmp_path / ".step-5.json.k2j4h5g6", tmp_path / ".step-6.json.a1b2c3d4"
    keep = tmp_path / ".hidden-notes"
    for f in (old, fresh, keep):
        f.write_text("x")
    hour_ago = time.time() - 3700
    os.utime(old, (hour_ago, hour_ago))
    os.utime(keep, (hour_ago, hour_ago))
    write_json(tmp_path / "step-7.json", {"a": 1})
    assert not old.exists() and fresh.exists() and keep.exists()


def test_archiving_verdicts_removes_a_killed_ranks_temporary_file(tmp_path: Path) -> None:
    from nansentinel.common.verdicts import VERDICTS_SUBDIR, archive_verdicts

    verdicts = tmp_path / VERDICTS_SUBDIR
    verdicts.mkdir()
    (verdicts / ".rank-3.ab12cd34.tmp").write_text("{")
    assert archive_verdicts(tmp_path) is None  # nothing else there: nothing to archive
    assert not any(verdicts.iterdir())
