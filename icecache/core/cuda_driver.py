"""The CUDA driver calls PyTorch does not expose, and ``HostFunctions``: how a decode step hands work to the host.

They let a decode step that needs host work in the middle of every layer (IceCache: the index search) still be
captured in one CUDA graph. The step enqueues, per layer, a device-to-host copy of what the host needs, a hand-off
to the host work, and a host-to-device copy of its results; captured, all three become graph nodes, and at every
replay the host work runs exactly when the stream reaches it. The transformer's ~500 kernels are then launched by
the graph, not one by one from Python.

A hand-off goes through one of two channels, chosen per sequence at its first hand-off on CUDA (``HostFunctions``;
``kind`` says which, and the generation loop records it with the step's counters):

* ``stream_memory`` (where the device supports stream memory operations and ``_host_channel`` is built): the stream
  writes a request word in pinned, device-mapped host memory (``cuStreamWriteValue32``), a C++ worker thread
  spinning on it runs the entry and writes an answer word, and the stream waits for that answer
  (``cuStreamWaitValue32``) and resets it (``core.host_channel`` describes the protocol). A few microseconds per
  hand-off; a native entry runs with no Python at all; a watchdog bounds the wait, so a failed, stopped or hung
  worker ends the step with an error instead of a hung stream.
* ``host_function`` (the fallback): a driver host function (``cuLaunchHostFunc``), which the driver runs on its own
  callback thread: the native entry's C pointer itself, or a ctypes trampoline into Python for a Python callable.
  Tens of microseconds per hand-off (about a hundred with Python), and a host function that never returns hangs
  the stream.

The copies go to ``libcuda`` through ``ctypes`` rather than through PyTorch's copy ops: PyTorch's pinned-memory
bookkeeping (events recorded per copy) is not meant for copies inside a capture, and these buffers are owned by
one layer for the whole sequence anyway. Host work must not call CUDA (no tensor on the device, no event, no
synchronisation): it runs while the stream waits for it. Exceptions raised in it cannot cross the driver, so they
are kept and re-raised by ``HostFunctions.raise_pending`` once the step is done.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from . import host_channel
from .host_channel import DEFAULT_TIMEOUT_S, HandOffChannel, HandOffWords

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_HOST_FUNCTION_THREAD = threading.local()

STREAM_MEMORY = "stream_memory"
HOST_FUNCTION = "host_function"
# Which channel a sequence asks for: auto (stream_memory where the device supports it), or one of the two by name;
# ICECACHE_HOST_CHANNEL sets the default of every sequence (the hand-off probe compares them).
CHANNEL_CHOICES = ("auto", STREAM_MEMORY, HOST_FUNCTION)

_CU_STREAM_WAIT_VALUE_EQ = 0x1
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # with a memory fence first: the step's copy to the host lands before it
_CU_MEMHOSTALLOC_PORTABLE_DEVICEMAP = 0x01 | 0x02
_CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 = 92
_CU_STREAM_CAPTURE_MODE_RELAXED = 2
_CU_STREAM_NON_BLOCKING = 0x1
_CUDA_ERROR_NOT_READY = 600


def in_host_function() -> bool:
    """Whether the calling code runs inside a host function (where CUDA must not be called, pinning included)."""
    return getattr(_HOST_FUNCTION_THREAD, "active", False)


def _declare(lib: ctypes.CDLL, name: str, *argtypes) -> None:
    function = getattr(lib, name)
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int


def _first_symbol(lib: ctypes.CDLL, *names: str) -> str | None:
    for name in names:
        if hasattr(lib, name):
            return name
    return None


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    u64, u32, ptr, pint = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
    _declare(lib, "cuMemcpyAsync", u64, u64, ctypes.c_size_t, ptr)
    # The function as a plain address: a native entry's C pointer, or a ctypes trampoline's
    _declare(lib, "cuLaunchHostFunc", ptr, ptr, ptr)
    _declare(lib, "cuDriverGetVersion", pint)
    _declare(lib, "cuDeviceGet", pint, ctypes.c_int)
    _declare(lib, "cuDeviceGetAttribute", pint, ctypes.c_int, ctypes.c_int)
    _declare(lib, "cuDevicePrimaryCtxRetain", ctypes.POINTER(ptr), ctypes.c_int)
    _declare(lib, "cuDevicePrimaryCtxRelease_v2", ctypes.c_int)
    _declare(lib, "cuCtxPushCurrent_v2", ptr)
    _declare(lib, "cuCtxPopCurrent_v2", ctypes.POINTER(ptr))
    _declare(lib, "cuMemHostAlloc", ctypes.POINTER(ptr), ctypes.c_size_t, ctypes.c_uint)
    _declare(lib, "cuMemFreeHost", ptr)
    _declare(lib, _first_symbol(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"),
             ctypes.POINTER(u64), ptr, ctypes.c_uint)
    _declare(lib, "cuStreamCreate", ctypes.POINTER(ptr), ctypes.c_uint)
    _declare(lib, "cuStreamSynchronize", ptr)
    _declare(lib, "cuStreamQuery", ptr)
    _declare(lib, "cuStreamDestroy_v2", ptr)
    _declare(lib, "cuThreadExchangeStreamCaptureMode", pint)
    # Stream memory operations: the _v2 entry points (CUDA 11.7+, always supported there), else the first ones
    # (which need the driver's stream memory operations switched on: CAN_USE_STREAM_MEM_OPS_V1)
    for operation in ("cuStreamWriteValue32", "cuStreamWaitValue32"):
        name = _first_symbol(lib, f"{operation}_v2", operation)
        if name is not None:
            _declare(lib, name, ptr, u64, u32, ctypes.c_uint)
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


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@contextmanager
def _primary_context(device_index: int) -> Iterator[None]:
    """The device's primary context (PyTorch's) current on this thread for the calls inside, whatever thread and
    device the caller is on."""
    _check(_libcuda().cuCtxPushCurrent_v2(_retained_primary_context(device_index)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        _libcuda().cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


@functools.lru_cache(maxsize=None)
def _retained_primary_context(device_index: int) -> ctypes.c_void_p:
    """The device's primary context, retained once for the life of the process and never released: called before
    PyTorch has made the context, a retain would create it and its release destroy it again, with every pinned
    allocation made inside it (the channel's words)."""
    torch.cuda.init()  # the driver initialised (cuInit), as PyTorch does at its first CUDA call
    lib = _libcuda()
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    return context


@contextmanager
def _unsafe_calls_allowed() -> Iterator[None]:
    """Let this thread make calls a stream capture would otherwise refuse (an allocation of pinned memory, a private
    stream's synchronisation): the channel may first be set up at the first hand-off, in the middle of a capture."""
    lib = _libcuda()
    mode = ctypes.c_int(_CU_STREAM_CAPTURE_MODE_RELAXED)
    _check(lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")
    try:
        yield
    finally:
        lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))


