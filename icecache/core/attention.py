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


def dense_attention_and_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dense_attention``'s output (no framework mask) and, where the attention's own kernel computes it anyway, each
    query row's log-sum-exp of its scaled causal scores: ``[B, Hq, S]`` float32, natural log; None elsewhere.

    That is a chunk after earlier tokens (``S < T``) on the flash kernel: ``dense_attention`` sends it through
    PyTorch's lower-right causal bias, which calls the flash kernel itself whenever it can run and keeps only the
    output. Here the same kernel is called with the same arguments, so the output has the same bits, and the
    log-sum-exp it returns beside it costs nothing (H2O's prompt scores need it). Every other case is
    ``dense_attention``'s, with no log-sum-exp."""
    q_len, kv_len = query.shape[-2], key.shape[-2]
    if q_len < kv_len and _flash_runs(query, key, value):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, is_causal=True, return_debug_mask=False, scale=scaling
        )[:2]
        return out.transpose(1, 2).contiguous(), lse[..., :q_len]
    return dense_attention(query, key, value, scaling), None


def _flash_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the lower-right causal bias takes the flash kernel for these inputs without padding them (the test
    PyTorch's dispatch makes, ``torch.nn.attention.bias.CausalBias``)."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16) or query.shape[-1] % 8:
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(query, key, value, None, 0.0, False, query.shape[1] != key.shape[1]))

