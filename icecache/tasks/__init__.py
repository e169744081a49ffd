"""Tasks and their metrics. Importing this package registers every task module in it (no central list to edit)."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
