"""On a CUDA host: the driver calls behind IceCache's captured decode step (raw async copies, host functions).

Run with `pytest -m gpu tests/test_cuda_driver.py` (make test-gpu); skipped without CUDA.
"""

import time

import pytest
import torch

from icecache.core.cuda_driver import HostFunctions, in_host_function, memcpy_async

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_memcpy_async_round_trip_through_pinned_memory():
    source = torch.randn(1000, device="cuda")
    host = torch.empty(1000, pin_memory=True)
    back = torch.empty(1000, device="cuda")
    memcpy_async(host, source)
    memcpy_async(back, host)
    torch.cuda.synchronize()
    assert torch.equal(host, source.cpu()) and torch.equal(back, source)
    with pytest.raises(ValueError, match="bytes"):
        memcpy_async(host[:10], source)


def test_a_captured_host_function_runs_at_every_replay_between_its_copies():
    """device -> host copy, host function (doubles on the host), host -> device copy, device op: captured once,
    each replay sees the host function's result of that replay's input."""
    functions = HostFunctions()
    device_in = torch.zeros(4, device="cuda")
    device_out = torch.zeros(4, device="cuda")
    host = torch.zeros(4, pin_memory=True)
    calls = []

    def double_on_host():
        calls.append(float(host[0]))
        host.mul_(2)

    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        memcpy_async(host, device_in)
        functions.launch(double_on_host, device_in.device)
        memcpy_async(device_out, host)
        device_out.add_(1)
    assert calls == []  # capture records, it does not run
    for value in (1.0, 2.0, 5.0):
        device_in.fill_(value)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        assert device_out.tolist() == [2 * value + 1] * 4
    assert calls == [1.0, 2.0, 5.0]
    functions.raise_pending()  # nothing failed


def test_an_exception_in_a_host_function_is_raised_on_the_caller_after_the_step():
    functions = HostFunctions()
    ran = []

    def fails():
        raise KeyError("boom")

    functions.launch(fails, torch.device("cuda"))
    functions.launch(lambda: ran.append(1), torch.device("cuda"))  # skipped: the state after a failure is not used
    torch.cuda.current_stream().synchronize()
    with pytest.raises(RuntimeError, match="boom"):
        functions.raise_pending()
    assert ran == []


def test_code_knows_it_runs_in_a_host_function_and_a_page_store_grows_there_without_pinning():
    from icecache.core.paged import CpuPageStore

    store = CpuPageStore(2, 4, 8, torch.float32, pin_memory=True, initial_pages=2)
    assert store._keys.is_pinned() and not in_host_function()
    seen = []

    def grow():
        seen.append(in_host_function())
        store.ensure_capacity(5)  # would pin through CUDA, which a host function must not call

    functions = HostFunctions()
    functions.launch(grow, torch.device("cuda"))
    torch.cuda.current_stream().synchronize()
    functions.raise_pending()
    assert seen == [True] and not in_host_function()
    assert store.capacity == 5 and not store._keys.is_pinned()
    store.reserve(20)  # outside: pinned again
    assert store.capacity == 20 and store._keys.is_pinned()


def test_a_large_page_store_growth_inside_a_captured_host_function_completes():
    """The page store may grow inside a host function (pageable); the token store refuses to, since its growth
    once hung a captured step. This grows a page store by a copy large enough for PyTorch to run it on its
    thread pool, from a host function replayed by a graph, and checks the stream does not hang."""

    from icecache.core.paged import CpuPageStore

    store = CpuPageStore(8, 16, 128, torch.bfloat16, pin_memory=True, initial_pages=256)
    store.ensure_capacity(256)
    store._keys.normal_()
    before = store._keys[:256].clone()
    functions = HostFunctions()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        functions.launch(lambda: store.ensure_capacity(4096), torch.device("cuda"))
    done = torch.cuda.Event()
    graph.replay()
    done.record()
    deadline = time.monotonic() + 30
    while not done.query():
        assert time.monotonic() < deadline, "the host function's growth hung the stream"
        time.sleep(0.01)
    functions.raise_pending()
    assert store.capacity >= 4096 and torch.equal(store._keys[:256], before)
