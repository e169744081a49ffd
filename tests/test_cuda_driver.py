"""On a CUDA host: the driver calls behind IceCache's captured decode step (raw async copies, the hand-off channel
of host work: stream memory operations and a C++ worker, or the driver's host functions as the fallback).

Run with `pytest -m gpu tests/test_cuda_driver.py` (make test-gpu); skipped without CUDA. The channel's protocol
itself is tested on the CPU in tests/test_host_channel.py.
"""

import ctypes
import threading
import time

import pytest
import torch

from icecache.core import host_channel
from icecache.core.cuda_driver import HOST_FUNCTION, STREAM_MEMORY, HostFunctions, in_host_function, memcpy_async

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Every hand-off test runs through both channels: the stream-memory one (where this host supports it) and the
# driver's host functions it falls back to.
CHANNELS = pytest.mark.parametrize("channel", [STREAM_MEMORY, HOST_FUNCTION])


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


@CHANNELS
def test_a_captured_host_function_runs_at_every_replay_between_its_copies(channel):
    """device -> host copy, host function (doubles on the host), host -> device copy, device op: captured once,
    each replay sees the host function's result of that replay's input."""
    functions = HostFunctions(channel=channel)
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
    assert functions.kind == channel
    functions.release()


@CHANNELS
def test_an_exception_in_a_host_function_is_raised_on_the_caller_after_the_step(channel):
    functions = HostFunctions(channel=channel)
    ran = []

    def fails():
        raise KeyError("boom")

    functions.launch(fails, torch.device("cuda"))
    functions.launch(lambda: ran.append(1), torch.device("cuda"))  # skipped: the state after a failure is not used
    torch.cuda.current_stream().synchronize()
    with pytest.raises(RuntimeError, match="boom"):
        functions.raise_pending()
    assert ran == []
    functions.release()


@CHANNELS
def test_code_knows_it_runs_in_a_host_function(channel):
    seen = []
    functions = HostFunctions(channel=channel)
    functions.launch(lambda: seen.append(in_host_function()), torch.device("cuda"))
    torch.cuda.current_stream().synchronize()
    functions.raise_pending()
    assert seen == [True] and not in_host_function()
    functions.release()


@CHANNELS
def test_a_captured_host_exchange_replays_what_its_eager_step_computes(channel):
    """``core.host_step.HostExchange``, the channel of a decode step with host work: send, run, receive. Captured
    once, each replay's answer is the host function's of that replay's input, bitwise the eager step's."""
    from icecache.core.host_step import HostExchange

    functions = HostFunctions(channel=channel)
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
    functions.release()



def test_the_stream_memory_channel_is_chosen_where_the_device_supports_it():
    """On the H200 hosts (CUDA 12/13 drivers, the extension built) a sequence hands off through stream memory."""
    functions = HostFunctions()
    assert functions.prepare(torch.device("cuda")) == STREAM_MEMORY, functions.fallback_reason
    assert functions.channel is not None and not functions.channel.worker_alive  # started at the first hand-off
    functions.release()
    assert functions.channel is None and functions.kind == STREAM_MEMORY


class LayeredStep:
    """A decode step of ``n_layers`` layers, each: a kernel, a device-to-host copy, host work through the layer's
    ``HostExchange``, a host-to-device copy, a kernel reading the answer. ``host_work(layer)`` is a Python callable
    per layer, or None: then the native count entry adds one to the layer's ``count`` section in ``host_out``."""

    def __init__(self, functions: HostFunctions, n_layers: int, host_work=None):
        from icecache.core.host_step import HostExchange

        self.exchanges = [HostExchange({"x": ((8,), torch.float32)},
                                       {"y": ((8,), torch.float32), "count": ((1,), torch.int64)},
                                       "cuda", functions) for _ in range(n_layers)]
        self.host_work = host_work
        self.x = torch.zeros(8, device="cuda")
        self.results = torch.zeros(n_layers, 9, device="cuda")

    def __call__(self) -> None:
        h = self.x
        for layer, exchange in enumerate(self.exchanges):
            h = h * 1.5 + layer
            exchange.send(x=h)
            if self.host_work is None:
                exchange.run_native(host_channel.native_count_entry(), exchange.host_out["count"].data_ptr())
            else:
                exchange.run(self.host_work(layer, exchange))
            answer = exchange.receive()
            self.results[layer, :8] = answer["y"] + h
            self.results[layer, 8] = answer["count"].to(torch.float32)[0]


def python_host_work(layer: int, exchange):
    """MagicPIG-style host work: CPU tensor math over the host views, no CUDA."""

    def work():
        exchange.host_out["y"].copy_(torch.sin(exchange.host_in["x"]) * (layer + 1))
        exchange.host_out["count"] += 1

    return work


def capture(step, stream=None) -> torch.cuda.CUDAGraph:
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    return graph


