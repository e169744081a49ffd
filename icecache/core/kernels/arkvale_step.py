"""ArkVale's decode-step bookkeeping as two operations around its scoring: the page start and the recall plan.

A decode step of ArkVale (``baselines/arkvale.py``) is, per layer: ``page_start``, the page scores and their
``topk``, ``recall_plan``, the block copy of the missing pages (``block_copy``) and the paged attention.

* ``page_start``: when the step's position begins a page, the page just finished is backed up to the host store
  (through its mapped device view) and digested, and the window ring turns: the page leaving the window is copied
  into the first free middle slot if there is one. These writes happen at every step, to the scratch page and slot
  when no page starts. Then the token is written into its slot, and ``end`` (one past the last candidate page)
  is set for the scoring. The slot table is only read here.
* ``recall_plan``: the slot-table side of the ring turn (the leaving page's new slot, the new page's ring slot),
  then per head group, from the scores and their top-k: the top pages already in a middle slot, the missing ones,
  the victims (empty slots first, then the cached pages by ascending score in a stable order, never a top page),
  the slot table, the copy list for ``copy_blocks`` (``-1`` slots: nothing to copy), the attention's page table and
  valid counts, and the counters: one (layer, step) pair, its mean attended tokens per head, the blocks and bytes
  loaded, added to the float64 totals of ``DecodeCounters.device_totals``.

The table's ring update is applied by ``recall_plan`` rather than ``page_start``: nothing between the two reads the
table, so every decision is the same, and ``page_start`` can run one program per KV head.

``page_start_reference`` and ``recall_plan_reference`` are the PyTorch definitions (CPU, and CUDA without Triton).
``page_start_triton`` is one program per KV head, ``recall_plan_triton`` one program for all groups (the groups are
independent, but the attended-token counter sums over them); where the references take some 50 and 60 small kernels.
``page_start`` and ``recall_plan`` dispatch to them on CUDA when ``triton_runtime.available()``.

Bitwise agreement of the kernels with the references on CUDA:

* The digest rounds every intermediate to the cache dtype where PyTorch does ((upper + lower) / 2, pages - centre,
  the mean, centre +/- radius), computing each in float32. The mean's float32 sum follows the order of PyTorch's
  CUDA reduction for this shape (a reduction over a non-innermost dimension of at most 32 elements per output,
  which one thread does with four interleaved accumulators: token ``t`` goes to accumulator ``t % 4`` in
  increasing ``t``, then the accumulators are added in order), times the float32 factor ``1 / page_size``. For
  page sizes above 32 PyTorch may split a sum over threads, and the digests can then differ in the last bit.
  PyTorch's CPU sum uses another order, so on a CPU the two agree where the sums are exact.
* Ties in the victims' scores go to the lower slot, as in a stable sort; only -0.0 against +0.0 and NaN scores
  may order otherwise than PyTorch's CUDA sort for middles of more than 128 slots (its radix sort).
* The scratch slot's table entry takes the last entry of a group with nothing to load, as PyTorch's sequential
  ``index_put_`` on a CPU does (on CUDA the reference's value there is unspecified); nothing reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .row_table import RowTable, at_row, at_row_unaligned, table_arguments
from .torch_order import ROUNDING as _DIGEST_ROUNDING
from .torch_order import rounded
from .triton_runtime import available as triton_available
from .triton_runtime import require_triton, tl, triton

#: The tensors each kernel finds per row of a batch (``row_table``), in its pointer order. ``position``, ``scores``,
#: ``top_values`` and ``top_indices`` may be rows of one batch tensor at any distance (``unaligned``).
PAGE_START_ROW_COLUMNS = ("pool_keys", "pool_values", "store_keys", "store_values", "digest_hi", "digest_lo",
                          "slot_page", "key", "value", "position", "end")
RECALL_ROW_COLUMNS = ("slot_page", "position", "scores", "top_values", "top_indices", "copy_pages", "copy_slots",
                      "table", "counts", "totals")
UNALIGNED_ROW_COLUMNS = ("position", "scores", "top_values", "top_indices")


@dataclass(frozen=True)
class ArkValeSlots:
    """The slot layout of one ArkVale layer: ``n_sink`` sink slots, the middle slots, ``n_window`` window slots (a
    ring), then one scratch slot (``n_slots``); ``n_groups`` head groups of ``kv_heads_per_group`` KV heads."""

    page_size: int
    n_sink: int
    n_window: int
    n_slots: int
    n_groups: int
    kv_heads_per_group: int

    @property
    def middle_start(self) -> int:
        return self.n_sink

    @property
    def middle_stop(self) -> int:
        return self.n_slots - self.n_window

    @property
    def n_middle(self) -> int:
        return self.middle_stop - self.middle_start

    @property
    def scratch_slot(self) -> int:
        return self.n_slots

    @property
    def n_kv_heads(self) -> int:
        return self.n_groups * self.kv_heads_per_group


def page_digests(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cuboid-mean digests of full pages ``[n, Hkv, page_size, D]`` -> ``(hi, lo)``, each ``[n, Hkv, D]``."""
    upper, lower = pages.amax(dim=2), pages.amin(dim=2)
    centre = (upper + lower) / 2
    radius = (pages - centre[:, :, None]).abs().mean(dim=2)
    return centre + radius, centre - radius


