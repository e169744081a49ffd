"""H2O, Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023), with real eviction.

**The paper.** Every head accumulates, for every cached key, the attention probability its queries gave that key:
over all rows of the prompt and then one row per decode step. The cache keeps the most recent tokens plus the
"heavy hitters", the older tokens with the largest accumulated probability, and evicts the rest for good. Scores of
kept tokens are never reset (``H2OKVCache_LayerWise``). The eviction follows the step's attention, so the step's
own probabilities count when choosing what to drop.

**Budget.** ``n_heavy = round(heavy_fraction * budget)`` heavy hitters (``heavy_fraction`` 0.5: the 50/50 split of
H2O's summarisation runs) + ``n_recent = budget - n_heavy`` recent tokens, the new one included.

**This code.** Scores are kept per query head (the paper's statistic); with GQA the cache is per KV head, so a KV head
keeps the tokens with the largest sum of its group's scores (H2O was written for multi-head attention). The prompt's
score matrix is never materialised: the ``causal_column_sums`` kernel gives each key's summed probability per prefill
chunk against all keys so far (on CUDA two Triton passes, each row's log-sum-exp and then column sums tile by tile, the
first skipped for a chunk after earlier tokens, whose rows' log-sum-exps the prefill's flash attention kernel returns
with its output, ``core.attention.dense_attention_and_lse``; on a CPU ``score_chunk_size`` (256) query rows at a time),
timed as the prefill phase ``prompt_scores``. After the prompt the rule keeps ``budget - 1`` tokens in ``budget`` slots
per KV head (``core.token_slots``). Each decode step writes its token into the free slot (score 0) and runs the
``h2o_step`` kernel: attend over the valid slots in float32, add each query head's probabilities to its scores, and name
the next free slot; once all are taken that is the slot of the older token (position at most
``position - (n_recent - 1)``) with the smallest summed score, marked evicted: one token in, one out, which is exactly
the token the top-``n_heavy`` rule drops. Ties go to the lowest slot in the Triton kernel and the PyTorch reference
alike. The step needs no host decision and replays from a CUDA graph.

**Deviation from the long-context practice** of the Quest and ArkVale papers, which collected H2O's scores from
the decode phase only for lack of prefill scores: the prompt's scores are collected, as H2O itself does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icecache.core.kernels.causal_column_sums import causal_column_sums
from icecache.core.kernels.h2o_step import h2o_step
from icecache.core.method import METHODS, Method, MethodConfig
from icecache.core.token_slots import TokenSlotsKV
from icecache.errors import ConfigError


@dataclass
class H2OConfig(MethodConfig):
    name: str = "h2o"
    heavy_fraction: float = 0.5  # share of the budget for heavy hitters; the rest is the recent window
    score_chunk_size: int = 256  # prompt query rows per block when accumulating prefill scores (memory only)

    def min_budget(self) -> int:
        """The smallest budget whose recent window keeps the new token and one more (``heavy_fraction < 1``)."""
        if not 0.0 <= self.heavy_fraction < 1.0:
            return 2  # the method's check refuses the fraction itself
        budget = 2
        while budget - int(round(self.heavy_fraction * budget)) < 2:
            budget += 1
        return budget

    def min_budget_reason(self) -> str:
        return (f"the least whose recent window, with heavy_fraction={self.heavy_fraction}, holds 2 tokens (the new "
                f"token and one more)")


def accumulated_attention(query: torch.Tensor, keys: torch.Tensor, scaling: float, chunk_size: int,
                          row_lse: torch.Tensor | None = None) -> torch.Tensor:
    """Column sums of the causal softmax attention: ``query [Hq, S, D]`` are the last S of ``keys [Hkv, T, D]``.
    Returns ``[Hq, T]`` float32 (``core.kernels.causal_column_sums``; ``chunk_size`` rows at a time on CPU;
    ``row_lse [Hq, S]``, the rows' log-sum-exps from the prefill's attention, spares the GPU one pass)."""
    return causal_column_sums(query, keys, scaling, chunk_size, row_lse)


def heavy_hitters_and_recent(kv_scores: torch.Tensor, n_heavy: int, n_recent: int) -> torch.Tensor:
    """H2O's rule on ``kv_scores [Hkv, T]`` (position order): the last ``n_recent`` plus the top-``n_heavy``
    older tokens by score. Returns ascending indices ``[Hkv, n_heavy + n_recent]``."""
    n_kv_heads, n_tokens = kv_scores.shape
    n_older = n_tokens - n_recent
    heavy = kv_scores[:, :n_older].topk(n_heavy, dim=-1).indices
    recent = torch.arange(n_older, n_tokens, device=kv_scores.device).expand(n_kv_heads, -1)
    return torch.cat([heavy, recent], dim=-1).sort(dim=-1).values


class H2OKV(TokenSlotsKV):
    keeps_prefill_lse = True  # a prompt chunk's row log-sum-exps, where its attention kernel gives them

    def __init__(self, layer_idx, model, seq, budget: int, n_heavy: int, score_chunk_size: int):
        super().__init__(layer_idx, model, seq, budget)
        self.n_heavy = n_heavy
        self.n_recent = budget - n_heavy  # the window, new token included
        self.score_chunk_size = score_chunk_size
        self.prompt_scores: torch.Tensor | None = None  # [Hq, T] accumulated over the prompt's rows
        self.scores: torch.Tensor | None = None  # [Hq, budget] accumulated probabilities, per slot
        self.free_slot: torch.Tensor | None = None  # [Hkv]: where the next token goes

    def observe_prefill(self, query, scaling):
        row_lse, self.prefill_lse = self.prefill_lse, None
        with self.seq.timer.phase("prompt_scores"):
            chunk_scores = accumulated_attention(query[0], self.keys[0], scaling, self.score_chunk_size,
                                                 None if row_lse is None else row_lse[0])
        if self.prompt_scores is not None:  # earlier chunks' keys: add this chunk's rows to their running sums
            chunk_scores[:, : self.prompt_scores.shape[1]] += self.prompt_scores
        self.prompt_scores = chunk_scores

    def place_prompt(self, n_prompt):
        # Room for the first step's token: keep budget - 1 prompt tokens at most, in slots 0, 1, ...
        n_kv_heads, device = self.model.n_kv_heads, self.prompt_scores.device
        n_keep = min(n_prompt, self.budget - 1)
        if n_keep < n_prompt:
            kv_scores = self.prompt_scores.view(n_kv_heads, -1, n_prompt).sum(dim=1)
            n_heavy = min(self.n_heavy, n_keep)
            kept = heavy_hitters_and_recent(kv_scores, n_heavy, n_keep - n_heavy)
        else:
            kept = torch.arange(n_prompt, device=device).expand(n_kv_heads, -1)
        return kept, torch.arange(n_keep, device=device).expand(n_kv_heads, -1)

    def on_prompt_placed(self, kept, slots):
        group = self.model.n_heads // self.model.n_kv_heads
        self.scores = self.prompt_scores.new_zeros(self.model.n_heads, self.budget)
        self.scores.scatter_(1, slots.repeat_interleave(group, dim=0),
                             self.prompt_scores.gather(1, kept.repeat_interleave(group, dim=0)))
        self.prompt_scores = None
        self.free_slot = torch.full((self.model.n_kv_heads,), kept.shape[1], dtype=torch.long, device=kept.device)

    def kept_scores(self) -> torch.Tensor:
        """``[Hq, n]``: the accumulated scores of the tokens held, in position order (tests and analysis)."""
        group = self.model.n_heads // self.model.n_kv_heads
        return self.scores.gather(1, self.kept_order().repeat_interleave(group, dim=0))

    def next_slot(self, position):
        return self.free_slot.clone()  # attend rewrites free_slot in place

    def on_write(self, slot):
        group = self.model.n_heads // self.model.n_kv_heads
        self.scores.scatter_(1, slot.repeat_interleave(group)[:, None], 0.0)  # a new token has no score yet

    def attend(self, query, position, scaling):
        # Attention, score accumulation and the choice of the next victim in one step (core.kernels.h2o_step).
        out = h2o_step(query, self.slot_keys, self.slot_values, self.slot_positions, self.scores, self.free_slot,
                       position, scaling, self.n_recent)
        # Slots fill one per step until all are taken, then one goes as one comes.
        self.seq.counters.record_on_device((position + 1).clamp(max=self.budget))
        return out


@METHODS.register("h2o")
class H2O(Method):
    display_name = "H2O"
    display_order = 50
    config_class = H2OConfig
    traces_in_graph = True

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

    def forced_positions(self, n_tokens):
        _, n_recent = self.split()
        return list(range(max(0, n_tokens - n_recent), n_tokens))

    def make_sparse_layer(self, layer_idx, seq):
        n_heavy, _ = self.split()
        return H2OKV(layer_idx, self.model, seq, self.config.budget, n_heavy, self.config.score_chunk_size)
