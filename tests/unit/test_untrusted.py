"""The one reader for files from outside (common/untrusted.py) and the readers built on it:
special files are refused by name and never block, a size cap holds, no byte is lost, every
JSON failure is named, a bad report is listed as bad while the others show, and ``--clear``
removes exactly the lines that name the host, keeping every other byte (issue 59)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from nansentinel import cli
from nansentinel.common import exitcodes, untrusted
from nansentinel.common.exclusion import ExclusionRecord, ExclusionStore, names_host
from nansentinel.reading import incidents
from nansentinel.skip_list import load as load_skip_list

pytestmark = pytest.mark.timeout(60)

HUGE = "1" * 5000


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "incident-job-step00000004.json"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(("special", "words"), [
    ("fifo", "a FIFO"), ("/dev/zero", "a character device"), ("dir", "a directory")])
def test_a_special_file_is_refused_by_name_without_blocking(
        tmp_path: Path, fifo: Path, special: str, words: str) -> None:
    path = {"fifo": fifo, "dir": tmp_path}.get(special, Path(special))
    started = time.monotonic()
    with pytest.raises(untrusted.InputFileError, match=words) as caught:
        untrusted.read_bytes(path, what="report")
    assert str(path) in str(caught.value) and time.monotonic() - started < 5


def test_the_size_cap_holds_and_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "big"
    path.write_bytes(b"x" * 101)
    assert untrusted.read_bytes(path, limit=101) == b"x" * 101
    with pytest.raises(untrusted.InputFileError, match=f"{path} is larger than 100 bytes"):
        untrusted.read_bytes(path, limit=100)


def test_decoding_loses_no_byte() -> None:
    raw = b'{"host": "a\xff\xfe\xc3"}\r\n\x00\xe2\x82'
    assert untrusted.encode(untrusted.decode(raw)) == raw
    assert b"".join(untrusted.split_lines(raw + b"\n\nx")) == raw + b"\n\nx"


@pytest.mark.parametrize(("text", "words"), [
    ('{"step": ' + HUGE + "}", "an integer of 5000 digits"),
    ('{"time": NaN}', "a NaN literal"), ("[Infinity]", "a Infinity literal"),
    ("[-Infinity]", "literal"), ("[1e999]", "too large for a float"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper than"),
    ("[" * 101 + "]" * 101, "nested deeper than 100"),
    ('\ufeff{"step": 1}', "byte-order mark"), ('{"step": 1, "ti', "a torn write"),
    ('{"a" 1}', "line 1, column 6"),
])
def test_each_json_failure_is_named(text: str, words: str) -> None:
    with pytest.raises(untrusted.JsonInputError, match=words) as caught:
        untrusted.parse_json(text, where="FILE")
    assert str(caught.value).startswith("FILE: ")


def test_one_bad_report_is_listed_as_bad_and_the_others_still_show(
        tmp_path: Path, fifo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"step": 9, "time": 1700000000, "job_id": "job", "bad_ranks": [1]}
    (tmp_path / "incident-job-step00000009.json").write_text(json.dumps(good))
    (tmp_path / "incident-job-step00000001.json").write_text('{"step": 1, "x": ' + HUGE + "}")
    (tmp_path / "incident-job-step00000002.json").write_bytes(b'\xef\xbb\xbf{"step": 2}')
    (tmp_path / "incident-job-step00000003.json").symlink_to("/dev/zero")
    started = time.monotonic()
    assert cli.main(["incidents", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "incident-job-step00000009.json" in out
    lines = err.splitlines()
    assert len(lines) == 4 and "Traceback" not in err and time.monotonic() - started < 10
    for words in ("5000 digits", "byte-order mark", "a character device", "a FIFO"):
        assert sum(words in line for line in lines) == 1, (words, err)


@pytest.mark.parametrize("ident", [HUGE, f"job:{HUGE}"])
def test_show_of_a_huge_id_is_one_line(tmp_path: Path, ident: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "incident-job-step00000009.json").write_text('{"step": 9, "time": 1}')
    assert cli.main(["incidents", "show", ident, "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "no incident" in err


def test_show_of_a_fifo_fails_at_once(fifo: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["incidents", "show", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert "a FIFO" in err and str(fifo) in err and len(err.splitlines()) == 1
    with pytest.raises(incidents.ReportError, match="a FIFO"):
        incidents.load(fifo)


GOOD = b'{"host": "good", "reason": "r", "step": 3, "time": 1700000000}'
#: Lines that name host "bad" and that nothing parses as a record.
UNPARSABLE = [
    b'{"evidence": {}, "host": "bad", "reason": "r", "step": ' + HUGE.encode() + b"}",
    b'{"evidence": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b', "host": "bad"}',
    b'{"evidence": {"host": "other"}, "host": "bad", "reason": "r", "st',
    b'\xef\xbb\xbf{"host": "bad", "reason": "r", "step": 1, "time": 1}',
    b'{"host": "b\\u0061d", "time": NaN}',
    b'{"host": "bad", "step": 1, "time": 1}',
]
#: Lines that must survive ``--clear bad`` byte for byte.
OTHERS = [
    b'{"host": "caf\xc3\xa9\xff", "reason": "r", "step": 1, "time": 1}\r\n',
    b"\n",
    b'{"evidence": {"host": "bad"}, "host": "other", "step": 1, "time": 1}\n',
    b'{"evidence": {"host": "bad"}, "host": "other2", "step": ' + HUGE.encode() + b"}\n",
    b"not json at all, bad\n",
    GOOD + b"\n",
]


@pytest.mark.parametrize("bad", range(len(UNPARSABLE)))
def test_clear_removes_every_line_naming_the_host_and_keeps_every_other_byte(
        tmp_path: Path, bad: int) -> None:
    path = tmp_path / "excluded.jsonl"
    torn = UNPARSABLE[bad]
    path.write_bytes(OTHERS[0] + torn + b"\n" + b"".join(OTHERS[1:]) + torn)  # last: no newline
    assert cli.main(["excluded", "--exclusion-file", str(path), "--clear", "bad"]) == 0
    assert path.read_bytes() == b"".join(OTHERS)
    assert names_host(torn, "bad") and not any(names_host(o, "bad") for o in OTHERS)


def test_listing_creates_no_lock_and_a_fifo_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = ExclusionStore(tmp_path / "x.jsonl")
    store.path.write_bytes(GOOD + b"\n")
    assert cli.main(["excluded", "--exclusion-file", str(store.path)]) == 0
    assert [r.host for r in store.records()] == ["good"]
    assert not store.lock_path.exists()
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    started = time.monotonic()
    assert cli.main(["excluded", "--exclusion-file", str(pipe)]) == exitcodes.EXIT_CONFIG
    err = capsys.readouterr().err
    assert "a FIFO" in err and str(pipe) in err and time.monotonic() - started < 5
    assert cli.main(["excluded", "--exclusion-file", str(pipe), "--clear", "h"]) \
        == exitcodes.EXIT_CONFIG
    assert "a FIFO" in capsys.readouterr().err
    store.add(ExclusionRecord("h", "r", 1))  # a writer still makes and uses the lock
    assert store.lock_path.exists()


def test_the_skip_list_refuses_a_special_file_and_names_a_bad_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="skip list /dev/zero is a character device"):
        load_skip_list("/dev/zero")
    path = tmp_path / "skip.jsonl"
    path.write_text('{"ids": [1, 2]}\n{"ids": [' + HUGE + "]}\n")
    with pytest.raises(ValueError, match=r"line 2 is not a skip record.*5000 digits"):
        load_skip_list(path)
    path.write_text('{"ids": [1, 2]}\n')
    assert load_skip_list(path) == {1, 2}
