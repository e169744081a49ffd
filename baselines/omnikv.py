"""OmniKV (Hao et al., ICLR 2025): a few filter layers choose, at every decode step, the tokens the layers after
them attend to.

**The paper.** Within one decode step the tokens that receive high attention are much the same across consecutive
layers. So only a few "filter" layers attend over the full context; each one scores every token with its step's
query (OmniKV's ``last`` selector: the scaled logits ``q . k / sqrt(D)``, the maximum over all query heads) and
takes the top tokens as one index set, which every layer up to the next filter layer attends to (all heads, no
per-head choice). No token is dropped: those layers' keys and values stay in CPU memory and the chosen tokens are
loaded for each step. The first ``num_wait_load_layers`` layers after a filter layer also attend fully, from the
GPU, while the loads for the layers after them arrive; the layers before the first filter layer attend fully.
OmniKV's Llama-3-8B setting: filter layers 2, 8 and 18 of 32, one wait layer after each, the top 6.7 % of the
prompt's tokens.

**Layers here**, for a model of ``L`` layers: the filter layers are ``filter_layers`` (default: 2, 8 and 18 scaled to
``L``, ``round(l * L / 32)``: the paper's for 32 layers; 2, 8 and 17 for SmolLM2's 30); each is followed by
``n_wait_layers`` (1) dense layers (up to the next filter layer); layers below ``n_dense_layers`` (2, the layers before
the first default filter layer) are dense too. Filter and dense layers keep their whole cache on the device and attend
fully, as the paper's do; like the harness's first ``n_dense_layers`` layers they are not sparsified, so the budget and
``mean_attended_tokens`` concern the other layers. On a 32-layer model those are 24 of the 32 layers (4-7, 10-17,
20-31); filter and dense layers record no attended count. Needs ``budget > n_recent``.

**The budget** (tokens a query head of a sparsified layer attends at a decode step): OmniKV attends its selected
prompt tokens plus every generated token. With the budget counting everything, a sparsified layer attends the
``n_recent`` most recent tokens (the new one included) and the ``budget - n_recent`` tokens chosen by its filter
layer among all older ones (the prompt's, and generated tokens once they are older than the window). OmniKV chooses
among the prompt's tokens only and keeps every generated token, which under a fixed budget would crowd the
selection out as generation goes on.

**This code.** A filter layer is the static full cache (``core.static_kv``); after attending, it scores its keys before
the window with the ``gqa_scores`` kernel, takes the maximum over query heads (``selector: last``; or the maximum of
each head's softmax, ``softmax_last``, OmniKV's ``softmax_before_last``) and writes the ``topk`` of fixed size into a
device tensor of the sequence (``SequenceContext.shared``), which its layers read at the same step. A sparsified layer
keeps its window and the step's selection in ``budget`` token slots on the device (a ``RingSlotsKV``: the window is the
ring, the selection the slots after it) and every token's key and value in a host store (a buffer of the core's host
pool, pinned on CUDA; the prompt's copy into it runs on a side stream beside the next layers' prefill) written at every
step; it gathers the selected tokens from the store with one ``index_select`` that reads the pinned memory in place
(``core.paged.mapped_device_view``) and attends over the slots. ``pages_loaded`` counts the (token, KV head) entries
read. No step reads a host value, so on CUDA it replays from a CUDA graph.

**Deviations.** Loads are issued by each sparsified layer in its own step rather than by the filter layer for its
whole span (so the wait layers hide no transfer here; they still attend fully, which is what they change in the
output). The selection's candidates include generated tokens older than the window (above). A sparsified layer
with no filter layer below it (only when ``n_dense_layers`` and ``filter_layers`` leave one, as the shared tests do
when they drive one layer alone) chooses with its own query by the same rule, scoring its host store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from icecache.core.kernels.gqa_scores import gqa_scores
from icecache.core.method import METHODS, Method, MethodConfig, prompt_offload_goals, storage_capacity
from icecache.core.paged import mapped_device_view
from icecache.core.static_kv import StaticDenseKV
from icecache.core.token_slots import RingSlotsKV
from icecache.errors import ConfigError

#: OmniKV's filter layers for Llama-3-8B (32 layers).
PAPER_FILTER_LAYERS = (2, 8, 18)
PAPER_N_LAYERS = 32
SELECTORS = ("last", "softmax_last")


@dataclass
class OmniKVConfig(MethodConfig):
    name: str = "omnikv"
    filter_layers: list[int] | None = None  # None: 2, 8, 18 scaled to the model's depth (round(l * L / 32))
    n_wait_layers: int = 1  # dense layers after each filter layer (OmniKV's num_wait_load_layers)
    n_recent: int = 32  # most recent tokens every sparsified layer attends (the new one included)
    selector: str = "last"  # last: max over heads of q.k / sqrt(D); softmax_last: max over heads of each softmax

    def min_budget(self) -> int:
        return self.n_recent + 1  # the window and one selected token

    def min_budget_reason(self) -> str:
        return f"n_recent={self.n_recent} + 1 selected token besides the window"


def default_filter_layers(n_layers: int) -> list[int]:
    """OmniKV's filter layers for 32 layers, at the same relative depths of ``n_layers``."""
    return sorted({min(n_layers - 1, round(layer * n_layers / PAPER_N_LAYERS)) for layer in PAPER_FILTER_LAYERS})


