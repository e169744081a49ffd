"""Phase timers for decode-step breakdowns and KV memory accounting.

A phase is timed with wall clock between synchronisations of the stream it runs on, so that the parts of a step add
up to the step's time; synchronising costs a little, so timers are enabled only for latency measurements. A phase
waits for its own stream only, not for the whole device: work a method queues on a side stream (a layer's prompt
copies to host memory, PQCache's clustering) runs under the next layers' prefill whether or not the run is timed.
A device-wide wait at every phase would have made each layer's prefill wait for the previous layer's side work in
timed runs alone, and so counted that work in their TTFT.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch


def synchronize(device: torch.device | str) -> None:
    """Wait for everything queued on ``device``, every stream (the start and end of a step or of a generation)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synchronize_stream(device: torch.device | str) -> None:
    """Wait for what is queued on ``device``'s current stream, and for what that stream was made to wait for."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class PhaseTimer:
    """Accumulates named phases (``query``, ``load``, ...) within the current decode step, and spans.

    A step's phases do not overlap, so that the step's remainder is the model's own work. A span is a piece of
    work timed on its own, whatever thread runs it and whether or not it overlaps phases or other spans (a layer's
    prompt index build on a worker thread, a layer's whole host step): every occurrence is kept, in ``spans``."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = False):
        self.device = torch.device(device)
        self.enabled = enabled
        self._step: dict[str, float] = defaultdict(float)
        self.spans: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()  # spans and host phases may be timed on worker threads

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        # Inside a CUDA-graph capture nothing runs and synchronising is illegal: a replayed step has no phases.
        if not self.enabled or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            yield
            return
        synchronize_stream(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize_stream(self.device)
            self._step[name] += time.perf_counter() - start

    @contextmanager
    def host_phase(self, name: str) -> Iterator[None]:
        """A phase of pure host work, timed without synchronising: it may run inside a CUDA host function, where
        synchronising is not allowed (and the device is idle, waiting for it, anyway)."""
        with self._host_timed(lambda elapsed: self._add_to_step(name, elapsed)):
            yield

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Wall-clock seconds of the work inside, appended to ``spans[name]``; no synchronisation (host work)."""
        with self._host_timed(lambda elapsed: self.spans[name].append(elapsed)):
            yield

    def add_host_phase(self, name: str, seconds: float) -> None:
        """Seconds of a host phase timed elsewhere (native host work keeps its own clock) added to this step."""
        if self.enabled:
            with self._lock:
                self._add_to_step(name, seconds)

    def add_spans(self, name: str, seconds: list[float]) -> None:
        """Occurrences of a span timed elsewhere, appended to ``spans[name]``."""
        if self.enabled and seconds:
            with self._lock:
                self.spans[name].extend(seconds)

    def _add_to_step(self, name: str, seconds: float) -> None:
        self._step[name] += seconds

    @contextmanager
    def _host_timed(self, record) -> Iterator[None]:
        """Wall-clock seconds of the work inside, handed to ``record`` under the lock (host phases and spans may be
        timed on worker threads); nothing when the timer is off."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                record(elapsed)

    def take_step(self) -> dict[str, float]:
        """Return the phases of the step just finished and start a new one."""
        with self._lock:
            step, self._step = dict(self._step), defaultdict(float)
        return step


@dataclass
class DecodeCounters:
    """Per-sequence counters a user needs to understand a sparse run.

    A layer whose decode step may be replayed from a CUDA graph records device tensors (``record_on_device``):
    they are summed on the device, inside the graph, so that every replay counts, and read once when the
    generation ends. Host values (eager steps, host functions) are summed here directly."""

    decode_layer_steps: int = 0  # sparsified (layer, step) pairs
    attended_tokens: float = 0.0  # sum over those pairs of the mean attended tokens per query head
    pages_loaded: int = 0
    bytes_to_gpu: int = 0
    # float64 [decode_layer_steps, attended_tokens, pages_loaded, bytes_to_gpu], one per device, made at first use
    _on_device: dict = field(default_factory=dict, repr=False)
    # A method's own host-side totals by name (``add``), reported beside the others.
    extra: dict = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.extra[name] = self.extra.get(name, 0) + value

    def record_attention(self, mean_tokens_per_head: float) -> None:
        self.decode_layer_steps += 1
        self.attended_tokens += float(mean_tokens_per_head)

    def record_on_device(
        self, mean_tokens_per_head: torch.Tensor | None = None, pages_loaded: torch.Tensor | None = None,
        bytes_to_gpu: torch.Tensor | None = None,
    ) -> None:
        """Device scalars, summed without a host synchronisation: a sparsified (layer, step) pair's mean attended
        tokens per query head (which counts the pair), and blocks and bytes it loaded."""
        values = (None, mean_tokens_per_head, pages_loaded, bytes_to_gpu)  # in the order of the totals
        given = [(i, v) for i, v in enumerate(values) if v is not None]
        if not given:
            return
        totals = self.device_totals(given[0][1].device)
        if mean_tokens_per_head is not None:
            totals[0] += 1
        for index, value in given:  # one-element tensors of any shape
            totals[index] += value.to(torch.float64).reshape(())

    def device_totals(self, device: torch.device) -> torch.Tensor:
        """The float64 ``[decode_layer_steps, attended_tokens, pages_loaded, bytes_to_gpu]`` that
        ``record_on_device`` adds to on ``device``, made at first use; a kernel that does its own counting adds to it
        in place, as ``record_on_device`` would."""
        totals = self._on_device.get(device)
        if totals is None:
            totals = self._on_device[device] = torch.zeros(4, dtype=torch.float64, device=device)
        return totals

    def _totals(self) -> tuple[int, float, int, int]:
        steps, attended, pages, n_bytes = self.decode_layer_steps, self.attended_tokens, self.pages_loaded, \
            self.bytes_to_gpu
        for totals in self._on_device.values():
            d_steps, d_attended, d_pages, d_bytes = totals.tolist()
            steps, attended = steps + int(d_steps), attended + d_attended
            pages, n_bytes = pages + int(d_pages), n_bytes + int(d_bytes)
        return steps, attended, pages, n_bytes

    @property
    def mean_attended_tokens(self) -> float | None:
        steps, attended, _, _ = self._totals()
        return attended / steps if steps else None

    def as_dict(self) -> dict[str, float | int | None]:
        steps, attended, pages, n_bytes = self._totals()
        return {
            "mean_attended_tokens": attended / steps if steps else None,
            "pages_loaded": pages,
            "bytes_to_gpu": n_bytes,
            **self.extra,
        }
