"""Batched decode: B sequences, each with its own method state and its own selection, decoded in one forward.

The transformer's own work (projections, MLPs, norms, the LM head) runs once for the batch, reading the weights
once for B tokens: that is what serving many sequences buys. Attention stays each sequence's: the batch's
``BatchKVHandle`` hands row ``b`` of the step's query, key and value to sequence ``b``'s ``LayerKV``, the same
batch-1 code that a single sequence runs, so every method that decodes one sequence decodes a batch, each row with
its own positions (ragged batches work) and its own selection, and a row's attention computes at batch B what it
computes alone. What may differ is the rounding of the batched matrix products (a GEMM over B rows need not sum
in the order of a matrix-vector product); the tests hold tokens equal at batch B and batch 1.

The sequences of a batch share the one stream they decode on, and so its hand-off channel
(``HarnessCache(host_functions=...)``): one host worker serves every row's host step in stream order, instead of B
workers spinning on the cores the host steps' own threads need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .cache import HarnessCache, HarnessCacheLayer, KVHandle
from .layer import LayerKV, SequenceContext


@dataclass
class BatchKVHandle(KVHandle):
    """``update``'s answer for a batch: every row's layer (``layers[b]``) and the step's keys and values."""

    layers: tuple[LayerKV, ...] = ()

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        if query.shape[-2] != 1:
            raise ValueError("a batch decodes one token per row; prefill each sequence on its own HarnessCache")
        # A decode step attends to its own sequence only: no mask (padding never enters a row's cache).
        rows = [KVHandle(layer, self.key[b : b + 1], self.value[b : b + 1]).attend(query[b : b + 1], None, scaling)
                for b, layer in enumerate(self.layers)]
        return torch.cat(rows, dim=0)


class BatchCacheLayer(HarnessCacheLayer):
    """One layer of every row of the batch (``kv`` is the first row's)."""

    def __init__(self, kvs: list[LayerKV]):
        super().__init__(kvs[0])
        self.kvs = tuple(kvs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != len(self.kvs):
            raise ValueError(f"a step of {key_states.shape[0]} rows on a batch of {len(self.kvs)} sequences")
        return BatchKVHandle(self.kv, key_states, value_states, layers=self.kvs), None

    def get_seq_length(self) -> int:
        # Only the mask sizes read it (positions are explicit per row), and decode attends unmasked.
        return max(kv.seq_len for kv in self.kvs)

    def reset(self) -> None:
        raise NotImplementedError("make new HarnessCaches per batch instead of resetting one")


def forward_step(model, cache: HarnessCache | BatchCache, input_ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """One decode step of every row of ``cache`` (one sequence's, or a batch's): ``input_ids`` and ``positions``
    ``[B, 1]``, each row's position handed to its sequence (what its layers read on the device); the logits
    ``[B, V]``."""
    for row, seq in enumerate(cache.sequences):
        seq.position = positions[row]
    out = model(input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1]


class BatchCache(Cache):
    """The rows of a batch: one ``HarnessCache`` per sequence, each prefilled on its own, decoded together. Closing
    the batch closes every row."""

    def __init__(self, caches: list[HarnessCache]):
        if not caches:
            raise ValueError("a batch needs at least one sequence")
        n_layers = {len(cache.layers) for cache in caches}
        if len(n_layers) != 1:
            raise ValueError("the sequences of a batch must come from one model")
        if len({id(cache.method) for cache in caches}) != 1:
            raise ValueError("the sequences of a batch run one method: make their HarnessCaches from one Method")
        channels = {id(cache.seq.host_functions) for cache in caches}
        if len(channels) != 1:
            raise ValueError("the sequences of a batch share one hand-off channel: make their HarnessCaches with "
                             "host_functions=<one HostFunctions>")
        self.caches = list(caches)
        self.method = caches[0].method
        layers = [BatchCacheLayer([cache.layers[i].kv for cache in caches]) for i in range(n_layers.pop())]
        super().__init__(layers=layers)

    @property
    def sequences(self) -> list[SequenceContext]:
        return [cache.seq for cache in self.caches]

    @property
    def layer_kvs(self) -> list[LayerKV]:
        """Every row's layers, row by row."""
        return [kv for cache in self.caches for kv in cache.layer_kvs]

    def rows_layer_kvs(self) -> list[list[LayerKV]]:
        return [cache.layer_kvs for cache in self.caches]

    def close(self) -> None:
        for cache in self.caches:
            cache.close()

    def __enter__(self) -> "BatchCache":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
