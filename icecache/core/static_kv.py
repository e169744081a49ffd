"""A layer's full cache in static buffers, attended through the paged kernel, with device-side positions.

Each layer's keys and values live in one buffer sized for the whole sequence before the first token; a decode step
writes its token at a position read from a device tensor (``SequenceContext.position``) and attends with the
split-K paged kernel over the buffer, seen as pages of ``page_size`` tokens with per-page valid counts computed on
the device. Nothing in its decode step depends on a host value, so a CUDA graph can capture it: ``full_static``
uses it for every layer, IceCache for its dense layers when its step is captured.
"""

from __future__ import annotations

import torch

from .attention import dense_attention
from .kernels.paged_decode_attention import PagedAttentionPlan, paged_decode_attention
from .layer import LayerKV, ModelInfo, SequenceContext, attended_prefix, storage_capacity


class StaticDenseKV(LayerKV):
    """Keys and values in ``[Hkv, capacity, D]`` buffers allocated once; decode reads its position on the device."""

    def __init__(self, layer_idx: int, model: ModelInfo, seq: SequenceContext, page_size: int):
        super().__init__(layer_idx, model, seq)
        self.page_size = page_size
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._attention_plan = PagedAttentionPlan()

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None else self._keys.shape[1]

    def _allocate(self, like: torch.Tensor, needed: int) -> None:
        """Buffers of ``storage_capacity`` tokens rounded up to whole pages. Growing is impossible inside a captured
        step; the generation loop always announces the length, so only transformers' own generate grows them."""
        capacity = storage_capacity(self.seq, needed, self.capacity)
        capacity = -(-capacity // self.page_size) * self.page_size
        n_kv_heads, head_dim = like.shape[1], like.shape[3]
        keys = like.new_zeros(n_kv_heads, capacity, head_dim)
        values = like.new_zeros(n_kv_heads, capacity, head_dim)
        if self._keys is not None:
            keys[:, : self.seq_len] = self._keys[:, : self.seq_len]
            values[:, : self.seq_len] = self._values[:, : self.seq_len]
        self._keys, self._values = keys, values
        n_pages = capacity // self.page_size
        # The kernel's view: page p is tokens [p * page_size, (p + 1) * page_size) of every head.
        self._page_table = torch.arange(n_pages, device=like.device, dtype=torch.int32).expand(n_kv_heads, n_pages)
        self._page_starts = torch.arange(0, capacity, self.page_size, device=like.device, dtype=torch.int64)

    def _pages(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[Hkv, capacity, D]`` as ``[n_pages, Hkv, page_size, D]`` (a view: the kernel takes any strides)."""
        n_kv_heads, capacity, head_dim = buffer.shape
        return buffer.view(n_kv_heads, capacity // self.page_size, self.page_size, head_dim).permute(1, 0, 2, 3)

    def prefill(self, query, key, value, attention_mask, scaling):
        if key.shape[0] != 1:
            raise ValueError("full_static runs batch size 1")
        end = self.seq_len + key.shape[2]
        if end > self.capacity:
            self._allocate(key, end)
        self._keys[:, self.seq_len : end] = key[0]
        self._values[:, self.seq_len : end] = value[0]
        return dense_attention(query, self._keys[None, :, :end], self._values[None, :, :end], scaling, attention_mask)

    def write_token(self, key: torch.Tensor) -> torch.Tensor:
        """Make room for one more token (growing only outside the generation loop, see ``_allocate``) and return
        the one-element device tensor of its position, where ``append_token`` writes it."""
        if self.seq_len + 1 > self.capacity:
            self._allocate(key, self.seq_len + 1)
        return self.decode_position(key.device)

    def append_token(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Write the step's ``key``/``value [1, Hkv, 1, D]`` at its device-side position; returns the position."""
        position = self.write_token(key)
        self._keys.index_copy_(1, position, key[0])
        self._values.index_copy_(1, position, value[0])
        return position

    def decode(self, query, key, value, scaling):
        position = self.append_token(key, value)
        counts = (position + 1 - self._page_starts).clamp_(0, self.page_size).to(torch.int32)
        counts = counts.expand_as(self._page_table)
        if self.seq.trace_selection:
            self.last_attended = attended_prefix(query.shape[1], position, self.trace_width(), query.device)
        out = paged_decode_attention(
            query[0, :, 0, :], self._pages(self._keys), self._pages(self._values), self._page_table, counts, scaling,
            self._attention_plan,
        )
        return out[None, None]

    def gpu_kv_bytes(self) -> int:
        if self._keys is None or self._keys.device.type != "cuda":
            return 0
        return self._keys.nbytes + self._values.nbytes
