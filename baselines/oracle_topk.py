"""Oracle TOP-k (the IceCache paper's "TOP-k" row): exact top-``budget`` tokens per query head by ``q . k``.

The whole cache stays on the GPU and every decode step scores every key, so this is not a practical method: it is
the upper bound of what a token-level selection method with the same budget could attend to. Softmax runs over the
selected tokens only. Nothing is forced in (no sinks, no window): the new token is attended only if it ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icecache.core.method import METHODS, DenseKV, Method, MethodConfig


@dataclass
class OracleTopKConfig(MethodConfig):
    name: str = "oracle_topk"


def topk_token_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``scores [Hq, T]`` -> bool mask of each row's top-``k`` entries (all entries when ``k >= T``)."""
    if k >= scores.shape[-1]:
        return torch.ones_like(scores, dtype=torch.bool)
    mask = torch.zeros_like(scores, dtype=torch.bool)
    return mask.scatter_(-1, scores.topk(k, dim=-1).indices, True)


class OracleTopKKV(DenseKV):
    def __init__(self, layer_idx, model, seq, budget: int):
        super().__init__(layer_idx, model, seq)
        self.budget = budget

    def prefill(self, query, key, value, attention_mask, scaling):
        assert query.shape[0] == 1, "sparse KV methods run with batch size 1"
        return super().prefill(query, key, value, attention_mask, scaling)

    def decode(self, query, key, value, scaling):
        assert query.shape[0] == 1, "sparse KV methods run with batch size 1"
        self.append(key, value)
        n_heads, head_dim = query.shape[1], query.shape[-1]
        keys, values = self.keys[0].float(), self.values[0].float()
        n_kv_heads, n_tokens = keys.shape[:2]
        group = n_heads // n_kv_heads
        q = query[0, :, 0].float().view(n_kv_heads, group, head_dim)
        with self.seq.timer.phase("select"):
            scores = torch.einsum("hgd,htd->hgt", q, keys) * scaling
            selected = topk_token_mask(scores.reshape(n_heads, n_tokens), self.budget)
        probs = torch.softmax(scores.masked_fill(~selected.view_as(scores), float("-inf")), dim=-1)
        out = torch.einsum("hgt,htd->hgd", probs, values).reshape(1, 1, n_heads, head_dim)
        self.seq.counters.record_attention(selected.sum(-1).float().mean())
        if self.seq.trace_selection:
            self.last_attended = selected
        return out.to(query.dtype)


@METHODS.register("oracle_topk")
class OracleTopK(Method):
    config_class = OracleTopKConfig

    def make_sparse_layer(self, layer_idx, seq):
        return OracleTopKKV(layer_idx, self.model, seq, self.config.budget)
