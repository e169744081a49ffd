"""The hand-off channel of a captured decode step: the stream asks a host worker through host memory, no driver thread.

A decode step that needs host work in every layer (``core.host_step``) hands it off at one point of the stream per
layer. The fast way is three stream memory operations per hand-off, which a CUDA graph records like kernels
(``cuda_driver.HostFunctions`` enqueues them):

1. the stream writes the **request** word: ``slot + 1`` (``cuStreamWriteValue32``; the write is ordered after the
   step's device-to-host copy, whose data the host then sees);
2. a C++ worker thread (``_host_channel``, spinning on the word with a pause instruction) takes the request (sets the
   word back to 0), runs entry ``slot`` (a native ``void f(void*)`` with its state, called with no Python, or a Python
   callable under the GIL), then writes the **answer** word: ``slot + 1``;
3. the stream waits for ``answer == slot + 1`` (``cuStreamWaitValue32``), then writes ``answer = 0``, so that the
   next replay's wait cannot be met by this one's answer.

Every value is a constant of the slot, so the operations a graph recorded are right at every replay. Per layer
this costs microseconds where a driver host function (``cuLaunchHostFunc``) costs tens and one that runs Python
about a hundred. The wait is bounded: a watchdog thread answers in the worker's place when the worker has stopped
or an entry runs past the timeout, and keeps the error, which ``HostFunctions.raise_pending`` raises once the step
has synchronised; the stream never hangs. An entry's failure is kept the same way, and the step's later entries
are then answered without running (the state a failed entry left is not to be built on).

This module holds no CUDA call: the words' memory and the stream operations belong to ``cuda_driver``. On a CPU the
words may be any host memory, which lets tests play the stream's side from Python (``HandOffWords.post`` and
``HandOffWords.wait_for_answer``).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

try:  # built by setup.py; without it a captured step's host work goes through the driver's host functions
    from . import _host_channel
except ImportError:  # pragma: no cover - a checkout whose extensions are not built
    _host_channel = None

DEFAULT_TIMEOUT_S = 5.0
# After this long without a request the worker sleeps ~50 us between probes instead of spinning: between sequences
# and long eager phases it then costs no core. A running captured step hands off far more often than this.
IDLE_BEFORE_SLEEP_S = 0.05
# The request and the answer word, each on its own cache line: the device writes one while the worker spins on it.
_WORD_STRIDE = 16  # uint32 words (64 bytes)
WORDS_BYTES = 2 * _WORD_STRIDE * 4


def available() -> bool:
    """Whether the C++ side of the channel is built."""
    return _host_channel is not None


_NATIVE_ENTRY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def call_native(function_address: int, state_address: int) -> None:
    """Call the native entry ``void f(void*)`` at ``function_address`` with ``state_address``, here and now (ctypes
    releases the GIL for the call)."""
    _NATIVE_ENTRY(int(function_address))(int(state_address or 0) or None)


def native_count_entry() -> int:
    """The address of a native entry of the extension that adds one to the uint64 its state points at (tests and
    the hand-off probe use it as the cheapest possible host work)."""
    return _host_channel.count_entry_address()


def native_sleep_entry() -> int:
    """The address of a native entry that sleeps for the microseconds in the uint64 its state points at."""
    return _host_channel.sleep_entry_address()


@dataclass(frozen=True)
class HandOffWords:
    """Where the two words live: host addresses (what the worker reads and writes) and the device addresses the
    stream's operations take (the same on a CPU). ``owner`` keeps the memory alive."""

    request: int
    answer: int
    device_request: int
    device_answer: int
    owner: object = None

    @classmethod
    def in_host_memory(cls) -> HandOffWords:
        """Words in plain host memory: a channel the stream's side of which is played from Python (CPU tests)."""
        buffer = np.zeros(WORDS_BYTES // 4, dtype=np.uint32)
        base = buffer.ctypes.data
        answer = base + _WORD_STRIDE * 4
        return cls(base, answer, base, answer, buffer)

    @classmethod
    def at(cls, host_base: int, device_base: int, owner: object = None) -> HandOffWords:
        """Words at the start of ``WORDS_BYTES`` of pinned host memory mapped at ``device_base`` on the device."""
        offset = _WORD_STRIDE * 4
        return cls(host_base, host_base + offset, device_base, device_base + offset, owner)

    def _view(self, address: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint32 * 1).from_address(address))

    def post(self, slot: int) -> None:
        """The stream's request for entry ``slot`` (what ``cuStreamWriteValue32`` does on a device)."""
        self._view(self.request)[0] = slot + 1

    def wait_for_answer(self, slot: int, timeout_s: float = 30.0) -> bool:
        """The stream's wait for entry ``slot``'s answer and its reset of the word; False past ``timeout_s`` (the
        device would still be waiting)."""
        answer = self._view(self.answer)
        deadline = time.perf_counter() + timeout_s
        while int(answer[0]) != slot + 1:
            if time.perf_counter() > deadline:
                return False
            time.sleep(0)
        answer[0] = 0
        return True


class HandOffChannel:
    """One sequence's worker and watchdog (C++) serving its registered entries through ``words``. Entries are kept
    until ``close``, since a graph may replay them; the threads start at the first ``start``."""

    def __init__(self, words: HandOffWords, timeout_s: float = DEFAULT_TIMEOUT_S,
                 idle_before_sleep_s: float = IDLE_BEFORE_SLEEP_S):
        if _host_channel is None:
            raise RuntimeError("icecache.core._host_channel is not built (python setup.py build_ext --inplace)")
        self.words = words
        self.timeout_s = timeout_s
        self._channel = _host_channel.Channel(words.request, words.answer, timeout_s, idle_before_sleep_s)
        self.closed = False

    def add_native(self, function_address: int, state_address: int) -> int:
        """Register ``void f(void*)`` at ``function_address``, called with ``state_address``; returns its slot."""
        return self._channel.add_native(int(function_address), int(state_address or 0))

    def add_python(self, work: Callable[[], None]) -> int:
        """Register a Python callable (run by the worker under the GIL); returns its slot. An exception it raises
        is kept (``exception``) and fails the channel."""
        return self._channel.add_python(work)

    def start(self) -> None:
        if self.closed:
            raise RuntimeError("the hand-off channel is closed")
        self._channel.start()

    @staticmethod
    def answer_value(slot: int) -> int:
        """The request and answer words' value for ``slot`` (0 is the words' rest)."""
        return slot + 1

    @property
    def failed(self) -> bool:
        return self._channel.failed

    @property
    def served(self) -> int:
        """Hand-offs the worker answered (not those the watchdog answered in its place)."""
        return self._channel.served

    @property
    def worker_alive(self) -> bool:
        return self._channel.worker_alive

    @property
    def n_entries(self) -> int:
        return self._channel.entries

    def error(self) -> str | None:
        """What went wrong first (an entry's exception, a stopped worker, a timeout), or None."""
        return self._channel.error()

    def exception(self) -> BaseException | None:
        """The exception a Python entry raised first, or None."""
        return self._channel.exception()

    def stop_worker_after(self, requests: int) -> None:
        """Test hook: the worker stops, as if killed, on taking its ``requests``-th request from now (1: the next),
        without answering it; the watchdog then answers that one and every later one with an error."""
        self._channel.stop_worker_after(requests)

    def close(self) -> bool:
        """Stop and join the threads and drop the entries; returns False when the worker is stuck in an entry past
        the timeout and was left to finish alone (then the words must stay allocated)."""
        if self.closed:
            return True
        joined = self._channel.stop()
        self._channel.release_callables()
        self.closed = True
        return joined
