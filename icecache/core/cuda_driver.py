"""Two CUDA driver calls PyTorch does not expose: a raw async copy and a host function on a stream.

They let a decode step that needs host work in the middle of every layer (IceCache: the index search) still be
captured in one CUDA graph. The step enqueues, per layer, a device-to-host copy of what the host needs, a host
function that does the host work, and a host-to-device copy of its results; captured, the three become graph
nodes, and on replay the driver runs the host function on its own thread exactly when the stream reaches it. The
transformer's ~500 kernels are then launched by the graph, not one by one from Python.

Both calls go to ``libcuda`` through ``ctypes`` rather than through PyTorch's copy ops: PyTorch's pinned-memory
bookkeeping (events recorded per copy) is not meant for copies inside a capture, and these buffers are owned by
one layer for the whole sequence anyway. A host function must not call CUDA (no tensor on the device, no event,
no synchronisation); exceptions raised in it cannot cross the driver, so they are kept and re-raised by
``HostFunctions.raise_pending`` once the step is done. Host work written in C (``void f(void* state)``) is
enqueued by its raw address instead (``launch_host_function``): no Python trampoline, no GIL on the driver's
thread; such a function keeps its own errors for its caller to raise.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Callable

import torch

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_HOST_FUNCTION_THREAD = threading.local()


def in_host_function() -> bool:
    """Whether the calling code runs inside a host function (where CUDA must not be called, pinning included)."""
    return getattr(_HOST_FUNCTION_THREAD, "active", False)


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuMemcpyAsync.restype = ctypes.c_int
    lib.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
    lib.cuLaunchHostFunc.restype = ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {result}")


try:  # the raw-handle query Triton itself uses; much cheaper than building a torch Stream object
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - CPU-only builds
    _raw_stream = None


def stream_handle(device: torch.device) -> int:
    """The raw handle of ``device``'s current stream (0 off CUDA): what kernel launches and driver calls take."""
    if device.type != "cuda":
        return 0
    if _raw_stream is not None:
        return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


def memcpy_async(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy ``source`` into ``destination`` (contiguous, same byte size; pinned host or device memory) on the
    current stream of whichever is on the device, without PyTorch's bookkeeping."""
    if not (destination.is_contiguous() and source.is_contiguous()):
        raise ValueError("memcpy_async needs contiguous tensors")
    if destination.nbytes != source.nbytes:
        raise ValueError(f"memcpy_async: {source.nbytes} bytes into {destination.nbytes}")
    device = destination.device if destination.is_cuda else source.device
    _check(
        _libcuda().cuMemcpyAsync(destination.data_ptr(), source.data_ptr(), source.nbytes, stream_handle(device)),
        "cuMemcpyAsync",
    )


@functools.lru_cache(maxsize=None)
def _native_function(function_address: int):
    return _HOST_FN(function_address)


def call_native(function_address: int, state_address: int) -> None:
    """Call the C function ``void f(void* state)`` at ``function_address`` on this thread, the GIL released."""
    _native_function(function_address)(state_address)


def launch_host_function(function_address: int, state_address: int, device: torch.device) -> None:
    """Enqueue the C function ``void f(void* state)`` at ``function_address`` on ``device``'s current stream, with
    ``state_address``, by its raw pointer: the driver runs it with no Python (nothing to keep alive here; the
    caller keeps the state alive as long as a graph that captured this may replay). It must not throw."""
    _check(_libcuda().cuLaunchHostFunc(stream_handle(device), _native_function(function_address),
                                       ctypes.c_void_p(state_address)), "cuLaunchHostFunc")


class HostFunctions:
    """Host functions enqueued on CUDA streams, kept alive as long as a graph may replay them, with the first
    exception any of them raised."""

    def __init__(self):
        self._keep: list = []
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    def launch(self, function: Callable[[], None], device: torch.device) -> None:
        """Run ``function()`` on a driver thread once the current stream reaches this point (and on every replay
        of a graph that captured it). It runs under inference mode, like the decode step that enqueued it."""
        errors, lock = self._errors, self._lock

        def trampoline(_user_data) -> None:
            if errors:  # an earlier host function failed: the state it left is not to be built on
                return
            _HOST_FUNCTION_THREAD.active = True
            try:
                with torch.inference_mode():
                    function()
            except BaseException as error:  # noqa: BLE001  re-raised on the caller's thread
                with lock:
                    errors.append(error)
            finally:
                _HOST_FUNCTION_THREAD.active = False

        callback = _HOST_FN(trampoline)
        self._keep.append(callback)
        _check(_libcuda().cuLaunchHostFunc(stream_handle(device), callback, None), "cuLaunchHostFunc")

    def release(self) -> None:
        """Forget the kept host functions and errors. Only once no graph that recorded them can replay: each holds
        the layer that enqueued it, which holds the sequence that holds this object, so until then a finished
        sequence's host memory (tens of GB at 128k) waits for Python's garbage collector."""
        self._keep.clear()
        self._errors.clear()

    def raise_pending(self) -> None:
        """Re-raise the first exception of a host function (call after the stream is synchronised)."""
        if self._errors:
            error = self._errors[0]
            raise RuntimeError(f"a host function of the decode step failed: {error!r}") from error
