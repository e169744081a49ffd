"""On a CUDA host: the driver calls behind IceCache's captured decode step (raw async copies, host functions).

Run with `pytest -m gpu tests/test_cuda_driver.py` (make test-gpu); skipped without CUDA.
"""

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


def test_code_knows_it_runs_in_a_host_function():
    seen = []
    functions = HostFunctions()
    functions.launch(lambda: seen.append(in_host_function()), torch.device("cuda"))
    torch.cuda.current_stream().synchronize()
    functions.raise_pending()
    assert seen == [True] and not in_host_function()


def test_a_captured_host_exchange_replays_what_its_eager_step_computes():
    """``core.host_step.HostExchange``, the channel of a decode step with host work: send, run, receive. Captured
    once, each replay's answer is the host function's of that replay's input, bitwise the eager step's."""
    from icecache.core.host_step import HostExchange

    functions = HostFunctions()
    exchange = HostExchange(
        to_host={"x": ((4, 3), torch.float32), "step": ((1,), torch.int64)},
        to_device={"y": ((4, 3), torch.float32), "seen": ((2,), torch.int32)}, device="cuda", host_functions=functions,
    )
    calls = []

    def host_work():  # no CUDA here: it reads and writes the pinned host views only
        step = int(exchange.host_in["step"][0])
        calls.append(step)
        exchange.host_out["y"].copy_(exchange.host_in["x"] * 2 + step)
        exchange.host_out["seen"][:] = torch.tensor([step, len(calls)], dtype=torch.int32)

    x, step = torch.zeros(4, 3, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
    result = torch.zeros(4, 3, device="cuda")

    def decode_step():
        exchange.send(x=x.to(torch.bfloat16), step=step)  # cast to the section's dtype on the device
        exchange.run(host_work)
        answer = exchange.receive()
        result.copy_(answer["y"] + 1)

    eager = []
    for value in (1.0, 2.5):
        x.fill_(value)
        step.fill_(int(value))
        decode_step()
        torch.cuda.synchronize()
        eager.append(result.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        decode_step()
    assert len(calls) == 2  # capture records the host function, it does not run it
    for value, expected in zip((1.0, 2.5), eager):
        x.fill_(value)
        step.fill_(int(value))
        graph.replay()
        torch.cuda.current_stream().synchronize()
        assert torch.equal(result, expected)
    functions.raise_pending()
    assert calls == [1, 2, 1, 2]
    assert exchange.device_out["seen"].tolist() == [2, 4]
    assert exchange.nbytes()[0] == exchange.nbytes()[1] > 0


def test_a_raw_c_function_launched_by_address_runs_at_every_replay_with_its_state():
    """``launch_host_function`` enqueues a C function by its address (here a ctypes thunk's) with a state pointer:
    captured once, each replay calls it with that pointer."""
    import ctypes

    from icecache.core.cuda_driver import launch_host_function

    seen = []
    thunk = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda state: seen.append(state))
    address = ctypes.cast(thunk, ctypes.c_void_p).value
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    marker = torch.zeros(1, device="cuda")
    with torch.cuda.graph(graph, stream=stream):
        marker.add_(1)
        launch_host_function(address, 1234, marker.device)
    assert seen == []
    for _ in range(3):
        graph.replay()
    torch.cuda.current_stream().synchronize()
    assert seen == [1234] * 3
