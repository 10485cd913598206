"""The layering the package promises, checked in its import graph (not only in intent).

The folders of ``nansentinel/`` are layers, from the bottom up (docs/design.md):

    result, common/, config     the contracts both sides share (the launcher may import them)
    checks/                     pure tensor checks, this rank's row, buffers, pipeline boundaries
    wire/                       the row schema, the exchange, the rare path's collectives
    engines/                    one module per gradient path, each declaring its capabilities
    decide/                     policy, spikes, origins: pure
    rare/                       detection, replay, trace, replicas, incidents, curves
    effects/                    recovery, scaling, drop, stop, metrics
    step/                       the step in progress, its states, the gates, the Sentinel
    the top level               the public API and the integrations (lightning, transformers, ...)

A module imports only modules of its own layer or of the layers below it. Three sides stand
apart: the launcher (``launcher/``, run in torchrun's agent), the reading side (``reading/``,
``nansentinel incidents``) and the shipped files (``files/``, ``nansentinel files``) import
only the contracts and themselves, and the worker side never imports them. Only ``wire/`` and
``engines/`` import ``torch.distributed`` (and the launcher, which wraps
``torch.distributed.run``, and the demo, a training script).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "nansentinel"

#: Layer of each folder (and of the top-level contracts), bottom up.
LEVELS = {
    "result": 0, "common": 1, "config": 2, "checks": 3, "wire": 4, "engines": 5, "decide": 6,
    "rare": 7, "effects": 8, "step": 9,
}
TOP = 10  # the rest of the top level: the public API and the integrations
COMMAND = 11  # cli.py and __main__.py: the command dispatches to both sides
SIDES = {"launcher", "reading", "files"}  # import only the contracts (levels 0-2) and themselves
#: Where ``torch.distributed`` may be imported, beside wire/ and engines/: the launcher wraps
#: ``torch.distributed.run``; the demo is a training script that starts its process group.
DISTRIBUTED_OK = {"wire", "engines", "launcher", "demo"}
#: The one room of torch's insides (every private seam, probed and adapted there): it imports
#: ``torch.distributed`` only inside the accessors that read a c10d, FSDP or rendezvous seam,
#: never at module level and never to issue a collective, so a layer that calls its kernels
#: (the checks' foreach norms) reaches no collective through it.
ROOM = "nansentinel.common.torch_insides"
MAX_TOP_LEVEL = 20


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The module's syntax tree, parsed once for all the tests (read-only)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(("nansentinel", *parts))] = path
    return found


MODULES = _modules()


def _unit(name: str) -> str:
    """The folder of a module, or its own name at the top level (``nansentinel.x.y`` -> x)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _level(name: str) -> int:
    unit = _unit(name)
    if unit in LEVELS:
        return LEVELS[unit]
    return COMMAND if unit in ("cli", "__main__") else TOP


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, *, typing: bool = True, functions: bool = True) -> set[str]:
    """Modules ``name`` imports, at module level or in a function, as written (``from
    nansentinel.x import y`` is ``nansentinel.x.y`` where that is a module); ``typing``:
    with those under ``if TYPE_CHECKING:``; ``functions``: with those inside functions."""
    tree = _tree(MODULES[name])
    skip: set[int] = set()
    if not functions:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _type_checking(node):
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            module = node.module
            if node.level:  # relative: resolve against the importing package
                base = name.split(".")[: len(name.split(".")) - node.level + (
                    1 if MODULES[name].name == "__init__.py" else 0)]
                module = ".".join([*base, module])
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names
                         if f"{module}.{a.name}" in MODULES)
    return found


def _ours(names: set[str]) -> set[str]:
    return {m for m in names if m in MODULES and m != "nansentinel"}


