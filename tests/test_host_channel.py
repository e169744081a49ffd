"""The hand-off channel's protocol on the CPU (``core.host_channel``): the tests play the stream's side from Python
(write the request word, wait for the answer word, reset it) against the C++ worker and watchdog, including an
entry that fails, one that runs past the timeout and a worker that stops in the middle of a step. The same
channel driven by a CUDA stream is tested in tests/test_cuda_driver.py."""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest
import torch

from icecache.core import host_channel
from icecache.core.host_channel import HandOffChannel, HandOffWords

pytestmark = pytest.mark.skipif(not host_channel.available(), reason="icecache.core._host_channel is not built")


def make_channel(timeout_s: float = 5.0, idle_before_sleep_s: float = 0.05) -> tuple[HandOffChannel, HandOffWords]:
    words = HandOffWords.in_host_memory()
    return HandOffChannel(words, timeout_s=timeout_s, idle_before_sleep_s=idle_before_sleep_s), words


def word(address: int) -> int:
    return ctypes.c_uint32.from_address(address).value


def test_a_native_entry_runs_once_per_request_and_the_words_come_back_to_rest():
    channel, words = make_channel()
    count = ctypes.c_uint64(0)
    slot = channel.add_native(host_channel.native_count_entry(), ctypes.addressof(count))
    channel.start()
    try:
        for step in range(1, 51):
            words.post(slot)
            assert words.wait_for_answer(slot, timeout_s=10)
            assert count.value == step
            assert word(words.request) == 0 and word(words.answer) == 0  # the worker took it, the stream reset it
        assert channel.served == 50 and not channel.failed and channel.error() is None
    finally:
        assert channel.close()


def test_several_hand_offs_per_step_each_answer_their_own_slot_in_order():
    """Like a decode step of several layers: slot after slot, each request answered with its own value, for
    several steps (the constant values a graph records work at every replay)."""
    channel, words = make_channel()
    order: list[int] = []
    slots = [channel.add_python(lambda layer=layer: order.append(layer)) for layer in range(12)]
    channel.start()
    try:
        for _ in range(3):
            for slot in slots:
                words.post(slot)
                assert words.wait_for_answer(slot, timeout_s=10)
        assert order == list(range(12)) * 3
    finally:
        channel.close()


def test_a_python_entry_runs_on_the_worker_with_the_gil_and_sees_host_tensors():
    channel, words = make_channel()
    host_in, host_out = torch.arange(6, dtype=torch.float32), torch.zeros(6)
    threads = []

    def host_work():
        threads.append(threading.get_ident())
        host_out.copy_(host_in * 2 + 1)

    slot = channel.add_python(host_work)
    channel.start()
    try:
        words.post(slot)
        assert words.wait_for_answer(slot, timeout_s=10)
        assert host_out.tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0]
        assert threads and threads[0] != threading.get_ident()
    finally:
        channel.close()


def test_an_exception_is_kept_and_later_entries_are_answered_without_running():
    channel, words = make_channel()
    ran = []

    def fails():
        raise KeyError("boom")

    failing, later = channel.add_python(fails), channel.add_python(lambda: ran.append(1))
    channel.start()
    try:
        words.post(failing)
        assert words.wait_for_answer(failing, timeout_s=10)  # answered all the same: the stream goes on
        words.post(later)
        assert words.wait_for_answer(later, timeout_s=10)
        assert ran == []  # the state a failed entry left is not built on
        assert channel.failed and "boom" in channel.error()
        assert isinstance(channel.exception(), KeyError)
    finally:
        channel.close()


def test_an_entry_past_the_timeout_is_answered_by_the_watchdog_with_an_error():
    channel, words = make_channel(timeout_s=0.2)
    release = threading.Event()
    count = ctypes.c_uint64(0)
    stuck = channel.add_python(lambda: release.wait(30))
    after = channel.add_native(host_channel.native_count_entry(), ctypes.addressof(count))
    channel.start()
    try:
        start = time.perf_counter()
        words.post(stuck)
        assert words.wait_for_answer(stuck, timeout_s=10)
        assert 0.2 <= time.perf_counter() - start < 5
        assert channel.failed and "timeout" in channel.error()
        words.post(after)  # the worker is still in the stuck entry: the watchdog answers the next request too
        assert words.wait_for_answer(after, timeout_s=10)
        assert count.value == 0
    finally:
        release.set()
        time.sleep(0.05)
        assert channel.close()  # the entry returned, so the worker is joined


