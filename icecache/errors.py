"""User-facing errors: one line that says what to change, raised before any expensive work."""

from __future__ import annotations

import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A configuration or input the user must change; the CLI prints its message alone and exits with code 2."""


def dataclass_from_dict(cls, values: dict, kind: str, messages: dict[str, str] | None = None):
    """``cls(**values)`` for a settings dataclass, refusing unknown keys with one line that lists the known ones, and
    values of the wrong type (``budget=abc``, ``task.lengths=abc``) with one line that names the key (``messages``:
    a key's own line, formatted with ``value``)."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(unknown_keys_message(f"{kind} {values.get('name', cls.__name__)!r}", unknown, known))
    check_types(cls, values, kind, messages)
    return cls(**values)


def unknown_keys_message(owner: str, unknown: list[str], known: set[str], tail: str = "") -> str:
    """'<owner> has no setting x (did you mean y?); its settings are: ...': a misspelt key names the one meant."""
    import difflib

    close = [match for key in unknown for match in difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)]
    meant = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"{owner} has no setting {', '.join(unknown)}{meant}; its settings are: {', '.join(sorted(known))}{tail}"


def check_types(cls, values: dict, kind: str, messages: dict[str, str] | None = None) -> None:
    """Raise ``ConfigError`` for the first value in ``values`` that does not match its field's annotation in the
    dataclass ``cls`` (ints pass for floats; a bool is not an int; unknown annotations pass); ``messages`` maps a key
    to its own line (``{value!r}`` in it is the value)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001  an annotation that cannot be resolved is not checked
        return
    for key, value in values.items():
        expected = hints.get(key)
        if expected is not None and not matches(value, expected):
            if messages and key in messages:
                raise ConfigError(messages[key].format(value=value))
            raise ConfigError(wrong_type_message(kind, key, value, expected))


def wrong_type_message(kind: str, key: str, value: Any, expected: Any) -> str:
    """'task.lengths=4096 must be a list of whole numbers: write task.lengths=[4096]' (a single item where a list
    is wanted gets the list to write)."""
    name = f"{kind}.{key}" if kind else key
    message = f"{name}={value!r} must be {describe(expected)}"
    if not isinstance(value, (list, tuple, dict)) and matches([value], expected):
        message += f": write {name}=[{value}]"
    return message


def matches(value: Any, expected: Any) -> bool:
    """Whether ``value`` (from YAML or the command line) fits the annotation ``expected``."""
    if expected is Any or expected is object:
        return True
    if expected is type(None):
        return value is None
    origin = typing.get_origin(expected)
    if origin is typing.Union or origin is types.UnionType:
        return any(matches(value, arm) for arm in typing.get_args(expected))
    if origin in (list, tuple, set, frozenset) or expected in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        args = [a for a in typing.get_args(expected) if a is not Ellipsis]
        return not args or all(matches(item, args[0]) for item in value)
    if origin is dict or expected is dict:
        if not isinstance(value, dict):
            return False
        args = typing.get_args(expected)
        return not args or all(matches(k, args[0]) and matches(v, args[1]) for k, v in value.items())
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is str:
        return isinstance(value, str)
    return True  # an annotation this check does not know


def describe(expected: Any) -> str:
    """``int | None`` -> 'a whole number or null', for the one-line message."""
    if expected is type(None):
        return "null"
    origin = typing.get_origin(expected)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(describe(arm) for arm in typing.get_args(expected))
    if origin in (list, tuple) or expected in (list, tuple):
        args = [a for a in typing.get_args(expected) if a is not Ellipsis]
        return f"a list of {_plural(describe(args[0]))}" if args else "a list"
    if origin is dict or expected is dict:
        return "a mapping"
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}.get(
        expected, getattr(expected, "__name__", str(expected)))


def _plural(text: str) -> str:
    return text.replace("a whole number", "whole numbers").replace("a number", "numbers").replace("a string",
                                                                                                   "strings")
