"""Every method of the harness, registered.

The core (``icecache/core``) names no method: its registry, ``METHODS``, is filled by the method modules as they
are imported. Importing this module imports them all (every module in ``baselines/``, and IceCache), so the runner,
the scripts and the tests take ``build_method`` and ``method_class`` from here. A new method in ``baselines/`` is
picked up without a change here.
"""

import baselines  # noqa: F401  every module in baselines/ registers its methods
import icecache.method  # noqa: F401  IceCache and IceCache-reuse
from icecache.core.method import METHODS, build_method, method_class

__all__ = ["METHODS", "build_method", "method_class"]
