"""The multi-level DCI index (Prioritized DCI + M-DCI page leaves + MIPS transform), C++ with OpenMP."""

from .index import PAGE_SLOTS, DCIIndex, default_query_field_of_view
from .kernels import (
    ISAS,
    KernelSettings,
    active_isa,
    measure_read_rate,
    scan_tuning,
    search_read_share,
    set_isa,
    set_scan_tuning,
    supported_isa,
)

__all__ = ["DCIIndex", "ISAS", "PAGE_SLOTS", "KernelSettings", "active_isa", "default_query_field_of_view",
           "measure_read_rate", "scan_tuning", "search_read_share", "set_isa", "set_scan_tuning", "supported_isa"]
