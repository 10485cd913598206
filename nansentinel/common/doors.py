"""Types checked at the public doors, from the annotations that already declare them.

``SentinelConfig``'s fields and ``Sentinel(...)``'s arguments are annotated; the annotation is
the contract. Checking a value against it here (instead of a hand-written ``isinstance`` per
field) means a field added later is checked too, and every refusal reads the same: the name,
the value, the type given and the type wanted. Only what ``isinstance`` can decide is checked,
and for a protocol that its methods are there: ``Any`` and a callable's signature pass.

Numbers follow PEP 484's numeric tower, less ``bool``: an ``int`` annotation takes an integer
but not ``True``; a ``float`` annotation takes an integer or a float.
"""

from __future__ import annotations

import collections.abc as abc
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

_WORDS: dict[type, str] = {
    str: "a string", int: "an integer", float: "a number", bool: "True or False",
    type(None): "None", dict: "a dict", list: "a list", tuple: "a tuple",
    abc.Mapping: "a mapping", abc.Sequence: "a sequence",
}
#: The most items of a container checked one by one (a batch-sized list is not walked).
MAX_ITEMS = 10_000


def _unions() -> tuple[Any, ...]:
    return (Union, types.UnionType)


def conforms(value: object, hint: Any, *, choices: bool = True) -> bool:
    """Whether ``value`` is of the type ``hint`` says (as far as ``isinstance`` can tell).
    ``choices=False``: a ``Literal`` takes any value of its choices' type (the owner names
    a wrong choice itself, with a "did you mean")."""
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin = get_origin(hint)
    if origin in _unions():
        return any(conforms(value, arm, choices=choices) for arm in get_args(hint))
    if origin is Literal:
        return any(type(value) is type(choice) and (value == choice or not choices)
                   for choice in get_args(hint))
    if origin is not None:
        return _generic(value, origin, get_args(hint))
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(hint, type) and getattr(hint, "_is_protocol", False):
        return all(callable(getattr(value, name, None)) for name in _members(hint))
    return not isinstance(hint, type) or isinstance(value, hint)


def _members(protocol: type) -> list[str]:
    """The methods a protocol declares (its own and its bases'), which a value must have."""
    return sorted({name for klass in protocol.__mro__ if getattr(klass, "_is_protocol", False)
                   and klass is not typing.Protocol for name, member in vars(klass).items()
                   if callable(member) and not name.startswith("_")})


def _generic(value: object, origin: Any, args: tuple[Any, ...]) -> bool:
    if origin is abc.Callable:
        return callable(value)
    if not isinstance(origin, type) or not isinstance(value, origin):
        return False
    if isinstance(value, str | bytes) and origin in (abc.Sequence, abc.Iterable):
        return False  # a string is a sequence of strings, never what a caller meant
    if not args or len(value) > MAX_ITEMS:  # type: ignore[arg-type]
        return True
    if isinstance(value, abc.Mapping):
        key, item = (*args, Any)[:2]
        return all(conforms(k, key) and conforms(v, item) for k, v in value.items())
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        return len(value) == len(args) and all(  # type: ignore[arg-type]
            conforms(v, a) for v, a in zip(value, args, strict=False))  # type: ignore[call-overload]
    return all(conforms(v, args[0]) for v in value)  # type: ignore[attr-defined]


def describe(hint: Any) -> str:
    """The type ``hint`` names, in words (``a string or None``)."""
    if hint is Any or hint is object:
        return "anything"
    origin = get_origin(hint)
    if origin in _unions():
        return " or ".join(dict.fromkeys(describe(arm) for arm in get_args(hint)))
    if origin is Literal:
        kinds = dict.fromkeys(describe(type(c)) for c in get_args(hint))
        return f"{' or '.join(kinds)} (one of {', '.join(repr(c) for c in get_args(hint))})"
    if origin is abc.Callable:
        return "a callable"
    if origin is not None:
        args = get_args(hint)
        inner = f" of {_plural(args[0])}" if args and origin is not tuple else ""
        if origin in (dict, abc.Mapping) and len(args) == 2:
            inner = f" of {_plural(args[0])} to {_plural(args[1])}"
        name = _WORDS.get(origin, f"a {getattr(origin, '__name__', origin)}")
        return f"{name}{inner}"
    if hint in _WORDS:
        return _WORDS[hint]
    return f"a {getattr(hint, '__qualname__', hint)}"


def _plural(hint: Any) -> str:
    words = describe(hint)
    return words.removeprefix("a ").removeprefix("an ") + "s" if words.startswith("a") else words


def given(value: object) -> str:
    """The type of ``value`` as a refusal names it (``a PosixPath``, ``None``)."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def refusal(name: str, value: object, hint: Any, *, choices: bool = True) -> str | None:
    """``None`` when ``value`` is of the type ``hint`` says; else the sentence that says
    what was given and what was wanted, naming ``name``."""
    if conforms(value, hint, choices=choices):
        return None
    if isinstance(value, int) and value.bit_length() > 200:  # repr refuses 4,300 digits
        shown = f"<an integer of {value.bit_length()} bits>"
    else:
        shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"{name}={shown} is {given(value)}, not {describe(hint)}"


def hints(obj: Any, **names: Any) -> dict[str, Any]:
    """``typing.get_type_hints(obj)``, with ``names`` for what the module imports only for
    type checking."""
    return typing.get_type_hints(obj, localns=names)
