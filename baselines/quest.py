"""Quest (Tang et al., ICML 2024): query-aware page selection by a per-channel upper bound.

**The paper.** Pages of ``page_size`` (16) tokens are aligned from position 0. For each page and KV head Quest
keeps the element-wise maximum ``M`` and minimum ``m`` of the page's post-RoPE keys, updated as tokens are
appended. At a decode step query head ``h`` bounds every ``q . k`` in a page by
``U(p) = sum_d max(q_d M_d, q_d m_d)`` (no 1/sqrt(d)) and attends the pages with the largest bound. Nothing is
evicted: the whole cache stays on the device (Quest saves reads, not memory).

**Budget.** ``page_budget = budget // page_size`` pages per query head: the ``page_budget - 1`` finished pages with
the largest bound plus the current (last) page, always (the end-to-end kernel's rule). When the sequence has at
most ``page_budget`` pages attention is full. Needs ``budget >= 2 * page_size``.

**This code.** Two implementations of the same rule, tested equal (same selection, outputs within 1e-5):

* ``paged`` (default, captured on CUDA): keys and values in static buffers sized for the sequence
  (``core.static_kv``), seen as pages; the metadata in ``[Hkv, P, D]`` buffers over all ``P`` pages of the buffer.
  After the prompt its pages' boxes are computed and every later page starts at ``(-inf, +inf)``, so a decode token
  updates its page's box with two scatter reductions (``amax`` into ``M``, ``amin`` into ``m``). The bound is
  ``q+ . M + q- . m`` (``q+ = max(q, 0)``, ``q- = min(q, 0)``; equal to the per-channel max since ``M >= m``), one
  Triton pass over both metadata tiles (the ``page_bounds`` kernel), the current and later pages at ``-inf``; one
  top-k of fixed size over all pages (``core.kernels.stable_topk``: equal bounds go to the lower page on every device,
  a few Triton passes on CUDA), ``-inf`` picks (fewer finished pages than the budget) turned into padding.
  The selection is per query head: the buffers are seen through a stride-0 view with one "virtual page" set per
  query head (page ``kv * P + p``), so one page table per query head serves the paged kernel in one launch.
* ``simulation``: the Quest paper's accuracy path. The bound is computed from the token keys as
  ``sum_d |q_d| max_t(k_td sign(q_d))`` and every unselected token is masked out of a dense float32 softmax. It
  slices the cache at the host's length, so it stays eager.

**Deviation.** The paper's accuracy script selects ``max(3, budget // 16)`` chunks by top-k without forcing the
current chunk; both paths here use the end-to-end rule, so that the budget is exact and the two paths can be tested
against each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icecache.core.kernels.gqa_scores import page_bounds
from icecache.core.kernels.paged_decode_attention import paged_decode_attention
from icecache.core.kernels.stable_topk import stable_topk
from icecache.core.layer import attended_from_positions
from icecache.core.method import METHODS, Method, MethodConfig
from icecache.core.static_kv import StaticDenseKV
from icecache.errors import ConfigError


@dataclass
class QuestConfig(MethodConfig):
    name: str = "quest"
    page_size: int = 16
    implementation: str = "paged"  # paged | simulation

    def budget_page_size(self) -> int | None:
        return self.page_size

    def min_budget(self) -> int:
        return 2 * self.page_size  # the current page and one selected page

    def min_budget_reason(self) -> str:
        return f"2 x page_size={self.page_size} (the current page plus one selected page)"


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
    top = stable_topk(scores, page_budget - 1)
    current = torch.full((n_heads, 1), n_pages - 1, dtype=top.dtype, device=top.device)
    return torch.cat([top, current], dim=-1)


class QuestKV(StaticDenseKV):
    """Keys and values in ``[Hkv, capacity, D]`` buffers (pages of ``page_size`` tokens) plus per-page key max / min
    ``[Hkv, capacity / page_size, D]``, all on the model's device; nothing is evicted."""

    def __init__(self, layer_idx, model, seq, budget: int, page_size: int, implementation: str):
        super().__init__(layer_idx, model, seq, page_size)
        self.page_budget = budget // page_size
        self.implementation = implementation
        self.page_max: torch.Tensor | None = None
        self.page_min: torch.Tensor | None = None

    def prefill(self, query, key, value, attention_mask, scaling):
        out = super().prefill(query, key, value, attention_mask, scaling)
        if not self.seq.more_prefill_chunks:
            self._prompt_metadata(self.seq_len + key.shape[2])
        return out

    def _allocate(self, like, needed):
        old = self.page_max, self.page_min
        super()._allocate(like, needed)
        if old[0] is not None:  # grown outside the generation loop: keep the metadata of the pages so far
            self._metadata_buffers()
            self.page_max[:, : old[0].shape[1]] = old[0]
            self.page_min[:, : old[1].shape[1]] = old[1]

    def _metadata_buffers(self) -> None:
        n_kv_heads, capacity, head_dim = self._keys.shape
        n_pages, n_heads = capacity // self.page_size, self.model.n_heads
        self.page_max = self._keys.new_full((n_kv_heads, n_pages, head_dim), float("-inf"))
        self.page_min = self._keys.new_full((n_kv_heads, n_pages, head_dim), float("inf"))
        # Query head h reads KV head h // group: as "virtual pages" kv * P + p of a view with one head per query
        # head (stride 0), a table per query head serves the core's paged attention in one call.
        self._head_base = (torch.arange(n_heads, device=self._keys.device) // (n_heads // n_kv_heads)) * n_pages

    def _prompt_metadata(self, n_tokens: int) -> None:
        ps = self.page_size
        n_kv_heads, _, head_dim = self._keys.shape
        self._metadata_buffers()
        n_full = n_tokens // ps
        full = self._keys[:, : n_full * ps].view(n_kv_heads, n_full, ps, head_dim)
        self.page_max[:, :n_full] = full.amax(dim=2)
        self.page_min[:, :n_full] = full.amin(dim=2)
        if n_tokens > n_full * ps:  # the partial page: its valid tokens only
            self.page_max[:, n_full] = self._keys[:, n_full * ps : n_tokens].amax(dim=1)
            self.page_min[:, n_full] = self._keys[:, n_full * ps : n_tokens].amin(dim=1)

    def _per_head_pages(self, buffer: torch.Tensor) -> torch.Tensor:
        n_kv_heads, capacity, head_dim = buffer.shape
        flat = buffer.view(n_kv_heads * capacity // self.page_size, 1, self.page_size, head_dim)
        return flat.expand(-1, self.model.n_heads, -1, -1)

    def decode(self, query, key, value, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        position = self.append_token(key, value)
        page, slot = position // self.page_size, position % self.page_size
        # Pages past the prompt start at (-inf, +inf), so a token updates its page's box with one reduction each.
        index = page.view(1, 1, 1).expand(key.shape[1], 1, key.shape[-1])
        self.page_max.scatter_reduce_(1, index, key[0], reduce="amax")
        self.page_min.scatter_reduce_(1, index, key[0], reduce="amin")
        q = query[0, :, 0]
        if self.implementation == "simulation":
            out, attended = self._simulated_attention(q, self.seq_len + 1, scaling)
            self.seq.counters.record_attention(attended.sum(-1).float().mean())
            if self.seq.trace_selection:
                self.last_attended = torch.nn.functional.pad(attended, (0, self.trace_width() - attended.shape[1]))
            return out.view(1, 1, *q.shape).to(query.dtype)
        with self.seq.timer.phase("select"):
            bounds = page_bounds(q, self.page_max, self.page_min, page)  # pages before the current one
            top = stable_topk(bounds, min(self.page_budget - 1, bounds.shape[1]))
        # Fewer finished pages than the budget: the -inf picks are padding, and every finished page is chosen.
        chosen = bounds.gather(1, top) > float("-inf")
        table = torch.cat([torch.where(chosen, top + self._head_base[:, None], -1),
                           (page + self._head_base)[:, None]], dim=1)
        counts = torch.cat([chosen * self.page_size, (slot + 1).expand(q.shape[0], 1)], dim=1)
        out = paged_decode_attention(q, self._per_head_pages(self._keys), self._per_head_pages(self._values),
                                     table, counts, scaling, self._attention_plan)
        self.seq.counters.record_on_device(counts.sum() / q.shape[0])
        if self.seq.trace_selection:
            pages = torch.cat([top, page.expand(q.shape[0], 1)], dim=1)
            self.last_attended = self._attended(pages, counts, self.trace_width())
        return out.view(1, 1, *q.shape)

    def _attended(self, table: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
        """bool ``[Hq, width]``: the positions of the chosen pages' valid slots."""
        slots = torch.arange(self.page_size, device=table.device)
        positions = table[..., None] * self.page_size + slots
        return attended_from_positions(positions, slots < counts[..., None], width, group=1)

    def _simulated_attention(self, q, n_tokens, scaling):
        n_heads, head_dim = q.shape
        n_kv_heads = self.model.n_kv_heads
        group = n_heads // n_kv_heads
        n_pages = -(-n_tokens // self.page_size)
        keys = self._keys[:, :n_tokens].float()
        values = self._values[:, :n_tokens]
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
        if self._keys is None or self._keys.device.type != "cuda":
            return 0
        return self._keys.nbytes + self._values.nbytes + self.page_max.nbytes + self.page_min.nbytes


@METHODS.register("quest")
class Quest(Method):
    display_name = "Quest"
    display_order = 60
    config_class = QuestConfig
    traces_in_graph = True
    test_settings = {"page_size": 8}

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

    def forced_positions(self, n_tokens):
        page_size = self.config.page_size  # the current page, pages aligned from position 0
        return list(range((n_tokens - 1) // page_size * page_size, n_tokens))

    @property
    def captures_decode_step(self) -> bool:
        # The simulation path slices the cache at the host's length every step: eager only.
        return super().captures_decode_step and self.config.implementation == "paged"

    def make_sparse_layer(self, layer_idx, seq):
        c = self.config
        return QuestKV(layer_idx, self.model, seq, c.budget, c.page_size, c.implementation)
