"""The multi-level DCI index (Prioritized DCI + M-DCI page leaves + MIPS transform), C++ with OpenMP."""

from .index import PAGE_SLOTS, DCIIndex, default_query_field_of_view

__all__ = ["DCIIndex", "PAGE_SLOTS", "default_query_field_of_view"]
