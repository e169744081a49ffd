"""How the report names and orders methods, read from the registered classes (``eval.plugins``).

Each method declares what the report prints on its own class: ``display_name`` (the paper's name),
``display_order`` (where its rows go) and ``paper_names`` (other spellings in the paper's tables). A label is a
method's registry name, ``<name>+<variant>`` for a declared variant (``Method.variants``), or a latency row's
``<name>:<key>=<value>`` (``report.names``).
"""

from __future__ import annotations

from typing import Iterable

from eval.plugins import METHODS, method_class

from .names import split_method


def base_method(label: str) -> str:
    """``icecache+lookahead`` and ``icecache:lookahead=true`` -> ``icecache``."""
    return split_method(label)[0]


def is_registered(name: str) -> bool:
    return name in METHODS


def order() -> list[str]:
    """Every registered method in display order."""
    return sorted(METHODS.names(), key=lambda name: (method_class(name).display_order, name))


def sort_key(label: str) -> tuple[int, int, str]:
    """By the method's ``display_order``, its variants right after it; unregistered names last, by name."""
    base = base_method(label)
    rank = method_class(base).display_order if is_registered(base) else None
    return (0, rank, label) if rank is not None else (1, 0, label)


def ordered(labels: Iterable[str]) -> list[str]:
    return sorted(labels, key=sort_key)


def display_name(label: str) -> str:
    """A registered method's ``display_name`` (its name if it has none), ``IceCache (lookahead)`` for a declared
    variant's label; any other label unchanged."""
    name, _, variant = str(label).partition("+")
    if not is_registered(name) or (variant and variant not in method_class(name).variants):
        return label
    printed = method_class(name).display_name or name
    return f"{printed} ({variant})" if variant else printed


def uses_budget(label: str) -> bool:
    """False for a method whose results do not depend on the budget (``Method.uses_budget``)."""
    base = base_method(label)
    return not is_registered(base) or method_class(base).uses_budget


def _spelling(name: str) -> str:
    return str(name).strip().lower().replace(" ", "")


def canonical_method(name: str) -> str:
    """A method as the paper spells it (``TOPK``, ``IceCache(r)``, ``SLM``) -> its registry name; an unknown
    name passes through lower-cased, without spaces."""
    spellings = {_spelling(registered): registered for registered in METHODS}  # a registry name always wins
    for registered in METHODS:
        cls = method_class(registered)
        for spelling in (cls.display_name or registered, *cls.paper_names):
            spellings.setdefault(_spelling(spelling), registered)
    key = _spelling(name)
    return spellings.get(key, key)
