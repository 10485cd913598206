"""Slurm hostlists (``node[1-3,7]``): read one, and write a set of hosts as one.

``nansentinel excluded --hostlist`` prints the excluded hosts in the form ``sbatch
--exclude=`` takes, and ``--among "$SLURM_JOB_NODELIST"`` keeps those of a job's allocation,
so a batch script can leave them out by itself. Host names in the exclusion file are data
from each rank's environment: a name that is not a plain Slurm node name (letters, digits,
``-``, ``_``, ``.``) is never put into a hostlist, where a comma or a bracket would name other
nodes.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable

#: What a node name in a hostlist may hold; anything else could change the list's meaning.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
#: At most this many names from one hostlist (``node[1-99999999]`` is a typo, not a cluster).
MAX_HOSTS = 1_000_000


def expand(hostlist: str) -> list[str]:
    """The node names of a Slurm hostlist, in order: ``"a[1-3,07],b"`` -> a1 a2 a3 a07 b.

    Several bracket groups in one name multiply (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2), and
    a range keeps the width of its first number (``[01-10]``). Raises ``ValueError`` naming
    the part that is not a hostlist.
    """
    names: list[str] = []
    for item in _top_level_items(hostlist):
        pieces: list[list[str]] = []
        for text, bracket in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
            if text:
                pieces.append([text])
            if bracket:
                pieces.append(_ranges(bracket, item))
        for combo in itertools.product(*pieces):
            name = "".join(combo)
            if not NODE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} in hostlist {hostlist!r} is not a node name")
            names.append(name)
            if len(names) > MAX_HOSTS:
                raise ValueError(f"hostlist {hostlist[:80]!r} names more than {MAX_HOSTS} hosts")
    return names


def compress(names: Iterable[str]) -> str:
    """One hostlist for ``names`` (duplicates dropped): ``node1 node2 node3 gpu07`` ->
    ``gpu07,node[1-3]``. Raises ``ValueError`` for a name that is not a plain node name."""
    groups: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    for name in sorted(set(names)):
        if not NODE_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a Slurm node name")
        match = re.fullmatch(r"(.*?)(\d+)", name)
        if match is None:
            plain.append(name)
            continue
        prefix, digits = match.groups()
        width = len(digits) if digits.startswith("0") else 0
        groups.setdefault((prefix, width), []).append(int(digits))
    parts = list(plain)
    for (prefix, width), numbers in sorted(groups.items()):
        numbers.sort()
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]:0{width}d}")
            continue
        runs: list[str] = []
        start = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            runs.append(f"{start:0{width}d}" if start == prev
                        else f"{start:0{width}d}-{prev:0{width}d}")
            if n is not None:
                start = prev = n
        parts.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(sorted(parts))


def _top_level_items(hostlist: str) -> list[str]:
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in hostlist.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {hostlist!r}: ']' without '['")
        if ch == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ValueError(f"hostlist {hostlist!r}: '[' without ']'")
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _ranges(bracket: str, item: str) -> list[str]:
    out: list[str] = []
    for part in bracket.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"{item!r}: [{bracket}] is not a list of numbers and ranges")
        first, last = match.group(1), match.group(2) or match.group(1)
        lo, hi = int(first), int(last)
        if hi < lo or hi - lo > MAX_HOSTS:
            raise ValueError(f"{item!r}: range {part!r} is empty or too long")
        width = len(first) if first.startswith("0") else 0
        out.extend(f"{n:0{width}d}" for n in range(lo, hi + 1))
    return out
