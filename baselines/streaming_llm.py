"""StreamingLLM (Xiao et al., ICLR 2024): attention sinks plus a sliding window of recent tokens.

The first ``n_sink_tokens`` tokens absorb the attention mass the softmax has to put somewhere; keeping them next to
a window of the most recent tokens keeps a model fluent with a constant-size cache. Every other token is evicted.
With ``budget`` token slots, a decode step attends to the sinks and the ``budget - n_sink_tokens`` most recent
tokens, the new one included: the sinks are pinned slots, the window a ring (``core.token_slots.RingSlotsKV``),
so a step writes its token over the oldest one in the window and the decode step replays from a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icecache.core.method import METHODS, Method, MethodConfig
from icecache.core.token_slots import RingSlotsKV
from icecache.errors import ConfigError


@dataclass
class StreamingLLMConfig(MethodConfig):
    name: str = "streaming_llm"
    n_sink_tokens: int = 4  # the paper's four initial tokens


class StreamingKV(RingSlotsKV):
    def __init__(self, layer_idx, model, seq, budget: int, n_sink_tokens: int):
        super().__init__(layer_idx, model, seq, budget)
        self.n_pinned = self.ring_start = n_sink_tokens
        self.ring_size = budget - n_sink_tokens

    def place_prompt(self, n_prompt):
        # Sinks, then as much of the prompt's end as the window holds (the first step's token replaces its oldest).
        sinks = torch.arange(min(self.n_pinned, n_prompt))
        recent = torch.arange(max(self.n_pinned, n_prompt - self.ring_size), n_prompt)
        kept = torch.cat([sinks, recent]).to(self.keys.device)
        kept = kept.expand(self.model.n_kv_heads, -1)
        return kept, self.ring_slots(kept)


@METHODS.register("streaming_llm")
class StreamingLLM(Method):
    display_name = "StreamingLLM"
    config_class = StreamingLLMConfig
    traces_in_graph = True

    def check(self) -> None:
        super().check()
        config = self.config
        if config.n_sink_tokens < 0:
            raise ConfigError(f"streaming_llm: n_sink_tokens={config.n_sink_tokens} must be >= 0")
        if config.budget < self.min_budget():
            raise ConfigError(
                f"streaming_llm: budget={config.budget} must be at least n_sink_tokens={config.n_sink_tokens} "
                f"+ 2 (a window of the new token and one recent token)"
            )

    def min_budget(self) -> int:
        return self.config.n_sink_tokens + 2  # the sinks, the new token and one recent token

    def forced_positions(self, n_tokens):
        n_recent = self.config.budget - self.config.n_sink_tokens
        return list(range(min(self.config.n_sink_tokens, n_tokens))) + list(range(max(0, n_tokens - n_recent),
                                                                                  n_tokens))

    def make_sparse_layer(self, layer_idx, seq):
        return StreamingKV(layer_idx, self.model, seq, self.config.budget, self.config.n_sink_tokens)
