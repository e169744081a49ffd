"""ArkVale (Chen et al., NeurIPS 2024): page eviction with CPU backup and recall by page digests.

**The paper.** Pages are positional (16 consecutive tokens). Every finished page is backed up to the CPU and
summarised by a digest: per KV head and channel, the centre ``c = (max + min) / 2`` of its post-RoPE keys and the
mean absolute deviation ``r = mean_t |k_t - c|``, kept as ``hi = c + r`` and ``lo = c - r`` (the paper's
"cuboid-mean"). At each decode step the pages outside sinks and window are scored with
``sum_d max(q_d hi_d, q_d lo_d)``, averaged over the query heads of each of ``n_groups`` head groups (default one:
one ranking per layer); each group's top-k pages must be on the GPU, and the missing ones are recalled from the CPU
into the middle slots holding the lowest-scored cached pages. Attention runs over all resident pages (sinks, middle
cache, window), not only the top-k.

**Budget.** ``B = budget // page_size`` page slots per layer: ``n_sink_pages`` (1) sink slots, ``n_window_pages``
(2) window slots in a ring (the page being filled included) and ``B - 3`` middle slots caching older pages.
``k = page_topks - n_sink_pages - (n_window_pages - 1)`` with ``page_topks = min(1280, budget / 2) / page_size``
(the paper's rule) unless set, clamped to ``[1, B - sinks - window]``. Needs
``budget >= (n_sink_pages + n_window_pages + 1) * page_size`` and ``n_groups`` dividing the KV heads.

**This code.** All state is sized for the announced sequence when the prompt ends: the pool ``[B + 1, Hkv, 16, D]``
(one scratch slot, never attended), the slot table ``slot_page [B + 1, n_groups]`` (the page each slot holds per
group, -1 empty) and the digests ``[Hkv, P + 1, D]`` on the device, and the host page store
``[P + 1, Hkv, 16, D]`` (``P`` pages plus a scratch page; a buffer of the core's host pool, ``core.host_memory``:
pinned on CUDA and kept from one sequence to the next). After the prompt (prefill phase ``offload``) all full pages
are digested, sinks and the last pages go to their slots, and the middle slots take the other pages if they fit,
else the top pages by the last prompt token's query; the full pages' backups are queued on the sequence's
prompt-copy stream, beside the next layers' prefill. A decode step, every
decision on the device:

1. page start: the page just finished is backed up and digested, and the ring turns: the page leaving the window moves
   to the first free middle slot if there is one (else it stays on the host only, recallable); these writes happen at
   every step, to the scratch page and slot when the step starts no page; then the token is written;
2. scoring with the ``page_bounds`` kernel, pages outside the candidates at ``-inf``;
3. a ``topk`` of fixed size ``k``; while every candidate fits in the middle slots nothing is ranked for loading; the
   missing pages take, in order, the slots of a stable sort of the cached pages by score (empty slots first, a chosen
   page never), and the slot table is updated in place (entries with nothing to do target the scratch slot);
4. recall: ``copy_blocks`` (``core.kernels.block_copy``) copies the missing (page, KV head) blocks in one kernel that
   reads the pinned host store in place through its device mapping (``core.paged.mapped_device_view``, zero-copy),
   skipping resident pages' blocks without a read;
5. attention with the paged kernel over every resident page, the current page counting its filled slots.

The step has no host decision and is captured on CUDA. Steps 1 and 3 are the two operations of
``core.kernels.arkvale_step`` (``page_start``: backup, digest, ring turn and token write; ``recall_plan``: the slot
table's ring turn, the victims, the copy list, the attention's page table and valid counts, the counters), one
Triton kernel each on CUDA and their PyTorch references elsewhere, bitwise the same decisions. A layer's step on
CUDA launches 8 kernels (page_start, page_bounds, the group mean, the sink mask, topk, recall_plan, copy_blocks, the
attention; topk may take two), counted by reading the code; before, the same step was 166 PyTorch operations on the
CPU profile (torch.profiler, top-level non-view aten operations of one decode step at budget 256, 8 KV heads),
of which some 45 are the CPU references of the three kernels and about 20 casts that launch nothing on CUDA: about
100 launches on CUDA. A batch's rows of one length share each launch (``decode_rows``, ``kernels.row_table``): 8
launches a layer for the whole batch, the group means, the sink mask and the top-k one PyTorch call each over every
row's scores.

**Deviations.** A decode step's backup of its finished page is written by the step itself into the mapped host store
(ArkVale uses a side stream; the prompt's backups here do too); the bookkeeping is two Triton kernels of this harness on
the device, replayed from the graph, rather than ArkVale's own CUDA kernels; no prefetch of later layers' selections;
the prefill keeps ``n_sink_pages`` sink pages (ArkVale's prefill uses ``max(2, n_sink)``); recall is one block-copy
kernel per layer rather than per-page copies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from icecache.core.kernels import arkvale_step
from icecache.core.kernels.arkvale_step import (
    UNALIGNED_ROW_COLUMNS,
    ArkValeSlots,
    home_slot,
    page_digests,
    page_start,
    page_start_triton,
    recall_plan,
    recall_plan_triton,
)
from icecache.core.kernels.block_copy import copy_blocks, copy_blocks_triton
from icecache.core.kernels.gqa_scores import gqa_scores_triton, page_bounds
from icecache.core.kernels.paged_decode_attention import (
    PagedAttentionPlan,
    paged_decode_attention,
    paged_decode_attention_triton,
)
from icecache.core.kernels.row_table import ROW_ALIGNMENT, KeptRowTables, RowTable, row_table, step_layout
from icecache.core.layer import attended_from_positions
from icecache.core.method import (
    METHODS,
    DenseKV,
    Method,
    MethodConfig,
    SpeedGoal,
    in_run_identity_unless_default,
    prompt_offload_goals,
    storage_capacity,
)
from icecache.core.paged import mapped_device_view
from icecache.errors import ConfigError

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
    # A batch's rows share each kernel launch (decode_rows); False: each row its own.
    batch_kernels: bool = in_run_identity_unless_default(True)

    def budget_page_size(self) -> int | None:
        return self.page_size

    def min_budget(self) -> int:
        return (self.n_sink_pages + self.n_window_pages + 1) * self.page_size  # sinks, window and one middle page

    def min_budget_reason(self) -> str:
        return (f"(n_sink_pages={self.n_sink_pages} + n_window_pages={self.n_window_pages} + 1 page) x "
                f"page_size={self.page_size}")


def group_page_scores(query: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor, n_groups: int,
                      n_pages: torch.Tensor | None = None) -> torch.Tensor:
    """``query [Hq, D]``, digests ``[Hkv, P, D]`` -> float32 ``[n_groups, P]``: the per-head bound averaged over each
    group's query heads (consecutive heads form a group, so a group's KV heads are whole); pages at or past
    ``n_pages`` (a one-element tensor; default all valid) score ``-inf``."""
    if n_pages is None:
        n_pages = torch.full((1,), hi.shape[1], dtype=torch.long, device=hi.device)
    per_head = page_bounds(query, hi, lo, n_pages)  # [Hq, P]
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
    """``B`` page slots on the device (plus a scratch slot), every finished page backed up to the CPU store (plus a
    scratch page) and digested on the device; the slot table ``slot_page [B + 1, G]`` lives on the device."""

    def __init__(self, layer_idx, model, seq, config: ArkValeConfig):
        super().__init__(layer_idx, model, seq)
        self.page_size = config.page_size
        self.n_slots = config.budget // config.page_size
        self.n_sink = config.n_sink_pages
        self.n_window = config.n_window_pages
        self.n_groups = config.n_groups
        self.n_topk = topk_count(config)
        self.middle = range(self.n_sink, self.n_slots - self.n_window)  # middle slot indices
        self.scratch_slot = self.n_slots
        self._attention_plan = PagedAttentionPlan()
        self.kv_heads_per_group = model.n_kv_heads // config.n_groups
        self.layout = ArkValeSlots(self.page_size, self.n_sink, self.n_window, self.n_slots, self.n_groups,
                                   self.kv_heads_per_group)
        self.pool_keys: torch.Tensor | None = None  # [B + 1, Hkv, ps, D] on the device
        self.pool_values: torch.Tensor | None = None
        self.slot_page: torch.Tensor | None = None  # [B + 1, G] int64, -1 = empty
        self.store_keys: torch.Tensor | None = None  # [P + 1, Hkv, ps, D] in CPU memory (pinned on CUDA)
        self.store_values: torch.Tensor | None = None
        self.digest_hi: torch.Tensor | None = None  # [Hkv, P + 1, D] on the device
        self.digest_lo: torch.Tensor | None = None
        # The step's device buffers (core.kernels.arkvale_step): one past the last candidate page, the copy list
        # (pages, slots, KV heads), the attention's page table and valid counts.
        self._end: torch.Tensor | None = None
        self._copy_pages: torch.Tensor | None = None
        self._copy_slots: torch.Tensor | None = None
        self._copy_heads: torch.Tensor | None = None
        self._table: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self.batch_kernels = config.batch_kernels
        # A new object at each allocation of the store (decode_rows: a batch's row tables were made for the buffers
        # it names), and the batch's tables and buffers, kept on its row-0 layer.
        self._buffers_token: object | None = None
        self._batch_tables: KeptRowTables | None = None

    # --- slots ---------------------------------------------------------------------------------------------------
    def home_slot(self, page: torch.Tensor) -> torch.Tensor:
        """Where a sink or window page lives: its sink slot, or its place in the window ring (tensor in, tensor out)."""
        return home_slot(self.layout, page)

    @property
    def scratch_page(self) -> int:
        return self.store_keys.shape[0] - 1

    # --- storage -------------------------------------------------------------------------------------------------
    def _allocate_store(self, n_pages: int, like: torch.Tensor) -> None:
        """CPU store and digests for ``n_pages`` pages plus the scratch page, keeping what is there."""
        n_kv_heads, head_dim, ps = self.model.n_kv_heads, like.shape[-1], self.page_size
        self._buffers_token = object()
        # From the host pool (kept across sequences), not cleared: a page is read only once it has been written.
        shape = (n_pages + 1, n_kv_heads, ps, head_dim)
        keys = self.seq.prompt_copies.take(shape, like.dtype, like.device)
        values = self.seq.prompt_copies.take(shape, like.dtype, like.device)
        hi = like.new_zeros(n_kv_heads, n_pages + 1, head_dim)
        lo = like.new_zeros(n_kv_heads, n_pages + 1, head_dim)
        if self.store_keys is not None:  # grown outside the generation loop (which announces the length)
            if like.is_cuda:
                torch.cuda.synchronize(like.device)
            kept = self.scratch_page
            keys[:kept], values[:kept] = self.store_keys[:kept], self.store_values[:kept]
            hi[:, :kept], lo[:, :kept] = self.digest_hi[:, :kept], self.digest_lo[:, :kept]
        self.store_keys, self.store_values, self.digest_hi, self.digest_lo = keys, values, hi, lo
        # The copy list has an entry per (group, top page, KV head of the group); the top-k is at most the pages.
        n_top = min(self.n_topk, n_pages + 1)
        shape = (self.n_groups, n_top, self.kv_heads_per_group)
        heads = torch.arange(n_kv_heads, device=like.device).view(self.n_groups, 1, -1)
        self._copy_heads = heads.expand(shape).flatten()
        self._copy_pages = torch.zeros(self._copy_heads.numel(), dtype=torch.long, device=like.device)
        self._copy_slots = torch.full_like(self._copy_pages, -1)
        # Kernels read and write the store in place; on CPU the store is the view.
        if like.is_cuda:
            self._store_keys_on_device = mapped_device_view(keys, like.device)
            self._store_values_on_device = mapped_device_view(values, like.device)
        else:
            self._store_keys_on_device, self._store_values_on_device = keys, values

    # --- prefill -------------------------------------------------------------------------------------------------
    def prefill(self, query, key, value, attention_mask, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        out = super().prefill(query, key, value, attention_mask, scaling)
        if not self.seq.more_prefill_chunks:
            with self.seq.timer.phase("offload"):
                key_pages, value_pages, n_full = self._place_prompt(query[0, :, -1], self.keys[0], self.values[0])
            # The backups, on the side stream beside the next layers' prefill (after the timed phase, which times the
            # model stream's part of the offload).
            if n_full:
                self.seq.prompt_copies.copy(self.store_keys[:n_full], key_pages[:n_full])
                self.seq.prompt_copies.copy(self.store_values[:n_full], value_pages[:n_full])
            self._keys = self._values = None
            self.length = 0
        return out

    def _place_prompt(self, last_query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """Sized state, digests and the resident pages of the prompt: ``(key_pages, value_pages, n_full)``, the
        prompt as pages and how many are full (what the host store backs up)."""
        n_kv_heads, n_tokens, head_dim = keys.shape
        ps, device = self.page_size, keys.device
        n_pages, n_full = -(-n_tokens // ps), n_tokens // ps
        self.pool_keys = keys.new_zeros(self.n_slots + 1, n_kv_heads, ps, head_dim)
        self.pool_values = keys.new_zeros(self.n_slots + 1, n_kv_heads, ps, head_dim)
        self.slot_page = torch.full((self.n_slots + 1, self.n_groups), -1, dtype=torch.long, device=device)
        self._allocate_store(-(-storage_capacity(self.seq, n_tokens + 1, 0) // ps), keys)
        self._group_heads = torch.arange(n_kv_heads, device=device).view(self.n_groups, self.kv_heads_per_group)
        self._end = torch.zeros(1, dtype=torch.long, device=device)
        self._table = torch.full((n_kv_heads, self.n_slots), -1, dtype=torch.long, device=device)
        self._counts = torch.zeros(self.n_slots, dtype=torch.long, device=device)

        pad = n_pages * ps - n_tokens
        def as_pages(tokens):  # [Hkv, T, D] -> [n_pages, Hkv, ps, D], the partial page zero-padded
            padded = torch.cat([tokens, tokens.new_zeros(n_kv_heads, pad, head_dim)], dim=1)
            return padded.view(n_kv_heads, n_pages, ps, head_dim).permute(1, 0, 2, 3)

        key_pages, value_pages = as_pages(keys), as_pages(values)
        if n_full:  # digest the finished pages
            hi, lo = page_digests(key_pages[:n_full])
            self.digest_hi[:, :n_full] = hi.transpose(0, 1)
            self.digest_lo[:, :n_full] = lo.transpose(0, 1)

        # Sinks and window go to their home slots; the middle keeps every candidate page if they fit, else the top
        # ones by the last prompt query.
        resident = list(range(min(self.n_sink, n_pages))) + list(range(max(self.n_sink, n_pages - self.n_window),
                                                                         n_pages))
        for page in resident:
            slot = int(self.home_slot(torch.tensor(page)))
            self.slot_page[slot] = page
            self.pool_keys[slot] = key_pages[page]
            self.pool_values[slot] = value_pages[page]
        n_candidates = n_pages - self.n_window - self.n_sink
        if n_candidates <= 0:
            return key_pages, value_pages, n_full
        if n_candidates <= len(self.middle):
            chosen = torch.arange(self.n_sink, self.n_sink + n_candidates, device=device).expand(self.n_groups, -1)
        else:
            end = torch.full((1,), n_pages - self.n_window, dtype=torch.long, device=device)
            scores = self._candidate_scores(last_query, end)
            chosen = scores.topk(len(self.middle), dim=-1).indices
        slots = torch.arange(self.middle.start, self.middle.start + chosen.shape[1], device=device)
        for group in range(self.n_groups):
            heads = self._group_heads[group]
            self.slot_page[slots, group] = chosen[group]
            index = (slots[:, None], heads[None, :])
            page_index = (chosen[group][:, None], heads[None, :])
            self.pool_keys[index] = key_pages[page_index]
            self.pool_values[index] = value_pages[page_index]
        return key_pages, value_pages, n_full

    def _candidate_scores(self, query: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
        """``[G, P + 1]`` group scores of the candidate pages ``[n_sink, end)``, ``-inf`` elsewhere."""
        scores = group_page_scores(query, self.digest_hi, self.digest_lo, self.n_groups, end)
        scores[:, : self.n_sink] = float("-inf")
        return scores

    # --- decode --------------------------------------------------------------------------------------------------
    def decode(self, query, key, value, scaling):
        if query.shape[0] != 1:
            raise ValueError("sparse KV methods run with batch size 1")
        self.seq.prompt_copies.join()
        if self.seq_len // self.page_size + 1 > self.scratch_page:  # only outside the generation loop
            self._allocate_store(2 * self.scratch_page, key)
        position = self.decode_position(key.device)
        # Page start (backup, digest, ring turn) and the token's write; sets self._end for the scoring.
        page_start(self.layout, position, key[0, :, 0], value[0, :, 0], self.pool_keys, self.pool_values,
                   self.slot_page, self._store_keys_on_device, self._store_values_on_device, self.digest_hi,
                   self.digest_lo, self._end)
        q = query[0, :, 0]
        # Each group's top-k pages must be resident. While every candidate fits in the middle slots they all are
        # resident already (pages leaving the window take free slots), so nothing is ranked for loading.
        totals = self.seq.counters.device_totals(self.pool_keys.device)
        with self.seq.timer.phase("select"):
            scores = self._candidate_scores(q, self._end)
            top = scores.topk(min(self.n_topk, scores.shape[1]), dim=-1)
            recall_plan(self.layout, position, self.slot_page, scores, top.values, top.indices, self._copy_pages,
                        self._copy_slots, self._table, self._counts, totals, 2 * self.pool_keys[0, 0].nbytes)
        with self.seq.timer.phase("load"):
            copy_blocks(**self._copy_arguments())

        # Attention over every resident page; the current page has offset + 1 valid tokens.
        out = paged_decode_attention(q, self.pool_keys, self.pool_values, self._table,
                                     self._counts.expand(self.model.n_kv_heads, -1), scaling, self._attention_plan)
        if self.seq.trace_selection:
            self.last_attended = self._attended_positions(self._counts)
        return out.view(1, 1, *q.shape)

    def _copy_arguments(self) -> dict[str, torch.Tensor]:
        """``copy_blocks``' arguments by name (``COPY_ROW_COLUMNS``): the missing pages from the host store."""
        return {"source_keys": self._store_keys_on_device, "source_values": self._store_values_on_device,
                "target_keys": self.pool_keys, "target_values": self.pool_values, "pages": self._copy_pages,
                "slots": self._copy_slots, "heads": self._copy_heads}

    # --- a batch's step ---------------------------------------------------------------------------------------------
    @classmethod
    def decode_rows(cls, layers, query, key, value, scaling):
        """Every row's step at once: each kernel of ``decode`` launched once for the batch (``kernels.row_table``),
        the group means, sink mask and top-k one PyTorch call each over the batch's scores; on CUDA with Triton,
        when every row is past its prompt and laid out as row 0 (rows of one length). Otherwise (ragged rows, a
        traced selection, ``batch_kernels=false``) the rows decode one by one. Each row computes what its own
        ``decode`` computes: the same kernels on the same buffers, and the same reductions row by row."""
        first, device = layers[0], key.device
        if not (first.batch_kernels and arkvale_step.runs_triton(key)) or any(layer.seq.trace_selection
                                                                              for layer in layers):
            return None
        for layer in layers:
            layer.seq.prompt_copies.join()
        if any(layer.pool_keys is None or layer.seq_len // layer.page_size + 1 > layer.scratch_page
               for layer in layers):
            return None
        if len({(layer.scratch_page, tuple(layer.digest_hi.shape), layer._copy_pages.numel()) for layer in layers}) > 1:
            return None
        n_rows, n_heads, _, head_dim = query.shape
        q, k, v = query[:, :, 0], key[:, :, 0], value[:, :, 0]
        positions = [layer.decode_position(device) for layer in layers]
        step = cls._batch_step(layers, q, k, v, positions)
        position, layout = positions[0], first.layout
        page_start_triton(layout, position, k[0], v[0], first.pool_keys, first.pool_values, first.slot_page,
                          first._store_keys_on_device, first._store_values_on_device, first.digest_hi,
                          first.digest_lo, first._end, rows=step.page_start)
        gqa_scores_triton(q[0], first.digest_hi, 1.0, first._end, second_keys=first.digest_lo, out=step.bounds[0],
                          rows=step.bounds_rows)
        # group_page_scores and the sink mask of _candidate_scores, for every row in one call each.
        torch.mean(step.bounds.view(n_rows, first.n_groups, -1, step.bounds.shape[-1]), dim=2, out=step.scores)
        step.scores[:, :, : first.n_sink] = float("-inf")
        torch.topk(step.scores, step.top_values.shape[-1], dim=-1, out=(step.top_values, step.top_indices))
        recall_plan_triton(layout, position, first.slot_page, step.scores[0], step.top_values[0],
                           step.top_indices[0], first._copy_pages, first._copy_slots, first._table, first._counts,
                           first.seq.counters.device_totals(device), 2 * first.pool_keys[0, 0].nbytes,
                           rows=step.recall)
        copy_blocks_triton(**first._copy_arguments(), rows=step.copy)
        paged_decode_attention_triton(q[0], first.pool_keys, first.pool_values, first._table,
                                      first._counts.expand(first.model.n_kv_heads, -1), scaling,
                                      first._attention_plan, out=step.out[0], rows=step.attention)
        return step.out.view(n_rows, 1, n_heads, head_dim)

    @staticmethod
    def _batch_step(layers, q, k, v, positions) -> "ArkValeBatchStep":
        """The batch's row tables and step buffers, made once for these rows' buffers and kept on row 0's layer."""
        tokens = tuple(layer._buffers_token for layer in layers)
        step_key = step_layout((q, k, v), positions)
        kept = layers[0]._batch_tables
        if kept is not None and kept.hold_for(tokens, step_key):
            return kept.tables
        first, device = layers[0], q.device
        n_rows, n_heads, head_dim = q.shape
        n_pages = first.digest_hi.shape[1]
        # Each row's per-head bounds start at a multiple of 16 bytes, as the scoring kernel assumes of its output.
        padded = -(-n_pages // ROW_ALIGNMENT) * ROW_ALIGNMENT
        bounds = torch.empty(n_rows, n_heads, padded, dtype=torch.float32, device=device)[:, :, :n_pages]
        scores = torch.empty(n_rows, first.n_groups, n_pages, dtype=torch.float32, device=device)
        n_top = min(first.n_topk, n_pages)
        top_values = torch.empty(n_rows, first.n_groups, n_top, dtype=torch.float32, device=device)
        top_indices = torch.empty(n_rows, first.n_groups, n_top, dtype=torch.long, device=device)
        out = torch.empty(n_rows, n_heads, head_dim, dtype=q.dtype, device=device)
        columns = {"page_start": [], "bounds": [], "recall": [], "copy": [], "attention": []}
        for b, layer in enumerate(layers):
            store_keys, store_values = layer._store_keys_on_device, layer._store_values_on_device
            columns["page_start"].append({
                "pool_keys": layer.pool_keys, "pool_values": layer.pool_values, "store_keys": store_keys,
                "store_values": store_values, "digest_hi": layer.digest_hi, "digest_lo": layer.digest_lo,
                "slot_page": layer.slot_page, "key": k[b], "value": v[b], "position": positions[b], "end": layer._end})
            columns["bounds"].append({"query": q[b], "keys": layer.digest_hi, "second_keys": layer.digest_lo,
                                      "n_valid": layer._end, "out": bounds[b]})
            columns["recall"].append({
                "slot_page": layer.slot_page, "position": positions[b], "scores": scores[b],
                "top_values": top_values[b], "top_indices": top_indices[b], "copy_pages": layer._copy_pages,
                "copy_slots": layer._copy_slots, "table": layer._table, "counts": layer._counts,
                "totals": layer.seq.counters.device_totals(device)})
            columns["copy"].append(layer._copy_arguments())
            columns["attention"].append({
                "query": q[b], "key_pages": layer.pool_keys, "value_pages": layer.pool_values,
                "page_table": layer._table, "valid_counts": layer._counts.expand(layer.model.n_kv_heads, -1),
                "out": out[b]})
        tables = {name: row_table(rows, unaligned=UNALIGNED_ROW_COLUMNS) for name, rows in columns.items()}
        step = ArkValeBatchStep(tables["page_start"], tables["bounds"], tables["recall"], tables["copy"],
                                tables["attention"], bounds, scores, top_values, top_indices, out)
        layers[0]._batch_tables = KeptRowTables(tokens, step_key, step)
        return step

    def _attended_positions(self, counts: torch.Tensor) -> torch.Tensor:
        """bool ``[Hq, trace_width()]`` of the positions in resident pages (valid slots only); ``counts [B]`` the
        valid tokens of each pool slot."""
        pages = self.slot_page[: self.n_slots].t()  # [G, B]
        offsets = torch.arange(self.page_size, device=pages.device)
        positions = pages[..., None] * self.page_size + offsets  # [G, B, page_size]
        valid = (pages[..., None] >= 0) & (offsets < counts[:, None])
        return attended_from_positions(positions, valid, self.trace_width(), self.model.n_heads // self.n_groups)

    def gpu_kv_bytes(self) -> int:
        if self.pool_keys is None or self.pool_keys.device.type != "cuda":
            return super().gpu_kv_bytes()
        return self.pool_keys.nbytes + self.pool_values.nbytes + self.digest_hi.nbytes + self.digest_lo.nbytes

    def cpu_kv_bytes(self) -> int:
        return 0 if self.store_keys is None else self.store_keys.nbytes + self.store_values.nbytes


@dataclass(frozen=True)
class ArkValeBatchStep:
    """What a batch's step of one layer launches with (``ArkValeKV.decode_rows``): the row tables of its kernels, and
    the batch's buffers for the per-head bounds (rows padded to whole multiples of 16 elements), the group scores,
    their top-k and the attention's output."""

    page_start: RowTable
    bounds_rows: RowTable
    recall: RowTable
    copy: RowTable
    attention: RowTable
    bounds: torch.Tensor  # [B, Hq, P + 1] float32
    scores: torch.Tensor  # [B, G, P + 1] float32
    top_values: torch.Tensor  # [B, G, k] float32
    top_indices: torch.Tensor  # [B, G, k] int64
    out: torch.Tensor  # [B, Hq, D]


@METHODS.register("arkvale")
class ArkVale(Method):
    display_name = "ArkVale"
    display_order = 100
    paper_names = ("AKV",)
    config_class = ArkValeConfig
    traces_in_graph = True
    speed_goals = (
        SpeedGoal(131072, "tpot", 1.0, "its step fused into a few kernels, the recalled pages a fraction of the KV"),
        SpeedGoal(32768, "tpot", 1.3, "its step fused into a few kernels"),
        *prompt_offload_goals("the prompt's KV copied to the host beside the next layers' prefill"),
    )
    test_settings = {"page_size": 8}

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
        if c.page_topks is not None and c.page_topks < 1:
            raise ConfigError(f"arkvale: page_topks={c.page_topks} must be >= 1 (or null for the paper's rule)")

    def forced_positions(self, n_tokens):
        c = self.config  # the sink pages and the window's last pages, the current one included
        n_pages = -(-n_tokens // c.page_size)
        sinks = list(range(min(c.n_sink_pages * c.page_size, n_tokens)))
        return sinks + list(range(max(len(sinks), (n_pages - c.n_window_pages) * c.page_size), n_tokens))

    def make_sparse_layer(self, layer_idx, seq):
        return ArkValeKV(layer_idx, self.model, seq, self.config)
