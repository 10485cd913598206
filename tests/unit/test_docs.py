"""The README and docs/ keep their promises: what they show imports, runs and links.

Every check reads the real thing rather than a copy of it: the CLI's own argparse parsers
(captured as ``nansentinel.cli.main`` builds them), torchrun's parser, the config's
``KNOWN_ENV``, the exporter's registry, the alert rules file and the exit-code constants. A
rename in the code, or a typo in the docs, fails here with the page and line.

Markers (an HTML comment on the line before a fenced block): ``<!-- run -->`` runs a python
block (in a temporary directory, without ``NANSENTINEL_*`` variables); ``<!-- fragment -->``
exempts a deliberately partial python block from parsing (its imports are still imported);
``<!-- ci: TEST[; TEST] -->`` names the tests that run a command block on CPU (a file, or
``file::function``). A command block without one says, on the line before it, what it needs
that CI does not have ("Not run in CI ... needs ...").
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
LANGUAGES = {"python", "bash", "console", "text"}
#: Modules a python block may import: the package, torch, the project's dependencies and
#: extras (pyproject.toml), and the standard library. Extras not installed are skipped.
CORE = {"nansentinel", "torch", "psutil", "prometheus_client"}
EXTRAS = {"lightning", "transformers", "accelerate", "torchtitan", "matplotlib", "deepspeed",
          "torchft"}
PLACEHOLDERS = {"…", "..."}


# --- reading markdown ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    mark: str | None
    before: str = ""
    """The paragraph just before the block (whose last line may be its marker; or the
    sentence that says what it needs)."""

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang})"


_FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
_MARK = re.compile(r"^<!--\s*(run|fragment)\s*-->$")


def _read(page: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of ``page``, and its other lines (numbered) with inline code kept."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page.name}:{start + 1}: unclosed code fence"
        before = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        mark = _MARK.match(before)
        blocks.append(Block(page, start + 1, lang, "\n".join(body), mark and mark.group(1),
                            _paragraph(lines[:start])))
        i += 1
    return blocks, prose


def _paragraph(lines: list[str]) -> str:
    """The paragraph that ends ``lines`` (its lines back to a blank one, stripped)."""
    end = len(lines)
    while end and not lines[end - 1].strip():
        end -= 1
    start = end
    while start and lines[start - 1].strip():
        start -= 1
    return "\n".join(ln.strip() for ln in lines[start:end])


_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def _spans(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    return [(n, m.group(2).strip()) for n, line in prose for m in _CODE_SPAN.finditer(line)]


def _without_code(line: str) -> str:
    return _CODE_SPAN.sub("", line)


BLOCKS = [b for page in PAGES for b in _read(page)[0]]


def _blocks(*langs: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang in langs]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower-cased, punctuation dropped
    (letters, digits, ``_``, ``-`` and spaces stay), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return "".join(c for c in text.strip().lower() if c.isalnum() or c in " -_").replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in _read(page)[1]:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = _slug(m.group(1))
            n = counts.get(base, 0)
            counts[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


# --- the front page ---------------------------------------------------------------------------

DEMO = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
        "pip install -e . && nansentinel demo")
TESTS = "bash tests/run.sh"


def test_the_front_page_is_short_and_opens_with_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, len(text.splitlines())
    blocks, _ = _read(README)
    assert [b.code for b in blocks[:2]] == [DEMO, TESTS]
    first_section = next(n for n, line in enumerate(text.splitlines(), 1) if line.startswith("## "))
    assert blocks[1].line < first_section, "the two commands come before any section"
    assert "torch==2.13.0` is pinned in both commands" in text  # and why
    assert TESTS in (ROOT / ".ci" / "run").read_text(encoding="utf-8")  # CI runs the same


def test_the_front_page_links_every_docs_page() -> None:
    linked = {m.group(1) for m in re.finditer(r"\]\((docs/[\w.-]+\.md)", README.read_text())}
    assert linked == {f"docs/{p.name}" for p in DOCS.glob("*.md")}


def test_every_fenced_block_names_its_language() -> None:
    bad = [str(b) for b in BLOCKS if b.lang not in LANGUAGES]
    assert not bad, f"name one of {sorted(LANGUAGES)}: {bad}"
    assert len([b for b in BLOCKS if b.mark == "fragment"]) <= 3, "keep fragments few"
    assert _blocks("python") and _blocks("bash")  # the reader sees the blocks


# --- links ------------------------------------------------------------------------------------

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page: Path) -> None:
    problems = []
    links = 0
    for n, line in _read(page)[1]:
        for target in _LINK.findall(_without_code(line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto: ...: not checked here
                continue
            links += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(f"{page.name}:{n}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.append(f"{page.name}:{n}: {target}: no heading #{anchor} in {dest.name}")
            elif ROOT not in dest.parents and dest != ROOT:
                problems.append(f"{page.name}:{n}: {target}: outside the repository")
    assert not problems, "\n".join(problems)
    assert links or page.name != "README.md"


def test_the_slug_rule_is_githubs() -> None:
    assert _slug("`nansentinel run`: launch, exclude a bad host, go on") == (
        "nansentinel-run-launch-exclude-a-bad-host-go-on")
    assert _slug("Pipeline parallel (`torch.distributed.pipelining`)") == (
        "pipeline-parallel-torchdistributedpipelining")
    assert _slug("FSDP2 and HSDP") == "fsdp2-and-hsdp"


# --- python blocks ----------------------------------------------------------------------------


def _imports(block: Block) -> list[ast.stmt]:
    if block.mark == "fragment":
        lines = [ln.strip() for ln in block.code.splitlines()]
        return [s for ln in lines if re.match(r"(import|from)\s", ln) for s in ast.parse(ln).body]
    tree = ast.parse(block.code, filename=str(block))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def _missing_dependency(exc: BaseException) -> str | None:
    """The module a third-party import lacked on this machine (torchtitan needs triton, a GPU
    package), or None when the import failed on its own account (a wrong name of ours)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            top = seen.name.split(".")[0]
            return None if top == "nansentinel" or top in CORE else seen.name
        seen = seen.__cause__ or seen.__context__
    return None


