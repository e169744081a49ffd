"""The DCI kernels' instruction set, and the host's read rate that a search's rate is measured against.

The scoring kernels run in one of four builds (docs/dci.md, kernels): ``portable`` (the x86-64 baseline),
``avx2`` (x86-64-v3: AVX2 + FMA), ``avx512`` (x86-64-v4) and ``avx512bf16`` (``avx512`` with bfloat16 key rows
scored by ``vdpbf16ps``, unwidened). ``avx2`` and ``avx512`` give bit-identical scores; ``portable`` rounds each
product before adding it, and ``avx512bf16`` adds the exact products in another order, so their scores can differ
in the last bits. The widest of ``portable``, ``avx2`` and ``avx512`` that the CPU runs is used unless the
environment variable ``ICECACHE_DCI_ISA`` (read once, at import) or ``set_isa`` says otherwise: ``avx512bf16`` is
asked for by name (``supported_isa`` says whether the CPU has it).
"""

from __future__ import annotations

import dataclasses
import os

from . import _dci

ISAS = ("portable", "avx2", "avx512", "avx512bf16")  # narrowest first


def active_isa() -> str:
    """The instruction set the kernels run with now."""
    return _dci.isa()


def supported_isa() -> str:
    """The widest instruction set this CPU runs the kernels with."""
    return _dci.supported_isa()


def set_isa(isa: str) -> None:
    """Run the kernels with ``isa`` from now on (every index in the process); ValueError if the CPU cannot."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    _dci.set_isa(isa)


def measure_read_rate(n_bytes: int = 1 << 30, num_threads: int | None = None, passes: int = 5) -> float:
    """Bytes per second that ``num_threads`` OpenMP threads (default: all CPUs) read from a fresh ``n_bytes`` buffer,
    each summing its share: the best of ``passes`` passes. Pick ``n_bytes`` well above the last-level cache."""
    threads = num_threads if num_threads is not None else (os.cpu_count() or 1)
    if n_bytes < 1 or threads < 1 or passes < 1:
        raise ValueError(f"n_bytes, num_threads and passes must be positive, got {n_bytes}, {threads}, {passes}")
    return float(_dci.measure_read_rate(int(n_bytes), int(threads), int(passes)))


def search_read_share(bytes_read: float, seconds: float, read_rate: float) -> float | None:
    """A search's achieved read rate (``last_query_stats()["bytes_read"]`` over its time) as a fraction of the
    host's ``read_rate`` (bytes/s, from ``measure_read_rate``); None when any of them is missing or zero."""
    if not bytes_read or not seconds or not read_rate:
        return None
    return bytes_read / seconds / read_rate


def scan_tuning() -> dict[str, int]:
    """The last-level scan's speed settings (they never change a result; docs/dci.md, kernels): ``prefetch_rows``
    (how far ahead key rows are requested; 0: the next page's rows before each page), ``chunk_rows`` (the most rows
    of one parent's run in one work item of a grouped query; 0: one item per parent) and ``prefetch_level`` (the
    cache those rows are requested into: 2, L2; 1, L1)."""
    return dict(_dci.scan_tuning())


def set_scan_tuning(prefetch_rows: int, chunk_rows: int, prefetch_level: int = 2) -> None:
    """Set the ``scan_tuning`` values for every index in the process."""
    if prefetch_rows < 0 or chunk_rows < 0:
        raise ValueError(f"prefetch_rows and chunk_rows must be >= 0, got {prefetch_rows} and {chunk_rows}")
    if prefetch_level not in (1, 2):
        raise ValueError(f"prefetch_level must be 1 (L1) or 2 (L2), got {prefetch_level}")
    _dci.set_scan_tuning(int(prefetch_rows), int(chunk_rows), int(prefetch_level))


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """The kernels' instruction set and the scan's speed settings, which are process-wide: what a benchmark sets,
    and records, to time one variant against another in the same process (``ISA:PREFETCH_ROWS:CHUNK_ROWS[:LEVEL]``)."""

    isa: str
    prefetch_rows: int
    chunk_rows: int
    prefetch_level: int = 2

    @classmethod
    def parse(cls, text: str) -> KernelSettings:
        parts = text.split(":")
        if len(parts) not in (3, 4) or parts[0] not in ISAS or not all(p.isdigit() for p in parts[1:]):
            raise ValueError(f"kernel settings are ISA:PREFETCH_ROWS:CHUNK_ROWS[:PREFETCH_LEVEL] with ISA one of "
                             f"{', '.join(ISAS)}, got {text!r}")
        if ISAS.index(parts[0]) > ISAS.index(supported_isa()):
            raise ValueError(f"{text}: this CPU runs the DCI kernels at most as {supported_isa()}")
        return cls(parts[0], *(int(p) for p in parts[1:]))

    @classmethod
    def argument(cls, text: str) -> KernelSettings:
        """``parse`` for argparse's ``type=``: its message becomes the command line's one error line."""
        import argparse

        try:
            return cls.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    @classmethod
    def current(cls) -> KernelSettings:
        tuning = scan_tuning()
        return cls(active_isa(), tuning["prefetch_rows"], tuning["chunk_rows"], tuning["prefetch_level"])

    @property
    def label(self) -> str:
        return f"{self.isa}:{self.prefetch_rows}:{self.chunk_rows}:{self.prefetch_level}"

    def apply(self) -> None:
        set_isa(self.isa)
        set_scan_tuning(self.prefetch_rows, self.chunk_rows, self.prefetch_level)
