"""Every registered method's defaults as a Hydra config: ``/method_defaults/<name>``.

A method's settings and their defaults are its config class (``Method.config_class``, a dataclass); the method's
YAML, ``configs/method/<name>.yaml``, starts from this node (its defaults list) and holds only what differs. So a
default is written once, and ``method.<key>=<value>`` overrides every key of the class from the command line.

The nodes are plain values (``dataclasses.asdict``), not typed structured configs: an override keeps the type it is
written with, as it did when every default was in the YAML, so a run's settings and directory do not change.
"""

from __future__ import annotations

import dataclasses

from icecache.core.method import METHODS, method_class

GROUP = "method_defaults"


def store_method_defaults() -> None:
    """Put each registered method's defaults into Hydra's ConfigStore (again: the same values), so that a
    composition of ``configs/`` finds them. ``eval.plugins`` calls it once the methods are registered."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name in METHODS.names():
        store.store(group=GROUP, name=name, node=dataclasses.asdict(method_class(name).config_class()))