def _top(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name.split(".")[0] for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    return [(node.module or "").split(".")[0]]


@pytest.mark.parametrize("block", _blocks("python"), ids=str)
def test_python_blocks_parse_and_their_imports_import(block: Block) -> None:
    namespace: dict[str, object] = {}
    for node in _imports(block):
        for top in _top(node):
            known = top in CORE | EXTRAS or top in sys.stdlib_module_names
            assert known, f"{block}: imports {top!r}, which is not a dependency of the project"
            if top in EXTRAS and importlib.util.find_spec(top) is None:
                pytest.skip(f"{top} is not installed here")
        try:
            exec(compile(ast.Module([node], []), str(block), "exec"), namespace)
        except ImportError as exc:
            missing = _missing_dependency(exc)
            if missing is None:
                raise
            pytest.skip(f"{ast.unparse(node)} needs {missing}, not installed here")
    # Attributes read off an imported nansentinel module exist: nansentinel.Sentinel, ...
    if block.mark != "fragment":
        for node in ast.walk(ast.parse(block.code)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner = namespace.get(node.value.id)
                if isinstance(owner, type(sys)) and owner.__name__.startswith("nansentinel"):
                    assert hasattr(owner, node.attr), f"{block}: {node.value.id}.{node.attr}"


@pytest.mark.parametrize("block", [b for b in _blocks("python") if b.mark == "run"], ids=str)
def test_runnable_blocks_run(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("NANSENTINEL_")]:
        monkeypatch.delenv(key)
    exec(compile(block.code, str(block), "exec"), {"__name__": "__docs__"})


def test_some_blocks_run() -> None:
    assert len([b for b in BLOCKS if b.mark == "run"]) >= 2


def _resolve(dotted: str) -> bool | None:
    """Whether ``dotted`` names a module or an attribute (None: a dependency is missing)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name == ".".join(parts[:cut]):
                continue
            raise
        except ImportError as exc:
            if _missing_dependency(exc) is not None:
                return None
            raise
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_dotted_nansentinel_names_in_the_prose_exist() -> None:
    names = {
        (page.name, n, span)
        for page in PAGES for n, span in _spans(_read(page)[1])
        if re.fullmatch(r"nansentinel(\.[A-Za-z_]\w*)+", span)
    }
    assert names
    missing = [f"{p}:{n}: {s}" for p, n, s in sorted(names) if _resolve(s) is False]
    assert not missing, missing
    assert _resolve("nansentinel.Sentinel") and _resolve("nansentinel.skip_list.SkipSampler")
    assert _resolve("nansentinel.Sentinal") is False


# --- commands ---------------------------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _capture(call: object, *args: object) -> argparse.ArgumentParser | None:
    """The parser ``call(*args)`` builds: caught at its ``parse_args``, before anything runs."""

    def parse_args(self: argparse.ArgumentParser, *a: object, **k: object) -> object:
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args):
        try:
            call(*args)  # type: ignore[operator]
        except _Captured as captured:
            return captured.parser
    return None


_PARSERS: dict[tuple[str, ...], argparse.ArgumentParser | None] = {}


def _cli_parser(*argv: str) -> argparse.ArgumentParser | None:
    if argv not in _PARSERS:
        from nansentinel import cli

        _PARSERS[argv] = _capture(cli.main, list(argv))
    return _PARSERS[argv]


def _script_parser(script: str) -> argparse.ArgumentParser:
    """A python entry point's parser, from its module-level ``parse_args(argv)``."""
    if script.endswith(".py"):
        path = ROOT / script
        name = f"_docs_{path.stem}"
        module = sys.modules.get(name)  # type: ignore[assignment]
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec and spec.loader, script
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses look their module up there
            sys.path.insert(0, str(path.parent))  # the script's own imports (benchlib)
            try:
                spec.loader.exec_module(module)
            finally:
                sys.path.remove(str(path.parent))
    else:
        module = importlib.import_module(script)
    assert hasattr(module, "parse_args"), f"{script}: no parse_args(argv) to introspect"
    parser = _capture(module.parse_args, [])
    assert parser is not None, script
    return parser


def _torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed import run as torchrun

    return torchrun.get_args_parser()


def _check_flags(
    tokens: list[str], parsers: list[argparse.ArgumentParser], *, script_ends: bool
) -> list[str]:
    """Flags of ``tokens`` that none of ``parsers`` accepts (exact names, no abbreviations),
    up to the first positional when ``script_ends`` (torchrun's training script)."""
    options = {s: a for p in parsers for a in p._actions for s in a.option_strings}
    wrong = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith("-") and token != "-":
            name = token.split("=", 1)[0]
            action = options.get(name)
            if action is None:
                wrong.append(name)
            elif "=" not in token and action.nargs != 0:
                i += 1
        elif token not in PLACEHOLDERS and script_ends:
            break
        i += 1
    return wrong


def _check_command(tokens: list[str]) -> list[str]:
    """What is wrong with one command line (empty: nothing, or not ours to check)."""
    while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):
        tokens = tokens[1:]  # VAR=value prefixes
    if not tokens:
        return []
    head, rest = tokens[0], tokens[1:]
    if head == "nansentinel":
        if not rest or rest[0].startswith("-"):
            return []  # nansentinel --help
        sub = rest[0]
        show = rest[:2] == ["incidents", "show"]  # a parser of its own
        parser = _cli_parser(*(("incidents", "show", "ID") if show else (sub,)))
        if parser is None:
            return [f"no subcommand {sub!r}"]
        args = rest[2 if show else 1:]
        from nansentinel.launcher import run as launcher

        if parser.prog == launcher.build_parser().prog:
            ours, theirs = launcher.split_argv(args)
            return _check_flags(ours, [parser], script_ends=False) + _check_flags(
                theirs, [_torchrun_parser()], script_ends=True)
        return _check_flags(args, [parser], script_ends=False)
    if head == "torchrun":
        return _check_flags(rest, [_torchrun_parser()], script_ends=True)
    if head in ("python", "python3") and rest:
        script, args = (rest[1], rest[2:]) if rest[0] == "-m" else (rest[0], rest[1:])
        ours = script.startswith(("nansentinel", "bench/"))
        if ours and any(a.startswith("-") for a in args):
            return _check_flags(args, [_script_parser(script)], script_ends=False)
    return []


def _command_lines(block: Block) -> list[str]:
    text = block.code.replace("\\\n", " ")
    lines = text.splitlines()
    if block.lang == "console":
        return [ln[2:] for ln in lines if ln.startswith("$ ")]
    return lines


def _commands(line: str) -> list[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def _all_commands() -> list[tuple[str, list[str]]]:
    found = []
    for block in _blocks("bash", "console"):
        for line in _command_lines(block):
            found += [(str(block), c) for c in _commands(line)]
    for page in PAGES:
        for n, span in _spans(_read(page)[1]):
            if re.match(r"^(nansentinel|torchrun|python3?) ", span):
                found += [(f"{page.name}:{n}", c) for c in _commands(span)]
    return found


def test_commands_use_subcommands_and_flags_the_parsers_accept() -> None:
    commands = _all_commands()
    ours = [c for _, c in commands if "nansentinel" in c[:3]]
    assert len(ours) >= 10, ours  # the reader finds the commands
    wrong = [f"{where}: {' '.join(c)}: {problems}"
             for where, c in commands if (problems := _check_command(c))]
    assert not wrong, "\n".join(wrong)


def test_the_flag_check_can_fail() -> None:
    assert _check_command(["nansentinel", "demo", "--fdsp"]) == ["--fdsp"]
    assert _check_command(["nansentinel", "rn"]) == ["no subcommand 'rn'"]
    # a sentinel option after torchrun's reaches torchrun, which does not know it
    assert _check_command(
        ["nansentinel", "run", "--nnodes=2", "--host-strikes=3", "train.py"]) == ["--host-strikes"]
    assert _check_command(["nansentinel", "run", "--host-strikes=3", "--nnodes=2", "t.py",
                           "--steps", "5"]) == []
    assert _check_command(["python", "bench/overhead.py", "--ppp"]) == ["--ppp"]


# --- names the docs promise -------------------------------------------------------------------

_ENV = re.compile(r"\bNANSENTINEL_[A-Z][A-Z0-9_]*")


def _text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in PAGES)


def _code_env_names() -> set[str]:
    """``NANSENTINEL_*`` names the package reads or sets outside the config: its string
    constants that are exactly such a name (docstrings and messages are not)."""
    found = set()
    for path in (ROOT / "nansentinel").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                r"NANSENTINEL_[A-Z][A-Z0-9_]*", node.value
            ):
                found.add(node.value)
    return found


