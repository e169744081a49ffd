"""Every method of the harness, one module each; importing this package registers them all.

The core (``icecache/core``) names no method: its registry, ``METHODS``, is filled by the method modules as they
are imported, and this package imports every module in it. The runner, the scripts and the tests take
``build_method`` and ``method_class`` from here. A new file in this folder is picked up without a change here.
"""

import importlib
import pkgutil

from icecache.core.method import METHODS, build_method, method_class

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["METHODS", "build_method", "method_class"]
