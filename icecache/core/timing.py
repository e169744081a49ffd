"""Phase timers for decode-step breakdowns and KV memory accounting.

A phase is timed with wall clock between device synchronisations, so that the parts of a step add up to the
step's time; synchronising costs a little, so timers are enabled only for latency measurements.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Accumulates named phases (``query``, ``load``, ...) within the current decode step."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = False):
        self.device = torch.device(device)
        self.enabled = enabled
        self._step: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self._step[name] += time.perf_counter() - start

    @contextmanager
    def host_phase(self, name: str) -> Iterator[None]:
        """A phase of pure host work, timed without synchronising: it may run inside a CUDA host function, where
        synchronising is not allowed (and the device is idle, waiting for it, anyway)."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self._step[name] += time.perf_counter() - start

    def take_step(self) -> dict[str, float]:
        """Return the phases of the step just finished and start a new one."""
        step, self._step = dict(self._step), defaultdict(float)
        return step


@dataclass
class DecodeCounters:
    """Per-sequence counters a user needs to understand a sparse run."""

    decode_layer_steps: int = 0  # sparsified (layer, step) pairs
    attended_tokens: float = 0.0  # sum over those pairs of the mean attended tokens per query head
    pages_loaded: int = 0
    bytes_to_gpu: int = 0

    def record_attention(self, mean_tokens_per_head: float) -> None:
        self.decode_layer_steps += 1
        self.attended_tokens += float(mean_tokens_per_head)

    @property
    def mean_attended_tokens(self) -> float | None:
        if self.decode_layer_steps == 0:
            return None
        return self.attended_tokens / self.decode_layer_steps

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "mean_attended_tokens": self.mean_attended_tokens,
            "pages_loaded": self.pages_loaded,
            "bytes_to_gpu": self.bytes_to_gpu,
        }