def test_each_layer_imports_only_itself_and_the_layers_below() -> None:
    broken = []
    for name in MODULES:
        if _unit(name) in SIDES:
            continue
        if _level(name) == COMMAND:  # the command runs in torchrun's agent: no worker code
            broken += [f"{name} -> {imported} (the command imports the worker side)"
                       for imported in _ours(_imports(name, typing=False))
                       if _unit(imported) not in SIDES
                       and LEVELS["config"] < _level(imported) < COMMAND]
            continue
        for imported in _ours(_imports(name, typing=False)):
            if _unit(imported) in SIDES and _level(name) != COMMAND:
                broken.append(f"{name} -> {imported} (the worker side imports a side)")
            elif _unit(imported) not in SIDES and _level(imported) > _level(name):
                broken.append(f"{name} (level {_level(name)}) -> {imported} "
                              f"(level {_level(imported)})")
    assert not broken, "\n".join(sorted(broken))


@pytest.mark.parametrize("side", sorted(SIDES))
def test_the_sides_import_only_the_contracts_and_themselves(side: str) -> None:
    broken = [
        f"{name} -> {imported}"
        for name in MODULES if _unit(name) == side
        for imported in _ours(_imports(name))
        if _unit(imported) != side and _level(imported) > LEVELS["config"]
    ]
    assert not broken, "\n".join(broken)


def test_only_the_wire_and_the_engines_import_torch_distributed() -> None:
    broken = sorted(
        f"{name} imports {imported}"
        for name in MODULES if _unit(name) not in DISTRIBUTED_OK
        for imported in _imports(name, typing=False, functions=name != ROOM)
        if imported == "torch.distributed" or imported.startswith("torch.distributed.")
    )
    assert not broken, "\n".join(broken)


def test_the_decision_reaches_no_collective() -> None:
    """policy, spikes, origins: pure functions of the view, the history and the config."""
    for name in (m for m in MODULES if _unit(m) == "decide"):
        reached = _closure(name)
        assert not any(m.startswith("torch.distributed") for m in reached), (name, reached)
        assert not {"nansentinel.wire.exchange", "nansentinel.wire.collectives"} & reached


def test_the_checks_reach_no_collective() -> None:
    for name in (m for m in MODULES if _unit(m) == "checks"):
        reached = _closure(name)
        assert not any(m.startswith("torch.distributed") for m in reached), (name, reached)


