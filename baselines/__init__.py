"""The baselines of the IceCache paper and the methods it is compared with, one file each on ``icecache.core``.

Every file is independent of the others: it imports the core and nothing from ``icecache.method``, ``eval`` or a
sibling. ``eval.plugins`` imports them all, which registers them.
"""
