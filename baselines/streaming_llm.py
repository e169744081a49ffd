"""StreamingLLM (Xiao et al., ICLR 2024): attention sinks plus a sliding window of recent tokens.

**The paper.** The first tokens absorb the attention mass the softmax has to put somewhere; keeping them next to a
window of the most recent tokens keeps a model fluent with a constant-size cache. Every other token is evicted for
good.

**Budget.** ``n_sink_tokens`` (4, the paper's) sinks + the ``budget - n_sink_tokens`` most recent tokens, the new
one included; needs ``budget >= n_sink_tokens + 2``.

**This code.** The sinks are the pinned slots of a ``core.token_slots.RingSlotsKV`` and the window its ring: after
the prompt the slots hold the sinks and up to ``budget - n_sink_tokens`` of the prompt's last tokens, and each step
writes its token over the oldest one in the ring. The step reads no host value and replays from a CUDA graph.

**Deviation.** Keys keep the RoPE of their original positions (transformers applies RoPE before the cache); the
paper's streaming variant re-rotates keys to their positions in the cache, which matters only for running past the
model's context length, not within it.
"""

from __future__ import annotations

from dataclasses import dataclass

from icecache.core.method import METHODS, Method, MethodConfig
from icecache.core.token_slots import RingSlotsKV
from icecache.errors import ConfigError


@dataclass
class StreamingLLMConfig(MethodConfig):
    name: str = "streaming_llm"
    n_sink_tokens: int = 4  # the paper's four initial tokens

    def min_budget(self) -> int:
        return self.n_sink_tokens + 2  # the sinks, the new token and one recent token

    def min_budget_reason(self) -> str:
        return f"n_sink_tokens={self.n_sink_tokens} + 2 (a window of the new token and one recent token)"


class StreamingKV(RingSlotsKV):
    def __init__(self, layer_idx, model, seq, budget: int, n_sink_tokens: int):
        super().__init__(layer_idx, model, seq, budget)
        self.n_pinned = self.ring_start = n_sink_tokens
        self.ring_size = budget - n_sink_tokens

    def place_prompt(self, n_prompt):
        # Sinks, then as much of the prompt's end as the window holds.
        return self.pinned_then_recent(n_prompt)


@METHODS.register("streaming_llm")
class StreamingLLM(Method):
    display_name = "StreamingLLM"
    display_order = 40
    paper_names = ("SLM",)
    config_class = StreamingLLMConfig
    traces_in_graph = True

    def check(self) -> None:
        super().check()
        config = self.config
        if config.n_sink_tokens < 0:
            raise ConfigError(f"streaming_llm: n_sink_tokens={config.n_sink_tokens} must be >= 0")

    def forced_positions(self, n_tokens):
        n_recent = self.config.budget - self.config.n_sink_tokens
        return list(range(min(self.config.n_sink_tokens, n_tokens))) + list(range(max(0, n_tokens - n_recent),
                                                                                  n_tokens))

    def make_sparse_layer(self, layer_idx, seq):
        return StreamingKV(layer_idx, self.model, seq, self.config.budget, self.config.n_sink_tokens)
