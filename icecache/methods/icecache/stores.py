"""The host-memory token store of one IceCache layer."""

from __future__ import annotations

import torch

from icecache.core.cuda_driver import in_host_function


class TokenStore:
    """A layer's offloaded keys and values by DCI token id, ``[Hkv, n, D]`` each, in CPU memory.

    Appending a window page must not copy the whole store (at 32k tokens that is 128 MB per layer every 16 steps),
    so the storage grows by an eighth of its size at a time; ``nbytes`` counts what is held, spare room included.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        if keys.stride() != values.stride():  # ``rows`` addresses both with one stride
            keys, values = keys.contiguous(), values.contiguous()
        self._keys, self._values = keys, values
        self.n_tokens = keys.shape[1]

    @property
    def keys(self) -> torch.Tensor:
        return self._keys[:, : self.n_tokens]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, : self.n_tokens]

    def reserve(self, n_tokens: int) -> None:
        """Grow the storage (contents kept) so that ``n_tokens`` tokens fit. A captured decode step appends from a
        host function, where this growth once hung the step on the H200 (cause not isolated: the page store's
        pageable growth there completes), so the caller reserves between steps and a growth there is an error."""
        if n_tokens > self._keys.shape[1]:
            if in_host_function():  # growing there hung a captured step on the H200: fail loudly instead
                raise RuntimeError("IceCache's token store must grow between decode steps (LayerKV.between_steps), "
                                   "not inside a captured step's host function")
            capacity = n_tokens + max(n_tokens // 8, 256)
            for name in ("_keys", "_values"):
                old = getattr(self, name)
                grown = torch.empty(old.shape[0], capacity, old.shape[2], dtype=old.dtype)
                grown[:, : self.n_tokens] = old[:, : self.n_tokens]
                setattr(self, name, grown)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        needed = self.n_tokens + keys.shape[1]
        self.reserve(needed)
        self._keys[:, self.n_tokens : needed] = keys
        self._values[:, self.n_tokens : needed] = values
        self.n_tokens = needed

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Keys and values as ``[rows, D]`` views of the storage, and the row stride between heads: token ``t`` of
        head ``h`` is row ``h * stride + t`` (no copy; the views change when the store grows)."""
        n_heads, _, head_dim = self._keys.shape
        stride = self._keys.stride(0) // head_dim
        size = ((n_heads - 1) * stride + self.n_tokens, head_dim)
        return (torch.as_strided(self._keys, size, (head_dim, 1)), torch.as_strided(self._values, size, (head_dim, 1)),
                stride)

    def nbytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes
