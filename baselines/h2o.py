"""H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023), with real eviction.

Every head accumulates, for every cached key, the attention probability its queries gave that key: over all rows
of the prompt and then one row per decode step. The cache keeps the most recent tokens plus the "heavy hitters",
the older tokens with the largest accumulated probability, and evicts the rest for good. Scores of kept tokens are
never reset (``H2OKVCache_LayerWise``).

Budget: a decode step attends to at most ``budget`` tokens, ``n_heavy = round(heavy_fraction * budget)`` heavy
hitters and ``budget - n_heavy`` recent tokens, the new one included. As in H2O the eviction follows the step's
attention, so the step's own probabilities count when choosing what to drop.

Accumulated scores are kept per query head (the paper's per-head statistic); with GQA the cache is per KV head,
so a KV head keeps the tokens with the largest sum of its query heads' scores. The prompt's score matrix is never
materialised: rows are processed ``score_chunk_size`` queries at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baselines.streaming_llm import TokenEvictionKV
from icecache.core.errors import ConfigError
from icecache.core.method import METHODS, Method, MethodConfig


@dataclass
class H2OConfig(MethodConfig):
    name: str = "h2o"
    heavy_fraction: float = 0.5  # share of the budget for heavy hitters; the rest is the recent window
    score_chunk_size: int = 256  # prompt query rows per block when accumulating prefill scores (memory only)


def accumulated_attention(query: torch.Tensor, keys: torch.Tensor, scaling: float, chunk_size: int) -> torch.Tensor:
    """Column sums of the causal softmax attention: ``query [Hq, S, D]`` are the last S of ``keys [Hkv, T, D]``.

    Returns ``[Hq, T]`` float32: for each query head and key, the summed probability over the S query rows.
    Works on ``chunk_size`` rows at a time, so memory is ``Hq * chunk_size * T`` rather than ``Hq * S * T``.
    """
    n_heads, n_queries, head_dim = query.shape
    n_kv_heads, n_keys = keys.shape[:2]
    group = n_heads // n_kv_heads
    k = keys.float()
    total = query.new_zeros(n_kv_heads, group, n_keys, dtype=torch.float32)
    columns = torch.arange(n_keys, device=query.device)
    offset = n_keys - n_queries  # query row i sits at position offset + i
    for begin in range(0, n_queries, chunk_size):
        q = query[:, begin : begin + chunk_size].float().view(n_kv_heads, group, -1, head_dim)
        rows = torch.arange(begin, begin + q.shape[2], device=query.device) + offset
        scores = torch.einsum("hgsd,htd->hgst", q, k) * scaling
        scores = scores.masked_fill(columns[None, :] > rows[:, None], float("-inf"))
        total += torch.softmax(scores, dim=-1).sum(dim=2)
    return total.reshape(n_heads, n_keys)


def heavy_hitters_and_recent(kv_scores: torch.Tensor, n_heavy: int, n_recent: int) -> torch.Tensor:
    """H2O's rule on ``kv_scores [Hkv, T]`` (position order): the last ``n_recent`` plus the top-``n_heavy``
    older tokens by score. Returns ascending indices ``[Hkv, n_heavy + n_recent]``."""
    n_kv_heads, n_tokens = kv_scores.shape
    n_older = n_tokens - n_recent
    heavy = kv_scores[:, :n_older].topk(n_heavy, dim=-1).indices
    recent = torch.arange(n_older, n_tokens, device=kv_scores.device).expand(n_kv_heads, -1)
    return torch.cat([heavy, recent], dim=-1).sort(dim=-1).values


class H2OKV(TokenEvictionKV):
    def __init__(self, layer_idx, model, seq, budget: int, n_heavy: int, score_chunk_size: int):
        super().__init__(layer_idx, model, seq, budget)
        self.n_heavy = n_heavy
        self.score_chunk_size = score_chunk_size
        self.scores: torch.Tensor | None = None  # [Hq, T] accumulated probabilities, aligned with the kept tokens

    def observe_prefill(self, query, scaling):
        chunk_scores = accumulated_attention(query[0], self.keys[0], scaling, self.score_chunk_size)
        if self.scores is not None:  # earlier chunks' keys: add this chunk's rows to their running sums
            chunk_scores[:, : self.scores.shape[1]] += self.scores
        self.scores = chunk_scores

    def observe_decode(self, probs):
        self.scores = torch.cat([self.scores, probs.new_zeros(probs.shape[0], 1)], dim=1) + probs

    def choose_kept(self, n_keep):
        n_kv_heads = self.kept_keys.shape[0]
        kv_scores = self.scores.view(n_kv_heads, -1, self.scores.shape[1]).sum(dim=1)
        n_heavy = min(self.n_heavy, n_keep)
        return heavy_hitters_and_recent(kv_scores, n_heavy, n_keep - n_heavy)

    def gather_kept(self, index):
        super().gather_kept(index)
        n_kv_heads, n_keep = index.shape
        group = self.scores.shape[0] // n_kv_heads
        per_head = index.repeat_interleave(group, dim=0)
        self.scores = self.scores.gather(1, per_head)

    def decode(self, query, key, value, scaling):
        if self.scores.shape[1] != self.kept_keys.shape[1]:
            raise AssertionError("H2O scores and kept tokens are out of step")
        return super().decode(query, key, value, scaling)


@METHODS.register("h2o")
class H2O(Method):
    config_class = H2OConfig

    def split(self) -> tuple[int, int]:
        """(heavy hitters, recent window) slots of the budget; the window includes the new token."""
        n_heavy = int(round(self.config.heavy_fraction * self.config.budget))
        return n_heavy, self.config.budget - n_heavy

    def check(self) -> None:
        super().check()
        config = self.config
        if not 0.0 <= config.heavy_fraction < 1.0:
            raise ConfigError(f"h2o: heavy_fraction={config.heavy_fraction} must lie in [0, 1)")
        if config.score_chunk_size < 1:
            raise ConfigError(f"h2o: score_chunk_size={config.score_chunk_size} must be >= 1")
        n_heavy, n_recent = self.split()
        if n_recent < 2:
            raise ConfigError(
                f"h2o: budget={config.budget} with heavy_fraction={config.heavy_fraction} leaves a recent window of "
                f"{n_recent} tokens; it needs at least 2 (the new token and one more)"
            )

    def make_sparse_layer(self, layer_idx, seq):
        n_heavy, _ = self.split()
        return H2OKV(layer_idx, self.model, seq, self.config.budget, n_heavy, self.config.score_chunk_size)
