"""A PyTorch reference of MagicPIG's host step, for tests only: the method runs the step in C++
(icecache/core/kernels/src/magicpig_host.cpp); this is the same work written as vectorised torch (the
implementation the method had before the step moved to C++), so that tests can hold the C++ step to it: the same
sampled tokens, outputs within float tolerance.

``ReferenceHostStep`` keeps its own copy of a layer's host state (the store, its norms, the codes after the
prompt), made from the layer right after its prompt is offloaded, and takes each step's inputs as the layer's
exchange received them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from baselines.magicpig import (
    MIN_COLLISIONS,
    WEIGHT_FLOOR,
    HashTables,
    collision_counts_reference,
    grown_along,
    sampling_probability,
)

_MASK64 = (1 << 64) - 1


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function on uint64 words (numpy's uint64 arithmetic wraps modulo 2^64)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def thinning_draws(seed: int, layer: int, position: int, n_tokens: int) -> torch.Tensor:
    """float64 ``[n_tokens]``: each token's uniform draw in [0, 1) at the step of ``position``:
    ``mix(mix(mix(mix(seed) + layer) + position) + token) >> 11`` over 2^53, mix splitmix64's output function."""
    with np.errstate(over="ignore"):
        stream = np.array([seed & _MASK64], dtype=np.uint64)
        for word in (layer, position):
            stream = _mix64(stream) + np.uint64(word & _MASK64)
        stream = _mix64(stream)
        bits = _mix64(stream + np.arange(n_tokens, dtype=np.uint64)) >> np.uint64(11)
    return torch.from_numpy(bits.astype(np.float64) * 2.0**-53)


