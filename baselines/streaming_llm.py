"""StreamingLLM (Xiao et al., ICLR 2024): attention sinks plus a sliding window of recent tokens.

The first ``n_sink_tokens`` tokens absorb the attention mass the softmax has to put somewhere; keeping them next to
a window of the most recent tokens keeps a model fluent with a constant-size cache. Every other token is evicted.
With ``budget`` token slots, a decode step attends to the sinks and the ``budget - n_sink_tokens`` most recent
tokens, the new one included.

This file also holds ``TokenEvictionKV``, the token-level cache with real eviction that H2O and SnapKV share:
they differ from StreamingLLM only in which tokens they keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icecache.core.errors import ConfigError
from icecache.core.method import METHODS, DenseKV, Method, MethodConfig, ModelInfo, SequenceContext


class TokenEvictionKV(DenseKV):
    """Keys and values of the kept tokens, per KV head, with their positions; real eviction after every step.

    The prompt is stored densely while it arrives (prefill attention is dense and method-independent); after its
    last chunk the cache is cut to ``budget - 1`` tokens, and after every decode step again, so that a step, which
    first appends its own token, attends to at most ``budget`` tokens. Subclasses say which tokens to keep
    (``choose_kept``) and may observe the attention probabilities (``observe_prefill``, ``observe_decode``).
    """

    def __init__(self, layer_idx: int, model: ModelInfo, seq: SequenceContext, budget: int):
        super().__init__(layer_idx, model, seq)
        self.budget = budget
        self.kept_keys: torch.Tensor | None = None  # [Hkv, T, D]
        self.kept_values: torch.Tensor | None = None  # [Hkv, T, D]
        self.kept_positions: torch.Tensor | None = None  # [Hkv, T], ascending in every head

    # --- what a method decides ---------------------------------------------------------------------------------
    def choose_kept(self, n_keep: int) -> torch.Tensor:
        """Indices ``[Hkv, n_keep]`` (ascending) into the kept tokens that survive; called when more are stored."""
        raise NotImplementedError

    def observe_prefill(self, query: torch.Tensor, scaling: float) -> None:
        """Called after each prompt chunk is stored (``self.keys`` holds the prompt so far)."""

    def observe_decode(self, probs: torch.Tensor) -> None:
        """Called with the step's attention probabilities ``[Hq, T]`` over the kept tokens (new one last)."""

    def gather_kept(self, index: torch.Tensor) -> None:
        """Keep the tokens at ``index [Hkv, n]``; subclasses extend this to gather their per-token state."""
        expand = index[..., None].expand(-1, -1, self.kept_keys.shape[-1])
        self.kept_keys = self.kept_keys.gather(1, expand)
        self.kept_values = self.kept_values.gather(1, expand)
        self.kept_positions = self.kept_positions.gather(1, index)

    # --- the shared mechanics ----------------------------------------------------------------------------------
    def prefill(self, query, key, value, attention_mask, scaling):
        assert query.shape[0] == 1, "sparse KV methods run with batch size 1"
        out = super().prefill(query, key, value, attention_mask, scaling)
        self.observe_prefill(query, scaling)
        if not self.seq.more_prefill_chunks:
            self.kept_keys, self.kept_values = self.keys[0].clone(), self.values[0].clone()
            n_kv_heads, length = self.kept_keys.shape[:2]
            self.kept_positions = torch.arange(length, device=key.device).expand(n_kv_heads, -1).contiguous()
            self.on_prompt_stored()
            self._keys = self._values = None  # the dense copy of the prompt is not kept
            self.length = 0
            self.evict_to(self.budget - 1)
        return out

    def on_prompt_stored(self) -> None:
        """Hook after the prompt has been moved into the kept store, before the first eviction (SnapKV compresses)."""

    def evict_to(self, n_keep: int) -> None:
        if self.kept_keys.shape[1] > n_keep:
            self.gather_kept(self.choose_kept(n_keep))

    def decode(self, query, key, value, scaling):
        assert query.shape[0] == 1, "sparse KV methods run with batch size 1"
        position = torch.full((key.shape[1], 1), self.seq_len, dtype=torch.long, device=key.device)
        self.kept_keys = torch.cat([self.kept_keys, key[0]], dim=1)
        self.kept_values = torch.cat([self.kept_values, value[0]], dim=1)
        self.kept_positions = torch.cat([self.kept_positions, position], dim=1)

        n_heads, head_dim = query.shape[1], query.shape[-1]
        n_kv_heads, n_kept = self.kept_keys.shape[:2]
        group = n_heads // n_kv_heads
        q = query[0, :, 0].float().view(n_kv_heads, group, head_dim)
        scores = torch.einsum("hgd,htd->hgt", q, self.kept_keys.float()) * scaling
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hgt,htd->hgd", probs, self.kept_values.float()).reshape(1, 1, n_heads, head_dim)

        self.seq.counters.record_attention(n_kept)
        if self.seq.trace_selection:
            attended = torch.zeros(n_kv_heads, self.seq_len + 1, dtype=torch.bool, device=key.device)
            attended.scatter_(1, self.kept_positions, True)
            self.last_attended = attended.repeat_interleave(group, dim=0)
        self.observe_decode(probs.reshape(n_heads, n_kept))
        self.evict_to(self.budget - 1)
        return out.to(query.dtype)

    def gpu_kv_bytes(self) -> int:
        if self.kept_keys is None or self.kept_keys.device.type != "cuda":
            return super().gpu_kv_bytes()
        return 2 * self.kept_keys.numel() * self.kept_keys.element_size()


@dataclass
class StreamingLLMConfig(MethodConfig):
    name: str = "streaming_llm"
    n_sink_tokens: int = 4  # the paper's four initial tokens


class StreamingKV(TokenEvictionKV):
    def __init__(self, layer_idx, model, seq, budget: int, n_sink_tokens: int):
        super().__init__(layer_idx, model, seq, budget)
        self.n_sink_tokens = n_sink_tokens

    def choose_kept(self, n_keep: int) -> torch.Tensor:
        # Every head keeps the same tokens: sinks, then the most recent ones. Positions are ascending, so the first
        # n_sink_tokens stored entries are the sinks once the prompt is longer than them.
        n_kv_heads, n_kept = self.kept_positions.shape
        n_recent = n_keep - self.n_sink_tokens
        index = torch.cat(
            [torch.arange(self.n_sink_tokens), torch.arange(n_kept - n_recent, n_kept)]
        ).to(self.kept_positions.device)
        return index.expand(n_kv_heads, -1)


@METHODS.register("streaming_llm")
class StreamingLLM(Method):
    config_class = StreamingLLMConfig

    def check(self) -> None:
        super().check()
        config = self.config
        if config.n_sink_tokens < 0:
            raise ConfigError(f"streaming_llm: n_sink_tokens={config.n_sink_tokens} must be >= 0")
        if config.budget < config.n_sink_tokens + 2:
            raise ConfigError(
                f"streaming_llm: budget={config.budget} must be at least n_sink_tokens={config.n_sink_tokens} "
                f"+ 2 (a window of the new token and one recent token)"
            )

    def make_sparse_layer(self, layer_idx, seq):
        return StreamingKV(layer_idx, self.model, seq, self.config.budget, self.config.n_sink_tokens)