def test_environment_variables_named_exist() -> None:
    from nansentinel.config import KNOWN_ENV

    extra = _code_env_names() - KNOWN_ENV
    assert extra  # the excluded host and reason of the --on-exclude hook
    named = set(_ENV.findall(_text()))
    assert not named - KNOWN_ENV - extra, sorted(named - KNOWN_ENV - extra)
    reference = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert not (KNOWN_ENV | extra) - set(_ENV.findall(reference)), "configuration.md lists all"


def test_fire_drill_specs_parse() -> None:
    from nansentinel.common.inject import parse_inject

    specs = []
    for _, command in _all_commands():
        specs += [t.split("=", 1)[1] for t in command if t.startswith("NANSENTINEL_INJECT=")]
    specs += [s.split("=", 1)[1] for p in PAGES for _, s in _spans(_read(p)[1])
              if re.fullmatch(r"NANSENTINEL_INJECT=[^ ]+", s)]
    specs = [s for s in specs if not re.search(r"=[A-Z]+(?=[,;]|$)", s)]  # rank=R, step=S
    assert len(specs) >= 3, specs
    for spec in specs:
        assert parse_inject(spec), spec


def _table(page: Path, header: str) -> list[list[str]]:
    """The rows of the table under ``header`` (its first line) in ``page``: cells, stripped."""
    lines = page.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _metric_names() -> set[str]:
    import torch
    from prometheus_client import CollectorRegistry

    from nansentinel.effects.metrics import SentinelMetrics
    from nansentinel.result import RankIdentity

    registry = CollectorRegistry()
    identity = RankIdentity(0, 0, 1, "host", "cuda:0")
    with mock.patch("torch.cuda.memory_allocated", return_value=0), mock.patch(
        "torch.cuda.memory_reserved", return_value=0
    ):  # a CUDA rank's registry, device memory included, without a GPU
        SentinelMetrics(identity, registry=registry, cluster_view=True,
                        device=torch.device("cuda", 0))
        families = list(registry.collect())
    suffix = {"counter": "_total", "info": "_info"}
    return {f.name + suffix.get(f.type, "") for f in families}


