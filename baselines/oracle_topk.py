"""Oracle TOP-k (the IceCache paper's "TOP-k" row): exact top-``budget`` tokens per query head by ``q . k``.

The whole cache stays on the GPU and every decode step scores every key, so this is not a practical method: it is
the upper bound of what a token-level selection with the same budget could attend to.

**Budget.** Exactly the ``budget`` keys with the largest ``q . k`` of each query head over the whole cache; nothing
is forced in (no sinks, no window): the new token is attended only if it ranks. Softmax runs over the selected
tokens only.

**This code.** The keys live in static buffers sized for the sequence (``core.static_kv``); a step scores the whole
buffer in float32 (the ``gqa_scores`` kernel, positions past the current one at ``-inf``), takes a ``topk`` of
fixed shape, and attends with a softmax over the chosen exact scores and the gathered values of the chosen tokens
(with fewer tokens than the budget the ``-inf`` picks get probability 0). Nothing depends on a host value, so on
CUDA the step replays from a CUDA graph. Selection quality measures it at its oracle exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icecache.core.kernels.gqa_scores import gqa_scores
from icecache.core.layer import attended_from_positions
from icecache.core.method import METHODS, Method, MethodConfig
from icecache.core.static_kv import StaticDenseKV


@dataclass
class OracleTopKConfig(MethodConfig):
    name: str = "oracle_topk"


class OracleTopKKV(StaticDenseKV):
    def __init__(self, layer_idx, model, seq, budget: int):
        super().__init__(layer_idx, model, seq, page_size=16)
        self.budget = budget

    def decode(self, query, key, value, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        position = self.append_token(key, value)
        q = query[0, :, 0]
        n_heads, head_dim = q.shape
        n_kv_heads = self._keys.shape[0]
        with self.seq.timer.phase("select"):
            scores = gqa_scores(q, self._keys, scaling, position + 1)  # [Hq, capacity]
            top = scores.topk(min(self.budget, scores.shape[1]), dim=-1)
        # Fewer tokens than the budget: the -inf picks get probability 0 (their values are finite: zero-filled).
        probs = torch.softmax(top.values, dim=-1)
        kv_head = torch.arange(n_heads, device=q.device) // (n_heads // n_kv_heads)
        values = self._values[kv_head[:, None], top.indices].float()  # [Hq, k, D]
        out = torch.einsum("hk,hkd->hd", probs, values)
        self.seq.counters.record_on_device((top.values > float("-inf")).sum(-1).float().mean())
        if self.seq.trace_selection:
            self.last_attended = attended_from_positions(top.indices, top.values > float("-inf"), self.trace_width(),
                                                         group=1)
        return out.view(1, 1, n_heads, head_dim).to(query.dtype)


@METHODS.register("oracle_topk")
class OracleTopK(Method):
    display_name = "TOPK"
    display_order = 20
    paper_names = ("Top-k",)
    config_class = OracleTopKConfig
    traces_in_graph = True

    def make_sparse_layer(self, layer_idx, seq):
        return OracleTopKKV(layer_idx, self.model, seq, self.config.budget)
