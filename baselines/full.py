"""Full cache: every token of every layer kept on the model's device, dense attention. Ignores the budget (runs record
``budget-none``).

Two forms of the same computation:

* ``full``: ``DenseKV`` storage (sized once to the sequence's announced length, else grown by doubling), dense SDPA
  attention, the plain transformers decode path, one Python pass per step. It is the one method never captured in
  a CUDA graph (``supports_cuda_graph = False``): it shows what a step costs without static buffers or a graph.
* ``full_static``: the fast full cache that latency ratios are stated against. Each layer's keys and values live in
  one ``[Hkv, capacity, D]`` buffer sized for the whole sequence before the first token (``core.static_kv``); a
  decode step writes its token at a position read from a device tensor and attends with the split-K paged kernel
  over the buffer, seen as pages of 16 tokens with an identity page table and per-page valid counts computed on the
  device. Nothing in its step depends on a host value, so on CUDA the first decode step runs eagerly, the second is
  captured and every later one replays the graph; the per-token cost is then the GPU's, not Python's. On a CPU the
  same layer runs eagerly through the kernel's PyTorch reference, which is what CI tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from icecache.core.method import METHODS, DenseKV, Method, MethodConfig
from icecache.core.static_kv import StaticDenseKV


@METHODS.register("full")
class FullCache(Method):
    """The plain transformers decode path, kept eager on purpose: it is the reference that shows what a step costs
    without static buffers or a graph (``full_static`` is the same cache with both)."""

    display_name = "FULL"
    display_order = 10
    paper_names = ("FullKV",)

    uses_budget = False
    supports_cuda_graph = False

    def make_layer(self, layer_idx, seq):
        return DenseKV(layer_idx, self.model, seq)

    def make_sparse_layer(self, layer_idx, seq):
        return DenseKV(layer_idx, self.model, seq)


@dataclass
class FullStaticConfig(MethodConfig):
    name: str = "full_static"
    # Tokens per page of the attention kernel's view of the buffer; a power of two <= 64.
    page_size: int = 16


@METHODS.register("full_static")
class FullStaticCache(Method):
    display_name = "FULL (static, graph)"
    display_order = 11
    config_class = FullStaticConfig
    traces_in_graph = True
    uses_budget = False

    def check(self) -> None:
        super().check()
        size = self.config.page_size
        if size < 1 or size > 64 or size & (size - 1):
            from icecache.errors import ConfigError

            raise ConfigError(f"full_static page_size must be a power of two <= 64, not {size}")

    def make_layer(self, layer_idx, seq):
        return StaticDenseKV(layer_idx, self.model, seq, self.config.page_size)

    def make_sparse_layer(self, layer_idx, seq):
        return self.make_layer(layer_idx, seq)
