"""The one reader for files that come from outside: incident reports, the exclusion file, the
skip list, anything a flag or a variable names.

Such a file may be anything a path can name: a FIFO (``open`` blocks until a writer comes, and
none ever does), ``/dev/zero`` (read until ``MemoryError``), a directory, a 10 GB file, bytes
that are not UTF-8, JSON with a 5,000-digit integer (``ValueError: Exceeds the limit (4300
digits)`` from inside ``json``), ``NaN`` literals, nesting 100,000 deep, a byte-order mark, or a
line a writer left torn. Every reader of the package goes through here, so each of those is one
:class:`InputFileError` or :class:`JsonInputError` whose message names the path and what was
wrong, and never a hang, a bare traceback or a lost byte:

- :func:`read_bytes` opens without blocking (``O_NONBLOCK``), accepts regular files only, and
  reads at most :data:`MAX_BYTES` (64 MiB: a report with every rank of a 100,000-rank job
  named is a few MB);
- :func:`decode` turns bytes into text without losing any (``surrogateescape``: invalid UTF-8
  comes back as the same bytes when encoded the same way);
- :func:`parse_json` parses with every failure named: integers of more than
  :data:`MAX_DIGITS` digits, numbers too large for a float, ``NaN``/``Infinity`` literals,
  nesting deeper than :data:`MAX_DEPTH`, a byte-order mark, a document cut short.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from nansentinel.result import NanSentinelError

#: The most bytes read from one file from outside (documented in docs/configuration.md).
MAX_BYTES = 64 * 1024 * 1024
#: The most digits of an integer in a file from outside (Python's own limit for ``int(str)``
#: is 4,300; a step or a time has at most 20).
MAX_DIGITS = 100
#: The deepest nesting of JSON arrays and objects accepted (a report nests about 6 deep);
#: deeper structures would overflow the recursion of whoever walks them next.
MAX_DEPTH = 100

ENCODING_ERRORS = "surrogateescape"


class InputFileError(NanSentinelError, OSError):
    """A file from outside cannot be read: not a regular file, too large, or unreadable. The
    message names the path. An ``OSError``, so callers that already report an unreadable file
    report this one the same way."""


class JsonInputError(NanSentinelError, ValueError):
    """Text from outside is not the JSON it should be; the message says what was wrong (and
    where, when the caller gave a name)."""


_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words (``a FIFO (named pipe)``)."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def read_bytes(path: str | os.PathLike[str], *, limit: int = MAX_BYTES,
               what: str = "file") -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them.

    Raises ``FileNotFoundError`` for a missing file (callers treat that as empty or name it
    themselves) and :class:`InputFileError`, naming ``what`` and the path, for anything else
    that is not a readable regular file of at most ``limit`` bytes. Never blocks: the open is
    non-blocking, so a FIFO without a writer is refused instead of waited on.
    """
    where = Path(path)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise InputFileError(f"{what} {where}: cannot be opened ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputFileError(f"{what} {where} is {kind_of(mode)}, not a regular file; give "
                                 "the path of a file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise InputFileError(f"{what} {where} is larger than {limit} bytes, the most read "
                                 "from one file; is it the right file?")
        return b"".join(chunks)
    except InputFileError:
        raise
    except OSError as exc:
        raise InputFileError(f"{what} {where}: cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)


def decode(data: bytes) -> str:
    """UTF-8 text that encodes back to exactly ``data`` (:func:`encode`): an invalid byte
    becomes a lone surrogate instead of a replacement character."""
    return data.decode("utf-8", ENCODING_ERRORS)


def encode(text: str) -> bytes:
    """The bytes :func:`decode` read ``text`` from."""
    return text.encode("utf-8", ENCODING_ERRORS)


def read_text(path: str | os.PathLike[str], *, limit: int = MAX_BYTES,
              what: str = "file") -> str:
    """:func:`read_bytes`, decoded without losing a byte."""
    return decode(read_bytes(path, limit=limit, what=what))


def split_lines(data: bytes) -> list[bytes]:
    """``data`` cut after each ``\\n``, every byte kept: the pieces join back to ``data``
    (the last one has no ``\\n`` when the file does not end with one)."""
    pieces = data.split(b"\n")
    lines = [p + b"\n" for p in pieces[:-1]]
    return [*lines, pieces[-1]] if pieces[-1] else lines


def _refuse_constant(name: str) -> Any:
    raise JsonInputError(f"a {name} literal, which JSON does not allow (numbers must be finite)")


def _parse_int(digits: str) -> int:
    count = len(digits.lstrip("-"))
    if count > MAX_DIGITS:
        raise JsonInputError(f"an integer of {count} digits (at most {MAX_DIGITS} are read)")
    return int(digits)


def _parse_float(text: str) -> float:
    mantissa = text.lstrip("-").split("e")[0].split("E")[0]
    if len(text) > MAX_DIGITS * 4 or len(mantissa) > MAX_DIGITS * 4:
        raise JsonInputError(f"a number of {len(text)} characters")
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise JsonInputError(f"the number {text[:40]} is too large for a float")
    return value


def depth(value: Any) -> int:
    """How deep ``value``'s lists and dicts nest (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level + 1)
            if level + 1 > MAX_DEPTH:
                return level + 1
            stack.extend((v, level + 1) for v in item)
    return deepest


def parse_json(text: str, *, where: str = "") -> Any:
    """``text`` parsed as one JSON value, or a :class:`JsonInputError` saying what was wrong,
    prefixed with ``where`` (a path, ``FILE line N``) when given."""
    prefix = f"{where}: " if where else ""
    if text.startswith("\ufeff"):
        raise JsonInputError(f"{prefix}starts with a byte-order mark (U+FEFF); save it as "
                             "UTF-8 without one")
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_int=_parse_int,
                           parse_float=_parse_float)
    except JsonInputError as exc:
        raise JsonInputError(f"{prefix}not valid JSON: {exc}") from None
    except json.JSONDecodeError as exc:
        torn = text.strip() and (exc.pos >= len(text.rstrip())
                                 or exc.msg.startswith("Unterminated string"))
        why = ("it ends before the JSON does (a torn write?)" if torn else
               f"line {exc.lineno}, column {exc.colno}: {exc.msg}")
        raise JsonInputError(f"{prefix}not valid JSON: {why}") from None
    except RecursionError:
        raise JsonInputError(f"{prefix}not valid JSON: nested deeper than {MAX_DEPTH} levels") \
            from None
    except ValueError as exc:  # anything else json's C scanner raises on a number
        raise JsonInputError(f"{prefix}not valid JSON: {str(exc)[:120]}") from None
    if depth(value) > MAX_DEPTH:
        raise JsonInputError(f"{prefix}not valid JSON: nested deeper than {MAX_DEPTH} levels")
    return value


def load_json(path: str | os.PathLike[str], *, limit: int = MAX_BYTES,
              what: str = "file") -> Any:
    """The one JSON document in the file at ``path``: :func:`read_text` then
    :func:`parse_json`, each failure naming the path."""
    return parse_json(read_text(path, limit=limit, what=what), where=f"{what} {path}")
