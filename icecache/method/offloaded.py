"""What an IceCache layer holds once its prompt has left the GPU, typed and made once: the page pool with its sink,
selected and window slots, the window ring, the host token store and which page each selected slot holds."""

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
    ``keys_in_index`` (an owner whose index holds them in the host dtype), in ``tokens``; ``positions`` maps a token
    id to its absolute position. The index itself is the reuse group's (``GroupState.index``).

    ``tokens`` starts empty and is replaced once by the prompt job with the store sized to the sequence (the only
    field a worker sets); every later change is the decode step's.
    """

    pool: GpuPagePool
    sink_len: int  # the sink tokens, in the first pool slots
    window: WindowRing
    host_dtype: torch.dtype
    keys_in_index: bool
    tokens: TokenStore
    positions: np.ndarray
    resident: np.ndarray  # int64 [Hkv, K]: the page id each selected slot holds, -1 for none
    stale: np.ndarray  # bool [Hkv, pages]: the page's content changed since it was loaded

    def store_keys(self, keys: torch.Tensor) -> torch.Tensor | None:
        """``keys`` where the token store holds keys, else None (the index holds them)."""
        return None if self.keys_in_index else keys

    def add_tokens(self, keys: torch.Tensor, values: torch.Tensor, positions: np.ndarray) -> None:
        """Offloaded tokens ``[Hkv, n, D]`` at ``positions``, next in token-id order (the index's insert order)."""
        self.tokens.append(self.store_keys(keys), values)
        self.positions = np.concatenate([self.positions, positions])

    def cover_pages(self, n_pages: int) -> None:
        """``stale`` has a flag for each of ``n_pages`` pages (new pages are not stale)."""
        if self.stale.shape[1] < n_pages:
            self.stale = np.pad(self.stale, ((0, 0), (0, n_pages - self.stale.shape[1])))

    def mark_stale(self, changed: np.ndarray | None) -> None:
        """Pages flagged in ``changed [Hkv, pages]`` hold other tokens now: a resident copy must be loaded again."""
        if changed is None:
            return
        self.cover_pages(changed.shape[1])
        self.stale[:, : changed.shape[1]] |= changed

    def gather(self, index, heads: np.ndarray, token_ids: np.ndarray, out_keys: np.ndarray,
               out_values: np.ndarray) -> None:
        """The rows of ``token_ids [n, page_size]`` of heads ``heads [n]`` into the byte buffers ``out_keys`` and
        ``out_values`` ``[n, page_bytes]``: the values from the store, the keys from wherever they are held."""
        self.tokens.gather(heads, token_ids, self.store_keys(out_keys), out_values)
        if self.keys_in_index:
            index.gather_keys(heads, token_ids, out_keys)
