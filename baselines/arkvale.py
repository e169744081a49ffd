"""ArkVale (Chen et al., NeurIPS 2024): page eviction with CPU backup and recall by page digests.

The GPU holds ``B = budget // page_size`` page slots per layer: ``n_sink_pages`` sink slots, ``n_window_pages``
window slots (the last pages, the one being filled included, in a ring) and ``B - sinks - window`` middle slots, a
score-driven cache of older pages. Every finished page is backed up to the CPU (pinned memory on CUDA) and
summarised by a digest: per KV head and channel, the centre ``c = (max + min) / 2`` of its post-RoPE keys and the
mean absolute deviation ``r = mean_t |c - k_t|``, stored as ``hi = c + r`` and ``lo = c - r`` (the paper's
"cuboid-mean").

At each decode step the pages outside sink and window are scored with ``s_h(p) = sum_d max(q_d hi_d, q_d lo_d)``,
averaged over the query heads of each of ``n_groups`` head groups (default one group: one ranking per layer).
The top-k pages of each group must be on the GPU: missing ones are recalled from the CPU through the shared bulk
transfer path into the middle slots holding the lowest-scored cached pages. Attention then runs over all
resident pages (sinks + middle cache + window), not only the top-k. A page leaving the window moves to a free
middle slot while there is one and otherwise becomes CPU-only (recallable later).

After the prompt (dense attention), all full pages are backed up and digested; if the prompt has more than ``B``
pages the middle slots keep the top pages by the last prompt token's query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baselines.quest import upper_bound_scores
from icecache.core.attention import paged_decode_attention
from icecache.core.errors import ConfigError
from icecache.core.method import METHODS, DenseKV, Method, MethodConfig
from icecache.core.paged import BulkLoader, CpuPageStore, GpuPagePool

# ArkVale's rule for its top-k, k = min(C, c / 2) / p pages, with C = 1280 tokens and c the cache size in tokens.
TOPK_TOKEN_CAP = 1280


@dataclass
class ArkValeConfig(MethodConfig):
    name: str = "arkvale"
    page_size: int = 16
    n_sink_pages: int = 1
    n_window_pages: int = 2  # the last pages, the one being filled included
    n_groups: int = 1  # query-head groups that share a page ranking (must divide the KV heads)
    page_topks: int | None = None  # ArkVale's knob, sink and window counted; None: min(1280, budget / 2) / page_size


def page_digests(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cuboid-mean digests of full pages ``[n, Hkv, page_size, D]`` -> ``(hi, lo)``, each ``[n, Hkv, D]``."""
    upper, lower = pages.amax(dim=2), pages.amin(dim=2)
    centre = (upper + lower) / 2
    radius = (pages - centre[:, :, None]).abs().mean(dim=2)
    return centre + radius, centre - radius


