"""Fills the registries: importing this module registers every method, task and model source of the harness.

The library's core keeps the registries (``METHODS``, ``TASKS``, ``MODEL_SOURCES``) and names no entry in them. The
entries live in three places: IceCache and IceCache-reuse in ``icecache.method``, one file per baseline in
``baselines/``, one file per task family in ``eval/tasks/``. A new file in ``baselines/`` or ``eval/tasks/`` is
picked up here without a change to this module. Once they are all registered, each method's defaults go into
Hydra's ConfigStore (``eval.method_defaults``): a composition of ``configs/`` needs this module imported first.
"""

from __future__ import annotations

import importlib
import pkgutil

import baselines
import icecache.method  # noqa: F401  (registers icecache and icecache_reuse)
from eval import tasks
from eval.method_defaults import store_method_defaults
from icecache.core.method import METHODS, build_method, method_class


def _import_all(package) -> None:
    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")


_import_all(baselines)
_import_all(tasks)
# The Hydra nodes configs/method/*.yaml start from: each method's defaults, from its config class.
store_method_defaults()

__all__ = ["METHODS", "build_method", "method_class"]