def test_the_metrics_table_lists_every_metric_and_the_docs_no_other() -> None:
    exported = _metric_names()
    listed = {
        re.sub(r"\{.*", "", name)
        for row in _table(DOCS / "monitoring.md", "| metric |")
        for name in re.findall(r"`(nansentinel_[a-z_]+(?:\{[^}]*\})?)`", row[0])
    }
    assert listed == exported, sorted(listed ^ exported)
    named = set(re.findall(r"\bnansentinel_[a-z_]+\b(?![/.])", _text())) - {"nansentinel_reports"}
    assert not named - exported, sorted(named - exported)


def test_alerts_named_are_the_rules_alerts() -> None:
    rules = (ROOT / "nansentinel/files/monitoring/prometheus/rules/nansentinel.rules.yml"
             ).read_text(encoding="utf-8")
    alerts = set(re.findall(r"^\s*- alert: (\w+)", rules, flags=re.M))
    assert alerts
    named = set(re.findall(r"\bNanSentinel[A-Z]\w*", _text())) - {"NanSentinelError"}  # the class
    assert not named - alerts, sorted(named - alerts)
    table = {re.sub(r"\W", "", row[0].split("](")[0]) for row in
             _table(DOCS / "monitoring.md", "| alert |")}
    assert table == alerts, sorted(table ^ alerts)


