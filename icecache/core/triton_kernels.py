"""Triton kernels of the shared core: sparse paged decode attention and the page scatter of the bulk loader.

``paged_decode_attention`` is flash-decoding (split-K) over a per-KV-head selection of pages:

* grid ``(n_kv_heads, n_splits)``; a program serves all query heads of one GQA group (their keys and values are
  the same, so each page is read from memory once per group, not once per query head) over one contiguous range
  of the page table, with an online softmax in float32;
* each loop iteration gathers ``BLOCK_TOKENS`` token rows (``BLOCK_TOKENS / page_size`` selected pages) through
  the page table; a slot is attended iff its page entry is not padding (``>= 0``) and the slot index is below the
  page's valid count;
* when there is more than one split, a second kernel combines the partial results by log-sum-exp.

The semantics are those of ``attention.paged_decode_attention_reference``, which the tests compare against; the
one difference is a KV head with no valid slot at all, where the reference returns NaN and the kernel returns 0.

``scatter_pages`` writes ``n`` transit blocks ``[page_size, head_dim]`` into ``pool[slot, head]`` (the last stage
of ``paged.BulkLoader``); ``paged.scatter_pages_reference`` is its PyTorch counterpart.

Triton is optional: this module imports on a machine without it, and ``available()`` says whether the kernels
can run (Triton importable and a CUDA device present). Setting ``ICECACHE_DISABLE_TRITON=1`` makes ``available()``
false, so the PyTorch reference is used on the GPU too (for comparisons). With ``TRITON_INTERPRET=1`` set before
import, the kernels also run on CPU tensors in Triton's interpreter, which is how they are checked without a GPU.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from .cuda_driver import stream_handle as _stream_handle

try:  # Triton is optional: the CPU path of every method uses the PyTorch references.
    import triton
    import triton.language as tl
except Exception as error:  # noqa: BLE001 - a broken Triton install must not break importing the harness
    triton = None
    tl = None
    TRITON_IMPORT_ERROR: Exception | None = error
else:
    TRITON_IMPORT_ERROR = None

#: Token rows gathered per loop iteration of the attention kernel (a multiple of the page size; >= 16 for tl.dot).
DEFAULT_BLOCK_TOKENS = 64
#: Programs to aim for when choosing the number of splits, per streaming multiprocessor.
PROGRAMS_PER_SM = 2


def available() -> bool:
    """True when the Triton kernels can run here: Triton imports, a CUDA device is present, not disabled."""
    if os.environ.get("ICECACHE_DISABLE_TRITON", "0") not in ("", "0"):
        return False
    return TRITON_IMPORT_ERROR is None and torch.cuda.is_available()


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``), so CPU tensors are accepted."""
    return TRITON_IMPORT_ERROR is None and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _require_triton() -> None:
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(f"the Triton kernels need Triton, which did not import: {TRITON_IMPORT_ERROR}")