def table_counts(tables: HashTables, query_codes: torch.Tensor, group: int, n_positions: int) -> torch.Tensor:
    """``[Hq, n_positions]`` int64: collisions of each position below ``n_positions`` with each query head, read
    from the tables' buckets (what ``collision_counts_reference`` gives on the tables' positions)."""
    n_heads, n_tables = query_codes.shape
    n_buckets, n_tokens = tables.offsets.shape[-1], tables.positions.shape[-1]
    rows = ((torch.arange(n_heads) // group)[:, None] * n_tables + torch.arange(n_tables)).flatten()  # [Hq*L]
    flat_offsets = tables.offsets.view(-1)
    bucket = rows * n_buckets + query_codes.long().flatten()
    starts = flat_offsets[bucket]
    lengths = flat_offsets[bucket + 1] - starts
    per_head = lengths.view(n_heads, n_tables).sum(1)
    total = int(per_head.sum())
    if total == 0 or n_positions == 0:
        return torch.zeros(n_heads, n_positions, dtype=torch.int64)
    first = starts + rows * n_tokens
    source = torch.repeat_interleave(first - (torch.cumsum(lengths, 0) - lengths), lengths) + torch.arange(total)
    positions = tables.positions.view(-1)[source].long()
    cells = torch.repeat_interleave(torch.arange(n_heads) * n_positions, per_head) + positions
    if n_positions < tables.end:
        cells = cells[positions < n_positions]
    return torch.bincount(cells, minlength=n_heads * n_positions).view(n_heads, n_positions)


def sampled_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor, log_weights: torch.Tensor, scaling: float, group: int):
    """``query [Hq, D]`` over ``positions [Hq, M]`` (``valid`` marks the used entries) of ``keys``/``values
    [Hkv, T, D]``, each score shifted by its ``log_weights``: float32 ``(out [Hq, D], lse [Hq])``, the weighted
    softmax's output and the log of its normaliser (``-inf`` with nothing attended)."""
    n_heads = query.shape[0]
    kv = (torch.arange(n_heads) // group)[:, None]
    picked_keys = keys[kv, positions].float()  # [Hq, M, D]
    scores = torch.einsum("hd,hmd->hm", query, picked_keys) * scaling + log_weights
    scores = scores.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.where(valid, torch.exp(scores - torch.where(finite, lse, 0.0)[:, None]), 0.0)
    out = torch.einsum("hm,hmd->hd", probs, values[kv, positions].float())
    return out, lse


@dataclass
class ReferenceStep:
    """What one step of the reference computed: the sample (``positions``, ``valid``, ``log_weights``, each
    ``[Hq, M]``) and the attention over it (``out [Hq, D]``, ``lse [Hq]``)."""

    positions: torch.Tensor
    valid: torch.Tensor
    log_weights: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor

    def sampled_sets(self) -> list[set[int]]:
        return [set(self.positions[h][self.valid[h]].tolist()) for h in range(self.positions.shape[0])]


class ReferenceHostStep:
    """The host step of one MagicPIG layer in torch, on its own copy of the layer's host state."""

    def __init__(self, layer):
        cfg = layer.cfg
        self.K, self.L, self.capped, self.seed = cfg.K, cfg.L, cfg.capped, cfg.seed
        self.layer_idx = layer.layer_idx
        self.n_sink, self.n_local, self.cap, self.group = layer.n_sink, layer.n_local, layer.cap, layer.group
        self.prompt_len = layer.prompt_len
        self.store_keys = layer.store_keys.clone()
        self.store_values = layer.store_values.clone()
        self.store_norms = layer.store_norms.clone()
        self.tail_codes = layer.tail_codes.clone()
        self.mean_key_host = layer.mean_key_host.clone()
        self.tables = layer.tables

    def _grow(self, needed: int) -> None:
        capacity = self.store_keys.shape[1]
        if needed <= capacity:
            return
        grown = max(needed, 2 * capacity)
        self.store_keys = grown_along(self.store_keys, grown, 1)
        self.store_values = grown_along(self.store_values, grown, 1)
        self.store_norms = grown_along(self.store_norms, grown, 1)
        self.tail_codes = grown_along(self.tail_codes, grown - self.prompt_len, 1)

    @torch.inference_mode()
    def step(self, inputs: dict[str, torch.Tensor], scaling: float) -> ReferenceStep:
        """One step on the host inputs of the layer's exchange (``query``, ``key``, ``value``, ``query_codes``,
        ``key_codes``, ``position``): store the token, sample the middle, attend to the sample."""
        position = int(inputs["position"][0])
        self._grow(position + 1)
        self.store_keys[:, position] = inputs["key"].to(self.store_keys.dtype)
        self.store_values[:, position] = inputs["value"].to(self.store_values.dtype)
        self.store_norms[:, position] = (inputs["key"] - self.mean_key_host).norm(dim=-1)
        self.tail_codes[:, position - self.prompt_len] = inputs["key_codes"]
        query = inputs["query"]
        positions, valid, log_weights = self.sample(query, inputs["query_codes"], position)
        out, lse = sampled_attention(query, self.store_keys, self.store_values, positions, valid, log_weights,
                                     scaling, self.group)
        return ReferenceStep(positions, valid, log_weights, out, lse)

    def sample(self, query: torch.Tensor, query_codes: torch.Tensor, position: int, capped: bool | None = None):
        """The middle tokens each query head attends at the step of ``position``: ``(positions [Hq, M], valid
        [Hq, M], log_weights [Hq, M])``. Exact (every middle token, log-weight 0) while the middle fits the cap;
        else the LSH sample with its importance log-weights, thinned to the cap when capped (``capped`` None:
        the layer's setting)."""
        capped = self.capped if capped is None else capped
        n_heads = query.shape[0]
        end = position + 1 - self.n_local  # the middle is [n_sink, end): after the sinks, before the window
        n_middle = end - self.n_sink
        if n_middle <= 0:
            empty = torch.zeros(n_heads, 0, dtype=torch.long)
            return empty, empty.bool(), empty.float()
        if n_middle <= self.cap:
            positions = torch.arange(self.n_sink, end).expand(n_heads, -1)
            return positions, torch.ones(n_heads, n_middle, dtype=torch.bool), torch.zeros(n_heads, n_middle)
        candidates = self.collision_counts(query_codes, end) >= MIN_COLLISIONS  # [Hq, end]
        candidates[:, : self.n_sink] = False
        n_candidates = candidates.sum(-1)
        kept_fraction = torch.ones(n_heads)
        if capped and int(n_candidates.max()) > self.cap:
            # The cap candidates of smallest draw per head (a stable sort: the position breaks a tie).
            draw = thinning_draws(self.seed, self.layer_idx, position, end)
            priority = torch.where(candidates, draw, float("inf"))
            positions = torch.sort(priority, dim=-1, stable=True).indices[:, : self.cap]
            valid = candidates.gather(1, positions)
            kept_fraction = (self.cap / n_candidates.clamp(min=1).double()).clamp(max=1.0).float()
        else:
            width = int(n_candidates.max())
            columns = torch.arange(end)
            positions = torch.where(candidates, columns, columns + end).topk(width, dim=-1, largest=False).indices
            valid = candidates.gather(1, positions)
        kv = (torch.arange(n_heads) // self.group)[:, None]
        dots = torch.einsum("hd,hmd->hm", query, self.store_keys[kv, positions].float())
        centred_dots = dots - (query * self.mean_key_host[kv[:, 0]]).sum(-1, keepdim=True)
        norms = query.norm(dim=-1, keepdim=True) * self.store_norms[kv, positions]
        cos_angle = centred_dots / norms.clamp(min=torch.finfo(torch.float32).tiny)
        chance = sampling_probability(cos_angle, self.K, self.L)
        log_weights = -torch.log(chance + WEIGHT_FLOOR) - torch.log(kept_fraction)[:, None]
        return positions, valid, torch.where(valid, log_weights, 0.0)

    def collision_counts(self, query_codes: torch.Tensor, end: int) -> torch.Tensor:
        """``[Hq, end]``: for each position below ``end`` in how many tables it shares the head's bucket (the
        prompt's through its tables, later tokens compared directly)."""
        in_prompt = min(end, self.prompt_len)
        if self.tables is None:
            counts = torch.zeros(query_codes.shape[0], in_prompt, dtype=torch.int64)
        else:
            counts = table_counts(self.tables, query_codes, self.group, in_prompt)
        if end > self.prompt_len:
            tail = collision_counts_reference(query_codes, self.tail_codes[:, : end - self.prompt_len], self.group)
            counts = torch.cat([counts, tail.to(counts.dtype)], dim=1)
        return counts
