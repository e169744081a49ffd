"""SnapKV (Li et al., NeurIPS 2024): compress the prompt by what its last queries attend to.

**The paper.** The last ``observation_window`` prompt tokens act as an observation window. Their queries'
attention over the prompt prefix (softmax over the whole causal row, as in the model) is summed over the window's
queries, giving one vote per prefix token and head; the votes are max-pooled along the sequence
(``pooling_kernel``, stride 1, same padding) so that the neighbours of a strong token survive with it, and each
head keeps its top prefix tokens plus the whole window. The IceCache paper ran it with window 32, max pooling,
kernel 7, the defaults here.

**Budget.** ``budget - observation_window`` selected prefix tokens + a sliding window of the rest, the new token
included. A prompt that fits the budget is not compressed.

**This code.** With GQA the votes of a KV group's query heads are averaged first, then pooled: one vote vector per
KV head, which is what is selected. The window's queries are carried across prefill chunks, so the window may
straddle them. The selected tokens are the pinned slots of a ``core.token_slots.RingSlotsKV`` and everything after
them its ring of ``budget - n_selected`` tokens; a prompt that fits pins its prefix (all but the last
``observation_window`` tokens) the same way. The decode step replays from a CUDA graph.

**Deviation** (SnapKV only compresses the prompt and lets the cache grow): to stay within ``budget`` the oldest
non-selected token is evicted at each step, the first step's token replacing the observation window's oldest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from icecache.core.method import METHODS, Method, MethodConfig
from icecache.core.token_slots import RingSlotsKV
from icecache.errors import ConfigError


@dataclass
class SnapKVConfig(MethodConfig):
    name: str = "snapkv"
    observation_window: int = 32  # last prompt tokens whose queries vote
    pooling_kernel: int = 7  # max-pooling kernel over the votes (odd: same padding)

    def min_budget(self) -> int:
        return self.observation_window + 1  # the window and one selected prompt token

    def min_budget_reason(self) -> str:
        return f"observation_window={self.observation_window} + 1 selected prompt token besides the window"


def pooled_votes(window_query: torch.Tensor, keys: torch.Tensor, scaling: float, pooling_kernel: int) -> torch.Tensor:
    """SnapKV's per-KV-head votes for the prompt prefix.

    ``window_query [Hq, W, D]`` are the queries of the last W of the ``keys [Hkv, T, D]`` positions. Returns
    ``[Hkv, T - W]`` float32: causal softmax rows over all T keys, summed over the W queries, averaged over each KV
    group's query heads, then max-pooled along the prefix.
    """
    n_heads, window, head_dim = window_query.shape
    n_kv_heads, n_keys = keys.shape[:2]
    group = n_heads // n_kv_heads
    q = window_query.float().view(n_kv_heads, group, window, head_dim)
    scores = torch.einsum("hgwd,htd->hgwt", q, keys.float()) * scaling
    rows = torch.arange(n_keys - window, n_keys, device=keys.device)
    columns = torch.arange(n_keys, device=keys.device)
    scores = scores.masked_fill(columns[None, :] > rows[:, None], float("-inf"))
    votes = torch.softmax(scores, dim=-1)[..., : n_keys - window].sum(dim=2).mean(dim=1)  # [Hkv, T - W]
    return F.max_pool1d(votes[:, None], pooling_kernel, stride=1, padding=pooling_kernel // 2)[:, 0]


class SnapKVKV(RingSlotsKV):
    def __init__(self, layer_idx, model, seq, budget: int, observation_window: int, pooling_kernel: int):
        super().__init__(layer_idx, model, seq, budget)
        self.observation_window = observation_window
        self.pooling_kernel = pooling_kernel
        self.window_query: torch.Tensor | None = None  # [Hq, <= W, D]: the last prompt queries seen so far
        self.scaling = 1.0

    def observe_prefill(self, query, scaling):
        # The window may straddle prefill chunks: keep the last W queries across them.
        recent = query[0] if self.window_query is None else torch.cat([self.window_query, query[0]], dim=1)
        self.window_query = recent[:, -self.observation_window :]
        self.scaling = scaling

    def place_prompt(self, n_prompt):
        keys = self.keys[0]
        n_kv_heads, device = keys.shape[0], keys.device
        window = self.window_query.shape[1]
        n_prefix = n_prompt - window
        if n_prompt <= self.budget:  # not compressed: the prefix pinned, the window (and what follows) a ring
            selected = torch.arange(n_prefix, device=device).expand(n_kv_heads, -1)
        else:
            votes = pooled_votes(self.window_query, keys, self.scaling, self.pooling_kernel)
            selected = votes.topk(self.budget - self.observation_window, dim=-1).indices.sort(dim=-1).values
        self.window_query = None
        self.n_pinned, self.ring_start = selected.shape[1], n_prefix
        self.ring_size = self.budget - self.n_pinned
        window_positions = torch.arange(n_prefix, n_prompt, device=device)
        kept = torch.cat([selected, window_positions.expand(n_kv_heads, -1)], dim=1)
        pinned_slots = torch.arange(self.n_pinned, device=device).expand(n_kv_heads, -1)
        slots = torch.cat([pinned_slots, self.ring_slots(window_positions).expand(n_kv_heads, -1)], dim=1)
        return kept, slots


@METHODS.register("snapkv")
class SnapKV(Method):
    display_name = "SnapKV"
    display_order = 30
    paper_names = ("SKV",)
    config_class = SnapKVConfig
    traces_in_graph = True
    test_settings = {"observation_window": 16}

    def check(self) -> None:
        super().check()
        config = self.config
        if config.observation_window < 1:
            raise ConfigError(f"snapkv: observation_window={config.observation_window} must be >= 1")
        if config.pooling_kernel < 1 or config.pooling_kernel % 2 == 0:
            raise ConfigError(f"snapkv: pooling_kernel={config.pooling_kernel} must be odd and >= 1")

    def forced_positions(self, n_tokens):
        return list(range(max(0, n_tokens - self.config.observation_window), n_tokens))

    def make_sparse_layer(self, layer_idx, seq):
        return SnapKVKV(
            layer_idx, self.model, seq, self.config.budget, self.config.observation_window, self.config.pooling_kernel
        )