def test_a_native_entry_past_the_timeout_is_bounded_too_and_close_does_not_wait_for_it():
    channel, words = make_channel(timeout_s=0.2)
    sleep_us = ctypes.c_uint64(1_500_000)
    slot = channel.add_native(host_channel.native_sleep_entry(), ctypes.addressof(sleep_us))
    channel.start()
    words.post(slot)
    assert words.wait_for_answer(slot, timeout_s=10)
    assert "timeout" in channel.error()
    start = time.perf_counter()
    assert channel.close() is False  # stuck in the entry: left to finish alone, its words kept
    assert time.perf_counter() - start < 1.0
    time.sleep(1.6)  # let the sleeping entry end before the words' buffer may go


def test_a_worker_stopped_in_the_middle_of_a_step_ends_the_step_with_an_error():
    channel, words = make_channel()
    count = ctypes.c_uint64(0)
    slots = [channel.add_native(host_channel.native_count_entry(), ctypes.addressof(count)) for _ in range(8)]
    channel.start()
    try:
        channel.stop_worker_after(4)  # serves three layers, takes the fourth and stops without answering
        start = time.perf_counter()
        for slot in slots:
            words.post(slot)
            assert words.wait_for_answer(slot, timeout_s=10)  # every wait ends: none hangs
        assert time.perf_counter() - start < 5
        assert count.value == 3
        assert not channel.worker_alive
        assert channel.failed and "stopped" in channel.error()
    finally:
        assert channel.close()


def test_an_idle_worker_dozes_and_still_answers_promptly():
    channel, words = make_channel(idle_before_sleep_s=0.01)
    count = ctypes.c_uint64(0)
    slot = channel.add_native(host_channel.native_count_entry(), ctypes.addressof(count))
    channel.start()
    try:
        time.sleep(0.2)  # long past the idle threshold: the worker sleeps between probes
        start = time.perf_counter()
        words.post(slot)
        assert words.wait_for_answer(slot, timeout_s=10)
        assert time.perf_counter() - start < 0.5 and count.value == 1
    finally:
        channel.close()


def test_a_request_for_an_unknown_entry_is_an_error_not_a_hang():
    channel, words = make_channel()
    channel.start()
    try:
        words.post(7)
        assert words.wait_for_answer(7, timeout_s=10)
        assert "never registered" in channel.error()
    finally:
        channel.close()


def test_a_closed_channel_drops_its_python_entries():
    channel, _ = make_channel()

    class Work:
        def __call__(self):
            pass

    work = Work()
    before = sys.getrefcount(work)
    channel.add_python(work)
    assert sys.getrefcount(work) == before + 1
    channel.start()
    channel.close()
    assert sys.getrefcount(work) == before
    with pytest.raises(RuntimeError, match="closed"):
        channel.start()


def test_run_native_on_the_cpu_calls_the_entry_at_once():
    from icecache.core.cuda_driver import HostFunctions
    from icecache.core.host_step import HostExchange

    exchange = HostExchange({"x": ((2,), torch.float32)}, {"n": ((1,), torch.int64)}, "cpu", HostFunctions())
    count_address = exchange.host_out["n"].data_ptr()  # the entry's state: a uint64 the device would read back
    for step in range(1, 4):
        exchange.send(x=torch.ones(2))
        exchange.run_native(host_channel.native_count_entry(), count_address)
        assert int(exchange.receive()["n"][0]) == step


def test_a_sequence_names_its_channel_or_gets_one_decided_on_its_device():
    from icecache.core.cuda_driver import HostFunctions

    assert HostFunctions().kind is None  # decided at the first hand-off on CUDA, recorded with the step's counters
    assert HostFunctions(channel="host_function").requested == "host_function"
    with pytest.raises(ValueError, match="host channel"):
        HostFunctions(channel="carrier_pigeon")


def test_the_hand_off_probe_renders_its_result_as_a_table():
    from icecache.core.handoff_probe import format_table

    table = format_table({"device": "H200", "layers": 30, "replays": 50, "channel": "stream_memory",
                          "floor_us_per_layer": 4.0,
                          "us_per_layer_over_floor": {"python_host_function": 94.0, "stream_memory_native": 5.0}})
    assert "stream_memory_native" in table and "94.0 us over the floor" in table and "30 layers" in table