def test_the_room_issues_no_collective() -> None:
    """What lets the checks import the room: it reads seams and returns them, but calls no
    collective of torch.distributed itself."""
    collectives = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                   "reduce_scatter_tensor", "broadcast", "barrier", "send", "recv",
                   "all_to_all", "gather", "scatter", "monitored_barrier"}
    tree = _tree(MODULES[ROOM])
    called = {node.func.attr for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert not called & collectives


def test_no_module_calls_an_object_collective() -> None:
    """torch's object collectives (``all_gather_object``, ...) read their bytes back through
    numpy, an optional dependency of torch that the package does not require: on an install
    without it they fail with "Numpy is not available". The rare path's ``Peers`` gathers
    JSON instead (wire/collectives.py)."""
    objects = {"all_gather_object", "gather_object", "broadcast_object_list",
               "scatter_object_list", "send_object_list", "recv_object_list"}
    found = sorted(f"{name}:{node.lineno} {node.func.attr}" for name, path in MODULES.items()
                   for node in ast.walk(_tree(path)) if isinstance(node, ast.Call)
                   and isinstance(node.func, ast.Attribute) and node.func.attr in objects)
    assert not found, found


def test_the_top_level_is_the_public_api() -> None:
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


#: The public constructor keeps its keywords; every other function takes at most this many.
MAX_PARAMETERS = 6
#: Names of the engines, as a comparison outside ``engines/`` would spell them: short names,
#: and every path's label (``Capabilities.label``: words for messages, not a key).
ENGINE_NAMES = {"ddp", "fsdp", "fsdp1", "fsdp2", "hsdp", "deepspeed", "local", "local_grads",
                "pipeline", "prehook", "torchft ddp", "local gradients", "collective pre-hooks"}


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found = []
    for name, path in MODULES.items():
        tree = _tree(path)

        def visit(node: ast.AST, where: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{where}.{child.name}")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((f"{where}.{child.name}", child))
                    visit(child, f"{where}.{child.name}")
                else:
                    visit(child, where)

        visit(tree, name)
    return found


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
            if a.arg not in ("self", "cls")]


def test_no_function_takes_more_than_six_parameters() -> None:
    """Shared state travels in one Context (wire/context.py), not threaded through long
    signatures; only the public Sentinel(...) keeps its keywords."""
    functions = _functions()
    assert len(functions) > 300  # the reader sees the package
    long = [f"{where} ({len(_parameters(f))})" for where, f in functions
            if len(_parameters(f)) > MAX_PARAMETERS
            and where != "nansentinel.step.sentinel.Sentinel.__init__"]
    assert not long, long


def _strings(node: ast.AST) -> list[str]:
    """The string constants ``node`` is, or holds as a literal collection's elements."""
    elements = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _engine_names_compared(tree: ast.AST) -> list[int]:
    """Lines comparing with an engine's name: a string written in the comparison, a name
    bound to one (``GRAD_PATHS = ("DDP", ...)`` then ``label in GRAD_PATHS``), or a path's
    ``.label``, whatever it is compared with."""
    named = {target.id for node in ast.walk(tree)
             if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None
             and any(s.lower() in ENGINE_NAMES for s in _strings(node.value))
             for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
             if isinstance(target, ast.Name)}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            if (any(s.lower() in ENGINE_NAMES for s in _strings(side))
                    or (isinstance(side, ast.Name) and side.id in named)
                    or (isinstance(side, ast.Attribute) and side.attr == "label")):
                lines.append(node.lineno)
                break
    return lines


def test_no_module_outside_the_engines_compares_an_engine_name() -> None:
    """Behaviour comes from an engine's declared capabilities (engines.Capabilities), so that
    adding an engine is one module: a `path == "fsdp"` elsewhere would need editing for it."""
    found = {name: lines for name, path in MODULES.items() if _unit(name) != "engines"
             if (lines := _engine_names_compared(_tree(path)))}
    assert not found, found
    # it can fail: a name written in, one bound to a constant, a label compared
    assert _engine_names_compared(ast.parse('if path.name in ("ddp", "x"): pass'))
    assert _engine_names_compared(ast.parse('PATHS = ("local gradients", "DDP")\n'
                                            'if label in PATHS: pass'))
    assert _engine_names_compared(ast.parse('if caps.label == wanted: pass'))
    assert not _engine_names_compared(ast.parse('KINDS = ("grad", "loss")\nif k in KINDS: pass'))


def test_the_engine_names_hold_every_label() -> None:
    from nansentinel.engines import registry

    assert {path.CAPS.label.lower() for path in registry()} <= ENGINE_NAMES


def test_the_graph_reader_sees_imports() -> None:
    """The checks above would pass vacuously if the reader found nothing."""
    assert "nansentinel.wire.exchange" in _closure("nansentinel.step.sentinel")
    assert "nansentinel.launcher.rendezvous_guard" in _imports("nansentinel.launcher.run")
    assert _level("nansentinel.step.gate") > _level("nansentinel.wire.view")
    assert "torch.distributed" in _imports("nansentinel.wire.exchange", typing=False) or any(
        m.startswith("torch.distributed") for m in _imports("nansentinel.wire.exchange"))


def _closure(name: str) -> set[str]:
    """Every module reachable from ``name`` through its imports (outside modules are listed,
    not followed), without those under ``if TYPE_CHECKING:``."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in MODULES and current != "nansentinel":  # the package's own __init__
            # is the API, not a dependency; the room's accessors import c10d lazily (ROOM)
            todo.extend(_imports(current, typing=False, functions=current != ROOM))
    return seen - {name}
