"""Dense attention of the shared core: causal attention of a chunk of queries over all keys so far (prefill, full
cache), through PyTorch's fused SDPA kernels. The sparse decode attention over selected pages is
``kernels.paged_decode_attention``.

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
