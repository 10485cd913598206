"""One error a user can catch: every exception class the package defines is a
``nansentinel.NanSentinelError`` (but ``StopRequested``, a clean ``SystemExit``), and keeps the
builtin base its callers catch."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import nansentinel
from nansentinel import NanSentinelError

PACKAGE = Path(nansentinel.__file__).resolve().parent
#: Modules whose import needs a framework that may not be installed.
OPTIONAL = {"lightning", "transformers", "accelerate", "torchtitan", "torchft", "deepspeed"}
#: The builtin bases callers rely on (``except ValueError`` around a config, ...).
KEPT = {
    "ConfigError": ValueError, "JsonInputError": ValueError, "InputFileError": OSError,
    "ExclusionWriteError": OSError, "NonFiniteError": RuntimeError,
    "ExchangeTimeoutError": RuntimeError, "SentinelUsageError": RuntimeError,
    "ArgumentTypeError": TypeError, "MetricsPortError": RuntimeError,
    "SnapshotMemoryError": RuntimeError,
}


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every class defined in the package that derives from BaseException, by import."""
    found: dict[str, type[BaseException]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        classes = [n.name for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                   if isinstance(n, ast.ClassDef)]
        if not classes or parts[-1] in OPTIONAL:
            continue
        module = importlib.import_module(name)
        for cls in classes:
            obj = getattr(module, cls, None)
            if isinstance(obj, type) and issubclass(obj, BaseException) and (
                    obj.__module__ == name):
                found[f"{name}.{cls}"] = obj
    return found


CLASSES = _exception_classes()


def test_the_reader_finds_the_errors() -> None:
    assert len(CLASSES) >= 17, sorted(CLASSES)
    assert "nansentinel.config.ConfigError" in CLASSES


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_error_is_a_nansentinel_error_and_keeps_its_builtin_base(name: str) -> None:
    cls = CLASSES[name]
    if cls is nansentinel.StopRequested:
        assert issubclass(cls, SystemExit) and not issubclass(cls, Exception)
        return
    assert issubclass(cls, NanSentinelError), name
    short = name.rsplit(".", 1)[1]
    if short in KEPT:
        assert issubclass(cls, KEPT[short]), (name, KEPT[short])


def test_one_except_catches_a_refusal() -> None:
    with pytest.raises(NanSentinelError, match="policy='nope'"):
        nansentinel.SentinelConfig(policy="nope")
    with pytest.raises(ValueError):  # what callers caught before
        nansentinel.SentinelConfig(policy="nope")
