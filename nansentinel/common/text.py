"""Text from files and the environment made safe to print and to write as JSON.

A host name, a job id or a reason is data: it reaches a terminal from an exclusion file or a
report another host wrote, and an ANSI escape in it would recolour, move or clear the
operator's screen (or hide the line that matters). JSON has no NaN or Inf, and a record read
back may hold them (older writers, hand edits), so what a command prints as JSON spells them
as strings, as reports do.
"""

from __future__ import annotations

import math
from typing import Any


def printable(text: object, limit: int = 500) -> str:
    """``str(text)`` with every control character (ANSI escapes, newlines, NUL) written as
    its ``\\x..`` escape, and cut to ``limit`` characters: one record is one line."""
    raw = str(text)
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in raw[: limit + 1])
    return out if len(out) <= limit else out[: limit - 3] + "..."


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float, at any depth of dicts and lists, spelled as a
    string (``"nan"``, ``"inf"``, ``"-inf"``), so ``json.dumps(..., allow_nan=False)`` holds;
    tuples become lists. Raises ``RecursionError`` on a structure nested past the
    interpreter's limit, which a reader treats as a malformed record."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    return obj