def home_slot(layout: ArkValeSlots, page: torch.Tensor) -> torch.Tensor:
    """Where a sink or window page lives: its sink slot, or its place in the window ring (tensor in, tensor out)."""
    return torch.where(page < layout.n_sink, page, layout.n_slots - layout.n_window + page % layout.n_window)


def ring_destination(layout: ArkValeSlots, slot_page: torch.Tensor, page: torch.Tensor,
                     starting: torch.Tensor) -> torch.Tensor:
    """``[1]``: the first free middle slot (free for group 0; the groups have the same free slots) that the page
    leaving the window moves to when ``page`` starts, else the scratch slot."""
    leaving = page - layout.n_window
    free = slot_page[layout.middle_start : layout.middle_stop, 0] < 0
    move = starting & (page >= layout.n_sink) & (leaving >= layout.n_sink) & free.any()
    return torch.where(move, layout.middle_start + free.int().argmax(), layout.scratch_slot).reshape(1)


# --------------------------------------------------------------------------------------------------- references


def page_start_reference(layout: ArkValeSlots, position: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         pool_keys: torch.Tensor, pool_values: torch.Tensor, slot_page: torch.Tensor,
                         store_keys: torch.Tensor, store_values: torch.Tensor, digest_hi: torch.Tensor,
                         digest_lo: torch.Tensor, end: torch.Tensor) -> None:
    """The step's page start and token write. ``position [1]`` int64; ``key``/``value [Hkv, D]``; the pool
    ``[B + 1, Hkv, ps, D]``; ``slot_page [B + 1, G]`` (read only); the store's device view ``[P + 1, Hkv, ps, D]``
    (the last page is the scratch page); digests ``[Hkv, P + 1, D]``; ``end [1]`` int64, set to one past the last
    candidate page."""
    page, offset = position // layout.page_size, position % layout.page_size
    starting = offset == 0
    finished = page - 1
    backup = starting & (finished >= 0)
    source = home_slot(layout, finished.clamp(min=0))
    target = torch.where(backup, finished, store_keys.shape[0] - 1)
    block_keys = pool_keys.index_select(0, source)  # [1, Hkv, ps, D]
    store_keys.index_copy_(0, target, block_keys)
    store_values.index_copy_(0, target, pool_values.index_select(0, source))
    hi, lo = page_digests(block_keys)
    digest_hi.index_copy_(1, target, hi.transpose(0, 1))
    digest_lo.index_copy_(1, target, lo.transpose(0, 1))

    # The ring slot of the new page holds the page leaving the window: keep it in a free middle slot if any.
    ring_slot = home_slot(layout, page)
    move_to = ring_destination(layout, slot_page, page, starting)
    pool_keys.index_copy_(0, move_to, pool_keys.index_select(0, ring_slot))
    pool_values.index_copy_(0, move_to, pool_values.index_select(0, ring_slot))
    heads = torch.arange(pool_keys.shape[1], device=pool_keys.device)
    pool_keys.index_put_((ring_slot, heads, offset), key)
    pool_values.index_put_((ring_slot, heads, offset), value)
    end.copy_(page + 1 - layout.n_window)