def test_the_exit_code_table_is_the_contract() -> None:
    from nansentinel.common import exitcodes

    codes = {v for k, v in vars(exitcodes).items() if k.startswith("EXIT_")}
    assert {int(row[0]) for row in _table(DOCS / "launch.md", "| exit code |")} == codes


def test_the_design_page_lists_every_engine_module() -> None:
    """A new gradient path is a module of engines/: the layout of docs/design.md names it."""
    text = (DOCS / "design.md").read_text(encoding="utf-8")
    layout = text[text.index("\n  engines/"):text.index("\n  decide/")]
    modules = {p.name for p in (ROOT / "nansentinel" / "engines").glob("*.py")}
    assert {"fsdp1.py", "prehook.py"} <= modules
    assert not {m for m in modules if m not in layout}, sorted(m for m in modules
                                                             if m not in layout)


# --- command blocks: run by a test, or saying what they need ----------------------------------

_CI = re.compile(r"^<!--\s*ci:\s*(.+?)\s*-->$")
#: Pages whose command blocks another branch is editing (none now).
PENDING: set[str] = set()


def _tests_named(block: Block) -> list[str] | None:
    """The tests a block's ``<!-- ci: ... -->`` names (None: it has no such marker)."""
    m = _CI.match(block.before.splitlines()[-1] if block.before else "")
    return [t.strip() for t in m.group(1).split(";")] if m else None


def _missing_test(ref: str) -> str | None:
    """What is wrong with a test reference (``path`` or ``path::function``), or None."""
    path, _, function = ref.partition("::")
    if not (ROOT / path).is_file():
        return f"{ref}: no such file"
    if function and not re.search(rf"^(async )?def {re.escape(function)}\(",
                                  (ROOT / path).read_text(encoding="utf-8"), re.M):
        return f"{ref}: no such test"
    return None


def test_every_command_block_is_run_by_a_test_or_says_what_it_needs() -> None:
    blocks = [b for b in _blocks("bash", "console") if b.page.name not in PENDING]
    problems = []
    for block in blocks:
        named = _tests_named(block)
        if named is not None:
            problems += [f"{block}: {p}" for ref in named if (p := _missing_test(ref))]
        elif not (block.before.startswith("Not run in CI") and "need" in block.before):
            problems.append(f"{block}: no <!-- ci: TEST --> marker and no 'Not run in CI ... "
                            f"needs ...' paragraph before it (found {block.before[-60:]!r})")
    assert not problems, "\n".join(problems)
    assert [b for b in blocks if _tests_named(b)] and len(blocks) > 10  # the reader sees them


def test_the_command_block_check_can_fail() -> None:
    page = ROOT / "README.md"
    assert _missing_test("tests/unit/test_docs.py::no_such_test")
    assert _missing_test("tests/unit/test_docs.py") is None
    assert _tests_named(Block(page, 1, "bash", "x", None, "<!-- ci: a.py; b.py::t -->")) == [
        "a.py", "b.py::t"]
    assert _tests_named(Block(page, 1, "bash", "x", None, "Run it:")) is None