if TRITON_IMPORT_ERROR is None:

    @triton.jit
    def _paged_decode_split_kernel(
        query_ptr, key_ptr, value_ptr, table_ptr, counts_ptr,
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        n_table, pages_per_split, qk_scale_log2,
        stride_qh, stride_qd,
        stride_kp, stride_kh, stride_ks, stride_kd,
        stride_vp, stride_vh, stride_vs, stride_vd,
        stride_th, stride_ch,
        stride_oh, stride_od,
        GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
        N_SPLITS: tl.constexpr, IEEE_FP32: tl.constexpr,
    ):
        kv_head = tl.program_id(0)
        split = tl.program_id(1)

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
            part = heads * N_SPLITS + split
            tl.store(
                part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc,
                mask=row_ok[:, None] & dim_ok[None, :],
            )
            tl.store(part_max_ptr + part, running_max, mask=row_ok)
            tl.store(part_sum_ptr + part, running_sum, mask=row_ok)

    @triton.jit
    def _combine_splits_kernel(
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        stride_oh, stride_od,
        HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        N_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    ):
        head = tl.program_id(0)
        splits = tl.arange(0, BLOCK_SPLITS)
        dims = tl.arange(0, BLOCK_DIM)
        split_ok = splits < N_SPLITS
        dim_ok = dims < HEAD_DIM
        part = head * N_SPLITS + splits
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

    @triton.jit
    def _scatter_pages_kernel(
        transit_keys_ptr, transit_values_ptr, pool_keys_ptr, pool_values_ptr, slots_ptr, heads_ptr,
        stride_tn, stride_pool_slot, stride_pool_head,
        BLOCK_SIZE: tl.constexpr, BLOCK_ELEMENTS: tl.constexpr,
    ):
        block = tl.program_id(0)
        slot = tl.load(slots_ptr + block).to(tl.int64)
        head = tl.load(heads_ptr + block).to(tl.int64)
        elements = tl.arange(0, BLOCK_ELEMENTS)
        # A negative slot is an unused entry of a fixed-size transfer: no element of it is moved.
        ok = elements < tl.where(slot >= 0, BLOCK_SIZE, 0)
        source = block.to(tl.int64) * stride_tn + elements
        target = slot * stride_pool_slot + head * stride_pool_head + elements
        keys = tl.load(transit_keys_ptr + source, mask=ok)
        values = tl.load(transit_values_ptr + source, mask=ok)
        tl.store(pool_keys_ptr + target, keys.to(pool_keys_ptr.dtype.element_ty), mask=ok)
        tl.store(pool_values_ptr + target, values.to(pool_values_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _copy_blocks_kernel(
        source_keys_ptr, source_values_ptr, target_keys_ptr, target_values_ptr, pages_ptr, slots_ptr, heads_ptr,
        stride_source_page, stride_source_head, stride_target_slot, stride_target_head,
        BLOCK_SIZE: tl.constexpr, BLOCK_ELEMENTS: tl.constexpr,
    ):
        block = tl.program_id(0)
        slot = tl.load(slots_ptr + block).to(tl.int64)
        page = tl.load(pages_ptr + block).to(tl.int64)
        head = tl.load(heads_ptr + block).to(tl.int64)
        elements = tl.arange(0, BLOCK_ELEMENTS)
        ok = elements < tl.where(slot >= 0, BLOCK_SIZE, 0)  # a negative slot: nothing read, nothing written
        source = page * stride_source_page + head * stride_source_head + elements
        target = slot * stride_target_slot + head * stride_target_head + elements
        keys = tl.load(source_keys_ptr + source, mask=ok)
        values = tl.load(source_values_ptr + source, mask=ok)
        tl.store(target_keys_ptr + target, keys.to(target_keys_ptr.dtype.element_ty), mask=ok)
        tl.store(target_values_ptr + target, values.to(target_values_ptr.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------------ host side
#
# A decode step calls the attention once per layer, so its host cost is paid ~30 times per token. Measured on the
# H200 host (results/bench/kernels_h200_20261130.json), Triton's generic launch path (binding and specialising
# ~30 arguments, then the launcher) plus a few small allocations cost ~130 us per call, against a kernel of a few
# microseconds. So the host side keeps one ``_AttentionPlan`` per call geometry (splits, grid, scratch buffers,
# the compiled kernel) and, after the first call of a geometry, launches the compiled kernel directly.


def _fast_launch_enabled() -> bool:
    """Direct launches of compiled kernels (Triton >= 3.3, not interpreted, not disabled by
    ``ICECACHE_TRITON_FAST_LAUNCH=0``). Older Triton passes a different argument list to its launcher."""
    if TRITON_IMPORT_ERROR is not None or interpreted():
        return False
    if os.environ.get("ICECACHE_TRITON_FAST_LAUNCH", "1") in ("", "0"):
        return False
    try:
        major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 3)


_FAST_LAUNCH = _fast_launch_enabled()


def set_fast_launch(enabled: bool) -> bool:
    """Turn direct launches on or off (benchmarks and tests compare both); returns the previous setting. Turning
    them on has no effect where ``_fast_launch_enabled`` says they cannot work."""
    global _FAST_LAUNCH
    previous = _FAST_LAUNCH
    _FAST_LAUNCH = bool(enabled) and _fast_launch_enabled()
    return previous


def _launch(kernel, compiled, grid: tuple[int, ...], args: tuple, stream: int, options: dict):
    """Launch ``kernel`` on ``grid``; returns the compiled kernel to reuse for later launches of the same
    specialisation.

    The first launch of a specialisation goes through Triton's JIT (which compiles, or finds the kernel in its
    cache). Later ones call the compiled kernel with the same full argument list (constexprs included, as
    Triton >= 3.3 does itself), skipping the per-call binding and specialisation. The caller's cache key must pin
    everything Triton specialises on: argument dtypes, integers' value class (== 1, multiple of 16, 32/64-bit)
    and 16-byte pointer alignment.
    """
    global _FAST_LAUNCH
    if compiled is not None and _FAST_LAUNCH:
        try:
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, stream=stream)  # compiled kernels take 3-D grids
            return compiled
        # Unexpected Triton internals: use the JIT path from now on.
        except (AttributeError, TypeError, IndexError) as error:
            import warnings

            warnings.warn(f"direct Triton launch failed ({error!r}); using Triton's launch path", RuntimeWarning,
                          stacklevel=2)
            _FAST_LAUNCH = False
    result = kernel[grid](*args, **options)
    return result if _FAST_LAUNCH and hasattr(result, "function") else None


def _aligned(*tensors: torch.Tensor) -> bool:
    """All pointers 16-byte aligned (what Triton assumes of tensors by default); then one compiled kernel serves
    every call of a geometry. Otherwise the call takes the JIT path, which specialises per pointer."""
    address = 0
    for tensor in tensors:
        address |= tensor.data_ptr()
    return address & 15 == 0


@functools.lru_cache(maxsize=None)
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: Tokens per KV head up to which one split (one kernel, no combine pass) is used on CUDA: below this the second
#: launch costs more than the extra programs would save. 512 tokens are 8 loop steps of 64 rows per program.
SINGLE_SPLIT_MAX_TOKENS = 512


def choose_splits(
    n_table: int, n_kv_heads: int, pages_per_block: int, device: torch.device, page_size: int | None = None
) -> tuple[int, int]:
    """``(n_splits, pages_per_split)``: enough programs to fill the GPU, no split without pages, whole blocks each.

    On CUDA, a selection of at most ``SINGLE_SPLIT_MAX_TOKENS`` tokens per KV head (``n_table * page_size``) gets
    one split, so the call is one kernel launch."""
    n_blocks = max(1, math.ceil(n_table / pages_per_block))
    if device.type == "cuda":
        if page_size is not None and n_table * page_size <= SINGLE_SPLIT_MAX_TOKENS:
            return 1, n_blocks * pages_per_block
        target_programs = PROGRAMS_PER_SM * _multiprocessor_count(device.index or 0)
    else:  # interpreter: a few splits, so that the combine path is exercised too
        target_programs = 4 * n_kv_heads
    n_splits = max(1, min(n_blocks, math.ceil(target_programs / n_kv_heads)))
    blocks_per_split = math.ceil(n_blocks / n_splits)
    n_splits = math.ceil(n_blocks / blocks_per_split)
    return n_splits, blocks_per_split * pages_per_block


class _AttentionPlan:
    """Everything about a paged attention call that depends only on its geometry: split count, grids, the
    constexpr arguments, the float32 scratch for the partial results (reused: calls on one stream run in order),
    and the compiled kernels once launched."""

    __slots__ = ("n_splits", "pages_per_split", "grid", "combine_grid", "constants", "combine_constants",
                 "options", "part_acc", "part_max", "part_sum", "split_kernel", "combine_kernel")

    def __init__(self, query, key_pages, page_table, n_splits, block_tokens, num_warps, stream):
        n_heads, head_dim = query.shape
        _, n_kv_heads, page_size, _ = key_pages.shape
        if n_heads % n_kv_heads:
            raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
        if page_size & (page_size - 1) or page_size > 64:
            raise ValueError(f"page_size must be a power of two <= 64, got {page_size}")
        block_tokens = max(block_tokens, page_size, 16)
        if block_tokens & (block_tokens - 1):
            raise ValueError(f"block_tokens must be a power of two, got {block_tokens}")
        device = query.device
        n_table = page_table.shape[1]
        pages_per_block = block_tokens // page_size
        if n_splits is None:
            n_splits, pages_per_split = choose_splits(n_table, n_kv_heads, pages_per_block, device, page_size)
        else:
            n_blocks = max(1, math.ceil(n_table / pages_per_block))
            blocks_per_split = math.ceil(n_blocks / max(1, min(n_splits, n_blocks)))
            n_splits = math.ceil(n_blocks / blocks_per_split)
            pages_per_split = blocks_per_split * pages_per_block
        self.n_splits, self.pages_per_split = n_splits, pages_per_split
        self.grid = (n_kv_heads, n_splits)
        self.combine_grid = (n_heads,)
        # Scratch for the partial results, shared by the plans of one stream (the single-split path ignores it).
        self.part_acc, self.part_max, self.part_sum = _split_scratch(device, stream, n_heads, head_dim, n_splits)
        block_dim = triton.next_power_of_2(head_dim)
        # Exact float32 products for float32 inputs. Triton's CPU interpreter multiplies bf16 tiles wrongly (it sees
        # their bits as integers), so there every dot runs in float32 too; compiled 16-bit inputs use tensor cores.
        fp32_inputs = query.dtype == torch.float32 or key_pages.dtype == torch.float32 or interpreted()
        group = n_heads // n_kv_heads
        # GROUP, BLOCK_GROUP, HEAD_DIM, BLOCK_DIM, PAGE_SIZE, BLOCK_TOKENS, N_SPLITS, IEEE_FP32 (kernel order).
        self.constants = (group, max(16, triton.next_power_of_2(group)), head_dim, block_dim, page_size,
                          block_tokens, n_splits, fp32_inputs)
        # Exact float32 dots run on FMA units and need 8 warps to hold a 64-row tile without spilling (ptxas, sm_90).
        self.options = {"num_warps": num_warps or (8 if fp32_inputs else 4), "num_stages": 2}
        # HEAD_DIM, BLOCK_DIM, N_SPLITS, BLOCK_SPLITS.
        self.combine_constants = (head_dim, block_dim, n_splits, max(2, triton.next_power_of_2(n_splits)))
        self.split_kernel = None
        self.combine_kernel = None


_ATTENTION_PLANS: dict[tuple, _AttentionPlan] = {}
_MAX_PLANS = 512
_SPLIT_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _split_scratch(device, stream: int, n_heads: int, head_dim: int, n_splits: int):
    """Float32 ``(acc [Hq, n, D], max [Hq, n], sum [Hq, n])`` with ``n >= n_splits``, per stream and geometry.

    The kernels index them as ``head * N_SPLITS + split``, so the first ``Hq * n_splits`` rows of a larger buffer
    serve. A larger request replaces the entry; plans made earlier keep (and still use) their smaller buffers.
    Calls on one stream run in order, so sharing them between calls is safe."""
    key = (device, stream, n_heads, head_dim)
    scratch = _SPLIT_SCRATCH.get(key)
    if scratch is None or scratch[1].numel() < n_heads * n_splits:
        if device.type == "cuda":  # room for the largest automatic split count, so that this rarely grows
            n_splits = max(n_splits, math.ceil(PROGRAMS_PER_SM * _multiprocessor_count(device.index or 0)))
        scratch = (torch.empty(n_heads * n_splits * head_dim, device=device, dtype=torch.float32),
                   torch.empty(n_heads * n_splits, device=device, dtype=torch.float32),
                   torch.empty(n_heads * n_splits, device=device, dtype=torch.float32))
        _SPLIT_SCRATCH[key] = scratch
    return scratch


def clear_plans() -> None:
    """Forget the cached launch plans (and free their scratch buffers)."""
    _ATTENTION_PLANS.clear()
    _SPLIT_SCRATCH.clear()
    _SCATTER_KERNELS.clear()


def attention_plan(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    page_table: torch.Tensor,
    *,
    n_splits: int | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> tuple[int, int]:
    """``(n_splits, pages_per_split)`` that ``paged_decode_attention`` uses for these shapes (benchmarks)."""
    _require_triton()
    plan = _AttentionPlan(query, key_pages, page_table, n_splits, block_tokens, None, _stream_handle(query.device))
    return plan.n_splits, plan.pages_per_split


def paged_decode_attention(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    page_table: torch.Tensor,
    valid_counts: torch.Tensor,
    scaling: float,
    *,
    n_splits: int | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton flash-decoding over selected pages: ``query [Hq, D]``, ``key_pages``/``value_pages [P, Hkv, S, D]``,
    ``page_table``/``valid_counts [Hkv, N]`` (entries < 0 are padding; any integer dtype) -> ``[Hq, D]`` in the
    query's dtype, written into ``out`` when given (same shape and dtype as the query, on its device).

    ``n_splits`` overrides the split count (tests); ``block_tokens`` is the token rows per loop step (a power of two,
    at least 16 and at least the page size); ``num_warps`` overrides the warps per program (benchmarks).

    The host cost per call is a dictionary look-up and one or two direct kernel launches: nothing synchronises
    with the device, and no tensor is allocated except the output (none when ``out`` is given). The plan's scratch
    buffers are shared by calls of the same geometry on the same stream, which run in order.
    """
    _require_triton()
    device = query.device
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

    stream = _stream_handle(device)
    # Everything Triton specialises on is in the key: dtypes, shapes and strides (the integer arguments follow
    # from them) and, through ``aligned``, the pointers' 16-byte alignment.
    aligned = _aligned(query, key_pages, value_pages, page_table, valid_counts, out)
    key = (device, stream, aligned, n_splits, block_tokens, num_warps,
           query.dtype, query.shape, query.stride(), out.dtype, out.stride(),
           key_pages.dtype, key_pages.shape, key_pages.stride(), value_pages.dtype, value_pages.stride(),
           page_table.dtype, page_table.shape, page_table.stride(), valid_counts.dtype, valid_counts.stride())
    plan = _ATTENTION_PLANS.get(key)
    if plan is None:
        if valid_counts.shape != page_table.shape:
            raise ValueError(f"valid_counts {tuple(valid_counts.shape)} and page_table {tuple(page_table.shape)} "
                             "must have the same shape")
        if len(_ATTENTION_PLANS) >= _MAX_PLANS:  # e.g. a table width that changes every step; Triton keeps the binaries
            _ATTENTION_PLANS.clear()
        plan = _ATTENTION_PLANS[key] = _AttentionPlan(query, key_pages, page_table, n_splits, block_tokens,
                                                      num_warps, stream)

    args = (
        query, key_pages, value_pages, page_table, valid_counts,
        out, plan.part_acc, plan.part_max, plan.part_sum,
        n_table, plan.pages_per_split, float(scaling) * _LOG2_E,
        *query.stride(), *key_pages.stride(), *value_pages.stride(),
        page_table.stride(0), valid_counts.stride(0), *out.stride(),
        *plan.constants,
    )
    compiled = _launch(_paged_decode_split_kernel, plan.split_kernel, plan.grid, args, stream, plan.options)
    if aligned:  # unaligned calls always take the JIT path, which specialises on alignment itself
        plan.split_kernel = compiled
    if plan.n_splits > 1:
        combine_args = (out, plan.part_acc, plan.part_max, plan.part_sum, *out.stride(), *plan.combine_constants)
        compiled = _launch(_combine_splits_kernel, plan.combine_kernel, plan.combine_grid, combine_args, stream,
                           {"num_warps": 4})
        if aligned:
            plan.combine_kernel = compiled
    return out


_LOG2_E = math.log2(math.e)

_SCATTER_KERNELS: dict[tuple, object] = {}


def scatter_pages(
    transit_keys: torch.Tensor,
    transit_values: torch.Tensor,
    pool_keys: torch.Tensor,
    pool_values: torch.Tensor,
    slots: torch.Tensor,
    heads: torch.Tensor,
) -> None:
    """Write block ``i`` of ``transit_keys``/``transit_values [n, S, D]`` into ``pool[slots[i], heads[i]]``.

    The pools are ``[n_slots, Hkv, S, D]`` and must be contiguous in their last two dimensions (one page block is
    one run of ``S * D`` elements); the transit blocks likewise. Values are cast to the pool dtype.
    ``(slots[i], heads[i])`` pairs must be distinct, as for ``index_put_``; entries with a negative slot are skipped
    (the padding of a fixed-size transfer). Launched directly after the first call of a layout, like the attention.
    """
    _require_triton()
    n = transit_keys.shape[0]
    if n == 0:
        return
    page_size, head_dim = pool_keys.shape[-2:]
    block_size = page_size * head_dim
    for name, tensor in (("transit_keys", transit_keys), ("transit_values", transit_values),
                         ("pool_keys", pool_keys), ("pool_values", pool_values)):
        if tensor.stride(-1) != 1 or tensor.stride(-2) != head_dim:
            raise ValueError(f"{name} must be contiguous within each page block")
    if transit_keys.stride(0) != transit_values.stride(0) or pool_keys.stride()[:2] != pool_values.stride()[:2]:
        raise ValueError("keys and values must have the same layout")
    device = pool_keys.device
    if slots.device != device:
        slots = slots.to(device=device, non_blocking=True)
    if heads.device != device:
        heads = heads.to(device=device, non_blocking=True)
    args = (
        transit_keys, transit_values, pool_keys, pool_values, slots, heads,
        transit_keys.stride(0), pool_keys.stride(0), pool_keys.stride(1),
        block_size, triton.next_power_of_2(block_size),
    )
    stream = _stream_handle(device)
    aligned = _aligned(transit_keys, transit_values, pool_keys, pool_values, slots, heads)
    key = (device, aligned, transit_keys.dtype, transit_values.dtype, pool_keys.dtype, pool_values.dtype,
           slots.dtype, heads.dtype, *args[6:])
    compiled = _launch(_scatter_pages_kernel, _SCATTER_KERNELS.get(key), (n,), args, stream, {"num_warps": 4})
    if aligned and compiled is not None:
        _SCATTER_KERNELS[key] = compiled


def copy_blocks(
    source_keys: torch.Tensor, source_values: torch.Tensor, pages: torch.Tensor,
    target_keys: torch.Tensor, target_values: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
) -> None:
    """``target[slots[i], heads[i]] = source[pages[i], heads[i]]`` (``[n, Hkv, page_size, D]`` layouts, each block
    contiguous), entries with a negative slot skipped without a read (``paged.copy_blocks_reference``)."""
    _require_triton()
    n = slots.numel()
    if n == 0:
        return
    page_size, head_dim = target_keys.shape[-2:]
    for name, tensor in (("source_keys", source_keys), ("source_values", source_values),
                         ("target_keys", target_keys), ("target_values", target_values)):
        if tensor.stride(-1) != 1 or tensor.stride(-2) != head_dim:
            raise ValueError(f"{name} must be contiguous within each page block")
    if source_keys.stride()[:2] != source_values.stride()[:2] or target_keys.stride()[:2] != target_values.stride()[:2]:
        raise ValueError("keys and values must have the same layout")
    block_size = page_size * head_dim
    _copy_blocks_kernel[(n,)](
        source_keys, source_values, target_keys, target_values, pages, slots, heads,
        source_keys.stride(0), source_keys.stride(1), target_keys.stride(0), target_keys.stride(1),
        BLOCK_SIZE=block_size, BLOCK_ELEMENTS=triton.next_power_of_2(block_size), num_warps=4,
    )