def _stream_memory_calls() -> tuple[Callable, Callable] | None:
    """(write, wait) of 32-bit stream memory operations, or None where the driver has neither."""
    lib = _libcuda()
    names = [_first_symbol(lib, f"{op}_v2", op) for op in ("cuStreamWriteValue32", "cuStreamWaitValue32")]
    if None in names:
        return None
    return getattr(lib, names[0]), getattr(lib, names[1])


def stream_write_value32(stream: int, device_address: int, value: int) -> None:
    """Enqueue a write of ``value`` to the 32-bit word at ``device_address`` (after the stream's earlier work, with
    a memory fence: what that work wrote is visible before the word is)."""
    write, _ = _stream_memory_calls()
    _check(write(stream, device_address, value, _CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32")


def stream_wait_value32(stream: int, device_address: int, value: int) -> None:
    """Enqueue a wait until the 32-bit word at ``device_address`` equals ``value``: later work of the stream waits."""
    _, wait = _stream_memory_calls()
    _check(wait(stream, device_address, value, _CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32")


class MappedHostMemory:
    """``nbytes`` of pinned host memory mapped into the device's address space (``cuMemHostAlloc`` with
    PORTABLE | DEVICEMAP), zeroed: ``host`` is its address here, ``device`` the one stream operations take."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device_index = _device_index(device)
        lib = _libcuda()
        host, mapped = ctypes.c_void_p(), ctypes.c_uint64()
        get_pointer = getattr(lib, _first_symbol(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"))
        with _unsafe_calls_allowed(), _primary_context(self.device_index):
            _check(lib.cuMemHostAlloc(ctypes.byref(host), nbytes, _CU_MEMHOSTALLOC_PORTABLE_DEVICEMAP),
                   "cuMemHostAlloc")
            result = get_pointer(ctypes.byref(mapped), host, 0)
            if result != 0:
                lib.cuMemFreeHost(host)
                _check(result, "cuMemHostGetDevicePointer")
        self.host, self.device, self.nbytes = int(host.value), int(mapped.value), nbytes
        ctypes.memset(self.host, 0, nbytes)

    def free(self) -> None:
        if self.host:
            with _unsafe_calls_allowed(), _primary_context(self.device_index):
                _libcuda().cuMemFreeHost(ctypes.c_void_p(self.host))
            self.host = 0


def pinned_host_allocation(nbytes: int, device: torch.device) -> tuple[int, Callable[[], None]]:
    """``(address, free)``: ``nbytes`` of pinned host memory, mapped into every device (``cuMemHostAlloc`` with
    PORTABLE | DEVICEMAP; with unified addressing a kernel reads it at its host address), not zeroed, and the call
    that frees it. Exactly ``nbytes``, where PyTorch's pinned allocator rounds up to a power of two."""
    device_index = _device_index(device)
    lib = _libcuda()
    host = ctypes.c_void_p()
    with _unsafe_calls_allowed(), _primary_context(device_index):
        _check(lib.cuMemHostAlloc(ctypes.byref(host), nbytes, _CU_MEMHOSTALLOC_PORTABLE_DEVICEMAP), "cuMemHostAlloc")
    address = int(host.value)

    def free() -> None:
        try:
            with _unsafe_calls_allowed(), _primary_context(device_index):
                _libcuda().cuMemFreeHost(ctypes.c_void_p(address))
        except (RuntimeError, OSError):  # the process is ending and the driver with it
            pass

    return address, free


def stream_memory_unsupported(device_index: int) -> str | None:
    """None where device ``device_index`` runs the channel's stream memory operations, else why not: the C++ side is
    not built, the driver lacks the calls, the first calls are switched off (no _v2 entry points and
    CAN_USE_STREAM_MEM_OPS_V1 is 0), or a round trip on a private stream failed: the stream writes a word the host
    must then read, and waits for a value the host writes after it, with a deadline (a device that never saw the
    host's write would hold only that private stream, and its word, for good). Asked once per sequence
    (``HostFunctions.prepare``): about a millisecond."""
    if not host_channel.available():
        return "icecache.core._host_channel is not built"
    torch.cuda.init()
    lib = _libcuda()
    calls = _stream_memory_calls()
    if calls is None:
        return "the driver has no cuStreamWriteValue32 / cuStreamWaitValue32"
    if not hasattr(lib, "cuStreamWaitValue32_v2"):
        device, supported = ctypes.c_int(), ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(device), device_index), "cuDeviceGet")
        _check(lib.cuDeviceGetAttribute(ctypes.byref(supported), _CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1,
                                        device), "cuDeviceGetAttribute")
        if not supported.value:
            return "stream memory operations are switched off (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 is 0)"
    try:
        memory = MappedHostMemory(64, torch.device("cuda", device_index))
    except RuntimeError as error:
        return f"no device-mapped host memory: {error}"
    word = ctypes.c_uint32.from_address(memory.host)
    stuck = False
    try:
        with _unsafe_calls_allowed(), _primary_context(device_index):
            stream = ctypes.c_void_p()
            _check(lib.cuStreamCreate(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING), "cuStreamCreate")
            try:
                stream_write_value32(stream.value, memory.device, 7)
                _check(lib.cuStreamSynchronize(stream), "cuStreamSynchronize")
                if word.value != 7:
                    return f"a stream's write to mapped host memory did not arrive (read {word.value})"
                stream_wait_value32(stream.value, memory.device, 9)
                stream_write_value32(stream.value, memory.device, 0)
                word.value = 9  # what the worker's answer does
                stuck = not _completes(stream, deadline_s=2.0)
                if stuck:
                    return "a stream's wait did not see the host's write to mapped host memory within 2 s"
                if word.value != 0:
                    return f"a stream's reset of mapped host memory did not arrive (read {word.value})"
            finally:
                lib.cuStreamDestroy_v2(stream)  # a stuck stream's resources go once its work ends, if ever
    except RuntimeError as error:
        return f"stream memory operations failed: {error}"
    finally:
        if not stuck:  # else the device may still be polling the word
            memory.free()
    return None


def _completes(stream: ctypes.c_void_p, deadline_s: float) -> bool:
    """Whether ``stream``'s work ends within ``deadline_s`` (polled, so a stream that never ends is no hang here)."""
    lib = _libcuda()
    deadline = time.perf_counter() + deadline_s
    while True:
        result = lib.cuStreamQuery(stream)
        if result == 0:
            return True
        if result != _CUDA_ERROR_NOT_READY:
            _check(result, "cuStreamQuery")
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.0001)


def _as_host_work(function: Callable[[], None]) -> Callable[[], None]:
    """``function`` as host work runs it: under inference mode (like the decode step that enqueued it), flagged as
    inside a host function (``in_host_function``)."""

    def host_work() -> None:
        _HOST_FUNCTION_THREAD.active = True
        try:
            with torch.inference_mode():
                function()
        finally:
            _HOST_FUNCTION_THREAD.active = False

    return host_work


class _ChannelResources:
    """A sequence's channel and its words' memory, closed together (and at exit, if the sequence never was)."""

    def __init__(self, channel: HandOffChannel, memory: MappedHostMemory):
        self.channel, self.memory = channel, memory

    def close(self) -> None:
        if self.channel.close():
            self.memory.free()
        # else a worker is stuck in an entry and may still touch the words: they stay allocated


class HostFunctions:
    """A sequence's host work enqueued on CUDA streams: its hand-off channel, the entries it keeps alive as long as
    a graph may replay them, and the first exception any of them raised.

    ``channel`` is what the sequence asks for (``CHANNEL_CHOICES``; default ``ICECACHE_HOST_CHANNEL`` or auto) and
    ``timeout_s`` how long one hand-off may take before the step ends with an error (``ICECACHE_HANDOFF_TIMEOUT_S``
    or ``host_channel.DEFAULT_TIMEOUT_S``). ``kind`` is the channel in use, decided at the first ``prepare`` on CUDA
    (None before), and ``fallback_reason`` why it is not ``stream_memory`` where it is not. The channel's worker
    starts at the first hand-off and is stopped and joined by ``release`` (or ``close``).
    """

    def __init__(self, timeout_s: float | None = None, channel: str | None = None):
        self.timeout_s = float(timeout_s if timeout_s is not None
                               else os.environ.get("ICECACHE_HANDOFF_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        self.requested = channel or os.environ.get("ICECACHE_HOST_CHANNEL", "auto")
        if self.requested not in CHANNEL_CHOICES:
            raise ValueError(f"host channel {self.requested!r}: expected one of {', '.join(CHANNEL_CHOICES)}")
        self.kind: str | None = None
        self.fallback_reason: str | None = None
        self._keep: list = []
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._resources: _ChannelResources | None = None
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ set-up
    def prepare(self, device: torch.device) -> str:
        """Decide the channel (once) and make its words for ``device``; returns ``kind``. A layer calls this where
        it makes its buffers, before any capture; a first hand-off inside a capture calls it too."""
        device = torch.device(device)
        if self.kind is None:
            reason = ("asked for" if self.requested == HOST_FUNCTION
                      else stream_memory_unsupported(_device_index(device)))
            if reason is not None and self.requested == STREAM_MEMORY:
                raise RuntimeError(f"the stream-memory host channel was asked for and cannot run here: {reason}")
            self.kind = HOST_FUNCTION if reason is not None else STREAM_MEMORY
            self.fallback_reason = reason
        if self.kind == STREAM_MEMORY and self._resources is None:
            memory = MappedHostMemory(host_channel.WORDS_BYTES, device)
            channel = HandOffChannel(HandOffWords.at(memory.host, memory.device, memory), self.timeout_s)
            self._resources = _ChannelResources(channel, memory)
            self._finalizer = weakref.finalize(self, self._resources.close)
        return self.kind

    @property
    def channel(self) -> HandOffChannel | None:
        """The stream-memory channel, while one is open."""
        return self._resources.channel if self._resources is not None else None

    # ------------------------------------------------------------------ hand-offs
    def launch(self, function: Callable[[], None], device: torch.device) -> None:
        """Run ``function()`` on the host once the current stream reaches this point (and on every replay of a
        graph that captured it), under inference mode like the decode step that enqueued it: by the channel's
        worker (which takes the GIL for it), or by a driver host function."""
        if self.prepare(device) == STREAM_MEMORY:
            self._hand_off(self.channel.add_python(_as_host_work(function)), device)
            return
        errors, lock = self._errors, self._lock
        work = _as_host_work(function)

        def trampoline(_user_data) -> None:
            if errors:  # an earlier host function failed: the state it left is not to be built on
                return
            try:
                work()
            except BaseException as error:  # noqa: BLE001  re-raised on the caller's thread
                with lock:
                    errors.append(error)

        callback = _HOST_FN(trampoline)
        self._keep.append(callback)
        _check(_libcuda().cuLaunchHostFunc(stream_handle(device), ctypes.cast(callback, ctypes.c_void_p), None),
               "cuLaunchHostFunc")

    def launch_native(self, function_address: int, state_address: int, device: torch.device) -> None:
        """Call the native ``void f(void*)`` at ``function_address`` with ``state_address`` once the current stream
        reaches this point (and at every replay): from the channel's worker with no Python, or as the driver's host
        function itself. The entry and its state must outlive every graph that may replay it."""
        if self.prepare(device) == STREAM_MEMORY:
            self._hand_off(self.channel.add_native(function_address, state_address), device)
            return
        _check(_libcuda().cuLaunchHostFunc(stream_handle(device), ctypes.c_void_p(int(function_address)),
                                           ctypes.c_void_p(int(state_address or 0) or None)), "cuLaunchHostFunc")

    def _hand_off(self, slot: int, device: torch.device) -> None:
        # request = slot + 1; wait for answer == slot + 1; answer = 0: constants a graph replays as recorded.
        channel = self.channel
        channel.start()
        stream, value, words = stream_handle(device), HandOffChannel.answer_value(slot), channel.words
        stream_write_value32(stream, words.device_request, value)
        stream_wait_value32(stream, words.device_answer, value)
        stream_write_value32(stream, words.device_answer, 0)

    def stop_worker_after(self, requests: int) -> None:
        """Test hook: the stream-memory channel's worker stops, as if killed, on taking its ``requests``-th request
        from now, without answering it (the watchdog then ends the step with an error)."""
        if self.channel is None:
            raise RuntimeError("no stream-memory channel is open")
        self.channel.stop_worker_after(requests)

    # ------------------------------------------------------------------ after the step
    def release(self) -> None:
        """Stop the channel's worker and forget the kept entries and errors. Only once no graph that recorded them
        can replay: each holds the layer that enqueued it, which holds the sequence that holds this object, so
        until then a finished sequence's host memory (tens of GB at 128k) waits for Python's garbage collector."""
        if self._resources is not None:
            self._finalizer.detach()
            self._resources.close()
            self._resources = self._finalizer = None
        self._keep.clear()
        self._errors.clear()

    close = release  # the sequence has ended (SequenceContext.close)

    def raise_pending(self) -> None:
        """Re-raise the first exception of a host function, or the channel's error (a stopped worker, a hand-off
        past the timeout); call after the stream is synchronised."""
        if self._errors:
            error = self._errors[0]
            raise RuntimeError(f"a host function of the decode step failed: {error!r}") from error
        channel = self.channel
        if channel is not None and channel.failed:
            raise RuntimeError(f"a host function of the decode step failed: {channel.error()}") \
                from channel.exception()
