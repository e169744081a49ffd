"""What one hand-off of host work costs inside a captured decode step, on the CUDA host this runs on.

A step of ``layers`` layers, each two tiny kernels, is captured in one CUDA graph per variant and replayed; a
variant's cost is its median replay time over the plain step's (the floor), per layer:

* ``python_host_function``: a driver host function (``cuLaunchHostFunc``) running a Python no-op through a ctypes
  trampoline: the host-function fallback's path for a Python callable;
* ``native_host_function``: a driver host function that is a C function (the native count entry): the fallback's
  path for a native entry;
* ``stream_memory_native`` and ``stream_memory_python``: the stream-memory channel (``core.host_channel``) with the
  native count entry and with a Python no-op: what ``HostExchange.run_native`` and ``HostExchange.run`` cost in a
  captured step where the device supports it;
* ``copies_<bytes>``: a device-to-host and a host-to-device copy of ``<bytes>`` bytes each (pinned memory, the
  driver's raw copies), with no hand-off; ``copies_<bytes>_stream_memory_native`` adds the native hand-off between
  them: a whole layer's exchange (``HostExchange``: send, run_native, receive).

``measure`` prints nothing and returns a dict (the latency engine records it in a latency file's settings);
``format_table`` renders it; scripts/bench/handoff.py is the command line.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from typing import Any, Callable

import torch

from . import host_channel
from .cuda_driver import HOST_FUNCTION, STREAM_MEMORY, HostFunctions, memcpy_async, stream_memory_unsupported

DEFAULT_LAYERS = 30
DEFAULT_REPLAYS = 50
DEFAULT_COPY_BYTES = (8 * 1024, 1024 * 1024)


def _noop() -> None:
    pass


class _Variant:
    """One way a layer hands off, enqueued between the layer's two kernels (``hand_off(layer)``), with the host
    functions and buffers it needs (released by ``close``)."""

    def __init__(self, device: torch.device, layers: int, channel: str | None, native: bool, copy_bytes: int = 0):
        self.device, self.native, self.copy_bytes = device, native, copy_bytes
        self.functions = HostFunctions(channel=channel) if channel is not None else None
        if self.functions is not None:
            self.functions.prepare(device)
        self.counts = (ctypes.c_uint64 * layers)()
        if copy_bytes:
            self.device_buffers = [torch.zeros(copy_bytes, dtype=torch.uint8, device=device) for _ in range(layers)]
            self.host_buffers = [torch.zeros(copy_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(layers)]

    def hand_off(self, layer: int) -> None:
        if self.copy_bytes:
            memcpy_async(self.host_buffers[layer], self.device_buffers[layer])
        if self.functions is not None:
            if self.native:
                state = ctypes.addressof(self.counts) + layer * ctypes.sizeof(ctypes.c_uint64)
                self.functions.launch_native(host_channel.native_count_entry(), state, self.device)
            else:
                self.functions.launch(_noop, self.device)
        if self.copy_bytes:
            memcpy_async(self.device_buffers[layer], self.host_buffers[layer])

    def close(self) -> None:
        if self.functions is not None:
            self.functions.raise_pending()
            self.functions.release()


def _replay_seconds(step: Callable[[], None], device: torch.device, replays: int, warmup: int) -> float:
    """Median wall-clock seconds of a replay (launch to synchronised) of ``step`` captured in one graph."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    times = []
    for index in range(warmup + replays):
        start = time.perf_counter()
        graph.replay()
        torch.cuda.current_stream(device).synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    del graph
    return statistics.median(times)


def measure(device: torch.device | str | None = None, layers: int = DEFAULT_LAYERS, replays: int = DEFAULT_REPLAYS,
            copy_bytes: tuple[int, ...] = DEFAULT_COPY_BYTES, warmup: int = 5) -> dict[str, Any]:
    """The per-layer cost over the floor of every variant (microseconds), the floor itself, and which channel a
    sequence gets here (``channel``; ``fallback_reason`` where it is not the stream-memory one)."""
    if not torch.cuda.is_available():
        raise RuntimeError("the hand-off probe needs a CUDA device")
    device = torch.device(device if device is not None else "cuda")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    unsupported = stream_memory_unsupported(device.index)
    x = torch.zeros(256, device=device)

    variants: dict[str, tuple[str | None, bool, int]] = {"floor": (None, False, 0),
                                                         "python_host_function": (HOST_FUNCTION, False, 0),
                                                         "native_host_function": (HOST_FUNCTION, True, 0)}
    if unsupported is None:
        variants.update({"stream_memory_native": (STREAM_MEMORY, True, 0),
                         "stream_memory_python": (STREAM_MEMORY, False, 0)})
    for size in copy_bytes:
        variants[f"copies_{size}"] = (None, False, size)
        if unsupported is None:
            variants[f"copies_{size}_stream_memory_native"] = (STREAM_MEMORY, True, size)

    seconds: dict[str, float] = {}
    for name, (channel, native, size) in variants.items():
        variant = _Variant(device, layers, channel, native, size)

        def step(variant=variant) -> None:
            for layer in range(layers):  # two tiny kernels per layer, the hand-off between them
                x.add_(1.0)
                variant.hand_off(layer)
                x.mul_(0.5)

        try:
            seconds[name] = _replay_seconds(step, device, replays, warmup)
        finally:
            variant.close()
    floor = seconds.pop("floor")
    return {
        "device": torch.cuda.get_device_name(device),
        "layers": layers,
        "replays": replays,
        "channel": STREAM_MEMORY if unsupported is None else HOST_FUNCTION,
        **({"fallback_reason": unsupported} if unsupported is not None else {}),
        "floor_us_per_layer": floor / layers * 1e6,
        "us_per_layer_over_floor": {name: (value - floor) / layers * 1e6 for name, value in seconds.items()},
    }


def format_table(result: dict[str, Any]) -> str:
    """The probe's result as a short text table."""
    lines = [f"hand-off cost per layer on {result['device']} ({result['layers']} layers in one graph, median of "
             f"{result['replays']} replays); a sequence's channel here: {result['channel']}"
             + (f" ({result['fallback_reason']})" if "fallback_reason" in result else ""),
             f"  {'floor (two tiny kernels)':<40} {result['floor_us_per_layer']:8.1f} us",
             *(f"  {name:<40} {value:8.1f} us over the floor"
               for name, value in result["us_per_layer_over_floor"].items())]
    return "\n".join(lines)