def recall_plan_reference(layout: ArkValeSlots, position: torch.Tensor, slot_page: torch.Tensor,
                          scores: torch.Tensor, top_values: torch.Tensor, top_indices: torch.Tensor,
                          copy_pages: torch.Tensor, copy_slots: torch.Tensor, table: torch.Tensor,
                          counts: torch.Tensor, totals: torch.Tensor, block_bytes: int) -> None:
    """The slot table's ring turn and the recall decisions. ``scores [G, P + 1]`` float32 (non-candidates
    ``-inf``) and their top-k ``top_values``/``top_indices [G, k]``; writes ``slot_page``, the copy list
    ``copy_pages``/``copy_slots [G * k * kv_heads_per_group]`` (entry ``(g, i, j)``: page ``i`` of group ``g`` for
    its ``j``-th KV head; slot ``-1``: resident already), the attention's ``table [Hkv, B]`` and ``counts [B]``, and
    adds to ``totals`` (float64 ``[4]``: pairs, mean attended tokens, blocks and bytes loaded) ``block_bytes`` per
    block (keys and values)."""
    page, offset = position // layout.page_size, position % layout.page_size
    starting = offset == 0
    ring_slot = home_slot(layout, page)
    leaving = page - layout.n_window
    move_to = ring_destination(layout, slot_page, page, starting)
    slot_page.index_copy_(0, move_to, leaving.expand(1, layout.n_groups))
    owner = torch.where(starting, page, slot_page.index_select(0, ring_slot))
    slot_page.index_copy_(0, ring_slot, owner.expand(1, layout.n_groups))

    # While every candidate fits in the middle slots they all are resident already: nothing is ranked for loading.
    end = page + 1 - layout.n_window  # candidates: [n_sink, end)
    ranked = end - layout.n_sink > layout.n_middle
    targets, wanted = top_indices, (top_values > float("-inf")) & ranked  # [G, k]
    middle = slot_page[layout.middle_start : layout.middle_stop].t()  # [G, n_middle]
    matches = (targets[:, :, None] == middle[:, None, :]) & wanted[:, :, None]  # [G, k, n_middle]
    missing = wanted & ~matches.any(dim=2)
    # Victims: empty slots first, then the cached pages with the lowest scores, never a target.
    held_score = torch.where(middle >= 0, scores.gather(1, middle.clamp(min=0)), float("-inf"))
    held_score = held_score.masked_fill(matches.any(dim=1), float("inf"))
    order = held_score.argsort(dim=-1, stable=True)
    rank = (missing.long().cumsum(dim=-1) - 1).clamp(min=0)
    victims = torch.where(missing, layout.middle_start + order.gather(1, rank), layout.scratch_slot)
    groups = torch.arange(layout.n_groups, device=slot_page.device)
    slot_page.index_put_((victims.flatten(), groups[:, None].expand_as(victims).flatten()), targets.flatten())

    shape = (*targets.shape, layout.kv_heads_per_group)  # [G, k, heads of the group]
    copy_pages.copy_(targets[..., None].expand(shape).flatten())
    copy_slots.copy_(torch.where(missing, victims, -1)[..., None].expand(shape).flatten())
    n_loaded = missing.sum() * layout.kv_heads_per_group  # (page, KV head) blocks

    # Attention over every resident page; the current page has offset + 1 valid tokens.
    slot_index = torch.arange(layout.n_slots, device=slot_page.device)
    counts.copy_(torch.where(slot_index == ring_slot, offset + 1, layout.page_size))
    held = slot_page[: layout.n_slots] >= 0  # [B, G]
    kv_group = torch.arange(layout.n_kv_heads, device=slot_page.device) // layout.kv_heads_per_group
    table.copy_(torch.where(held, slot_index[:, None], -1).t()[kv_group])
    mean_attended = (held * counts[:, None]).sum(0).float().mean()
    totals[0] += 1
    totals[1] += mean_attended.to(torch.float64)
    totals[2] += n_loaded.to(torch.float64)
    totals[3] += (n_loaded * block_bytes).to(torch.float64)


# ---------------------------------------------------------------------------------------------------- dispatch


def runs_triton(tensor: torch.Tensor) -> bool:
    """Whether the dispatchers take the Triton kernels for this tensor's device."""
    return tensor.is_cuda and triton_available()


def page_start(layout: ArkValeSlots, position, key, value, pool_keys, pool_values, slot_page, store_keys,
               store_values, digest_hi, digest_lo, end) -> None:
    """Dispatch: the Triton kernel on CUDA when available, the PyTorch reference otherwise."""
    run = page_start_triton if runs_triton(pool_keys) else page_start_reference
    run(layout, position, key, value, pool_keys, pool_values, slot_page, store_keys, store_values, digest_hi,
        digest_lo, end)


