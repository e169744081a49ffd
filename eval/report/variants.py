"""A measured row's method named by what ran, not by what was typed.

A latency or throughput row's ``method`` is the string its command was given (``pqcache``,
``icecache:lookahead=true``); what that string runs is the method's defaults of the day. When a default changes
(PQCache's ``cache_copy_programs`` went from 0 to 32), an older file's ``pqcache`` row is the old setting under
today's name. Files whose rows recorded their settings (``method_config``, eval/latency.py and eval/throughput.py)
are named instead by the settings that differ from the method's defaults as composed today: the old row becomes
``pqcache:cache_copy_programs=0``, and a row typed ``pqcache:cache_copy_programs=32`` becomes ``pqcache``. Rows
without recorded settings keep their string.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from icecache.errors import ConfigError

from .names import LATENCY_REFERENCES

# Set by the budget a row ran at, or a name: never a setting that tells two variants apart.
_NOT_SETTINGS = ("name", "budget")


@functools.lru_cache(maxsize=None)
def _defaults(name: str, budget: int | None) -> dict[str, Any]:
    """Today's settings of ``name`` at ``budget``: its config class's defaults (its YAML adds only its name and the
    budget, eval/method_defaults.py), fitted to the budget as a run's are."""
    import eval.plugins  # noqa: F401  the registry of methods
    from icecache.core.method import method_settings

    return dataclasses.asdict(method_settings({"name": name, "budget": budget}))


def _text(value: Any) -> str:
    """A setting's value as an override writes it (``true``, ``null``, ``32``, ``[1, 2]``)."""
    if isinstance(value, (bool, type(None))):
        return json.dumps(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def measured_variant(method: str, budget: int | None, config: dict[str, Any] | None) -> str:
    """``method`` renamed by ``config`` (the settings the row ran with) against today's defaults of its method at
    ``budget``: ``name`` alone when they agree, else ``name:key=value,...`` over the settings that differ (sorted).
    A setting today's method no longer has is left out; without ``config``, ``method`` as given."""
    if not config:
        return method
    name = method.partition(":")[0]
    try:
        defaults = _defaults(name, budget)
    except ConfigError:  # a method since removed or renamed: its string is all there is
        return method
    changed = [f"{key}={_text(config[key])}" for key in sorted(config)
               if key in defaults and key not in _NOT_SETTINGS and config[key] != defaults[key]]
    return f"{name}:{','.join(changed)}" if changed else name


def rename_rows(data: dict[str, Any]) -> None:
    """Rename in place every entry of a result file (a latency file's summary rows and measurements, a throughput
    file's rows, limits and summary) whose method recorded its settings in some entry of the file; the references
    (``full``, ``full_static``) stay as typed: the other rows' ratios are to them."""
    entries = [entry for value in data.values() if isinstance(value, list)
               for entry in value if isinstance(entry, dict) and "method" in entry]
    renamed: dict[str, str] = {}
    for entry in entries:
        method = entry["method"]
        if "method_config" in entry and method not in LATENCY_REFERENCES and method not in renamed:
            renamed[method] = measured_variant(method, entry.get("budget"), entry["method_config"])
    for entry in entries:
        entry["method"] = renamed.get(entry["method"], entry["method"])
