"""The opt-in look-ahead search (``lookahead=true``; off by default): a layer's index search starts one layer early.

The exact step searches layer l's index with layer l's query, which exists only once layer l runs; the search then
sits on the step's critical path, layer after layer. Consecutive layers' inputs differ little (the residual stream
changes by one layer's update), which InfiniGen uses to speculate attention, and the IceCache code's prefetch
option uses to start layer l's selection from layer l-1's input. Here an owner layer l takes layer l-1's input,
projects it with its own norm, ``q_proj`` and RoPE (``core.layer_inputs``) into a speculative query, and a worker
thread offloads the window page that is due and searches layer l's index with that query while layer l-1's
attention, loads and MLP run. When layer l's own query arrives the step checks the speculation:

* a hit (every query head's speculative query has cosine at least ``lookahead_min_cosine`` with its exact one):
  the speculative pages are used;
* a miss: the correction is the exact search, run then with the exact query, so that a poor speculation costs
  time, never a selection the exact search would not make from a query that far from the speculative one.

The miss check is ours. The counters
``lookahead_searches`` and ``lookahead_misses`` say how often each happened. With look-ahead the step's ``query`` phase
is the time it still waits for the search. The look-ahead's job and its speculative query are captured in the step's
CUDA graph like the rest of the host work. Only owners look ahead (a reusing layer reads its owner's selection), and
never layer 0 (there is no layer before it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from icecache.core.cuda_driver import HostFunctions
from icecache.core.host_step import HostExchange


@dataclass
class LookaheadResult:
    """What a look-ahead job found: its speculative query, the index's ranked pages per query head (None: the index
    had no tokens), and the search's counters (``DCIIndex.last_query_stats``, read on the worker's thread)."""

    query: np.ndarray
    pages: np.ndarray | None
    stats: dict = field(default_factory=dict)


def head_cosines(speculative: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Cosine of every query head's speculative and exact query (rows of ``[Hq, D]``), in float64; a zero row
    against a zero row counts as 1, a zero row against another as 0."""
    speculative, exact = speculative.astype(np.float64), exact.astype(np.float64)
    speculative_norms, exact_norms = np.linalg.norm(speculative, axis=1), np.linalg.norm(exact, axis=1)
    norms = speculative_norms * exact_norms
    dots = np.einsum("hd,hd->h", speculative, exact)
    both_zero = (speculative_norms == 0) & (exact_norms == 0)
    return np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), np.where(both_zero, 1.0, 0.0))


def is_hit(speculative: np.ndarray, exact: np.ndarray, min_cosine: float) -> bool:
    return bool(head_cosines(speculative, exact).min() >= min_cosine)


class SpeculativeQuery:
    """A speculative query ``[Hq, D]`` on its way to the host (float32) through its own ``HostExchange``, so that
    its copy and the job launch after it can be captured in a CUDA graph."""

    def __init__(self, n_heads: int, head_dim: int, device: torch.device, host_functions: HostFunctions):
        self.exchange = HostExchange({"query": ((n_heads, head_dim), torch.float32)}, {}, device, host_functions)

    def send(self, query: torch.Tensor, then: Callable[[], None]) -> None:
        """Stage ``query [Hq, D]`` for the host and run ``then()`` there once it has arrived (``HostExchange.run``:
        a host function when captured)."""
        self.exchange.send(query=query)
        self.exchange.run(then)

    def read(self) -> np.ndarray:
        """A copy of the staged query, which the next step overwrites."""
        return self.exchange.host_in["query"].numpy().copy()
