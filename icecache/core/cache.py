"""transformers 5.x integration: one registered attention function and one ``Cache`` subclass, always paired.

``Cache.update`` in transformers 5 receives only the new keys and values, while every query-dependent method
needs the query; so ``HarnessCacheLayer.update`` returns a ``KVHandle`` and the registered attention function
hands the query to the layer's ``LayerKV``, which stores and attends in one place. No model class is patched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import dense_attention
from .cuda_driver import HostFunctions
from .host_memory import HostPool, PromptCopies
from .method import LayerKV, Method, SequenceContext
from .selection_quality import SelectionMeter
from .timing import PhaseTimer

ATTENTION_NAME = "icecache_harness"


@dataclass
class KVHandle:
    """What ``update`` returns in place of key tensors: the layer and its new keys and values."""

    layer: LayerKV
    key: torch.Tensor
    value: torch.Tensor

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """The layer stores the new tokens and attends: ``[B, S, Hq, D]``."""
        meter = self.layer.seq.selection_meter
        if meter is not None:
            return meter.forward(self.layer, query, self.key, self.value, attention_mask, scaling)
        return self.layer.forward(query, self.key, self.value, attention_mask, scaling)


class HarnessCacheLayer(CacheLayerMixin):
    """Adapter from the ``CacheLayerMixin`` contract to a method's ``LayerKV``. Sets no ``_layer_type`` on purpose:
    that would register this class in transformers' global layer mapping."""

    def __init__(self, kv: LayerKV):
        super().__init__()
        self.kv = kv

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return KVHandle(self.kv, key_states, value_states), None

    def get_seq_length(self) -> int:
        # Logical length: RoPE positions and generate()'s prompt slicing derive from it.
        return self.kv.seq_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise NotImplementedError("make a new HarnessCache per sequence instead of resetting one")


class HarnessCache(Cache):
    """One sequence's KV state under a method. Make a new one per sequence, and close it when the sequence ends
    (``close``, or ``with HarnessCache(...) as cache:``), which ends the workers a method's layers share.

    ``host_functions``: the hand-off channel of the stream the sequence decodes on; sequences decoded together in
    one step (``core.batch``) share one, so that one host worker serves the step's hand-offs in stream order."""

    def __init__(self, method: Method, timer: PhaseTimer | None = None, trace_selection: bool = False,
                 measure_selection: bool = False, host_pool: HostPool | None = None,
                 host_functions: HostFunctions | None = None):
        self.method = method
        self.seq = SequenceContext(
            timer=timer or PhaseTimer(method.model.device), trace_selection=trace_selection or measure_selection,
            prompt_copies=PromptCopies(host_pool if host_pool is not None else method.host_pool),
            host_functions=host_functions if host_functions is not None else HostFunctions(),
        )
        if measure_selection:  # the layers' traces are what it measures (core.selection_quality)
            self.seq.selection_meter = SelectionMeter(self.seq, method.model.n_layers, method.config.n_dense_layers)
        layers = [HarnessCacheLayer(method.make_layer(i, self.seq)) for i in range(method.model.n_layers)]
        super().__init__(layers=layers)

    @property
    def layer_kvs(self) -> list[LayerKV]:
        return [layer.kv for layer in self.layers]

    @property
    def sequences(self) -> list[SequenceContext]:
        """The sequences this cache decodes, one row of the batch each (here one)."""
        return [self.seq]

    def gpu_kv_bytes(self) -> int:
        return sum(kv.gpu_kv_bytes() for kv in self.layer_kvs)

    def cpu_kv_bytes(self) -> int:
        return sum(kv.cpu_kv_bytes() for kv in self.layer_kvs)

    def offloaded_kv_bytes(self) -> int:
        return sum(kv.offloaded_kv_bytes() for kv in self.layer_kvs)

    def close(self) -> None:
        self.seq.close()

    def __enter__(self) -> "HarnessCache":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def harness_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function: ``(attn_output [B, S, Hq, D], None)``."""
    scaling = module.scaling if scaling is None else scaling
    if isinstance(key, KVHandle):
        return key.attend(query, attention_mask, scaling), None
    # No HarnessCache (use_cache=False, or a plain DynamicCache): plain dense attention.
    return dense_attention(query, key, value, scaling, attention_mask), None


def register() -> str:
    """Register the attention and mask functions (idempotent); returns the ``attn_implementation`` name."""
    AttentionInterface.register(ATTENTION_NAME, harness_attention)
    # The classmethod writes the global mapping, which create_causal_mask consults; without it padding masks vanish.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


register()
