"""Attention kernels of the shared core.

* ``dense_attention``: causal attention of a chunk of queries over all keys so far (prefill, full cache).
* ``paged_decode_attention``: one decode query per head over a per-KV-head selection of pages with per-page
  valid-token counts. The PyTorch reference runs everywhere and defines the semantics; on CUDA the Triton kernel
  in ``triton_kernels`` is used when present and is tested against the reference.

Shapes follow transformers: queries ``[B, Hq, S, D]``, keys and values ``[B, Hkv, T, D]`` (GQA not expanded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def dense_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention where the queries are the last ``S`` of the ``T`` key positions. Returns ``[B, S, Hq, D]``.

    ``attention_mask`` is the framework's boolean ``[B, 1, S, T]`` mask (padding + causal) when there is one.
    """
    q_len, kv_len = query.shape[-2], key.shape[-2]
    gqa = query.shape[1] != key.shape[1]
    if attention_mask is not None:
        mask = attention_mask[..., -kv_len:]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    elif q_len == kv_len:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=q_len > 1, scale=scaling, enable_gqa=gqa)
    else:
        # A chunk after earlier tokens: bottom-right aligned causal attention (SDPA's is_causal is top-left aligned).
        # PyTorch's lower-right causal bias keeps the fused kernels; a boolean [S, T] mask would send SDPA to a
        # masked kernel that is several times slower and, at 8k x 128k, materialises gigabytes.
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(q_len, kv_len), scale=scaling, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous()


def gather_pages(
    pages: torch.Tensor, page_table: torch.Tensor
) -> torch.Tensor:
    """``pages [P, Hkv, page_size, D]``, ``page_table [Hkv, N]`` -> ``[Hkv, N * page_size, D]`` (unused slots
    arbitrary)."""
    n_kv_heads = pages.shape[1]
    heads = torch.arange(n_kv_heads, device=pages.device)[:, None]
    gathered = pages[page_table.clamp(min=0), heads]  # [Hkv, N, page_size, D]
    return gathered.reshape(n_kv_heads, -1, pages.shape[-1])


def valid_slot_mask(page_table: torch.Tensor, valid_counts: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[Hkv, N * page_size]`` bool: slot ``s`` of selected page ``j`` is attended iff ``s < valid_counts[j]``."""
    slots = torch.arange(page_size, device=page_table.device)
    mask = (slots[None, None, :] < valid_counts[..., None]) & (page_table[..., None] >= 0)
    return mask.reshape(page_table.shape[0], -1)


def paged_decode_attention_reference(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    page_table: torch.Tensor,
    valid_counts: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Exact softmax attention of ``query [Hq, D]`` over the selected pages; returns ``[Hq, D]``.

    Query head ``h`` reads KV head ``h // (Hq / Hkv)``. Page ``page_table[g, j]`` contributes its first
    ``valid_counts[g, j]`` slots; entries of ``page_table`` below zero are padding. Softmax is in float32.
    """
    n_heads, head_dim = query.shape
    n_kv_heads, page_size = key_pages.shape[1], key_pages.shape[2]
    group = n_heads // n_kv_heads
    keys = gather_pages(key_pages, page_table).float()
    values = gather_pages(value_pages, page_table).float()
    mask = valid_slot_mask(page_table, valid_counts, page_size)
    q = query.float().view(n_kv_heads, group, head_dim)
    scores = torch.einsum("hgd,htd->hgt", q, keys) * scaling
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgt,htd->hgd", probs, values)
    return out.reshape(n_heads, head_dim).to(query.dtype)


def paged_decode_attention(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    page_table: torch.Tensor,
    valid_counts: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA when available, the PyTorch reference otherwise."""
    if query.is_cuda:
        from . import triton_kernels

        if triton_kernels.available():
            return triton_kernels.paged_decode_attention(
                query, key_pages, value_pages, page_table, valid_counts, scaling
            )
    return paged_decode_attention_reference(query, key_pages, value_pages, page_table, valid_counts, scaling)
