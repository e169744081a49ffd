"""Device time of GPU work, for the probes and kernel sweeps: CUDA events around launches, and CUDA-graph replays for
work whose host cost must not count."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_event_seconds(launch: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """The median device time of ``launch()`` over ``repeats`` timed calls after ``warmup`` untimed ones, each
    between two events on the current stream."""
    stream = torch.cuda.current_stream(device)
    times = []
    for index in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        launch()
        end.record(stream)
        end.synchronize()
        if index >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_call_us(call: Callable[[], object], calls_per_graph: int = 20, replays: int = 10) -> float:
    """The device time of one ``call()`` in microseconds: ``calls_per_graph`` calls captured in one CUDA graph (the
    first call, run before, compiles and allocates), the median of ``replays`` replays over the call count."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            call()
    device = torch.device("cuda", torch.cuda.current_device())
    return median_event_seconds(graph.replay, device, replays) * 1e6 / calls_per_graph
