"""What an IceCache layer holds once its prompt has left the GPU, typed and made once: the page pool with its sink,
selected and window slots, the window ring, the host token store, and the layer's C++ decode step, which holds
which page each selected slot holds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from icecache.core.paged import GpuPagePool

from .stores import TokenStore
from .window import WindowRing


@dataclass
class OffloadedState:
    """An offloaded layer's state (``IceCacheLayer.offload_prompt`` makes it; the decode step reads and updates it).

    The pool's slots are the sink pages (``[0, n_sink_pages)``), the selected pages, then the window's ring. Host
    memory holds one copy of every offloaded token, by token id (the DCI's ids): the values, and the keys unless
    ``keys_in_index`` (an owner whose index holds them in the host dtype), in ``tokens``. The index itself is the
    reuse group's (``GroupState.index``).

    ``native`` is the layer's ``_dci.DecodeStep``: the decode step's host work in C++, which owns what that work
    updates (the window ring's position, the token store's fill, ``positions``, ``resident``, ``stale``); Python
    allocates the memory it writes (the decode buffers, the window's host copy, the token store's storage) and
    reads the rest through the properties below (copies).

    ``tokens`` starts empty and is replaced once by the prompt job with the store sized to the sequence (the only
    field a worker sets); it is bound to ``native`` at the layer's first decode step.
    """

    pool: GpuPagePool
    sink_len: int  # the sink tokens, in the first pool slots
    window: WindowRing
    host_dtype: torch.dtype
    keys_in_index: bool
    tokens: TokenStore
    native: object

    @property
    def positions(self) -> np.ndarray:
        """int64 [offloaded tokens]: the absolute position of each token id."""
        return self.native.positions()

    @property
    def resident(self) -> np.ndarray:
        """int64 [Hkv, K]: the page id each selected slot holds, -1 for none."""
        return self.native.resident()

    @property
    def stale(self) -> np.ndarray:
        """bool [Hkv, pages]: the page's content changed since it was loaded."""
        return self.native.stale()

    def store_keys(self, keys: torch.Tensor) -> torch.Tensor | None:
        """``keys`` where the token store holds keys, else None (the index holds them)."""
        return None if self.keys_in_index else keys