def group_page_scores(query: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``query [Hq, D]``, digests ``[P, Hkv, D]`` -> ``[n_groups, P]``: the per-head bound averaged over each group's
    query heads (consecutive heads form a group, so a group's KV heads are whole)."""
    per_head = upper_bound_scores(query, hi, lo)  # [Hq, P]
    return per_head.view(n_groups, -1, per_head.shape[-1]).mean(dim=1)


def topk_count(config: ArkValeConfig) -> int:
    """Pages of the middle that must be resident at every step (ArkVale's ``page_topks - ns - (nw - 1)``)."""
    n_slots = config.budget // config.page_size
    n_middle = n_slots - config.n_sink_pages - config.n_window_pages
    page_topks = config.page_topks
    if page_topks is None:
        page_topks = min(TOPK_TOKEN_CAP, config.budget // 2) // config.page_size
    return max(1, min(n_middle, page_topks - config.n_sink_pages - (config.n_window_pages - 1)))


class ArkValeKV(DenseKV):
    def __init__(self, layer_idx, model, seq, config: ArkValeConfig):
        super().__init__(layer_idx, model, seq)
        self.page_size = config.page_size
        self.n_slots = config.budget // config.page_size
        self.n_sink = config.n_sink_pages
        self.n_window = config.n_window_pages
        self.n_groups = config.n_groups
        self.n_topk = topk_count(config)
        self.middle = range(self.n_sink, self.n_slots - self.n_window)  # middle slot indices
        # Bookkeeping on the host: logical page held by each slot, per head group (the heads of a group always
        # hold the same pages), -1 for an empty slot.
        self.slot_page = torch.full((self.n_slots, self.n_groups), -1, dtype=torch.long)
        self.kv_heads_per_group = model.n_kv_heads // config.n_groups
        self.pool: GpuPagePool | None = None
        self.store: CpuPageStore | None = None
        self.loader: BulkLoader | None = None
        self.digest_hi: torch.Tensor | None = None  # [capacity, Hkv, D]
        self.digest_lo: torch.Tensor | None = None
        self.n_digests = 0  # pages 0 .. n_digests-1 are finished, backed up and digested

    # --- slots ---------------------------------------------------------------------------------------------------
    def home_slot(self, page: int) -> int:
        """Where a sink or window page lives: its sink slot, or its place in the window ring."""
        if page < self.n_sink:
            return page
        return self.n_slots - self.n_window + page % self.n_window

    def group_heads(self, group: int) -> torch.Tensor:
        start = group * self.kv_heads_per_group
        return torch.arange(start, start + self.kv_heads_per_group)

    # --- prefill -------------------------------------------------------------------------------------------------
    def prefill(self, query, key, value, attention_mask, scaling):
        assert query.shape[0] == 1, "sparse KV methods run with batch size 1"
        out = super().prefill(query, key, value, attention_mask, scaling)
        if not self.seq.more_prefill_chunks:
            self._offload_prompt(query[0, :, -1], self.keys[0], self.values[0])
            self._keys = self._values = None
            self.length = 0
        return out

    def _offload_prompt(self, last_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        n_kv_heads, n_tokens, head_dim = keys.shape
        ps = self.page_size
        n_pages, n_full = -(-n_tokens // ps), n_tokens // ps
        self.pool = GpuPagePool(self.n_slots, n_kv_heads, ps, head_dim, keys.dtype, keys.device)
        self.store = CpuPageStore(n_kv_heads, ps, head_dim, keys.dtype, pin_memory=keys.is_cuda,
                                  initial_pages=max(64, n_pages))
        self.loader = BulkLoader(ps, head_dim, keys.dtype, keys.device, max_pages=len(self.middle) * n_kv_heads)
        pad = n_pages * ps - n_tokens

        def as_pages(tokens):  # [Hkv, T, D] -> [n_pages, Hkv, ps, D], the partial page zero-padded
            padded = torch.cat([tokens, tokens.new_zeros(n_kv_heads, pad, head_dim)], dim=1)
            return padded.view(n_kv_heads, n_pages, ps, head_dim).permute(1, 0, 2, 3)

        key_pages, value_pages = as_pages(keys), as_pages(values)
        self._back_up(key_pages[:n_full], value_pages[:n_full])

        # Sinks and window go to their home slots; the middle keeps every candidate page if they fit, else the top
        # ones by the last prompt query.
        resident = [(page, self.home_slot(page)) for page in range(min(self.n_sink, n_pages))]
        resident += [(page, self.home_slot(page)) for page in range(max(self.n_sink, n_pages - self.n_window), n_pages)]
        n_candidates = n_pages - self.n_window - self.n_sink
        for page, slot in resident:
            self.slot_page[slot] = page
            self.pool.key_pages[slot] = key_pages[page]
            self.pool.value_pages[slot] = value_pages[page]
        if n_candidates <= 0:
            return
        candidates = torch.arange(self.n_sink, self.n_sink + n_candidates)
        if n_candidates <= len(self.middle):
            chosen = candidates.expand(self.n_groups, -1)
        else:
            hi, lo = self.digest_hi[candidates], self.digest_lo[candidates]
            scores = group_page_scores(last_query, hi, lo, self.n_groups)
            chosen = scores.topk(len(self.middle), dim=-1).indices.cpu() + self.n_sink
        slots = torch.arange(self.middle.start, self.middle.start + chosen.shape[1])
        for group in range(self.n_groups):
            heads = self.group_heads(group)
            self.slot_page[slots, group] = chosen[group]
            index = (slots[:, None].to(keys.device), heads[None, :].to(keys.device))
            page_index = (chosen[group][:, None].to(keys.device), heads[None, :].to(keys.device))
            self.pool.key_pages[index] = key_pages[page_index]
            self.pool.value_pages[index] = value_pages[page_index]

    def _back_up(self, key_pages: torch.Tensor, value_pages: torch.Tensor) -> None:
        """Finished pages ``[n, Hkv, ps, D]`` (the next ``n`` page ids) -> CPU store and digests."""
        n, n_kv_heads, ps, head_dim = key_pages.shape
        if n == 0:
            return
        page_ids = torch.arange(self.n_digests, self.n_digests + n).repeat_interleave(n_kv_heads)
        heads = torch.arange(n_kv_heads).repeat(n)
        self.store.write_pages(page_ids, heads, key_pages.reshape(-1, ps, head_dim),
                               value_pages.reshape(-1, ps, head_dim))
        hi, lo = page_digests(key_pages)
        needed = self.n_digests + n
        if self.digest_hi is None or needed > self.digest_hi.shape[0]:
            capacity = max(needed, 2 * (0 if self.digest_hi is None else self.digest_hi.shape[0]), 64)
            grown = [hi.new_zeros(capacity, n_kv_heads, head_dim) for _ in range(2)]
            if self.digest_hi is not None:
                grown[0][: self.n_digests] = self.digest_hi[: self.n_digests]
                grown[1][: self.n_digests] = self.digest_lo[: self.n_digests]
            self.digest_hi, self.digest_lo = grown
        self.digest_hi[self.n_digests : needed] = hi
        self.digest_lo[self.n_digests : needed] = lo
        self.n_digests = needed

    # --- decode --------------------------------------------------------------------------------------------------
    def decode(self, query, key, value, scaling):
        assert query.shape[0] == 1, "sparse KV methods run with batch size 1"
        page, offset = divmod(self.seq_len, self.page_size)
        if offset == 0:
            self._start_page(page)
        slot = self.home_slot(page)
        self.pool.key_pages[slot, :, offset] = key[0, :, 0]
        self.pool.value_pages[slot, :, offset] = value[0, :, 0]

        q = query[0, :, 0]
        self._select_and_recall(q, n_pages=page + 1)

        # Attention over every resident page; the current page has offset + 1 valid tokens.
        counts = torch.full((self.n_slots,), self.page_size, dtype=torch.long)
        counts[slot] = offset + 1
        table = torch.where(self.slot_page >= 0, torch.arange(self.n_slots)[:, None], -1)  # [B, G]
        kv_group = torch.arange(self.model.n_kv_heads) // self.kv_heads_per_group
        page_table = table.t()[kv_group].to(q.device)  # [Hkv, B]
        valid = counts.expand(self.model.n_kv_heads, -1).to(q.device)
        out = paged_decode_attention(q, self.pool.key_pages, self.pool.value_pages, page_table, valid, scaling)

        attended_per_group = torch.where(self.slot_page >= 0, counts[:, None], 0).sum(0).float()  # [G]
        self.seq.counters.record_attention(attended_per_group.mean())
        if self.seq.trace_selection:
            self.last_attended = self._attended_positions(counts).to(q.device)
        return out.view(1, 1, *q.shape)

    def _start_page(self, page: int) -> None:
        """A new page begins: back up the page just finished, and rotate the window ring."""
        finished = page - 1
        if finished >= self.n_digests:  # not yet backed up (prompt pages were, at prefill)
            slot = self.home_slot(finished)
            self._back_up(self.pool.key_pages[slot][None], self.pool.value_pages[slot][None])
        slot = self.home_slot(page)
        leaving = page - self.n_window
        if page >= self.n_sink and leaving >= self.n_sink:
            # The ring slot of the new page holds the page leaving the window. Keep it on the GPU in a free middle
            # slot if there is one (heads of all groups have the same free slots); else it is on the CPU only.
            free = [s for s in self.middle if self.slot_page[s, 0] < 0]
            if free:
                self.pool.key_pages[free[0]] = self.pool.key_pages[slot]
                self.pool.value_pages[free[0]] = self.pool.value_pages[slot]
                self.slot_page[free[0]] = leaving
        self.slot_page[slot] = page

    def _select_and_recall(self, q: torch.Tensor, n_pages: int) -> None:
        first, end = self.n_sink, n_pages - self.n_window  # candidate pages: outside sinks and window
        n_candidates = end - first
        if n_candidates <= 0:
            return
        with self.seq.timer.phase("select"):
            if n_candidates <= len(self.middle):
                # Everything fits: all candidates resident (no ranking needed), lowest slots first.
                targets = torch.arange(first, end).expand(self.n_groups, -1)
                scores = torch.zeros(self.n_groups, n_candidates)
            else:
                scores = group_page_scores(q, self.digest_hi[first:end], self.digest_lo[first:end], self.n_groups)
                targets = scores.topk(self.n_topk, dim=-1).indices.cpu() + first
                scores = scores.float().cpu()
            page_ids, heads, slots = [], [], []
            middle = torch.arange(self.middle.start, self.middle.stop)
            for group in range(self.n_groups):
                held = self.slot_page[middle, group]
                missing = targets[group][~torch.isin(targets[group], held)]
                if missing.numel() == 0:
                    continue
                # Victims: empty slots first, then the cached pages with the lowest scores, never a target.
                held_score = torch.where(held >= 0, scores[group][(held - first).clamp(min=0)], float("-inf"))
                held_score = held_score.masked_fill(torch.isin(held, targets[group]), float("inf"))
                victims = middle[held_score.argsort()[: missing.numel()]]
                self.slot_page[victims, group] = missing
                group_heads = self.group_heads(group)
                page_ids.append(missing.repeat_interleave(len(group_heads)))
                slots.append(victims.repeat_interleave(len(group_heads)))
                heads.append(group_heads.repeat(missing.numel()))
        if page_ids:
            with self.seq.timer.phase("load"):
                page_ids, heads, slots = torch.cat(page_ids), torch.cat(heads), torch.cat(slots)
                self.seq.counters.bytes_to_gpu += self.loader.load(self.store, page_ids, heads, self.pool, slots)
                self.seq.counters.pages_loaded += page_ids.numel()  # (page, KV head) blocks

    def _attended_positions(self, counts: torch.Tensor) -> torch.Tensor:
        """bool ``[Hq, seq_len + 1]`` of the positions in resident pages (valid slots only)."""
        n_tokens = self.seq_len + 1
        per_group = torch.zeros(self.n_groups, n_tokens, dtype=torch.bool)
        offsets = torch.arange(self.page_size)
        for group in range(self.n_groups):
            resident = self.slot_page[:, group] >= 0
            pages, valid = self.slot_page[resident, group], counts[resident]
            positions = pages[:, None] * self.page_size + offsets[None, :]
            per_group[group, positions[offsets[None, :] < valid[:, None]]] = True
        heads_per_group = self.model.n_heads // self.n_groups
        return per_group.repeat_interleave(heads_per_group, dim=0)

    def gpu_kv_bytes(self) -> int:
        if self.pool is None or self.pool.device.type != "cuda":
            return super().gpu_kv_bytes()
        return self.pool.nbytes() + 2 * self.digest_hi[: self.n_digests].nbytes

    def cpu_kv_bytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes()


@METHODS.register("arkvale")
class ArkVale(Method):
    config_class = ArkValeConfig

    def check(self) -> None:
        super().check()
        c = self.config
        if c.page_size < 1 or c.n_sink_pages < 0 or c.n_window_pages < 1:
            raise ConfigError(
                f"arkvale: page_size={c.page_size}, n_sink_pages={c.n_sink_pages}, n_window_pages={c.n_window_pages} "
                f"need page_size >= 1, n_sink_pages >= 0, n_window_pages >= 1"
            )
        if c.n_groups < 1 or self.model.n_kv_heads % c.n_groups:
            raise ConfigError(
                f"arkvale: n_groups={c.n_groups} must divide the model's {self.model.n_kv_heads} KV heads"
            )
        if self.model.device.type == "cuda" and (c.page_size & (c.page_size - 1) or c.page_size > 64):
            raise ConfigError(
                f"{c.name}: page_size={c.page_size} must be a power of two <= 64 for the CUDA paged attention kernel"
            )
        needed = (c.n_sink_pages + c.n_window_pages + 1) * c.page_size
        if c.budget < needed:
            raise ConfigError(
                f"arkvale: budget={c.budget} is below (n_sink_pages={c.n_sink_pages} + n_window_pages="
                f"{c.n_window_pages} + 1 page) x page_size={c.page_size} = {needed}"
            )
        if c.page_topks is not None and c.page_topks < 1:
            raise ConfigError(f"arkvale: page_topks={c.page_topks} must be >= 1 (or null for the paper's rule)")

    def make_sparse_layer(self, layer_idx, seq):
        return ArkValeKV(layer_idx, self.model, seq, self.config)
