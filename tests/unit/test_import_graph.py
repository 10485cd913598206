"""The layering the package promises, checked in its import graph (not only in intent).

- The decision and the data it reads are pure: policy.py reaches no collective and no
  process group, only the view, the config and the history.
- The launcher side (nansentinel/launcher/, run in torchrun's agent) imports nothing from the
  worker side; the two share only their contracts.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "nansentinel"

#: What both sides may use: the env variables (and the drill spec their validation parses), the
#: exclusion file, the verdict files, the exit codes, and the result types those carry.
CONTRACTS = {"config", "inject", "exclusion", "verdicts", "exitcodes", "result"}


def _module_path(name: str) -> Path:
    parts = name.split(".")[1:]
    base = PACKAGE.joinpath(*parts)
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _imports(name: str) -> set[str]:
    """Modules ``name`` imports at module level or in a function (``nansentinel.*`` and the
    rest as written), without executing it."""
    tree = ast.parse(_module_path(name).read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "nansentinel":  # from nansentinel import checks, ...
                found.update(f"nansentinel.{alias.name}" for alias in node.names)
            else:
                found.add(node.module)
    return found


def _closure(name: str) -> set[str]:
    """Every module reachable from ``name`` through imports, inside and outside the package
    (outside modules are not followed)."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.startswith("nansentinel") and _module_path(current).exists():
            todo.extend(_imports(current))
    return seen - {name}


def test_the_decision_reaches_no_collective() -> None:
    reached = _closure("nansentinel.policy")
    assert "nansentinel.exchange" not in reached
    assert "nansentinel.collectives" not in reached
    assert not any(m.startswith("torch.distributed") for m in reached), sorted(reached)
    assert "nansentinel.view" in reached  # what it does read


def test_reports_and_replay_get_the_view_without_the_exchange() -> None:
    for name in ("nansentinel.incident", "nansentinel.replay", "nansentinel.local"):
        assert "nansentinel.exchange" not in _closure(name), name


def test_the_launcher_side_imports_only_itself_and_the_contracts() -> None:
    modules = sorted(p.stem for p in (PACKAGE / "launcher").glob("*.py"))
    assert {"run", "agent", "rendezvous_guard", "on_exclude"} <= set(modules)
    for stem in modules:
        name = "nansentinel.launcher" if stem == "__init__" else f"nansentinel.launcher.{stem}"
        ours = {m for m in _closure(name) if m.startswith("nansentinel.")}
        worker_side = {
            m for m in ours
            if not m.startswith("nansentinel.launcher")
            and m.split(".")[1] not in CONTRACTS
        }
        assert not worker_side, f"{name} reaches {sorted(worker_side)}"


def test_the_graph_reader_sees_imports() -> None:
    """The checks above would pass vacuously if the reader found nothing."""
    assert "nansentinel.exchange" in _closure("nansentinel.sentinel")
    assert "nansentinel.launcher.rendezvous_guard" in _imports("nansentinel.launcher.run")
