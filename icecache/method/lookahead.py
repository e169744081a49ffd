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
is the time it still waits for the search. The job runs in C++ (``_dci.DecodeStep``, on the sequence's
``_dci.NativeSequence`` thread, one job at a time): its start is a native entry that copies the speculative query and
hands the job over, called through the query's ``HostExchange.run_native``, so that the query's copy and the start
are captured in the step's CUDA graph like the rest of the host work; the layer's host step waits for the job. Only
owners look ahead (a reusing layer reads its owner's selection), and never layer 0 (there is no layer before it).

In stream order layer l's look-ahead starts before layer l-1's own host step, and both want the search team. The job
is therefore held back until layer l-1's host step is done with the team (``NativeSequence::defer``, released at the
end of every host step, or by layer l's own step if none ran): started at once, its search held the team through
layer l-1's page gather (which then ran on one thread) and made a missed speculation's exact search wait for the
whole speculative one. After a dense layer, which has no host step, it starts at once.

From its start until layer l's step takes it, the job owns layer l's window, token store and index: the model's
thread prepares the step (the store's room for the page the job may offload) before the start, and leaves the store
alone until the step (``DecodeStep.lookahead_pending``).
"""

from __future__ import annotations

import numpy as np
import torch

from icecache.core.cuda_driver import HostFunctions
from icecache.core.host_step import HostExchange
from icecache.dci import _dci


def head_cosines(speculative: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Cosine of every query head's speculative and exact query (rows of ``[Hq, D]``, float32), in float64; a zero
    row against a zero row counts as 1, a zero row against another as 0. The decode step's own check (C++)."""
    return _dci.head_cosines(np.ascontiguousarray(speculative, dtype=np.float32),
                             np.ascontiguousarray(exact, dtype=np.float32))


def is_hit(speculative: np.ndarray, exact: np.ndarray, min_cosine: float) -> bool:
    return bool(head_cosines(speculative, exact).min() >= min_cosine)


class SpeculativeQuery:
    """A speculative query ``[Hq, D]`` on its way to the host (float32) through its own ``HostExchange``, so that
    its copy and the job start after it can be captured in a CUDA graph."""

    def __init__(self, n_heads: int, head_dim: int, device: torch.device, host_functions: HostFunctions):
        self.exchange = HostExchange({"query": ((n_heads, head_dim), torch.float32)}, {}, device, host_functions)

    @property
    def address(self) -> int:
        """Where the host reads the staged query (what the look-ahead's start copies)."""
        return self.exchange.host_in["query"].data_ptr()

    def send(self, query: torch.Tensor, start: tuple[int, int]) -> None:
        """Stage ``query [Hq, D]`` for the host and call the native entry ``start`` (function and state addresses)
        there once it has arrived (``HostExchange.run_native``: a host function when captured)."""
        self.exchange.send(query=query)
        self.exchange.run_native(*start)

    def read(self) -> np.ndarray:
        """A copy of the staged query, which the next step overwrites."""
        return self.exchange.host_in["query"].numpy().copy()
