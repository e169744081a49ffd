"""The recent window of an offloaded IceCache layer: a ring of GPU pool slots and its host copy."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class WindowRing:
    """The window's ``n_pages`` pool slots from ``first_slot``, used as a ring: logical window page ``j`` (oldest
    first) sits in slot ``first_slot + (head + j) % n_pages``, so offloading the oldest page moves nothing on the
    GPU (its slot becomes the newest page). ``start`` is the absolute position of the window's first token,
    ``count`` the tokens it holds.

    The host copy (``host_keys``, ``host_values`` ``[Hkv, n_pages * page_size, D]``, oldest token first, in the
    host dtype) is what a full page is offloaded from: the decode step writes each new token into it, so an offload
    reads no device memory (it may run in a host function). Made under inference mode, like every tensor the host
    step writes.
    """

    first_slot: int
    n_pages: int
    page_size: int
    start: int
    count: int
    host_keys: torch.Tensor
    host_values: torch.Tensor
    head: int = 0
    _ring_slots: np.ndarray = field(init=False, repr=False)
    _head_rows: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._ring_slots = np.arange(self.n_pages)
        self._head_rows = np.arange(self.host_keys.shape[0]) * self.page_size

    @classmethod
    @torch.inference_mode()
    def empty(cls, first_slot: int, n_pages: int, page_size: int, start: int, count: int, n_kv_heads: int,
              head_dim: int, dtype: torch.dtype) -> WindowRing:
        """A ring whose host copy is zeros: the prompt job fills its first ``count`` tokens (``fill_host_copy``)."""
        host_keys = torch.zeros(n_kv_heads, n_pages * page_size, head_dim, dtype=dtype)
        return cls(first_slot, n_pages, page_size, start, count, host_keys, torch.zeros_like(host_keys))

    @property
    def capacity(self) -> int:
        return self.n_pages * self.page_size

    def is_full(self) -> bool:
        return self.count == self.capacity

    def fill_host_copy(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The prompt's window tokens ``[Hkv, count, D]`` into the host copy."""
        self.host_keys[:, : keys.shape[1]] = keys
        self.host_values[:, : values.shape[1]] = values

    def append(self, key: torch.Tensor, value: torch.Tensor) -> np.ndarray:
        """The new token ``[Hkv, D]`` into the host copy; returns its flat pool rows ``[Hkv]`` (a pool of
        ``[slots, Hkv, page_size, D]`` seen as rows of ``D``), where the device writes it."""
        self.host_keys[:, self.count] = key
        self.host_values[:, self.count] = value
        page, offset = divmod(self.count, self.page_size)
        slot = self.first_slot + (self.head + page) % self.n_pages
        self.count += 1
        return (slot * self._head_rows.size) * self.page_size + self._head_rows + offset

    def pop_oldest_page(self) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Take the oldest page out of the window (the ring turns; its slot is now the newest page, whose counts
        hide what new tokens have not yet overwritten): its keys and values ``[Hkv, page_size, D]`` from the host
        copy and its absolute positions."""
        ps = self.page_size
        page_k = self.host_keys[:, :ps].clone()
        page_v = self.host_values[:, :ps].clone()
        self.host_keys[:, :-ps] = self.host_keys[:, ps:].clone()
        self.host_values[:, :-ps] = self.host_values[:, ps:].clone()
        self.count -= ps
        self.head = (self.head + 1) % self.n_pages
        positions = np.arange(self.start, self.start + ps)
        self.start += ps
        return page_k, page_v, positions

    def slot_counts(self) -> np.ndarray:
        """Valid tokens of each of the window's slots ``[n_pages]``, in slot order."""
        logical = (self._ring_slots - self.head) % self.n_pages
        return np.clip(self.count - logical * self.page_size, 0, self.page_size)
