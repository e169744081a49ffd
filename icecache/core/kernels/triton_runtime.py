"""What the Triton kernels of the core share: the optional Triton import, whether the kernels can run here, and
direct launches of compiled kernels.

Triton is optional: this module imports on a machine without it, and ``available()`` says whether the kernels can
run (Triton importable and a CUDA device present). Setting ``ICECACHE_DISABLE_TRITON=1`` makes ``available()``
false, so the PyTorch references are used on the GPU too (for comparisons). With ``TRITON_INTERPRET=1`` set before
import, the kernels also run on CPU tensors in Triton's interpreter, which is how they are checked without a GPU.
"""

from __future__ import annotations

import os
import warnings

import torch

try:  # Triton is optional: the CPU path of every method uses the PyTorch references.
    import triton
    import triton.language as tl
except Exception as error:  # noqa: BLE001 - a broken Triton install must not break importing the harness
    triton = None
    tl = None
    TRITON_IMPORT_ERROR: Exception | None = error
else:
    TRITON_IMPORT_ERROR = None


def available() -> bool:
    """True when the Triton kernels can run here: Triton imports, a CUDA device is present, not disabled."""
    if os.environ.get("ICECACHE_DISABLE_TRITON", "0") not in ("", "0"):
        return False
    return TRITON_IMPORT_ERROR is None and torch.cuda.is_available()


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), so CPU tensors are accepted."""
    return TRITON_IMPORT_ERROR is None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton() -> None:
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(f"the Triton kernels need Triton, which did not import: {TRITON_IMPORT_ERROR}")


def direct_launch_supported() -> bool:
    """Direct launches of compiled kernels work here: Triton >= 3.3, not interpreted, not disabled by
    ``ICECACHE_TRITON_FAST_LAUNCH=0``. Older Triton passes a different argument list to its launcher."""
    if TRITON_IMPORT_ERROR is not None or interpreted():
        return False
    if os.environ.get("ICECACHE_TRITON_FAST_LAUNCH", "1") in ("", "0"):
        return False
    try:
        major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 3)


class DirectLaunch:
    """Launches a Triton kernel through Triton's JIT the first time, then its compiled kernel directly.

    A decode step calls a kernel once per layer, so its host cost is paid ~30 times per token. Measured on the H200
    host (results/bench/kernels_h200_20261130.json), Triton's generic launch path (binding and specialising ~30
    arguments, then the launcher) cost ~130 us per call against a kernel of a few microseconds. Later launches of a
    specialisation call the compiled kernel with the same full argument list (constexprs included, as Triton >= 3.3
    does itself), skipping the per-call binding. ``enabled`` is off where ``direct_launch_supported`` says it cannot
    work, and turns itself off when a direct launch fails (unexpected Triton internals).
    """

    __slots__ = ("enabled",)

    def __init__(self, enabled: bool | None = None):
        supported = direct_launch_supported()
        self.enabled = supported if enabled is None else bool(enabled) and supported

    def __call__(self, kernel, compiled, grid: tuple[int, ...], args: tuple, stream: int, options: dict):
        """Launch ``kernel`` on ``grid``; returns the compiled kernel to reuse for later launches of the same
        specialisation (None when direct launches are off).

        The caller's key for the returned kernel must pin everything Triton specialises on: argument dtypes,
        integers' value class (== 1, multiple of 16, 32/64-bit) and 16-byte pointer alignment.
        """
        if compiled is not None and self.enabled:
            try:
                compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, stream=stream)  # compiled kernels take 3-D grids
                return compiled
            except (AttributeError, TypeError, IndexError) as error:
                warnings.warn(f"direct Triton launch failed ({error!r}); using Triton's launch path", RuntimeWarning,
                              stacklevel=2)
                self.enabled = False
        result = kernel[grid](*args, **options)
        return result if self.enabled and hasattr(result, "function") else None


def aligned(*tensors: torch.Tensor) -> bool:
    """All pointers 16-byte aligned (what Triton assumes of tensors by default); then one compiled kernel serves
    every call of a layout. Otherwise the call takes the JIT path, which specialises per pointer."""
    address = 0
    for tensor in tensors:
        address |= tensor.data_ptr()
    return address & 15 == 0


def last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its last dimension has unit stride (what the kernels index by), else a contiguous copy."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