@CHANNELS
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_captured_step_of_many_layers_hands_off_at_every_replay_bitwise_as_eagerly(channel, native):
    functions = HostFunctions(channel=channel)
    step = LayeredStep(functions, n_layers=30, host_work=None if native else python_host_work)
    eager = []
    for value in (0.5, -1.25):
        step.x.fill_(value)
        step()
        torch.cuda.synchronize()
        eager.append(step.results.clone())
    graph = capture(step)
    for replay, (value, expected) in enumerate(zip((0.5, -1.25, 0.5, -1.25), eager * 2)):
        step.x.fill_(value)
        graph.replay()
        torch.cuda.current_stream().synchronize()
        functions.raise_pending()
        assert torch.equal(step.results[:, :8], expected[:, :8])
        assert step.results[:, 8].tolist() == [2.0 + replay + 1] * 30  # eager steps counted 2, each replay one more
    assert functions.kind == channel
    if channel == STREAM_MEMORY:
        assert functions.channel.served == 4 * 30
    functions.release()


def test_a_worker_killed_in_the_middle_of_a_captured_step_ends_it_with_an_error_and_the_gpu_goes_on():
    functions = HostFunctions(channel=STREAM_MEMORY)
    step = LayeredStep(functions, n_layers=30)
    graph = capture(step)
    graph.replay()
    torch.cuda.current_stream().synchronize()
    functions.raise_pending()
    functions.stop_worker_after(12)  # serves eleven layers of the next replay, stops in the twelfth
    start = time.perf_counter()
    graph.replay()
    torch.cuda.current_stream().synchronize()  # returns: the watchdog answered in the stopped worker's place
    assert time.perf_counter() - start < 10
    with pytest.raises(RuntimeError, match="host worker stopped"):
        functions.raise_pending()
    assert step.results[:11, 8].tolist() == [2.0] * 11 and step.results[11:, 8].tolist() == [1.0] * 19
    functions.release()
    # The GPU still works: a tensor op, a plain capture, and a new channel's capture.
    assert (torch.ones(3, device="cuda") * 2).sum().item() == 6
    y = torch.zeros(4, device="cuda")
    plain = capture(lambda: y.add_(1))
    plain.replay()
    plain.replay()
    assert y.tolist() == [2.0] * 4
    again = HostFunctions(channel=STREAM_MEMORY)
    fresh = LayeredStep(again, n_layers=4)
    fresh_graph = capture(fresh)
    fresh_graph.replay()
    torch.cuda.current_stream().synchronize()
    again.raise_pending()
    assert fresh.results[:, 8].tolist() == [1.0] * 4
    again.release()


def test_a_hand_off_past_the_timeout_ends_the_step_with_an_error_instead_of_hanging():
    functions = HostFunctions(channel=STREAM_MEMORY, timeout_s=0.3)
    release = threading.Event()
    step = LayeredStep(functions, n_layers=3,
                       host_work=lambda layer, exchange: (lambda: release.wait(30)) if layer == 1 else (lambda: None))
    graph = capture(step)
    start = time.perf_counter()
    graph.replay()
    torch.cuda.current_stream().synchronize()
    assert time.perf_counter() - start < 10
    with pytest.raises(RuntimeError, match="timeout"):
        functions.raise_pending()
    release.set()
    functions.release()
    assert (torch.ones(2, device="cuda") + 1).tolist() == [2.0, 2.0]


def test_a_sequence_that_ends_joins_its_worker():
    from icecache.core.method import SequenceContext

    seq = SequenceContext(host_functions=HostFunctions(channel=STREAM_MEMORY))
    count = ctypes.c_uint64(0)
    seq.host_functions.launch_native(host_channel.native_count_entry(), ctypes.addressof(count),
                                     torch.device("cuda"))
    torch.cuda.current_stream().synchronize()
    channel = seq.host_functions.channel
    assert count.value == 1 and channel.worker_alive
    seq.close()
    assert not channel.worker_alive and seq.host_functions.channel is None


def test_the_hand_off_probe_runs_in_a_process_where_pytorch_has_made_no_context_yet():
    """The probe asks for the channel before any tensor is on the device: the primary context the channel retains
    must outlive its first use (a retain-then-release there once destroyed the context with the channel's pinned
    words, and the next write to them crashed)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    code = ("import json; from icecache.core import handoff_probe; "
            "print(json.dumps(handoff_probe.measure('cuda', layers=4, replays=5, copy_bytes=(8192,), warmup=1)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    costs = result["us_per_layer_over_floor"]
    assert {"python_host_function", "native_host_function", "copies_8192"} <= set(costs)
    if result["channel"] == STREAM_MEMORY:
        assert {"stream_memory_native", "stream_memory_python", "copies_8192_stream_memory_native"} <= set(costs)
