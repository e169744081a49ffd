"""Full cache: every token of every layer kept on the model's device, dense attention. Ignores the budget.

Two forms of the same computation:

* ``full``: ``DenseKV`` storage, the plain transformers decode path (one Python pass per step).
* ``full_static``: the fast full cache that latency ratios are measured against. Each layer's keys and values live
  in one buffer sized for the whole sequence before the first token, a decode step writes its token at a position
  read from a device tensor and attends with the split-K paged kernel over the buffer (seen as pages of 16 tokens
  with per-page valid counts computed on the device). Nothing in its decode step depends on a host value, so on
  CUDA the generation loop captures the step in a CUDA graph and replays it; the per-token cost is then the GPU's,
  not Python's. On CPU the same layer runs eagerly (the kernel's PyTorch reference), which is what CI tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icecache.core.attention import dense_attention, paged_decode_attention
from icecache.core.method import (
    METHODS, DenseKV, LayerKV, Method, MethodConfig, ModelInfo, SequenceContext, storage_capacity,
)


@METHODS.register("full")
class FullCache(Method):
    uses_budget = False

    def make_layer(self, layer_idx, seq):
        return DenseKV(layer_idx, self.model, seq)

    def make_sparse_layer(self, layer_idx, seq):
        return DenseKV(layer_idx, self.model, seq)


@dataclass
class FullStaticConfig(MethodConfig):
    name: str = "full_static"
    cuda_graph: bool = True  # capture the decode step on CUDA (no effect on CPU)
    # Tokens per page of the attention kernel's view of the buffer; a power of two <= 64.
    page_size: int = 16


@METHODS.register("full_static")
class FullStaticCache(Method):
    config_class = FullStaticConfig
    uses_budget = False

    def check(self) -> None:
        super().check()
        size = self.config.page_size
        if size < 1 or size > 64 or size & (size - 1):
            from icecache.core.errors import ConfigError

            raise ConfigError(f"full_static page_size must be a power of two <= 64, not {size}")

    @property
    def captures_decode_step(self) -> bool:
        return self.config.cuda_graph

    def make_layer(self, layer_idx, seq):
        return StaticDenseKV(layer_idx, self.model, seq, self.config.page_size)

    def make_sparse_layer(self, layer_idx, seq):
        return self.make_layer(layer_idx, seq)


class StaticDenseKV(LayerKV):
    """Keys and values in ``[Hkv, capacity, D]`` buffers allocated once; decode reads its position on the device."""

    def __init__(self, layer_idx: int, model: ModelInfo, seq: SequenceContext, page_size: int):
        super().__init__(layer_idx, model, seq)
        self.page_size = page_size
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

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

    def decode(self, query, key, value, scaling):
        if self.seq_len + 1 > self.capacity:
            self._allocate(key, self.seq_len + 1)
        position = self.seq.position
        if position is None:  # called outside the generation loop: a host position is fine when nothing is captured
            position = torch.full((1,), self.seq_len, dtype=torch.long, device=key.device)
        self._keys.index_copy_(1, position[:1], key[0])
        self._values.index_copy_(1, position[:1], value[0])
        counts = (position[:1] + 1 - self._page_starts).clamp_(0, self.page_size).to(torch.int32)
        counts = counts.expand_as(self._page_table)
        if self.seq.trace_selection:
            self.last_attended = torch.ones(query.shape[1], self.seq_len + 1, dtype=torch.bool, device=query.device)
        out = paged_decode_attention(
            query[0, :, 0, :], self._pages(self._keys), self._pages(self._values), self._page_table, counts, scaling
        )
        return out[None, None]

    def gpu_kv_bytes(self) -> int:
        if self._keys is None or self._keys.device.type != "cuda":
            return 0
        return self._keys.nbytes + self._values.nbytes
