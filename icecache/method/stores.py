"""The host-memory token store of one IceCache layer."""

from __future__ import annotations

import torch

from icecache.core.cuda_driver import in_host_function


class TokenStore:
    """A layer's offloaded values, and keys where the index does not hold them, by DCI token id, ``[Hkv, n, D]``
    each, in CPU memory.

    This is the layer's only host copy of its offloaded tokens: an index owner's keys live in its index, so
    ``keys`` is None there; a reusing layer keeps its own keys here. A load gathers a page's rows by token id from
    here (the C++ decode step, given the storage's address), so no page-ordered copy exists.

    Once ``bind``-ed to the layer's decode step, the step appends the window's offloaded pages into the storage and
    ``n_tokens`` is the step's count; a growth (``reserve``, between steps) points the step at the new storage.

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
        self._n_tokens = n_tokens
        self._native = None  # the decode step (_dci.DecodeStep) that appends, once bound

    def shares_memory_with(self, tensor: torch.Tensor) -> bool:
        """Whether the storage is ``tensor``'s (a store made without room is a view of the tensors it was given)."""
        held = [t for t in (self._keys, self._values) if t is not None]
        return any(t.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() for t in held)

    @property
    def n_tokens(self) -> int:
        return self._n_tokens if self._native is None else self._native.n_tokens

    def bind(self, native) -> None:
        """From now on ``native`` (the layer's ``_dci.DecodeStep``) appends into this storage."""
        self._native = native
        self._point_native(self._n_tokens)

    def _point_native(self, n_tokens: int) -> None:
        if self._keys is not None and self._keys.stride() != self._values.stride():
            raise ValueError("keys and values must have the same strides")
        if self._values.stride(1) != self._values.shape[2] or self._values.stride(2) != 1:
            raise ValueError("the token store's rows must be contiguous")
        self._native.set_tokens(0 if self._keys is None else self._keys.data_ptr(), self._values.data_ptr(),
                                self._values.stride(0) // self._values.shape[2], n_tokens, self.capacity)

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
            n_held = self.n_tokens
            if in_host_function():  # growing there hung a captured step on the H200: fail loudly instead
                raise RuntimeError("IceCache's token store must grow between decode steps (LayerKV.between_steps), "
                                   "not inside a captured step's host function")
            capacity = n_tokens + max(n_tokens // 8, 256)
            self._values = _with_room(self._values[:, :n_held], capacity)
            if self._keys is not None:
                self._keys = _with_room(self._keys[:, :n_held], capacity)
            if self._native is not None:
                self._point_native(n_held)

    def append(self, keys: torch.Tensor | None, values: torch.Tensor) -> None:
        """Append tokens ``[Hkv, m, D]``; ``keys`` only where the store holds keys."""
        if (keys is None) != (self._keys is None):
            raise ValueError("append keys exactly when the store holds keys")
        if self._native is not None:
            raise RuntimeError("a token store bound to a decode step is appended to by the step")
        needed = self.n_tokens + values.shape[1]
        self.reserve(needed)
        if self._keys is not None:
            self._keys[:, self.n_tokens : needed] = keys
        self._values[:, self.n_tokens : needed] = values
        self._n_tokens = needed

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

    def nbytes(self) -> int:
        return self._values.nbytes + (0 if self._keys is None else self._keys.nbytes)


def _with_room(tokens: torch.Tensor, capacity: int) -> torch.Tensor:
    """``tokens [H, n, D]`` copied into new storage of ``capacity`` tokens per head."""
    grown = torch.empty(tokens.shape[0], capacity, tokens.shape[2], dtype=tokens.dtype)
    grown[:, : tokens.shape[1]] = tokens
    return grown
