"""Fills the registries: importing this module registers every method, task and model source of the harness.

The library's core keeps the registries (``METHODS``, ``TASKS``, ``MODEL_SOURCES``) and names no entry in them. The
entries live in three places: IceCache and IceCache-reuse in ``icecache.method``, one file per baseline in
``baselines/``, one file per task family in ``eval/tasks/``. A new file in ``baselines/`` or ``eval/tasks/`` is
picked up here without a change to this module.
"""

from __future__ import annotations

import importlib
import pkgutil

import baselines
import icecache.method  # noqa: F401  (registers icecache and icecache_reuse)
from eval import tasks
from icecache.core.method import METHODS, build_method, method_class


def _import_all(package) -> None:
    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")


_import_all(baselines)
_import_all(tasks)

__all__ = ["METHODS", "build_method", "method_class"]