def filter_scores(query: torch.Tensor, keys: torch.Tensor, scaling: float, n_candidates: torch.Tensor,
                  selector: str) -> torch.Tensor:
    """OmniKV's token scores from a filter layer's step: ``query [Hq, D]`` against ``keys [Hkv, T, D]``, the tokens
    before ``n_candidates`` (a one-element tensor) -> float32 ``[T]``, the maximum over query heads of the scaled
    logits (``last``) or of each head's softmax over the candidates (``softmax_last``); ``-inf`` off the
    candidates."""
    logits = gqa_scores(query, keys, scaling, n_candidates)  # [Hq, T], -inf at and past n_candidates
    if selector == "softmax_last":
        candidate = logits[0] > float("-inf")
        probs = torch.softmax(logits, dim=-1).amax(dim=0)
        return torch.where(candidate, probs, float("-inf"))
    return logits.amax(dim=0)


def choose(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of ``scores [T]``, best first: ``(indices [k], chosen [k])``, ``chosen`` false for picks
    beyond the candidates, whose index is 0 (a position every layer's store holds)."""
    top = scores.topk(min(k, scores.shape[0]))
    chosen = top.values > float("-inf")
    return torch.where(chosen, top.indices, 0), chosen


@dataclass
class FilterSelection:
    """A filter layer's choice at this step, in tensors made once (a replayed step writes into them): the token
    positions ``[k]`` and whether each pick is a real token."""

    indices: torch.Tensor
    chosen: torch.Tensor


@dataclass
class OmniKVSequence:
    """What a sequence's OmniKV layers share: each filter layer's selection, by layer, which its sparse layers read."""

    selections: dict[int, FilterSelection] = field(default_factory=dict)


class OmniKVFilterKV(StaticDenseKV):
    """The full cache in static buffers; each decode step also writes the selection of its layers."""

    def __init__(self, layer_idx, model, seq, config: OmniKVConfig):
        super().__init__(layer_idx, model, seq, page_size=16)
        self.config = config
        self.n_selected = config.budget - config.n_recent

    def selection(self) -> FilterSelection:
        return self.seq.state(OmniKVSequence).selections[self.layer_idx]

    def prefill(self, query, key, value, attention_mask, scaling):
        out = super().prefill(query, key, value, attention_mask, scaling)
        if not self.seq.more_prefill_chunks:
            # Made once, before the first step: a replayed step writes into the same tensors.
            k = min(self.n_selected, self.capacity)
            self.seq.state(OmniKVSequence).selections[self.layer_idx] = FilterSelection(
                torch.zeros(k, dtype=torch.long, device=key.device),
                torch.zeros(k, dtype=torch.bool, device=key.device))
        return out

    def decode(self, query, key, value, scaling):
        out = super().decode(query, key, value, scaling)
        position = self.decode_position(key.device)
        with self.seq.timer.phase("select"):
            scores = filter_scores(query[0, :, 0], self._keys, scaling, position + 1 - self.config.n_recent,
                                   self.config.selector)
            indices, chosen = choose(scores, self.n_selected)
            shared = self.selection()
            if shared.indices.shape != indices.shape:  # the buffers grew (only outside the generation loop)
                shared.indices, shared.chosen = indices.clone(), chosen.clone()
            shared.indices.copy_(indices)
            shared.chosen.copy_(chosen)
        return out


class OmniKVSparseKV(RingSlotsKV):
    """Slots ``[0, n_recent)`` the window (a ring), ``[n_recent, budget)`` the step's selection; every token in the
    host store ``[capacity, Hkv, D]``."""

    def __init__(self, layer_idx, model, seq, config: OmniKVConfig, filter_layer: int | None):
        super().__init__(layer_idx, model, seq, config.budget)
        self.config = config
        self.filter_layer = filter_layer
        self.n_pinned = self.ring_start = 0
        self.ring_size = config.n_recent
        self.n_selected = config.budget - config.n_recent
        self.capacity = 0

    def place_prompt(self, n_prompt):
        kept = torch.arange(max(0, n_prompt - self.ring_size), n_prompt, device=self.keys.device)
        kept = kept.expand(self.model.n_kv_heads, -1)
        return kept, self.ring_slots(kept)

    def on_prompt_placed(self, kept, slots):
        super().on_prompt_placed(kept, slots)
        keys, values = self.keys[0], self.values[0]
        with self.seq.timer.phase("offload"):
            self._allocate(storage_capacity(self.seq, keys.shape[1] + 1, 0), keys)
        # On the side stream, beside the next layers' prefill (outside the timed phase, whose closing
        # synchronisation would wait for the copies).
        self.seq.prompt_copies.copy(self.host_keys[: keys.shape[1]], keys.transpose(0, 1))
        self.seq.prompt_copies.copy(self.host_values[: keys.shape[1]], values.transpose(0, 1))

    def _allocate(self, capacity: int, like: torch.Tensor) -> None:
        """The host store for ``capacity`` tokens, keeping what is there (it grows only outside the generation
        loop, which announces the length)."""
        n_kv_heads, head_dim = self.model.n_kv_heads, like.shape[-1]
        pin = like.is_cuda
        # Token-major: a selected token's keys of every head are one contiguous row for the gather.
        keys = self.seq.prompt_copies.take((capacity, n_kv_heads, head_dim), like.dtype, like.device)
        values = self.seq.prompt_copies.take((capacity, n_kv_heads, head_dim), like.dtype, like.device)
        if self.capacity:
            if pin:
                torch.cuda.synchronize(like.device)
            keys[: self.capacity], values[: self.capacity] = self.host_keys, self.host_values
        self.host_keys, self.host_values, self.capacity = keys, values, capacity
        if pin:
            self._store_keys = mapped_device_view(keys, like.device)
            self._store_values = mapped_device_view(values, like.device)
        else:
            self._store_keys, self._store_values = keys, values

    def _own_selection(self, q: torch.Tensor, position: torch.Tensor, scaling: float):
        scores = filter_scores(q, self._store_keys.transpose(0, 1), scaling, position + 1 - self.config.n_recent,
                               self.config.selector)
        return choose(scores, self.n_selected)

    def decode(self, query, key, value, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        self.seq.prompt_copies.join()
        if self.seq_len + 1 > self.capacity:  # only outside the generation loop
            self._allocate(2 * self.capacity, key[0])
        position = self.decode_position(key.device)
        self.write(self.next_slot(position), key[0], value[0], position)
        self._store_keys.index_copy_(0, position, key[0].transpose(0, 1))
        self._store_values.index_copy_(0, position, value[0].transpose(0, 1))
        q = query[0, :, 0]
        if self.filter_layer is None:
            with self.seq.timer.phase("select"):
                indices, chosen = self._own_selection(q, position, scaling)
        else:
            shared = self.seq.state(OmniKVSequence).selections[self.filter_layer]
            indices, chosen = shared.indices, shared.chosen
        k = indices.shape[0]
        with self.seq.timer.phase("load"):
            # Rows of the pinned store read in place: only the k selected tokens cross the bus.
            begin, end = self.ring_size, self.ring_size + k
            self.slot_keys[:, begin:end] = self._store_keys.index_select(0, indices).transpose(0, 1)
            self.slot_values[:, begin:end] = self._store_values.index_select(0, indices).transpose(0, 1)
            self.slot_positions[:, begin:end] = torch.where(chosen, indices, -1)
        n_loaded = chosen.sum() * self.model.n_kv_heads
        self.seq.counters.record_on_device(pages_loaded=n_loaded,
                                           bytes_to_gpu=n_loaded * 2 * self.model.head_dim * key.element_size())
        if self.seq.trace_selection:
            self.last_attended = self.attended_positions(self.trace_width())
        out = self.attend(q, position, scaling)
        return out.view(1, 1, *out.shape).to(query.dtype)

    def cpu_kv_bytes(self) -> int:
        return 0 if not self.capacity else self.host_keys.nbytes + self.host_values.nbytes


@METHODS.register("omnikv")
class OmniKV(Method):
    display_name = "OmniKV"
    display_order = 70
    paper_names = ("OKV",)
    config_class = OmniKVConfig
    traces_in_graph = True
    speed_goals = (*prompt_offload_goals("the prompt's KV copied to the host beside the next layers' prefill"),)
    # Tiny models have 4 layers: layer 0 dense, layer 1 the filter (inside the dense prefix, which the shared tests
    # hold to no budget: a filter layer attends fully), layers 2 and 3 sparsified by its selection.
    test_settings = {"filter_layers": [1], "n_wait_layers": 0, "n_recent": 16}

    @property
    def filter_layers(self) -> list[int]:
        layers = self.config.filter_layers
        return sorted(set(layers)) if layers is not None else default_filter_layers(self.model.n_layers)

    def layer_role(self, layer_idx: int) -> tuple[str, int | None]:
        """``("filter" | "dense" | "sparse", the filter layer whose selection a sparse layer attends)``."""
        filters = self.filter_layers
        if layer_idx in filters:
            return "filter", layer_idx
        below = [f for f in filters if f < layer_idx]
        source = below[-1] if below else None
        if layer_idx < self.config.n_dense_layers or (source is not None and
                                                      layer_idx <= source + self.config.n_wait_layers):
            return "dense", source
        return "sparse", source

    def check(self) -> None:
        super().check()
        c = self.config
        layers = self.filter_layers
        if not layers or not all(0 <= layer < self.model.n_layers for layer in layers):
            raise ConfigError(f"omnikv: filter_layers={c.filter_layers} must name at least one layer in "
                              f"[0, {self.model.n_layers})")
        if c.n_wait_layers < 0:
            raise ConfigError(f"omnikv: n_wait_layers={c.n_wait_layers} must be >= 0")
        if c.selector not in SELECTORS:
            raise ConfigError(f"omnikv: selector={c.selector!r} must be one of {', '.join(SELECTORS)}")
        if c.n_recent < 1:
            raise ConfigError(f"omnikv: n_recent={c.n_recent} must be >= 1 (the new token)")

    def forced_positions(self, n_tokens):
        return list(range(max(0, n_tokens - self.config.n_recent), n_tokens))

    def make_layer(self, layer_idx, seq):
        role, source = self.layer_role(layer_idx)
        if role == "filter":
            return OmniKVFilterKV(layer_idx, self.model, seq, self.config)
        if role == "dense":
            return self.make_dense_layer(layer_idx, seq)
        return OmniKVSparseKV(layer_idx, self.model, seq, self.config, source)

    def make_sparse_layer(self, layer_idx, seq):
        return self.make_layer(layer_idx, seq)
