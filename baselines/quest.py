"""Quest (Tang et al., ICML 2024): query-aware page selection by a per-channel upper bound.

Pages of ``page_size`` tokens are aligned from position 0. For each page and KV head Quest keeps the element-wise
maximum ``M`` and minimum ``m`` of the page's post-RoPE keys, updated as tokens are appended. At a decode step,
query head ``h`` bounds every ``q . k`` in a page by ``U(p) = sum_d max(q_d M_d, q_d m_d)`` (no 1/sqrt(d)), takes
the ``page_budget - 1`` pages with the largest bound among the finished pages, and always attends the current
(last) page: ``page_budget = budget // page_size`` pages in all (the end-to-end kernel's rule). When the sequence has
at most ``page_budget`` pages attention is full. Nothing is evicted: the whole cache stays on the device.

Two implementations of the same rule:
* ``paged`` (default, fast): keys live in pages, the bound comes from the incremental metadata, and the core's
  sparse paged decode attention reads only the selected pages.
* ``simulation``: the Quest paper's accuracy path. The bound is computed from the token keys as
  ``sum_d |q_d| max_t(k_td sign(q_d))`` and every unselected token is masked out of a dense softmax.
The paper's simulation script also differs in its rule (at least 3 chunks, current chunk not forced); both paths
here use the end-to-end rule so that they can be tested against each other and so that the budget is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icecache.core.attention import paged_decode_attention
from icecache.core.errors import ConfigError
from icecache.core.method import METHODS, DenseKV, Method, MethodConfig


@dataclass
class QuestConfig(MethodConfig):
    name: str = "quest"
    page_size: int = 16
    implementation: str = "paged"  # paged | simulation


def upper_bound_scores(query: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor) -> torch.Tensor:
    """``U(p) = sum_d max(q_d M_d, q_d m_d)`` for ``query [Hq, D]`` and metadata ``[P, Hkv, D]`` -> ``[Hq, P]``."""
    n_heads, head_dim = query.shape
    n_kv_heads = page_max.shape[1]
    q = query.float().view(n_kv_heads, n_heads // n_kv_heads, 1, head_dim)
    upper = page_max.float().permute(1, 0, 2)[:, None]  # [Hkv, 1, P, D]
    lower = page_min.float().permute(1, 0, 2)[:, None]
    return torch.maximum(q * upper, q * lower).sum(-1).reshape(n_heads, -1)


def select_pages(scores: torch.Tensor, n_pages: int, page_budget: int) -> torch.Tensor:
    """Quest's page choice: ``scores [Hq, n_pages - 1]`` of the finished pages -> ``[Hq, N]`` page ids, the current
    page ``n_pages - 1`` last; all pages when they fit the budget."""
    n_heads = scores.shape[0]
    if n_pages <= page_budget:
        return torch.arange(n_pages, device=scores.device).expand(n_heads, -1)
    top = scores.topk(page_budget - 1, dim=-1).indices
    current = torch.full((n_heads, 1), n_pages - 1, dtype=top.dtype, device=top.device)
    return torch.cat([top, current], dim=-1)


class QuestKV(DenseKV):
    """Keys and values in pages ``[P, Hkv, page_size, D]`` plus per-page key max / min ``[P, Hkv, D]``."""

    def __init__(self, layer_idx, model, seq, budget: int, page_size: int, implementation: str):
        super().__init__(layer_idx, model, seq)
        self.page_size = page_size
        self.page_budget = budget // page_size
        self.implementation = implementation
        self.key_pages: torch.Tensor | None = None
        self.value_pages: torch.Tensor | None = None
        self.page_max: torch.Tensor | None = None
        self.page_min: torch.Tensor | None = None

    def prefill(self, query, key, value, attention_mask, scaling):
        assert query.shape[0] == 1, "sparse KV methods run with batch size 1"
        out = super().prefill(query, key, value, attention_mask, scaling)
        if not self.seq.more_prefill_chunks:
            self._to_pages(self.keys[0], self.values[0])
            self._keys = self._values = None
            self.length = 0
        return out

    def _to_pages(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n_kv_heads, n_tokens, head_dim = keys.shape
        n_pages = -(-n_tokens // self.page_size)
        self._grow(n_pages)
        padded = n_pages * self.page_size
        # Pad the partial page with copies of the last token: they change neither max nor min, and the attention
        # never reads them (valid counts).
        def as_pages(tokens):
            padded_tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, padded - n_tokens, -1)], dim=1)
            return padded_tokens.view(n_kv_heads, n_pages, self.page_size, head_dim).permute(1, 0, 2, 3)

        pages = as_pages(keys)
        self.key_pages[:n_pages] = pages
        self.value_pages[:n_pages] = as_pages(values)
        self.page_max[:n_pages] = pages.amax(dim=2)
        self.page_min[:n_pages] = pages.amin(dim=2)

    def _grow(self, n_pages: int) -> None:
        capacity = 0 if self.key_pages is None else self.key_pages.shape[0]
        if n_pages <= capacity:
            return
        new_capacity = max(n_pages, 2 * capacity, 16)
        n_kv_heads, head_dim = self.model.n_kv_heads, self.model.head_dim
        like = self._keys if self.key_pages is None else self.key_pages
        grown = [like.new_zeros(new_capacity, n_kv_heads, self.page_size, head_dim) for _ in range(2)]
        meta = [like.new_zeros(new_capacity, n_kv_heads, head_dim) for _ in range(2)]
        if capacity:
            for new, old in zip(grown + meta, (self.key_pages, self.value_pages, self.page_max, self.page_min)):
                new[:capacity] = old
        self.key_pages, self.value_pages, self.page_max, self.page_min = *grown, *meta

    def _append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """One token at position ``seq_len``; the metadata of its page is updated in place."""
        page, slot = divmod(self.seq_len, self.page_size)
        self._grow(page + 1)
        self.key_pages[page, :, slot] = key
        self.value_pages[page, :, slot] = value
        if slot == 0:
            self.page_max[page], self.page_min[page] = key, key
        else:
            self.page_max[page] = torch.maximum(self.page_max[page], key)
            self.page_min[page] = torch.minimum(self.page_min[page], key)

    def decode(self, query, key, value, scaling):
        assert query.shape[0] == 1, "sparse KV methods run with batch size 1"
        self._append(key[0, :, 0], value[0, :, 0])
        n_tokens = self.seq_len + 1
        n_pages = -(-n_tokens // self.page_size)
        q = query[0, :, 0]
        if self.implementation == "simulation":
            out, attended = self._simulated_attention(q, n_tokens, n_pages, scaling)
        else:
            out, attended = self._paged_attention(q, n_tokens, n_pages, scaling)
        self.seq.counters.record_attention(attended.sum(-1).float().mean())
        if self.seq.trace_selection:
            self.last_attended = attended
        return out.view(1, 1, *q.shape).to(query.dtype)

    def _paged_attention(self, q, n_tokens, n_pages, scaling):
        n_heads, head_dim = q.shape
        n_kv_heads = self.model.n_kv_heads
        group = n_heads // n_kv_heads
        with self.seq.timer.phase("select"):
            scores = upper_bound_scores(q, self.page_max[: n_pages - 1], self.page_min[: n_pages - 1])
            pages = select_pages(scores, n_pages, self.page_budget)  # [Hq, N]
        last_valid = n_tokens - (n_pages - 1) * self.page_size
        counts = torch.where(pages == n_pages - 1, last_valid, self.page_size)
        # Selection is per query head while pages are per KV head: one sparse attention call per position in the
        # KV group, each a plain (group 1) paged attention with its own page table.
        per_group_q = q.view(n_kv_heads, group, head_dim)
        per_group_pages = pages.view(n_kv_heads, group, -1)
        per_group_counts = counts.view(n_kv_heads, group, -1)
        out = torch.stack(
            [
                paged_decode_attention(
                    per_group_q[:, g].contiguous(), self.key_pages, self.value_pages,
                    per_group_pages[:, g].contiguous(), per_group_counts[:, g].contiguous(), scaling,
                )
                for g in range(group)
            ],
            dim=1,
        ).reshape(n_heads, head_dim)
        token_page = torch.arange(n_tokens, device=q.device) // self.page_size
        attended = torch.zeros(n_heads, n_pages, dtype=torch.bool, device=q.device)
        attended.scatter_(1, pages, True)
        return out, attended[:, token_page]

    def _simulated_attention(self, q, n_tokens, n_pages, scaling):
        n_heads, head_dim = q.shape
        n_kv_heads = self.model.n_kv_heads
        group = n_heads // n_kv_heads
        keys = self.key_pages[:n_pages].permute(1, 0, 2, 3).reshape(n_kv_heads, -1, head_dim)[:, :n_tokens].float()
        values = self.value_pages[:n_pages].permute(1, 0, 2, 3).reshape(n_kv_heads, -1, head_dim)[:, :n_tokens]
        qg = q.float().view(n_kv_heads, group, head_dim)
        with self.seq.timer.phase("select"):
            # |q_d| * max over the page's tokens of k_d * sign(q_d), padded positions excluded (-inf).
            signed = keys[:, None] * qg.sign()[:, :, None]  # [Hkv, group, T, D]
            pad = n_pages * self.page_size - n_tokens
            signed = torch.cat([signed, signed.new_full((*signed.shape[:2], pad, head_dim), float("-inf"))], dim=2)
            page_max = signed.view(n_kv_heads, group, n_pages, self.page_size, head_dim).amax(dim=3)
            bounds = (qg.abs()[:, :, None] * page_max).sum(-1).reshape(n_heads, n_pages)
            pages = select_pages(bounds[:, :-1], n_pages, self.page_budget)
        chosen = torch.zeros(n_heads, n_pages, dtype=torch.bool, device=q.device)
        chosen.scatter_(1, pages, True)
        attended = chosen[:, torch.arange(n_tokens, device=q.device) // self.page_size]
        scores = torch.einsum("hgd,htd->hgt", qg, keys) * scaling
        scores = scores.masked_fill(~attended.view(n_kv_heads, group, n_tokens), float("-inf"))
        out = torch.einsum("hgt,htd->hgd", torch.softmax(scores, dim=-1), values.float())
        return out.reshape(n_heads, head_dim), attended

    def gpu_kv_bytes(self) -> int:
        if self.key_pages is None or self.key_pages.device.type != "cuda":
            return super().gpu_kv_bytes()
        n_pages = -(-self.seq_len // self.page_size)
        per_page = 2 * self.key_pages[0].numel() + 2 * self.page_max[0].numel()
        return n_pages * per_page * self.key_pages.element_size()


@METHODS.register("quest")
class Quest(Method):
    config_class = QuestConfig

    def check(self) -> None:
        super().check()
        config = self.config
        if config.implementation not in ("paged", "simulation"):
            raise ConfigError(f"quest: implementation={config.implementation!r} must be 'paged' or 'simulation'")
        if config.page_size < 1:
            raise ConfigError(f"quest: page_size={config.page_size} must be >= 1")
        page_size = config.page_size
        if self.model.device.type == "cuda" and (page_size & (page_size - 1) or page_size > 64):
            raise ConfigError(f"quest: page_size={page_size} must be a power of two <= 64 for the CUDA paged attention")
        if config.budget < 2 * config.page_size:
            raise ConfigError(
                f"quest: budget={config.budget} must be at least 2 x page_size={config.page_size} "
                f"(the current page plus one selected page)"
            )

    def make_sparse_layer(self, layer_idx, seq):
        c = self.config
        return QuestKV(layer_idx, self.model, seq, c.budget, c.page_size, c.implementation)
