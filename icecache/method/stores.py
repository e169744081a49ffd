"""The host-memory token store of one IceCache layer."""

from __future__ import annotations

import numpy as np
import torch

from icecache.core.cuda_driver import in_host_function


class TokenStore:
    """A layer's offloaded values, and keys where the index does not hold them, by DCI token id, ``[Hkv, n, D]``
    each, in CPU memory.

    This is the layer's only host copy of its offloaded tokens: an index owner's keys live in its index
    (``DCIIndex.gather_keys`` reads them), so ``keys`` is None there; a reusing layer keeps its own keys here. A
    load gathers a page's rows by token id from here (``gather``), so no page-ordered copy exists.

    ``capacity`` (tokens) sizes the storage from the sequence's announced length; without one it grows by an eighth
    at a time (appending a window page must not copy the whole store every 16 steps). ``nbytes`` counts what is
    held, spare room included.
    """

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor, capacity: int | None = None):
        n_tokens = values.shape[1]
        if capacity is not None and capacity > n_tokens:
            keys = None if keys is None else _with_room(keys, capacity)
            values = _with_room(values, capacity)
        elif keys is not None and keys.stride() != values.stride():  # ``rows`` addresses both with one stride
            keys, values = keys.contiguous(), values.contiguous()
        self._keys, self._values = keys, values
        self.n_tokens = n_tokens

    @property
    def has_keys(self) -> bool:
        return self._keys is not None

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None else self._keys[:, : self.n_tokens]

    @property
    def values(self) -> torch.Tensor:
        return self._values[:, : self.n_tokens]

    @property
    def capacity(self) -> int:
        return self._values.shape[1]

    def reserve(self, n_tokens: int) -> None:
        """Grow the storage (contents kept) so that ``n_tokens`` tokens fit. A captured decode step appends from a
        host function, where this growth once hung the step on the H200 (cause not isolated: the page store's
        pageable growth there completes), so the caller reserves between steps and a growth there is an error."""
        if n_tokens > self.capacity:
            if in_host_function():  # growing there hung a captured step on the H200: fail loudly instead
                raise RuntimeError("IceCache's token store must grow between decode steps (LayerKV.between_steps), "
                                   "not inside a captured step's host function")
            capacity = n_tokens + max(n_tokens // 8, 256)
            self._values = _with_room(self._values[:, : self.n_tokens], capacity)
            if self._keys is not None:
                self._keys = _with_room(self._keys[:, : self.n_tokens], capacity)

    def append(self, keys: torch.Tensor | None, values: torch.Tensor) -> None:
        """Append tokens ``[Hkv, m, D]``; ``keys`` only where the store holds keys."""
        if (keys is None) != (self._keys is None):
            raise ValueError("append keys exactly when the store holds keys")
        needed = self.n_tokens + values.shape[1]
        self.reserve(needed)
        if self._keys is not None:
            self._keys[:, self.n_tokens : needed] = keys
        self._values[:, self.n_tokens : needed] = values
        self.n_tokens = needed

    def rows(self) -> tuple[torch.Tensor | None, torch.Tensor, int]:
        """Keys (None when not held) and values as ``[rows, D]`` views of the storage, and the row stride between
        heads: token ``t`` of head ``h`` is row ``h * stride + t`` (no copy; the views change when the store
        grows)."""
        n_heads, _, head_dim = self._values.shape
        stride = self._values.stride(0) // head_dim
        size = ((n_heads - 1) * stride + self.n_tokens, head_dim)

        def view(tensor):
            return None if tensor is None else torch.as_strided(tensor, size, (head_dim, 1))

        return view(self._keys), view(self._values), stride

    def gather(self, heads: np.ndarray, token_ids: np.ndarray, out_keys: np.ndarray | None,
               out_values: np.ndarray) -> None:
        """Copy the rows of ``token_ids [n, 16]`` (-1: row 0 of the head, any finite content; the slot's count masks
        it) of heads ``heads [n]`` into the byte buffers ``out_values`` (and ``out_keys`` when the store holds keys),
        row ``r * 16 + t``."""
        key_rows, value_rows, stride = self.rows()
        flat = (heads[:, None] * stride + np.maximum(token_ids, 0)).reshape(-1)
        for source, target in ((value_rows, out_values), (key_rows, out_keys)):
            if source is None:
                continue
            source_bytes = source.view(torch.uint8).numpy()  # [rows, D * itemsize]
            # 'clip' rather than the default 'raise', which would copy through a temporary buffer
            np.take(source_bytes, flat, axis=0, out=target.reshape(flat.size, -1), mode="clip")

    def nbytes(self) -> int:
        return self._values.nbytes + (0 if self._keys is None else self._keys.nbytes)


def _with_room(tokens: torch.Tensor, capacity: int) -> torch.Tensor:
    """``tokens [H, n, D]`` copied into new storage of ``capacity`` tokens per head."""
    grown = torch.empty(tokens.shape[0], capacity, tokens.shape[2], dtype=tokens.dtype)
    grown[:, : tokens.shape[1]] = tokens
    return grown
