"""Sparse paged decode attention: one decode query per head over a per-KV-head selection of pages.

``paged_decode_attention(query [Hq, D], key_pages, value_pages [P, Hkv, S, D], page_table [Hkv, N],
valid_counts [Hkv, N], scaling, plan) -> [Hq, D]``: query head ``h`` reads KV head ``h // (Hq / Hkv)``; page
``page_table[g, j]`` contributes its first ``valid_counts[g, j]`` slots; entries of ``page_table`` below zero are
padding. The softmax is exact and in float32.

* ``paged_decode_attention_reference``: PyTorch; runs everywhere and defines the semantics.
* ``paged_decode_attention_triton``: flash-decoding (split-K). Grid ``(n_kv_heads, n_splits)``; a program serves
  all query heads of one GQA group (their keys and values are the same, so each page is read from memory once per
  group, not once per query head) over one contiguous range of the page table, with an online softmax in float32.
  Each loop iteration gathers ``BLOCK_TOKENS`` token rows (``BLOCK_TOKENS / page_size`` selected pages) through
  the page table; a slot is attended iff its page entry is not padding (``>= 0``) and the slot index is below the
  page's valid count. With more than one split, a second kernel combines the partial results by log-sum-exp. The
  one difference from the reference is a KV head with no valid slot at all, where the reference returns NaN and
  the kernel returns 0.
* ``paged_decode_attention``: the dispatch, the Triton kernel on CUDA when ``triton_runtime.available()``, the
  reference otherwise.

The kernel's launch state (split counts, grids, scratch for the partial results, the compiled kernels) lives in a
``PagedAttentionPlan`` that the calling layer makes once and passes to every call.

With a ``RowTable`` (``rows``, columns ``ATTENTION_ROW_COLUMNS``) one launch attends for every row of a batch, each row
with its own query, pages, table, counts and output, the tensors given being row 0's (``row_table``). A row is split
as it would be alone, so that it computes what it computes alone, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..cuda_driver import stream_handle
from .row_table import RowTable, at_row, table_arguments
from .triton_runtime import DirectLaunch, aligned, interpreted, require_triton, tl, triton
from .triton_runtime import available as triton_available

#: Token rows gathered per loop iteration of the attention kernel (a multiple of the page size; >= 16 for tl.dot).
DEFAULT_BLOCK_TOKENS = 64
#: Programs to aim for when choosing the number of splits, per streaming multiprocessor.
PROGRAMS_PER_SM = 2
#: Tokens per KV head up to which one split (one kernel, no combine pass) is used on CUDA: below this the second
#: launch costs more than the extra programs would save. 512 tokens are 8 loop steps of 64 rows per program.
SINGLE_SPLIT_MAX_TOKENS = 512
#: Geometries one plan keeps launch state for (e.g. a table width that changes every step); beyond, it starts over.
MAX_GEOMETRIES = 512

_LOG2_E = math.log2(math.e)
#: The tensors the attention finds per row of a batch, in the kernel's pointer order.
ATTENTION_ROW_COLUMNS = ("query", "key_pages", "value_pages", "page_table", "valid_counts", "out")


# ------------------------------------------------------------------------------------------------ reference


def gather_pages(pages: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """``pages [P, Hkv, page_size, D]``, ``page_table [Hkv, N]`` -> ``[Hkv, N * page_size, D]`` (unused slots
    arbitrary)."""
    n_kv_heads = pages.shape[1]
    heads = torch.arange(n_kv_heads, device=pages.device)[:, None]
    gathered = pages[page_table.clamp(min=0), heads]  # [Hkv, N, page_size, D]
    return gathered.reshape(n_kv_heads, -1, pages.shape[-1])


def valid_slot_mask(page_table: torch.Tensor, valid_counts: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[Hkv, N * page_size]`` bool: slot ``s`` of selected page ``j`` is attended iff ``s < valid_counts[j]``."""
    slots = torch.arange(page_size, device=page_table.device)
    mask = (slots[None, None, :] < valid_counts[..., None]) & (page_table[..., None] >= 0)
    return mask.reshape(page_table.shape[0], -1)


