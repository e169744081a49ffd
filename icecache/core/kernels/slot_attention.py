"""Attention of one decode query per head over a layer's token slots, with the probabilities.

``slot_attention(query [Hq, D], keys/values [Hkv, S, D], valid [Hkv, S], scaling) -> (out [Hq, D], probs [Hq, S])``,
float32, invalid slots at probability 0. PyTorch only: the generic attention of ``token_slots.TokenSlotsKV`` and
the attention inside ``h2o_step_reference``. The ring methods attend through the paged kernel instead, and H2O's
decode step through its own kernel (``h2o_step``), so no Triton version is needed.
"""

from __future__ import annotations

import torch


def slot_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``query [Hq, D]`` over ``keys``/``values [Hkv, S, D]`` where ``valid [Hkv, S]``: float32 ``(out [Hq, D],
    probs [Hq, S])``, invalid slots with probability 0."""
    n_heads, head_dim = query.shape
    n_kv_heads = keys.shape[0]
    q = query.float().view(n_kv_heads, n_heads // n_kv_heads, head_dim)
    scores = torch.einsum("hgd,hsd->hgs", q, keys.float()) * scaling
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    out = torch.einsum("hgs,hsd->hgd", probs, values.float())
    return out.reshape(n_heads, head_dim), probs.reshape(n_heads, -1)