def recall_plan(layout: ArkValeSlots, position, slot_page, scores, top_values, top_indices, copy_pages, copy_slots,
                table, counts, totals, block_bytes: int) -> None:
    """Dispatch: the Triton kernel on CUDA when available, the PyTorch reference otherwise."""
    run = recall_plan_triton if runs_triton(slot_page) else recall_plan_reference
    run(layout, position, slot_page, scores, top_values, top_indices, copy_pages, copy_slots, table, counts, totals,
        block_bytes)


# ----------------------------------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _home_slot(page, N_SINK: tl.constexpr, N_WINDOW: tl.constexpr, N_SLOTS: tl.constexpr):
        return tl.where(page < N_SINK, page, N_SLOTS - N_WINDOW + page % N_WINDOW)

    @triton.jit
    def _ring_destination(slot_page_ptr, stride_slot, page, starting, N_SINK: tl.constexpr, N_WINDOW: tl.constexpr,
                          N_SLOTS: tl.constexpr, BLOCK_MIDDLE: tl.constexpr):
        n_middle = N_SLOTS - N_WINDOW - N_SINK
        index = tl.arange(0, BLOCK_MIDDLE)
        in_middle = index < n_middle
        held = tl.load(slot_page_ptr + (N_SINK + index) * stride_slot, mask=in_middle, other=0)
        free = in_middle & (held < 0)
        first_free = tl.min(tl.where(free, index, BLOCK_MIDDLE), 0)
        leaving = page - N_WINDOW
        move = starting & (page >= N_SINK) & (leaving >= N_SINK) & (first_free < BLOCK_MIDDLE)
        return tl.where(move, N_SINK + first_free, N_SLOTS)

    @triton.jit
    def _page_start_kernel(
        pool_keys_ptr, pool_values_ptr, store_keys_ptr, store_values_ptr, hi_ptr, lo_ptr, slot_page_ptr,
        key_ptr, value_ptr, position_ptr, end_ptr, rows_ptr,
        scratch_page, mean_factor,
        stride_pool_slot, stride_pool_head, stride_store_page, stride_store_head, stride_digest_head,
        stride_digest_page, stride_key_head, stride_value_head, stride_slot,
        PAGE_SIZE: tl.constexpr, BLOCK_PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        N_SINK: tl.constexpr, N_WINDOW: tl.constexpr, N_SLOTS: tl.constexpr, BLOCK_MIDDLE: tl.constexpr,
        ROUNDING: tl.constexpr, N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr,
    ):
        head = tl.program_id(0).to(tl.int64)
        row = tl.program_id(2)  # PAGE_START_ROW_COLUMNS
        pool_keys_ptr = at_row(pool_keys_ptr, rows_ptr, row, 0, N_COLUMNS, BATCHED)
        pool_values_ptr = at_row(pool_values_ptr, rows_ptr, row, 1, N_COLUMNS, BATCHED)
        store_keys_ptr = at_row(store_keys_ptr, rows_ptr, row, 2, N_COLUMNS, BATCHED)
        store_values_ptr = at_row(store_values_ptr, rows_ptr, row, 3, N_COLUMNS, BATCHED)
        hi_ptr = at_row(hi_ptr, rows_ptr, row, 4, N_COLUMNS, BATCHED)
        lo_ptr = at_row(lo_ptr, rows_ptr, row, 5, N_COLUMNS, BATCHED)
        slot_page_ptr = at_row(slot_page_ptr, rows_ptr, row, 6, N_COLUMNS, BATCHED)
        key_ptr = at_row(key_ptr, rows_ptr, row, 7, N_COLUMNS, BATCHED)
        value_ptr = at_row(value_ptr, rows_ptr, row, 8, N_COLUMNS, BATCHED)
        position_ptr = at_row_unaligned(position_ptr, rows_ptr, row, 9, N_COLUMNS, BATCHED)
        end_ptr = at_row(end_ptr, rows_ptr, row, 10, N_COLUMNS, BATCHED)
        dtype = pool_keys_ptr.dtype.element_ty
        position = tl.load(position_ptr).to(tl.int64)
        page = position // PAGE_SIZE
        offset = position % PAGE_SIZE
        starting = offset == 0
        finished = page - 1
        backup = starting & (finished >= 0)
        source = _home_slot(tl.maximum(finished, 0), N_SINK, N_WINDOW, N_SLOTS)
        target = tl.where(backup, finished, scratch_page)
        ring_slot = _home_slot(page, N_SINK, N_WINDOW, N_SLOTS)
        move_to = _ring_destination(slot_page_ptr, stride_slot, page, starting, N_SINK, N_WINDOW, N_SLOTS,
                                    BLOCK_MIDDLE).to(tl.int64)

        rows = tl.arange(0, BLOCK_PAGE)
        dims = tl.arange(0, BLOCK_DIM)
        row_ok = rows < PAGE_SIZE
        dim_ok = dims < HEAD_DIM
        ok = row_ok[:, None] & dim_ok[None, :]
        within = rows[:, None] * HEAD_DIM + dims[None, :]  # a page block is contiguous
        source_keys = pool_keys_ptr + source * stride_pool_slot + head * stride_pool_head
        source_values = pool_values_ptr + source * stride_pool_slot + head * stride_pool_head
        ring_keys = pool_keys_ptr + ring_slot * stride_pool_slot + head * stride_pool_head
        ring_values = pool_values_ptr + ring_slot * stride_pool_slot + head * stride_pool_head
        keys = tl.load(source_keys + within, mask=ok)
        values = tl.load(source_values + within, mask=ok)
        ring_block_keys = tl.load(ring_keys + within, mask=ok)
        ring_block_values = tl.load(ring_values + within, mask=ok)

        # Backup of the finished page (or of the scratch page's stand-in).
        store_offset = target * stride_store_page + head * stride_store_head
        tl.store(store_keys_ptr + store_offset + within, keys, mask=ok)
        tl.store(store_values_ptr + store_offset + within, values, mask=ok)

        # Its digest, rounded to the cache dtype at every step where PyTorch rounds (all arithmetic in float32:
        # the interpreter cannot add 16-bit floats).
        wide = keys.to(tl.float32)
        upper = tl.max(tl.where(ok, wide, float("-inf")), 0)
        lower = tl.min(tl.where(ok, wide, float("inf")), 0)
        centre = rounded(rounded(upper + lower, ROUNDING) * 0.5, ROUNDING)
        # The mean's sum in the order of PyTorch's CUDA reduction: token t into accumulator t % 4, then in order.
        acc0 = tl.zeros([BLOCK_DIM], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_DIM], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_DIM], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_DIM], dtype=tl.float32)
        for token in tl.static_range(PAGE_SIZE):
            row = tl.load(source_keys + token * HEAD_DIM + dims, mask=dim_ok, other=0.0).to(tl.float32)
            deviation = tl.abs(rounded(row - centre, ROUNDING))
            if token % 4 == 0:
                acc0 += deviation
            elif token % 4 == 1:
                acc1 += deviation
            elif token % 4 == 2:
                acc2 += deviation
            else:
                acc3 += deviation
        radius = rounded((((acc0 + acc1) + acc2) + acc3) * mean_factor, ROUNDING)
        digest_offset = head * stride_digest_head + target * stride_digest_page + dims
        # Rounded already, so the cast is exact.
        tl.store(hi_ptr + digest_offset, rounded(centre + radius, ROUNDING).to(dtype), mask=dim_ok)
        tl.store(lo_ptr + digest_offset, rounded(centre - radius, ROUNDING).to(dtype), mask=dim_ok)

        # The ring turn: the block of the page leaving the window to its middle slot (or the scratch slot).
        move_offset = move_to * stride_pool_slot + head * stride_pool_head
        tl.store(pool_keys_ptr + move_offset + within, ring_block_keys, mask=ok)
        tl.store(pool_values_ptr + move_offset + within, ring_block_values, mask=ok)

        # The token goes into its ring slot after that slot (and the finished page) were read by every thread.
        tl.debug_barrier()
        token_key = tl.load(key_ptr + head * stride_key_head + dims, mask=dim_ok)
        token_value = tl.load(value_ptr + head * stride_value_head + dims, mask=dim_ok)
        tl.store(ring_keys + offset * HEAD_DIM + dims, token_key, mask=dim_ok)
        tl.store(ring_values + offset * HEAD_DIM + dims, token_value, mask=dim_ok)
        tl.store(end_ptr, page + 1 - N_WINDOW, mask=head == 0)

    @triton.jit
    def _recall_plan_kernel(
        slot_page_ptr, position_ptr, scores_ptr, top_values_ptr, top_indices_ptr, copy_pages_ptr, copy_slots_ptr,
        table_ptr, counts_ptr, totals_ptr, rows_ptr,
        n_top, block_bytes, inv_groups,
        stride_slot, stride_scores, stride_top, stride_table,
        PAGE_SIZE: tl.constexpr, N_SINK: tl.constexpr, N_WINDOW: tl.constexpr, N_SLOTS: tl.constexpr,
        N_GROUPS: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, BLOCK_TOP: tl.constexpr,
        BLOCK_MIDDLE: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
        BLOCK_GROUP_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, N_COLUMNS: tl.constexpr,
        BATCHED: tl.constexpr,
    ):
        row = tl.program_id(2)  # RECALL_ROW_COLUMNS
        slot_page_ptr = at_row(slot_page_ptr, rows_ptr, row, 0, N_COLUMNS, BATCHED)
        position_ptr = at_row_unaligned(position_ptr, rows_ptr, row, 1, N_COLUMNS, BATCHED)
        scores_ptr = at_row_unaligned(scores_ptr, rows_ptr, row, 2, N_COLUMNS, BATCHED)
        top_values_ptr = at_row_unaligned(top_values_ptr, rows_ptr, row, 3, N_COLUMNS, BATCHED)
        top_indices_ptr = at_row_unaligned(top_indices_ptr, rows_ptr, row, 4, N_COLUMNS, BATCHED)
        copy_pages_ptr = at_row(copy_pages_ptr, rows_ptr, row, 5, N_COLUMNS, BATCHED)
        copy_slots_ptr = at_row(copy_slots_ptr, rows_ptr, row, 6, N_COLUMNS, BATCHED)
        table_ptr = at_row(table_ptr, rows_ptr, row, 7, N_COLUMNS, BATCHED)
        counts_ptr = at_row(counts_ptr, rows_ptr, row, 8, N_COLUMNS, BATCHED)
        totals_ptr = at_row(totals_ptr, rows_ptr, row, 9, N_COLUMNS, BATCHED)
        n_middle = N_SLOTS - N_WINDOW - N_SINK
        position = tl.load(position_ptr).to(tl.int64)
        page = position // PAGE_SIZE
        offset = position % PAGE_SIZE
        starting = offset == 0
        ring_slot = _home_slot(page, N_SINK, N_WINDOW, N_SLOTS)
        move_to = _ring_destination(slot_page_ptr, stride_slot, page, starting, N_SINK, N_WINDOW, N_SLOTS,
                                    BLOCK_MIDDLE).to(tl.int64)

        # The ring turn in the table (the two rows differ: a middle or scratch slot, and a sink or window slot).
        groups = tl.arange(0, BLOCK_GROUPS)
        group_ok = groups < N_GROUPS
        ring_row = slot_page_ptr + ring_slot * stride_slot + groups
        owner = tl.where(starting, page, tl.load(ring_row, mask=group_ok, other=-1))
        tl.store(slot_page_ptr + move_to * stride_slot + groups, tl.zeros_like(groups).to(tl.int64) + page - N_WINDOW,
                 mask=group_ok)
        tl.store(ring_row, owner, mask=group_ok)
        tl.debug_barrier()

        ranked = page + 1 - N_WINDOW - N_SINK > n_middle
        tops = tl.arange(0, BLOCK_TOP)
        top_ok = tops < n_top
        slots = tl.arange(0, BLOCK_MIDDLE)
        slot_ok = slots < n_middle
        heads = tl.arange(0, BLOCK_GROUP_HEADS)
        head_ok = heads < HEADS_PER_GROUP
        n_missing = 0
        for group in range(N_GROUPS):
            targets = tl.load(top_indices_ptr + group * stride_top + tops, mask=top_ok, other=-1)
            values = tl.load(top_values_ptr + group * stride_top + tops, mask=top_ok, other=float("-inf"))
            wanted = top_ok & (values > float("-inf")) & ranked
            middle = tl.load(slot_page_ptr + (N_SINK + slots) * stride_slot + group, mask=slot_ok, other=-1)
            matches = (targets[:, None] == middle[None, :]) & wanted[:, None] & slot_ok[None, :]  # [top, middle]
            missing = wanted & (tl.max(matches.to(tl.int32), 1) == 0)
            target_held = tl.max(matches.to(tl.int32), 0) > 0
            held_score = tl.load(scores_ptr + group * stride_scores + tl.maximum(middle, 0),
                                 mask=slot_ok & (middle >= 0), other=float("-inf"))
            held_score = tl.where(target_held, float("inf"), held_score)
            # Each slot's place in a stable ascending sort of the held scores (ties: lower slot first).
            before = (held_score[:, None] < held_score[None, :]) | (
                (held_score[:, None] == held_score[None, :]) & (slots[:, None] < slots[None, :]))
            place = tl.sum((before & slot_ok[:, None]).to(tl.int32), 0)  # [middle]
            # The r-th missing page (r counted from 0) takes the slot in place r.
            rank = tl.sum((missing[:, None] & (tops[:, None] <= tops[None, :])).to(tl.int32), 0) - 1
            rank = tl.maximum(rank, 0)
            chosen = (place[None, :] == rank[:, None]) & slot_ok[None, :]  # [top, middle]
            victim_slot = N_SINK + tl.sum(tl.where(chosen, slots[None, :], 0), 1)
            victims = tl.where(missing, victim_slot, N_SLOTS).to(tl.int64)
            tl.store(slot_page_ptr + victims * stride_slot + group, targets, mask=missing)
            # Entries with nothing to load all name the scratch slot: the last of them is what stays there.
            last_kept = tl.max(tl.where(top_ok & ~missing, tops, -1), 0)
            kept_target = tl.sum(tl.where(tops == last_kept, targets, 0), 0)
            tl.store(slot_page_ptr + N_SLOTS * stride_slot + group, kept_target, mask=last_kept >= 0)

            entries = (group * n_top + tops[:, None]) * HEADS_PER_GROUP + heads[None, :]
            entry_ok = top_ok[:, None] & head_ok[None, :]
            tl.store(copy_pages_ptr + entries, tl.zeros_like(entries).to(tl.int64) + targets[:, None], mask=entry_ok)
            tl.store(copy_slots_ptr + entries, tl.zeros_like(entries).to(tl.int64)
                     + tl.where(missing, victims, -1)[:, None], mask=entry_ok)
            n_missing += tl.sum(missing.to(tl.int32), 0)
        tl.debug_barrier()

        # The attention's table and valid counts, and the counters.
        pool_slots = tl.arange(0, BLOCK_SLOTS)
        pool_ok = pool_slots < N_SLOTS
        counts = tl.where(pool_slots == ring_slot, offset + 1, PAGE_SIZE).to(tl.int64)
        tl.store(counts_ptr + pool_slots, counts, mask=pool_ok)
        kv_heads = tl.arange(0, BLOCK_KV_HEADS)
        kv_ok = kv_heads < N_GROUPS * HEADS_PER_GROUP
        cell_ok = kv_ok[:, None] & pool_ok[None, :]
        held = tl.load(slot_page_ptr + pool_slots[None, :] * stride_slot + (kv_heads // HEADS_PER_GROUP)[:, None],
                       mask=cell_ok, other=-1) >= 0
        table = tl.where(held, pool_slots[None, :], -1).to(tl.int64)
        tl.store(table_ptr + kv_heads[:, None] * stride_table + pool_slots[None, :], table, mask=cell_ok)
        group_held = tl.load(slot_page_ptr + pool_slots[None, :] * stride_slot + groups[:, None],
                             mask=group_ok[:, None] & pool_ok[None, :], other=-1) >= 0
        attended = tl.sum(tl.sum(tl.where(group_held, counts[None, :], 0), 1), 0)
        mean_attended = attended.to(tl.float32) * inv_groups
        n_loaded = (n_missing * HEADS_PER_GROUP).to(tl.int64)
        tl.store(totals_ptr, tl.load(totals_ptr) + 1.0)
        tl.store(totals_ptr + 1, tl.load(totals_ptr + 1) + mean_attended.to(tl.float64))
        tl.store(totals_ptr + 2, tl.load(totals_ptr + 2) + n_loaded.to(tl.float64))
        tl.store(totals_ptr + 3, tl.load(totals_ptr + 3) + (n_loaded * block_bytes).to(tl.float64))


def _check_block_layout(name: str, tensor: torch.Tensor) -> None:
    page_size, head_dim = tensor.shape[-2:]
    if tensor.stride(-1) != 1 or tensor.stride(-2) != head_dim:
        raise ValueError(f"arkvale_step: {name} must be contiguous within each page block")


def page_start_triton(layout: ArkValeSlots, position, key, value, pool_keys, pool_values, slot_page, store_keys,
                      store_values, digest_hi, digest_lo, end, rows: RowTable | None = None) -> None:
    """The Triton version of ``page_start_reference``: one program per KV head; with ``rows``
    (``PAGE_START_ROW_COLUMNS``), per row of a batch too, the tensors given being row 0's."""
    require_triton()
    if rows is not None:
        rows.check(PAGE_START_ROW_COLUMNS, "page_start")
    for name, tensor in (("pool_keys", pool_keys), ("pool_values", pool_values), ("store_keys", store_keys),
                         ("store_values", store_values)):
        _check_block_layout(name, tensor)
    if pool_keys.stride() != pool_values.stride() or store_keys.stride() != store_values.stride():
        raise ValueError("arkvale_step: keys and values must have the same layout")
    if digest_hi.stride() != digest_lo.stride() or digest_hi.stride(-1) != 1:
        raise ValueError("arkvale_step: the digests must share a layout, contiguous in the last dimension")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or slot_page.dtype != torch.int64:
        raise ValueError("arkvale_step: key and value contiguous in the last dimension, slot_page int64")
    n_kv_heads, page_size, head_dim = pool_keys.shape[1:]
    rows_ptr, n_rows, n_columns, batched = table_arguments(rows, position)
    _page_start_kernel[(n_kv_heads, 1, n_rows)](
        pool_keys, pool_values, store_keys, store_values, digest_hi, digest_lo, slot_page, key, value, position, end,
        rows_ptr, store_keys.shape[0] - 1, 1.0 / page_size,
        pool_keys.stride(0), pool_keys.stride(1), store_keys.stride(0), store_keys.stride(1), digest_hi.stride(0),
        digest_hi.stride(1), key.stride(0), value.stride(0), slot_page.stride(0),
        PAGE_SIZE=page_size, BLOCK_PAGE=triton.next_power_of_2(page_size), HEAD_DIM=head_dim,
        BLOCK_DIM=triton.next_power_of_2(head_dim), N_SINK=layout.n_sink, N_WINDOW=layout.n_window,
        N_SLOTS=layout.n_slots, BLOCK_MIDDLE=triton.next_power_of_2(layout.n_middle),
        ROUNDING=_DIGEST_ROUNDING[pool_keys.dtype], N_COLUMNS=n_columns, BATCHED=batched, num_warps=4,
    )


def recall_plan_triton(layout: ArkValeSlots, position, slot_page, scores, top_values, top_indices, copy_pages,
                       copy_slots, table, counts, totals, block_bytes: int, rows: RowTable | None = None) -> None:
    """The Triton version of ``recall_plan_reference``: one program for all groups; with ``rows``
    (``RECALL_ROW_COLUMNS``), one per row of a batch, the tensors given being row 0's."""
    require_triton()
    if rows is not None:
        rows.check(RECALL_ROW_COLUMNS, "recall_plan")
    n_top = top_indices.shape[1]
    for name, tensor in (("slot_page", slot_page), ("scores", scores), ("top_values", top_values),
                         ("top_indices", top_indices), ("table", table), ("counts", counts),
                         ("copy_pages", copy_pages), ("copy_slots", copy_slots)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"arkvale_step: {name} must be contiguous in its last dimension")
    if top_values.stride() != top_indices.stride() or scores.dtype != torch.float32:
        raise ValueError("arkvale_step: top values and indices of one layout, float32 scores")
    if totals.dtype != torch.float64 or copy_pages.numel() != layout.n_groups * n_top * layout.kv_heads_per_group:
        raise ValueError("arkvale_step: float64 totals, copy lists of G * k * kv_heads_per_group entries")
    rows_ptr, n_rows, n_columns, batched = table_arguments(rows, position)
    _recall_plan_kernel[(1, 1, n_rows)](
        slot_page, position, scores, top_values, top_indices, copy_pages, copy_slots, table, counts, totals, rows_ptr,
        n_top, block_bytes, 1.0 / layout.n_groups,
        slot_page.stride(0), scores.stride(0), top_indices.stride(0), table.stride(0),
        PAGE_SIZE=layout.page_size, N_SINK=layout.n_sink, N_WINDOW=layout.n_window, N_SLOTS=layout.n_slots,
        N_GROUPS=layout.n_groups, HEADS_PER_GROUP=layout.kv_heads_per_group,
        BLOCK_TOP=triton.next_power_of_2(n_top), BLOCK_MIDDLE=triton.next_power_of_2(layout.n_middle),
        BLOCK_SLOTS=triton.next_power_of_2(layout.n_slots), BLOCK_GROUPS=triton.next_power_of_2(layout.n_groups),
        BLOCK_GROUP_HEADS=triton.next_power_of_2(layout.kv_heads_per_group),
        BLOCK_KV_HEADS=triton.next_power_of_2(layout.n_kv_heads), N_COLUMNS=n_columns, BATCHED=batched,
        num_warps=4,
    )
