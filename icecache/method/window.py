"""The recent window of an offloaded IceCache layer: a ring of GPU pool slots and its host copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WindowRing:
    """The window's ``n_pages`` pool slots from ``first_slot``, used as a ring: logical window page ``j`` (oldest
    first) sits in slot ``first_slot + (head + j) % n_pages``, so offloading the oldest page moves nothing on the
    GPU (its slot becomes the newest page). ``start`` is the absolute position of the window's first token,
    ``count`` the tokens it holds.

    The host copy (``host_keys``, ``host_values`` ``[Hkv, n_pages * page_size, D]``, oldest token first, in the
    host dtype) is what a full page is offloaded from: the decode step writes each new token into it, so an offload
    reads no device memory. The decode step (C++, ``_dci.DecodeStep``, given the host copy's addresses) appends the
    new token and offloads the oldest page; ``start``, ``count`` and ``head`` are read from it.
    """

    first_slot: int
    n_pages: int
    page_size: int
    host_keys: torch.Tensor
    host_values: torch.Tensor
    native: object  # the layer's _dci.DecodeStep, which holds the ring's position

    @classmethod
    @torch.inference_mode()
    def empty(cls, first_slot: int, n_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
              dtype: torch.dtype, native) -> WindowRing:
        """A ring whose host copy is zeros (the prompt job fills it, ``fill_host_copy``), its addresses given to
        ``native`` with the ring's start and count, which the caller has set there."""
        host_keys = torch.zeros(n_kv_heads, n_pages * page_size, head_dim, dtype=dtype)
        ring = cls(first_slot, n_pages, page_size, host_keys, torch.zeros_like(host_keys), native)
        return ring

    @property
    def start(self) -> int:
        return self.native.window_start

    @property
    def count(self) -> int:
        return self.native.window_count

    @property
    def head(self) -> int:
        return self.native.window_head

    def fill_host_copy(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The prompt's window tokens ``[Hkv, count, D]`` into the host copy."""
        self.host_keys[:, : keys.shape[1]] = keys
        self.host_values[:, : values.shape[1]] = values