def paged_decode_attention_reference(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    page_table: torch.Tensor,
    valid_counts: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Exact softmax attention of ``query [Hq, D]`` over the selected pages; returns ``[Hq, D]``.

    Query head ``h`` reads KV head ``h // (Hq / Hkv)``. Page ``page_table[g, j]`` contributes its first
    ``valid_counts[g, j]`` slots; entries of ``page_table`` below zero are padding. Softmax is in float32.
    """
    n_heads, head_dim = query.shape
    n_kv_heads, page_size = key_pages.shape[1], key_pages.shape[2]
    group = n_heads // n_kv_heads
    keys = gather_pages(key_pages, page_table).float()
    values = gather_pages(value_pages, page_table).float()
    mask = valid_slot_mask(page_table, valid_counts, page_size)
    q = query.float().view(n_kv_heads, group, head_dim)
    scores = torch.einsum("hgd,htd->hgt", q, keys) * scaling
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgt,htd->hgd", probs, values)
    return out.reshape(n_heads, head_dim).to(query.dtype)


# ------------------------------------------------------------------------------------------------ Triton kernels

if triton is not None:

    @triton.jit
    def _paged_decode_split_kernel(
        query_ptr, key_ptr, value_ptr, table_ptr, counts_ptr,
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, rows_ptr,
        n_table, pages_per_split, qk_scale_log2,
        stride_qh, stride_qd,
        stride_kp, stride_kh, stride_ks, stride_kd,
        stride_vp, stride_vh, stride_vs, stride_vd,
        stride_th, stride_ch,
        stride_oh, stride_od,
        GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
        N_SPLITS: tl.constexpr, IEEE_FP32: tl.constexpr, N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr,
    ):
        kv_head = tl.program_id(0)
        split = tl.program_id(1)
        row = tl.program_id(2)  # ATTENTION_ROW_COLUMNS
        query_ptr = at_row(query_ptr, rows_ptr, row, 0, N_COLUMNS, BATCHED)
        key_ptr = at_row(key_ptr, rows_ptr, row, 1, N_COLUMNS, BATCHED)
        value_ptr = at_row(value_ptr, rows_ptr, row, 2, N_COLUMNS, BATCHED)
        table_ptr = at_row(table_ptr, rows_ptr, row, 3, N_COLUMNS, BATCHED)
        counts_ptr = at_row(counts_ptr, rows_ptr, row, 4, N_COLUMNS, BATCHED)
        out_ptr = at_row(out_ptr, rows_ptr, row, 5, N_COLUMNS, BATCHED)
        # Each row's partial results follow the previous row's: Hq * N_SPLITS entries a row.
        row_parts = row.to(tl.int64) * tl.num_programs(0) * GROUP * N_SPLITS

        group_rows = tl.arange(0, BLOCK_GROUP)
        dims = tl.arange(0, BLOCK_DIM)
        heads = kv_head * GROUP + group_rows
        row_ok = group_rows < GROUP
        dim_ok = dims < HEAD_DIM
        query = tl.load(
            query_ptr + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
            mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
        )

        # Token row t of a block is slot (t % PAGE_SIZE) of the block's (t // PAGE_SIZE)-th page.
        token = tl.arange(0, BLOCK_TOKENS)
        page_in_block = token // PAGE_SIZE
        slot = token % PAGE_SIZE

        running_max = tl.full([BLOCK_GROUP], float("-inf"), dtype=tl.float32)  # log2 units
        running_sum = tl.zeros([BLOCK_GROUP], dtype=tl.float32)
        acc = tl.zeros([BLOCK_GROUP, BLOCK_DIM], dtype=tl.float32)

        first_page = split * pages_per_split
        for block_start in range(first_page, first_page + pages_per_split, BLOCK_TOKENS // PAGE_SIZE):
            entry = block_start + page_in_block
            in_table = entry < n_table
            page = tl.load(table_ptr + kv_head * stride_th + entry, mask=in_table, other=-1).to(tl.int64)
            count = tl.load(counts_ptr + kv_head * stride_ch + entry, mask=in_table, other=0)
            valid = (page >= 0) & (slot < count)
            page = tl.where(valid, page, 0)  # keep masked-off addresses in range

            key_rows = key_ptr + page * stride_kp + kv_head * stride_kh + slot * stride_ks
            tile_ok = valid[:, None] & dim_ok[None, :]
            keys = tl.load(key_rows[:, None] + dims[None, :] * stride_kd, mask=tile_ok, other=0.0)
            keys = keys.to(query.dtype)
            if IEEE_FP32:
                scores = tl.dot(query.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(query, tl.trans(keys))
            scores = tl.where(valid[None, :], scores * qk_scale_log2, float("-inf"))

            new_max = tl.maximum(running_max, tl.max(scores, 1))
            # A row that has seen no valid slot yet keeps max -inf; subtract 0 instead so that exp2 gives 0, not NaN.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp2(scores - shift[:, None])
            rescale = tl.exp2(running_max - shift)
            running_sum = running_sum * rescale + tl.sum(probs, 1)

            value_rows = value_ptr + page * stride_vp + kv_head * stride_vh + slot * stride_vs
            values = tl.load(value_rows[:, None] + dims[None, :] * stride_vd, mask=tile_ok, other=0.0)
            # Probabilities stay float32 (tf32 tensor cores for 16-bit values, exact FMA for float32 inputs) so
            # that the result follows the float32 reference more closely than a bf16 cast of the probabilities.
            if IEEE_FP32:
                update = tl.dot(probs, values.to(tl.float32), input_precision="ieee")
            else:
                update = tl.dot(probs, values.to(tl.float32))
            acc = acc * rescale[:, None] + update
            running_max = new_max

        if N_SPLITS == 1:
            denominator = tl.where(running_sum > 0, running_sum, 1.0)
            out = acc / denominator[:, None]
            tl.store(
                out_ptr + heads[:, None] * stride_oh + dims[None, :] * stride_od,
                out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
            )
        else:
            part = row_parts + heads * N_SPLITS + split
            tl.store(
                part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                mask=row_ok[:, None] & dim_ok[None, :],
            )
            tl.store(part_max_ptr + part, running_max, mask=row_ok)
            tl.store(part_sum_ptr + part, running_sum, mask=row_ok)

    @triton.jit
    def _combine_splits_kernel(
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, rows_ptr,
        stride_oh, stride_od,
        HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        N_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr, N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr,
    ):
        head = tl.program_id(0)
        row = tl.program_id(2)
        out_ptr = at_row(out_ptr, rows_ptr, row, 5, N_COLUMNS, BATCHED)
        splits = tl.arange(0, BLOCK_SPLITS)
        dims = tl.arange(0, BLOCK_DIM)
        split_ok = splits < N_SPLITS
        dim_ok = dims < HEAD_DIM
        part = row.to(tl.int64) * tl.num_programs(0) * N_SPLITS + head * N_SPLITS + splits
        maxima = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
        sums = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
        accs = tl.load(
            part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :], other=0.0
        )
        top = tl.max(maxima, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        weights = tl.exp2(maxima - top)  # splits without a valid slot have max -inf and weight 0
        total = tl.sum(weights * sums, 0)
        total = tl.where(total > 0, total, 1.0)
        out = tl.sum(weights[:, None] * accs, 0) / total
        tl.store(out_ptr + head * stride_oh + dims * stride_od, out.to(out_ptr.dtype.element_ty), mask=dim_ok)

# ------------------------------------------------------------------------------------------------ launch plan


def _multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def choose_splits(
    n_table: int, n_kv_heads: int, pages_per_block: int, device: torch.device, page_size: int | None = None,
    programs_per_sm: int = PROGRAMS_PER_SM,
) -> tuple[int, int]:
    """``(n_splits, pages_per_split)``: enough programs to fill the GPU, no split without pages, whole blocks each.

    On CUDA, a selection of at most ``SINGLE_SPLIT_MAX_TOKENS`` tokens per KV head (``n_table * page_size``) gets
    one split, so the call is one kernel launch."""
    n_blocks = max(1, math.ceil(n_table / pages_per_block))
    if device.type == "cuda":
        if page_size is not None and n_table * page_size <= SINGLE_SPLIT_MAX_TOKENS:
            return 1, n_blocks * pages_per_block
        target_programs = programs_per_sm * _multiprocessor_count(device)
    else:  # interpreter: a few splits, so that the combine path is exercised too
        target_programs = 4 * n_kv_heads
    n_splits = max(1, min(n_blocks, math.ceil(target_programs / n_kv_heads)))
    blocks_per_split = math.ceil(n_blocks / n_splits)
    n_splits = math.ceil(n_blocks / blocks_per_split)
    return n_splits, blocks_per_split * pages_per_block


class _GeometryLaunch:
    """Everything about a call that depends only on its geometry: split count, grids, the constexpr arguments, the
    float32 scratch for the partial results, and the compiled kernels once launched."""

    __slots__ = ("n_splits", "pages_per_split", "grid", "combine_grid", "constants", "combine_constants",
                 "options", "part_acc", "part_max", "part_sum", "split_kernel", "combine_kernel")

    def __init__(self, plan: PagedAttentionPlan, query, key_pages, page_table, stream, rows: RowTable | None = None):
        n_heads, head_dim = query.shape
        _, n_kv_heads, page_size, _ = key_pages.shape
        if n_heads % n_kv_heads:
            raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
        if page_size & (page_size - 1) or page_size > 64:
            raise ValueError(f"page_size must be a power of two <= 64, got {page_size}")
        block_tokens = max(plan.block_tokens, page_size, 16)
        if block_tokens & (block_tokens - 1):
            raise ValueError(f"block_tokens must be a power of two, got {block_tokens}")
        device = query.device
        n_table = page_table.shape[1]
        pages_per_block = block_tokens // page_size
        if plan.n_splits is None:
            n_splits, pages_per_split = choose_splits(n_table, n_kv_heads, pages_per_block, device, page_size,
                                                      plan.programs_per_sm)
        else:
            n_blocks = max(1, math.ceil(n_table / pages_per_block))
            blocks_per_split = math.ceil(n_blocks / max(1, min(plan.n_splits, n_blocks)))
            n_splits = math.ceil(n_blocks / blocks_per_split)
            pages_per_split = blocks_per_split * pages_per_block
        self.n_splits, self.pages_per_split = n_splits, pages_per_split
        _, n_rows, n_columns, batched = table_arguments(rows, page_table)
        self.grid = (n_kv_heads, n_splits, n_rows)
        self.combine_grid = (n_heads, 1, n_rows)
        # Scratch for the partial results, shared by the plan's geometries of one stream (one split ignores it); a
        # batch's rows take one after the other.
        self.part_acc, self.part_max, self.part_sum = plan._split_scratch(device, stream, n_heads * n_rows,
                                                                          n_kv_heads, head_dim, n_splits)
        block_dim = triton.next_power_of_2(head_dim)
        # Exact float32 products for float32 inputs. Triton's CPU interpreter multiplies bf16 tiles wrongly (it sees
        # their bits as integers), so there every dot runs in float32 too; compiled 16-bit inputs use tensor cores.
        fp32_inputs = query.dtype == torch.float32 or key_pages.dtype == torch.float32 or interpreted()
        group = n_heads // n_kv_heads
        # GROUP, BLOCK_GROUP, HEAD_DIM, BLOCK_DIM, PAGE_SIZE, BLOCK_TOKENS, N_SPLITS, IEEE_FP32 (kernel order).
        self.constants = (group, max(16, triton.next_power_of_2(group)), head_dim, block_dim, page_size,
                          block_tokens, n_splits, fp32_inputs, n_columns, batched)
        # Exact float32 dots run on FMA units and need 8 warps to hold a 64-row tile without spilling (ptxas, sm_90).
        self.options = {"num_warps": plan.num_warps or (8 if fp32_inputs else 4), "num_stages": plan.num_stages}
        # HEAD_DIM, BLOCK_DIM, N_SPLITS, BLOCK_SPLITS, N_COLUMNS, BATCHED.
        self.combine_constants = (head_dim, block_dim, n_splits, max(2, triton.next_power_of_2(n_splits)), n_columns,
                                  batched)
        self.split_kernel = None
        self.combine_kernel = None


@dataclass(eq=False)
class PagedAttentionPlan:
    """The launch state of one caller's paged attention: made once by the layer that attends, passed to every call.

    The settings are ``n_splits`` (a fixed split count instead of the automatic one: tests), ``block_tokens`` (token
    rows per loop step: a power of two, at least 16 and at least the page size), ``num_warps`` and ``num_stages``
    (warps per program and software-pipelining stages: benchmarks), ``programs_per_sm`` (the automatic split
    count's aim: benchmarks) and ``direct_launch`` (None: wherever
    ``triton_runtime.direct_launch_supported``; False: Triton's own launch path every call). The first call of a
    geometry (dtypes, shapes, strides, stream, 16-byte alignment) prepares its launch and compiles; later ones
    launch the compiled kernel directly, so a call's host cost is a dictionary look-up and one or two launches. The
    float32 scratch for the partial results is shared by the plan's geometries of one stream, whose calls run in
    order.
    """

    n_splits: int | None = None
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    num_warps: int | None = None
    num_stages: int = 2
    programs_per_sm: int = PROGRAMS_PER_SM
    direct_launch: bool | None = None
    _launch: DirectLaunch = field(init=False, repr=False)
    _geometries: dict[tuple, _GeometryLaunch] = field(init=False, repr=False, default_factory=dict)
    _scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(init=False, repr=False,
                                                                                   default_factory=dict)

    def __post_init__(self):
        self._launch = DirectLaunch(self.direct_launch)

    def splits(self, query: torch.Tensor, key_pages: torch.Tensor, page_table: torch.Tensor) -> tuple[int, int]:
        """``(n_splits, pages_per_split)`` that this plan launches for these shapes (benchmarks)."""
        require_triton()
        launch = _GeometryLaunch(self, query, key_pages, page_table, stream_handle(query.device))
        return launch.n_splits, launch.pages_per_split

    def _split_scratch(self, device, stream: int, n_heads: int, n_kv_heads: int, head_dim: int, n_splits: int):
        """Float32 ``(acc [Hq, n, D], max [Hq, n], sum [Hq, n])`` with ``n >= n_splits``, per stream and geometry.

        The kernels index them as ``head * N_SPLITS + split``, so the first ``Hq * n_splits`` rows of a larger buffer
        serve. A larger request replaces the entry; geometries prepared earlier keep (and still use) their smaller
        buffers."""
        key = (device, stream, n_heads, n_kv_heads, head_dim)
        scratch = self._scratch.get(key)
        if scratch is None or scratch[1].numel() < n_heads * n_splits:
            if device.type == "cuda":  # room for the largest automatic split count, so that this rarely grows
                n_splits = max(n_splits, math.ceil(self.programs_per_sm * _multiprocessor_count(device) / n_kv_heads))
            scratch = (torch.empty(n_heads * n_splits * head_dim, device=device, dtype=torch.float32),
                       torch.empty(n_heads * n_splits, device=device, dtype=torch.float32),
                       torch.empty(n_heads * n_splits, device=device, dtype=torch.float32))
            self._scratch[key] = scratch
        return scratch


def paged_decode_attention_triton(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    page_table: torch.Tensor,
    valid_counts: torch.Tensor,
    scaling: float,
    plan: PagedAttentionPlan,
    *,
    out: torch.Tensor | None = None,
    rows: RowTable | None = None,
) -> torch.Tensor:
    """The Triton kernel: ``query [Hq, D]``, ``key_pages``/``value_pages [P, Hkv, S, D]``,
    ``page_table``/``valid_counts [Hkv, N]`` (entries < 0 are padding; any integer dtype) -> ``[Hq, D]`` in the
    query's dtype, written into ``out`` when given (same shape and dtype as the query, on its device).

    Nothing synchronises with the device, and no tensor is allocated except the output (none when ``out`` is
    given) once ``plan`` has seen the geometry. With ``rows`` (``ATTENTION_ROW_COLUMNS``), every row of a batch; the
    output is then row 0's, ``out`` (given, and in ``rows``) holding every row's.
    """
    require_triton()
    device = query.device
    if rows is not None:
        rows.check(ATTENTION_ROW_COLUMNS, "paged_decode_attention")
        if out is None or page_table.device != device or page_table.stride(-1) != 1 or \
                valid_counts.device != device or valid_counts.stride(-1) != 1:
            raise ValueError("paged_decode_attention: a batch's call gives out, and tables on the query's device with "
                             "unit stride along the entries")
    # Tables are used in place when they are on the device with unit stride along the entries (the kernel takes
    # any row stride and any integer dtype), so the usual call copies nothing.
    if page_table.device != device or page_table.stride(-1) != 1:
        page_table = page_table.to(device=device, non_blocking=True).contiguous()
    if valid_counts.device != device or valid_counts.stride(-1) != 1:
        valid_counts = valid_counts.to(device=device, non_blocking=True).contiguous()
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != device:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} on {device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    n_table = page_table.shape[1]
    if n_table == 0:
        return out.zero_()

    stream = stream_handle(device)
    # Everything Triton specialises on is in the key: dtypes, shapes and strides (the integer arguments follow
    # from them) and, through ``is_aligned``, the pointers' 16-byte alignment.
    is_aligned = aligned(query, key_pages, value_pages, page_table, valid_counts, out,
                         *(() if rows is None else (rows.offsets,)))
    key = (device, stream, is_aligned, None if rows is None else rows.offsets.shape,
           query.dtype, query.shape, query.stride(), out.dtype, out.stride(),
           key_pages.dtype, key_pages.shape, key_pages.stride(), value_pages.dtype, value_pages.stride(),
           page_table.dtype, page_table.shape, page_table.stride(), valid_counts.dtype, valid_counts.stride())
    launch = plan._geometries.get(key)
    if launch is None:
        if valid_counts.shape != page_table.shape:
            raise ValueError(f"valid_counts {tuple(valid_counts.shape)} and page_table {tuple(page_table.shape)} "
                             "must have the same shape")
        if len(plan._geometries) >= MAX_GEOMETRIES:  # Triton keeps the binaries; only the launch state goes
            plan._geometries.clear()
        launch = plan._geometries[key] = _GeometryLaunch(plan, query, key_pages, page_table, stream, rows)

    rows_ptr = table_arguments(rows, page_table)[0]
    args = (
        query, key_pages, value_pages, page_table, valid_counts,
        out, launch.part_acc, launch.part_max, launch.part_sum, rows_ptr,
        n_table, launch.pages_per_split, float(scaling) * _LOG2_E,
        *query.stride(), *key_pages.stride(), *value_pages.stride(),
        page_table.stride(0), valid_counts.stride(0), *out.stride(),
        *launch.constants,
    )
    compiled = plan._launch(_paged_decode_split_kernel, launch.split_kernel, launch.grid, args, stream, launch.options)
    if is_aligned:  # unaligned calls always take the JIT path, which specialises on alignment itself
        launch.split_kernel = compiled
    if launch.n_splits > 1:
        combine_args = (out, launch.part_acc, launch.part_max, launch.part_sum, rows_ptr, *out.stride(),
                        *launch.combine_constants)
        compiled = plan._launch(_combine_splits_kernel, launch.combine_kernel, launch.combine_grid, combine_args,
                                stream, {"num_warps": 4})
        if is_aligned:
            launch.combine_kernel = compiled
    return out


# ------------------------------------------------------------------------------------------------ dispatch


def paged_decode_attention(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    page_table: torch.Tensor,
    valid_counts: torch.Tensor,
    scaling: float,
    plan: PagedAttentionPlan,
) -> torch.Tensor:
    """Dispatch: the Triton kernel (launched through ``plan``) on CUDA when available, the reference otherwise."""
    if query.is_cuda and triton_available():
        return paged_decode_attention_triton(query, key_pages, value_pages, page_table, valid_counts, scaling, plan)
    return paged_decode_attention_reference(query, key_pages, value_pages, page_table, valid_counts, scaling)
