"""ShadowKV's decode step as three operations around its value copy: the window's turn, the selection with its
load plan, and the step's finish.

A sparse decode step of ShadowKV (``baselines/shadowkv.py``) is, per layer: ``turn_window``, ``select_and_plan``,
the block copy of the missing chunks' values from host memory (``block_copy``, on a side stream), ``finish_step``
and the paged attention.

* ``turn_window``: when a chunk starts, the window's oldest chunk (in the ring slot the new one takes) becomes a
  candidate: its landmark (the mean of its post-RoPE keys), the host copy of its values, and its keys' coefficients
  on the rank-``r`` basis (the keys rotated back to before RoPE, times the basis). The reference writes at every
  step, to the scratch chunk when no chunk leaves, so that the step has one shape; the kernel, launched at every
  step too, returns at once when no chunk leaves (seven steps in eight with chunks of 8 tokens: a step that turns
  the window took about 60 us a layer on an H100, the most of any ShadowKV kernel), and nothing reads the scratch
  chunk.
* ``select_and_plan``: each query head's softmax over its KV head's candidate chunks of ``q . landmark * scaling``
  (chunks before the window, outliers excluded), maximised over the KV group's heads; each KV head's top chunks;
  then the chosen chunks already in a selected slot stay, the others take the freed slots in slot order; the copy
  list for ``copy_blocks``, the attention's valid counts, and per KV head the tokens attended and chunks loaded.
* ``finish_step``: the new token into its window slot, the loaded chunks' keys rebuilt from their coefficients and
  rotated at their positions, and the step's counters added to ``DecodeCounters.device_totals``. Only the loaded
  chunks are rebuilt: a chunk's coefficients never change once it is a candidate, so a resident chunk's keys are
  those it was rebuilt with.

``*_reference`` are the PyTorch definitions (CPU, and CUDA without Triton); their results are the method's. The
Triton kernels: ``turn_window`` one program per KV head (landmark and values) and per block of the rank
(coefficients); ``select_and_plan`` three kernels (scores of small blocks of chunks with each block's softmax maximum
and sum, enough blocks to keep every SM reading landmarks; the probabilities and the top chunks of larger blocks;
per KV head the merge of those blocks' tops and the plan);
``finish_step`` one program per (KV head, ranked chunk). Six launches a step with the copy and the attention, where
the references take some 110 small kernels. ``ShadowKVStepPlan`` holds what they write, made once per layer.

Agreement of the kernels with the references on CUDA:

* Exact: the values' host copy, the token write, every decision of the plan given the same top chunks, and the
  counters. The landmark's float32 mean follows PyTorch's CUDA reduction order (``torch_order.mean_of_rows``),
  so it is bitwise too.
* Within float32 rounding: the coefficients, the scores and probabilities, the rebuilt keys (other summation
  orders than cuBLAS's, and the GPU's own cos and sin). Products of 16-bit values are exact in either, so the
  differences are the sums' rounding; stored in the cache dtype, most values are the same.
* The top chunks: sorted by probability, ties to the lower chunk id (PyTorch's CUDA ``topk`` leaves the order of
  ties unspecified). A near-tie can rank differently when the two probabilities round differently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .row_table import RowTable, at_row, at_row_unaligned, row_table, table_arguments
from .torch_order import ROUNDING, mean_of_rows, rounded
from .triton_runtime import available as triton_available
from .triton_runtime import interpreted, require_triton, tl, triton


@dataclass(frozen=True)
class ShadowKVSlots:
    """The slot layout of one ShadowKV layer: ``n_outlier`` outlier slots, ``n_selected`` selected slots, then the
    ``n_local`` window slots (a ring), then one scratch slot; chunks of ``chunk_size`` tokens."""

    chunk_size: int
    n_outlier: int
    n_selected: int
    n_local: int

    @property
    def window_slot0(self) -> int:
        return self.n_outlier + self.n_selected

    @property
    def n_attended_slots(self) -> int:
        return self.window_slot0 + self.n_local

    @property
    def scratch_slot(self) -> int:
        return self.n_attended_slots


class ShadowKVStepPlan:
    """The buffers a layer's steps write: the top chunks ``top [Hkv, k]`` (``k = min(n_selected, chunks)``), the
    copy list ``copy_pages``/``copy_slots``/``copy_heads [Hkv * k]`` (entry ``(h, i)``: chunk ``top[h, i]`` for KV
    head ``h``; slot ``-1``: resident already), the attention's ``counts [Hkv, n_attended_slots]`` int32 and
    ``loaded [Hkv, 2]`` (tokens attended, chunks loaded), and the Triton kernels' scratch. ``n_chunks`` counts the
    scratch chunk (the landmarks' second dimension)."""

    def __init__(self, layout: ShadowKVSlots, n_kv_heads: int, group_size: int, n_chunks: int,
                 device: torch.device, score_launch: "ScoreLaunch | None" = None):
        self.score_launch = score_launch or ScoreLaunch()
        self.n_top = min(layout.n_selected, n_chunks)
        self.n_chunks = n_chunks
        long = dict(dtype=torch.long, device=device)
        self.top = torch.zeros(n_kv_heads, self.n_top, **long)
        self.copy_pages = torch.zeros(n_kv_heads * self.n_top, **long)
        self.copy_slots = torch.full((n_kv_heads * self.n_top,), -1, **long)
        self.copy_heads = torch.arange(n_kv_heads, **long).repeat_interleave(self.n_top)
        self.counts = torch.zeros(n_kv_heads, layout.n_attended_slots, dtype=torch.int32, device=device)
        self.loaded = torch.zeros(n_kv_heads, 2, **long)
        # Triton's ranking: blocks of chunks sized so that at most about 16 blocks per KV head are merged.
        self.block_chunks = max(256, min(2048, _next_power_of_2(-(-n_chunks // 16))))
        self.n_blocks = -(-n_chunks // self.block_chunks)
        self.block_top = min(self.n_top, self.block_chunks)
        # Triton's scoring reads every landmark once and is bound by memory, so its blocks are smaller: about
        # SCORE_PROGRAMS programs in all, enough to keep every SM reading (with the ranking's blocks, 72 programs
        # read 32 MB a layer at 128k tokens and the scores took 4x the time of a read at the GPU's rate).
        self.score_chunks = min(self.block_chunks, max(self.score_launch.tile, _next_power_of_2(
            -(-n_chunks * n_kv_heads // self.score_launch.programs))))
        self.n_score_blocks = -(-n_chunks // self.score_chunks)
        if device.type == "cuda" or interpreted():
            padded = self.n_blocks * self.block_chunks
            self.scores = torch.empty(n_kv_heads, group_size, padded, dtype=torch.float32, device=device)
            self.probabilities = torch.zeros(n_kv_heads, padded, dtype=torch.float32, device=device)
            # Each score block's softmax maximum and sum, per query head of the group.
            self.block_max = torch.empty(n_kv_heads, group_size, self.n_score_blocks, dtype=torch.float32,
                                         device=device)
            self.block_sum = torch.empty_like(self.block_max)
            self.block_keys = torch.empty(n_kv_heads, self.n_blocks, self.block_top, **long)


#: The tensors each kernel finds per row of a batch (``row_table``), in the order of its pointer arguments. Names
#: are those of a layer's buffers (``is_outlier``, ``store_values``: the store's device view, ``totals``: the
#: sequence's device counters), its plan's (``scores`` ... ``loaded``) and the step's (``query [Hq, D]``, ``key`` and
#: ``value [Hkv, D]``, ``position [1]``).
TURN_ROW_COLUMNS = ("pool_keys", "pool_values", "landmarks", "store_values", "coefficients", "basis", "position")
SCORE_ROW_COLUMNS = ("query", "landmarks", "is_outlier", "scores", "block_max", "block_sum", "position")
RANK_ROW_COLUMNS = ("scores", "block_max", "block_sum", "probabilities", "block_keys")
PLAN_ROW_COLUMNS = ("block_keys", "top", "is_outlier", "outlier_ids", "slot_chunk", "copy_pages", "copy_slots",
                    "counts", "loaded", "position")
FINISH_ROW_COLUMNS = ("pool_keys", "pool_values", "key", "value", "coefficients", "basis", "copy_pages",
                      "copy_slots", "loaded", "totals", "position")


@dataclass(frozen=True)
class ShadowKVRowTables:
    """The row tables of one batched step of a layer: ``turn`` for ``turn_window``, ``score``, ``rank`` and ``plan``
    for ``select_and_plan``'s three kernels, ``finish`` for ``finish_step``."""

    turn: RowTable
    score: RowTable
    rank: RowTable
    plan: RowTable
    finish: RowTable

    @classmethod
    def of(cls, rows: list[dict[str, torch.Tensor]]) -> "ShadowKVRowTables":
        """The tables of ``rows``: each row's tensors by name (every name of the ``*_ROW_COLUMNS``)."""

        def table(columns: tuple[str, ...]) -> RowTable:
            return row_table([{name: row[name] for name in columns} for row in rows], unaligned=("position",))

        return cls(table(TURN_ROW_COLUMNS), table(SCORE_ROW_COLUMNS), table(RANK_ROW_COLUMNS),
                   table(PLAN_ROW_COLUMNS), table(FINISH_ROW_COLUMNS))


#: Chunks one step of the scoring kernel's loop scores, and about how many programs the scoring runs.
SCORE_TILE = 64
SCORE_PROGRAMS = 1024


#: How the scoring kernel multiplies the query heads of a group by a tile of landmarks (``ScoreLaunch.products``).
SCORE_PRODUCTS = ("dot", "dot_16bit", "fma")


@dataclass(frozen=True)
class ScoreLaunch:
    """How the scoring kernel is launched (scripts/diagnostics/shadowkv_score_sweep.py times the choices): about
    ``programs`` programs per row, ``tile`` chunks per loop step, ``num_warps``, ``num_stages`` (None: Triton's
    default), and ``products``:

    * ``dot``: landmarks widened to float32 and multiplied on tensor cores (TF32 products, exact for 16-bit inputs;
      IEEE for float32 ones), the group's query heads padded to the 16 rows a tensor-core product needs;
    * ``dot_16bit``: 16-bit landmarks and query multiplied as they are (exact products, float32 sums), which halves
      the tile's registers; float32 inputs fall back to ``dot``;
    * ``fma``: each query head of the group against the float32 tile on the ordinary cores, no padding to 16 rows.

    The scores agree within float32 rounding (their sums run in another order), so a near-tie can rank otherwise."""

    programs: int = SCORE_PROGRAMS
    tile: int = SCORE_TILE
    num_warps: int = 4
    num_stages: int | None = None
    products: str = "dot"

    def __post_init__(self):
        if self.products not in SCORE_PRODUCTS:
            raise ValueError(f"products must be one of {', '.join(SCORE_PRODUCTS)}, not {self.products!r}")
        if self.programs < 1 or self.tile < 16 or self.tile & (self.tile - 1):
            raise ValueError(f"programs must be positive and tile a power of two of at least 16, not "
                             f"{self.programs} and {self.tile}")


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# --- the paper's definitions -----------------------------------------------------------------------------------


def key_coefficients(pre_rope_keys: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``[Hkv, T, D]`` -> ``[T, r]``: each token's coordinates on the basis (``U S`` of the SVD for its tokens)."""
    n_kv_heads, n_tokens, head_dim = pre_rope_keys.shape
    return pre_rope_keys.float().transpose(0, 1).reshape(n_tokens, n_kv_heads * head_dim) @ basis.T


def rebuild_keys(coefficients: torch.Tensor, basis: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """``coefficients [..., T, r]`` (leading dims ``[Hkv]`` or none) -> pre-RoPE keys ``[Hkv, T, D]`` float32."""
    per_head = basis.float().view(basis.shape[0], n_kv_heads, -1).transpose(0, 1)  # [Hkv, r, D]
    if coefficients.dim() == 2:
        coefficients = coefficients.expand(n_kv_heads, -1, -1)
    return torch.einsum("htr,hrd->htd", coefficients.float(), per_head)


def landmark_scores(query: torch.Tensor, landmarks: torch.Tensor, candidates: torch.Tensor, scaling: float):
    """``query [Hq, D]``, ``landmarks [Hkv, C, D]``, ``candidates [Hkv, C]`` -> ``[Hkv, C]`` float32: each query
    head's softmax over its candidate chunks of ``q . landmark * scaling``, maximised over the KV group's heads
    (0 for chunks that are not candidates)."""
    n_kv_heads = landmarks.shape[0]
    q = query.float().view(n_kv_heads, -1, query.shape[-1])
    scores = torch.einsum("hgd,hcd->hgc", q, landmarks.float()) * scaling
    scores = scores.masked_fill(~candidates[:, None, :], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)  # no candidate: all 0 below
    weights = torch.exp(scores - top)
    probs = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return probs.amax(dim=1)


def window_base(layout: ShadowKVSlots, position: torch.Tensor) -> torch.Tensor:
    """The first chunk of the window at ``position``: the chunks before it are candidates."""
    return position // layout.chunk_size - layout.n_local + 1


def ring_chunks(layout: ShadowKVSlots, base: torch.Tensor) -> torch.Tensor:
    """``[n_local]``: the chunk each window ring slot holds, the window starting at chunk ``base``."""
    ring = torch.arange(layout.n_local, device=base.device)
    return base + torch.remainder(ring - base, layout.n_local)


# --- references ------------------------------------------------------------------------------------------------


def turn_window_reference(layout: ShadowKVSlots, position, pool_keys, pool_values, landmarks, store_values,
                          coefficients, basis, rotary, inv_freq) -> None:
    """``position [1]`` int64; the pool ``[slots + 1, Hkv, cs, D]``; ``landmarks [Hkv, C, D]`` and the store's
    device view ``[C, Hkv, cs, D]`` (chunk ``C - 1`` the scratch chunk); ``coefficients [C * cs, r]``; ``basis
    [r, Hkv * D]``; ``rotary`` applies and inverts RoPE with ``inv_freq``."""
    cs = layout.chunk_size
    chunk = position // cs
    leaving = chunk - layout.n_local
    leaves = (position % cs == 0) & (leaving >= 0)
    target = torch.where(leaves, leaving, landmarks.shape[1] - 1)  # [1]
    ring_slot = layout.window_slot0 + chunk % layout.n_local
    block_keys = pool_keys.index_select(0, ring_slot)[0]  # [Hkv, cs, D] post-RoPE, exact
    landmarks.index_copy_(1, target, block_keys.float().mean(dim=1, keepdim=True).to(landmarks.dtype))
    store_values.index_copy_(0, target, pool_values.index_select(0, ring_slot))
    offsets = torch.arange(cs, device=position.device)
    pre_rope = rotary.invert(block_keys, leaving.clamp(min=0) * cs + offsets, inv_freq)
    rows = target * cs + offsets
    coefficients.index_copy_(0, rows, key_coefficients(pre_rope, basis.float()).to(coefficients.dtype))


def select_and_plan_reference(layout: ShadowKVSlots, position, query, landmarks, is_outlier, outlier_ids,
                              slot_chunk, scaling: float, plan: ShadowKVStepPlan) -> None:
    """``query [Hq, D]``; ``is_outlier [Hkv, C]`` bool; ``outlier_ids [Hkv, n_outlier]`` (-1: none);
    ``slot_chunk [Hkv, n_selected + 1]`` (the chunk each selected slot holds, -1 empty; the last column takes
    writes with no target), updated in place; writes ``plan``'s top, copy list, counts and loaded."""
    cs, n_selected = layout.chunk_size, layout.n_selected
    base = window_base(layout, position)
    chunk_ids = torch.arange(landmarks.shape[1], device=position.device)
    candidates = (chunk_ids < base)[None, :] & ~is_outlier
    scores = landmark_scores(query, landmarks, candidates, scaling)
    top = scores.topk(plan.n_top, dim=-1).indices  # [Hkv, k]
    wanted = candidates.gather(1, top)
    plan.top.copy_(top)

    # The chosen chunks already in a selected slot stay; the others take the freed slots in slot order.
    held = slot_chunk[:, :n_selected]  # [Hkv, S]
    same = (held[:, :, None] == top[:, None, :]) & wanted[:, None, :]  # [Hkv, S, k]
    kept = same.any(dim=2)
    missing = wanted & ~same.any(dim=1)
    free_first = torch.argsort(kept.to(torch.int8), dim=1, stable=True)
    rank = (missing.long().cumsum(dim=1) - 1).clamp(min=0)
    target_slots = free_first.gather(1, rank)
    updated = torch.where(kept, held, -1)
    updated = torch.cat([updated, updated.new_full((updated.shape[0], 1), -1)], dim=1)
    updated.scatter_(1, torch.where(missing, target_slots, n_selected), torch.where(missing, top, -1))
    slot_chunk.copy_(updated)
    plan.copy_pages.copy_(top.clamp(min=0).flatten())
    plan.copy_slots.copy_(torch.where(missing, layout.n_outlier + target_slots, -1).flatten())

    # Whole outlier and selected chunks, the window's chunks up to the new token.
    ring_chunk = ring_chunks(layout, base)
    window = torch.where(ring_chunk >= 0, (position + 1 - ring_chunk * cs).clamp(0, cs), 0)
    counts = torch.cat([(outlier_ids >= 0) * cs, (slot_chunk[:, :n_selected] >= 0) * cs,
                        window.expand(slot_chunk.shape[0], -1)], dim=1)
    plan.counts.copy_(counts)
    plan.loaded.copy_(torch.stack([counts.sum(-1), missing.sum(-1)], dim=1))


def finish_step_reference(layout: ShadowKVSlots, position, key, value, pool_keys, pool_values, coefficients, basis,
                          rotary, inv_freq, plan: ShadowKVStepPlan, totals: torch.Tensor, block_bytes: int) -> None:
    """``key``/``value [Hkv, D]``: the new token into its window slot; the loaded chunks' keys (entries of the copy
    list with a slot) rebuilt into their slots; ``totals`` (float64 ``[4]``: pairs, mean attended tokens per KV
    head, blocks and bytes loaded) counts the step, ``block_bytes`` per (chunk, KV head) block of values."""
    cs = layout.chunk_size
    n_kv_heads = pool_keys.shape[1]
    heads = torch.arange(n_kv_heads, device=position.device)
    ring_slot = layout.window_slot0 + (position // cs) % layout.n_local
    offset = position % cs
    pool_keys.index_put_((ring_slot, heads, offset), key)
    pool_values.index_put_((ring_slot, heads, offset), value)

    offsets = torch.arange(cs, device=position.device)
    chunks = plan.copy_pages.view(n_kv_heads, -1)
    positions = (chunks[..., None] * cs + offsets).flatten(1)  # [Hkv, k * cs]
    keys = rotary.apply(rebuild_keys(coefficients[positions], basis, n_kv_heads), positions, inv_freq)
    slots = torch.where(plan.copy_slots >= 0, plan.copy_slots, layout.scratch_slot)
    pool_keys.index_put_((slots, plan.copy_heads), keys.view(-1, cs, keys.shape[-1]).to(pool_keys.dtype))

    n_loaded = plan.loaded[:, 1].sum()
    totals[0] += 1
    totals[1] += plan.loaded[:, 0].float().mean().to(torch.float64)
    totals[2] += n_loaded.to(torch.float64)
    totals[3] += (n_loaded * block_bytes).to(torch.float64)


# --- dispatch --------------------------------------------------------------------------------------------------


def runs_triton(tensor: torch.Tensor) -> bool:
    """Whether the dispatchers take the Triton kernels for this tensor's device."""
    return tensor.is_cuda and triton_available()


def turn_window(layout, position, pool_keys, pool_values, landmarks, store_values, coefficients, basis, rotary,
                inv_freq) -> None:
    run = turn_window_triton if runs_triton(pool_keys) else turn_window_reference
    run(layout, position, pool_keys, pool_values, landmarks, store_values, coefficients, basis, rotary, inv_freq)


def select_and_plan(layout, position, query, landmarks, is_outlier, outlier_ids, slot_chunk, scaling,
                    plan) -> None:
    run = select_and_plan_triton if runs_triton(landmarks) else select_and_plan_reference
    run(layout, position, query, landmarks, is_outlier, outlier_ids, slot_chunk, scaling, plan)


def finish_step(layout, position, key, value, pool_keys, pool_values, coefficients, basis, rotary, inv_freq, plan,
                totals, block_bytes: int) -> None:
    run = finish_step_triton if runs_triton(pool_keys) else finish_step_reference
    run(layout, position, key, value, pool_keys, pool_values, coefficients, basis, rotary, inv_freq, plan, totals,
        block_bytes)


# --- kernels ---------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _turn_window_kernel(
        pool_keys_ptr, pool_values_ptr, landmarks_ptr, store_ptr, coefficients_ptr, basis_ptr, inv_freq_ptr,
        position_ptr, rows_ptr, mean_factor, rope_scaling, rope_scaling_squared,
        stride_pool_slot, stride_pool_head, stride_landmark_head, stride_landmark_chunk, stride_store_chunk,
        stride_store_head, stride_coefficient_row, stride_basis_rank, stride_basis_column,
        N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr,
        CS: tl.constexpr, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, N_KV_HEADS: tl.constexpr, RANK: tl.constexpr,
        BLOCK_RANK: tl.constexpr, N_LOCAL: tl.constexpr, WINDOW_SLOT0: tl.constexpr, HAS_ROPE: tl.constexpr,
        ROUNDING: tl.constexpr,
    ):
        program = tl.program_id(0)
        row = tl.program_id(2)  # the batch's row (TURN_ROW_COLUMNS)
        pool_keys_ptr = at_row(pool_keys_ptr, rows_ptr, row, 0, N_COLUMNS, BATCHED)
        pool_values_ptr = at_row(pool_values_ptr, rows_ptr, row, 1, N_COLUMNS, BATCHED)
        landmarks_ptr = at_row(landmarks_ptr, rows_ptr, row, 2, N_COLUMNS, BATCHED)
        store_ptr = at_row(store_ptr, rows_ptr, row, 3, N_COLUMNS, BATCHED)
        coefficients_ptr = at_row(coefficients_ptr, rows_ptr, row, 4, N_COLUMNS, BATCHED)
        basis_ptr = at_row(basis_ptr, rows_ptr, row, 5, N_COLUMNS, BATCHED)
        position_ptr = at_row_unaligned(position_ptr, rows_ptr, row, 6, N_COLUMNS, BATCHED)
        position = tl.load(position_ptr).to(tl.int64)
        chunk = position // CS
        leaving = chunk - N_LOCAL
        # Only a step that starts a chunk, once the window is full, has a chunk leaving it; the others return at
        # once (the reference writes their scratch chunk instead, which nothing reads).
        if (position % CS == 0) & (leaving >= 0):
            target = leaving
            ring_slot = (WINDOW_SLOT0 + chunk % N_LOCAL).to(tl.int64)
            rows = tl.arange(0, BLOCK_ROWS)
            row_ok = rows < CS
            if program < N_KV_HEADS:  # this KV head's landmark and the host copy of its values
                head = program.to(tl.int64)
                dims = tl.arange(0, BLOCK_DIM)
                dim_ok = dims < HEAD_DIM
                block = ring_slot * stride_pool_slot + head * stride_pool_head
                mean = mean_of_rows(pool_keys_ptr + block, HEAD_DIM, dims, dim_ok, mean_factor, CS, BLOCK_DIM)
                landmark = landmarks_ptr + head * stride_landmark_head + target * stride_landmark_chunk + dims
                tl.store(landmark, rounded(mean, ROUNDING).to(landmarks_ptr.dtype.element_ty), mask=dim_ok)
                within = rows[:, None] * HEAD_DIM + dims[None, :]
                ok = row_ok[:, None] & dim_ok[None, :]
                values = tl.load(pool_values_ptr + block + within, mask=ok)
                stored = store_ptr + target * stride_store_chunk + head * stride_store_head
                tl.store(stored + within, values, mask=ok)
            else:  # a block of the leaving chunk's coefficients, summed over the KV heads
                ranks = (program - N_KV_HEADS) * BLOCK_RANK + tl.arange(0, BLOCK_RANK)
                rank_ok = ranks < RANK
                halves = tl.arange(0, BLOCK_HALF)
                half_ok = halves < HALF
                half_block_ok = row_ok[:, None] & half_ok[None, :]
                basis_ok = half_ok[:, None] & rank_ok[None, :]
                if HAS_ROPE:
                    token = (leaving * CS + rows).to(tl.float32)
                    frequency = tl.load(inv_freq_ptr + halves, mask=half_ok, other=0.0)
                    angle = token[:, None] * frequency[None, :]
                    cos = tl.cos(angle) * rope_scaling
                    sin = tl.sin(angle) * rope_scaling
                acc = tl.zeros([BLOCK_ROWS, BLOCK_RANK], dtype=tl.float32)
                for kv_head in range(N_KV_HEADS):
                    keys_block = pool_keys_ptr + ring_slot * stride_pool_slot + kv_head * stride_pool_head
                    x1 = tl.load(keys_block + rows[:, None] * HEAD_DIM + halves[None, :], mask=half_block_ok,
                                 other=0.0).to(tl.float32)
                    x2 = tl.load(keys_block + rows[:, None] * HEAD_DIM + HALF + halves[None, :],
                                 mask=half_block_ok, other=0.0).to(tl.float32)
                    if HAS_ROPE:  # Rotary.invert: (x cos - rotate_half(x) sin) / scaling^2
                        pre1 = tl.math.div_rn(x1 * cos - (-x2) * sin, rope_scaling_squared)
                        pre2 = tl.math.div_rn(x2 * cos - x1 * sin, rope_scaling_squared)
                    else:
                        pre1, pre2 = x1, x2
                    columns = (basis_ptr + ranks[None, :] * stride_basis_rank
                               + (kv_head * HEAD_DIM + halves[:, None]) * stride_basis_column)
                    basis1 = tl.load(columns, mask=basis_ok, other=0.0).to(tl.float32)
                    basis2 = tl.load(columns + HALF * stride_basis_column, mask=basis_ok,
                                     other=0.0).to(tl.float32)
                    acc += tl.dot(pre1, basis1, input_precision="ieee")
                    acc += tl.dot(pre2, basis2, input_precision="ieee")
                out = coefficients_ptr + (target * CS + rows)[:, None] * stride_coefficient_row + ranks[None, :]
                tl.store(out, rounded(acc, ROUNDING).to(coefficients_ptr.dtype.element_ty),
                         mask=row_ok[:, None] & rank_ok[None, :])

    @triton.jit
    def _score_kernel(
        query_ptr, landmarks_ptr, outlier_ptr, scores_ptr, block_max_ptr, block_sum_ptr, position_ptr, rows_ptr,
        n_chunks, scaling,
        stride_query_head, stride_landmark_head, stride_landmark_chunk, stride_outlier_head, stride_scores_head,
        stride_scores_group, stride_block_head, stride_block_group,
        N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr,
        CS: tl.constexpr, N_LOCAL: tl.constexpr, GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, TILE: tl.constexpr,
        PRECISION: tl.constexpr, DOT_16BIT: tl.constexpr, FMA: tl.constexpr,
    ):
        head = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        row = tl.program_id(2)  # SCORE_ROW_COLUMNS
        query_ptr = at_row(query_ptr, rows_ptr, row, 0, N_COLUMNS, BATCHED)
        landmarks_ptr = at_row(landmarks_ptr, rows_ptr, row, 1, N_COLUMNS, BATCHED)
        outlier_ptr = at_row(outlier_ptr, rows_ptr, row, 2, N_COLUMNS, BATCHED)
        scores_ptr = at_row(scores_ptr, rows_ptr, row, 3, N_COLUMNS, BATCHED)
        block_max_ptr = at_row(block_max_ptr, rows_ptr, row, 4, N_COLUMNS, BATCHED)
        block_sum_ptr = at_row(block_sum_ptr, rows_ptr, row, 5, N_COLUMNS, BATCHED)
        position_ptr = at_row_unaligned(position_ptr, rows_ptr, row, 6, N_COLUMNS, BATCHED)
        position = tl.load(position_ptr).to(tl.int64)
        base = position // CS - N_LOCAL + 1
        groups = tl.arange(0, BLOCK_GROUP)
        group_ok = groups < GROUP
        dims = tl.arange(0, BLOCK_DIM)
        dim_ok = dims < HEAD_DIM
        q = tl.load(query_ptr + (head * GROUP + groups)[:, None] * stride_query_head + dims[None, :],
                    mask=group_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_16BIT:
            q = q.to(landmarks_ptr.dtype.element_ty)
        else:
            q = q.to(tl.float32)
        running_max = tl.full([BLOCK_GROUP], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_GROUP], dtype=tl.float32)
        for start in range(0, BLOCK_CHUNKS, TILE):
            chunks = block * BLOCK_CHUNKS + start + tl.arange(0, TILE)
            in_range = chunks < n_chunks
            landmarks = tl.load(landmarks_ptr + head * stride_landmark_head + chunks[:, None] * stride_landmark_chunk
                                + dims[None, :], mask=in_range[:, None] & dim_ok[None, :], other=0.0)
            if DOT_16BIT:
                scores = tl.dot(q, tl.trans(landmarks)) * scaling  # [BLOCK_GROUP, TILE], float32 sums
            elif FMA:
                wide = landmarks.to(tl.float32)
                scores = tl.zeros([BLOCK_GROUP, TILE], dtype=tl.float32)
                for g in tl.static_range(BLOCK_GROUP):
                    head_query = tl.sum(tl.where(groups[:, None] == g, q, 0.0), 0)  # [BLOCK_DIM], q's row g
                    head_scores = tl.sum(wide * head_query[None, :], 1)  # [TILE]
                    scores = tl.where(groups[:, None] == g, head_scores[None, :], scores)
                scores = scores * scaling
            else:
                scores = tl.dot(q, tl.trans(landmarks.to(tl.float32)), input_precision=PRECISION) * scaling
            outlier = tl.load(outlier_ptr + head * stride_outlier_head + chunks, mask=in_range, other=1)
            candidate = in_range & (chunks < base) & (outlier == 0)
            scores = tl.where(candidate[None, :], scores, float("-inf"))
            tl.store(scores_ptr + head * stride_scores_head + groups[:, None] * stride_scores_group + chunks[None, :],
                     scores, mask=group_ok[:, None] & in_range[None, :])
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(scores - shift[:, None]), 1)
            running_max = new_max
        out = head * stride_block_head + groups * stride_block_group + block
        tl.store(block_max_ptr + out, running_max, mask=group_ok)
        tl.store(block_sum_ptr + out, running_sum, mask=group_ok)

    @triton.jit
    def _rank_kernel(
        scores_ptr, block_max_ptr, block_sum_ptr, probabilities_ptr, block_keys_ptr, rows_ptr, n_chunks,
        n_score_blocks,
        stride_scores_head, stride_scores_group, stride_block_head, stride_block_group, stride_probabilities_head,
        stride_keys_head, stride_keys_block,
        N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr,
        GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, BLOCK_BLOCKS: tl.constexpr,
        BLOCK_TOP: tl.constexpr, TOP_POW2: tl.constexpr,
    ):
        head = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        row = tl.program_id(2)  # RANK_ROW_COLUMNS
        scores_ptr = at_row(scores_ptr, rows_ptr, row, 0, N_COLUMNS, BATCHED)
        block_max_ptr = at_row(block_max_ptr, rows_ptr, row, 1, N_COLUMNS, BATCHED)
        block_sum_ptr = at_row(block_sum_ptr, rows_ptr, row, 2, N_COLUMNS, BATCHED)
        probabilities_ptr = at_row(probabilities_ptr, rows_ptr, row, 3, N_COLUMNS, BATCHED)
        block_keys_ptr = at_row(block_keys_ptr, rows_ptr, row, 4, N_COLUMNS, BATCHED)
        groups = tl.arange(0, BLOCK_GROUP)
        group_ok = groups < GROUP
        blocks = tl.arange(0, BLOCK_BLOCKS)
        partials = head * stride_block_head + groups[:, None] * stride_block_group + blocks[None, :]
        partial_ok = group_ok[:, None] & (blocks < n_score_blocks)[None, :]  # every score block's softmax partials
        block_max = tl.load(block_max_ptr + partials, mask=partial_ok, other=float("-inf"))
        block_sum = tl.load(block_sum_ptr + partials, mask=partial_ok, other=0.0)
        top = tl.maximum(tl.max(block_max, 1), -3.4028234663852886e38)  # no candidate: every probability 0
        total = tl.sum(tl.where(block_max == float("-inf"), 0.0, block_sum * tl.exp(block_max - top[:, None])), 1)
        total = tl.maximum(total, 1.1754943508222875e-38)

        chunks = block * BLOCK_CHUNKS + tl.arange(0, BLOCK_CHUNKS)
        in_range = chunks < n_chunks
        scores = tl.load(scores_ptr + head * stride_scores_head + groups[:, None] * stride_scores_group
                         + chunks[None, :], mask=group_ok[:, None] & in_range[None, :], other=float("-inf"))
        probabilities = tl.max(tl.exp(scores - top[:, None]) / total[:, None], 0)  # [BLOCK_CHUNKS], >= 0
        tl.store(probabilities_ptr + head * stride_probabilities_head + chunks, probabilities, mask=in_range)
        # Ranked by one int64 key: the probability's bits (non-negative floats order as their bits), then the
        # lower chunk first.
        keys = (probabilities.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (0xFFFFFFFF - chunks.to(tl.int64))
        keys = tl.where(in_range, keys, -1)
        # Bitonic top-k: sorts runs of TOP_POW2 and keeps the larger half of each merge, a fraction of a full sort's
        # exchanges; the keys are distinct, so the top and its order are the sort's.
        ranked = tl.topk(keys, TOP_POW2)
        places = tl.arange(0, TOP_POW2)
        tl.store(block_keys_ptr + head * stride_keys_head + block * stride_keys_block + places, ranked,
                 mask=places < BLOCK_TOP)

    @triton.jit
    def _plan_kernel(
        block_keys_ptr, top_ptr, outlier_ptr, outlier_ids_ptr, slot_chunk_ptr, copy_pages_ptr, copy_slots_ptr,
        counts_ptr, loaded_ptr, position_ptr, rows_ptr, n_keys,
        stride_keys_head, stride_top_head, stride_outlier_head, stride_outlier_ids_head, stride_slot_head,
        stride_counts_head,
        N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr,
        CS: tl.constexpr, N_OUTLIER: tl.constexpr, N_SELECTED: tl.constexpr, N_LOCAL: tl.constexpr,
        N_TOP: tl.constexpr, BLOCK_KEYS: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
        BLOCK_OUTLIER: tl.constexpr, BLOCK_LOCAL: tl.constexpr,
    ):
        head = tl.program_id(0).to(tl.int64)
        row = tl.program_id(2)  # PLAN_ROW_COLUMNS
        block_keys_ptr = at_row(block_keys_ptr, rows_ptr, row, 0, N_COLUMNS, BATCHED)
        top_ptr = at_row(top_ptr, rows_ptr, row, 1, N_COLUMNS, BATCHED)
        outlier_ptr = at_row(outlier_ptr, rows_ptr, row, 2, N_COLUMNS, BATCHED)
        outlier_ids_ptr = at_row(outlier_ids_ptr, rows_ptr, row, 3, N_COLUMNS, BATCHED)
        slot_chunk_ptr = at_row(slot_chunk_ptr, rows_ptr, row, 4, N_COLUMNS, BATCHED)
        copy_pages_ptr = at_row(copy_pages_ptr, rows_ptr, row, 5, N_COLUMNS, BATCHED)
        copy_slots_ptr = at_row(copy_slots_ptr, rows_ptr, row, 6, N_COLUMNS, BATCHED)
        counts_ptr = at_row(counts_ptr, rows_ptr, row, 7, N_COLUMNS, BATCHED)
        loaded_ptr = at_row(loaded_ptr, rows_ptr, row, 8, N_COLUMNS, BATCHED)
        position_ptr = at_row_unaligned(position_ptr, rows_ptr, row, 9, N_COLUMNS, BATCHED)
        position = tl.load(position_ptr).to(tl.int64)
        base = position // CS - N_LOCAL + 1

        # The merge of the blocks' top chunks: the first N_TOP keys in descending order.
        places = tl.arange(0, BLOCK_KEYS)
        keys = tl.load(block_keys_ptr + head * stride_keys_head + places, mask=places < n_keys, other=-1)
        ranked = tl.topk(keys, BLOCK_TOP)
        tops = tl.arange(0, BLOCK_TOP)
        tl.store(top_ptr + head * stride_top_head + tops, 0xFFFFFFFF - (ranked & 0xFFFFFFFF), mask=tops < N_TOP)
        tl.debug_barrier()

        top_ok = tops < N_TOP
        top = tl.load(top_ptr + head * stride_top_head + tops, mask=top_ok, other=-1)
        outlier = tl.load(outlier_ptr + head * stride_outlier_head + tl.maximum(top, 0), mask=top_ok, other=1)
        wanted = top_ok & (top < base) & (outlier == 0)
        slots = tl.arange(0, BLOCK_SLOTS)
        slot_ok = slots < N_SELECTED
        held = tl.load(slot_chunk_ptr + head * stride_slot_head + slots, mask=slot_ok, other=-1)
        same = (held[:, None] == top[None, :]) & wanted[None, :] & slot_ok[:, None]  # [slots, top]
        kept = tl.max(same.to(tl.int32), 1) > 0
        missing = wanted & (tl.max(same.to(tl.int32), 0) == 0)
        free = slot_ok & ~kept
        # The r-th missing chunk (r counted from 0, in top order) takes the r-th free slot.
        free_rank = tl.cumsum(free.to(tl.int32), 0) - free.to(tl.int32)
        missing_rank = tl.cumsum(missing.to(tl.int32), 0) - missing.to(tl.int32)
        chosen = free[:, None] & missing[None, :] & (free_rank[:, None] == missing_rank[None, :])
        target = tl.sum(tl.where(chosen, slots[:, None], 0), 0)  # [top]
        incoming = tl.sum(tl.where(chosen, top[None, :], 0), 1)  # [slots]
        arrives = tl.max(chosen.to(tl.int32), 1) > 0
        updated = tl.where(kept, held, tl.where(arrives, incoming, -1))
        tl.store(slot_chunk_ptr + head * stride_slot_head + slots, updated, mask=slot_ok)
        entries = head * N_TOP + tops
        tl.store(copy_pages_ptr + entries, tl.maximum(top, 0), mask=top_ok)
        tl.store(copy_slots_ptr + entries, tl.where(missing, N_OUTLIER + target, -1).to(tl.int64), mask=top_ok)

        # Valid counts: whole outlier and selected chunks, the window's chunks up to the new token.
        counts_row = counts_ptr + head * stride_counts_head
        outliers = tl.arange(0, BLOCK_OUTLIER)
        outlier_ok = outliers < N_OUTLIER
        outlier_ids = tl.load(outlier_ids_ptr + head * stride_outlier_ids_head + outliers, mask=outlier_ok, other=-1)
        outlier_counts = tl.where(outlier_ids >= 0, CS, 0)
        tl.store(counts_row + outliers, outlier_counts.to(tl.int32), mask=outlier_ok)
        selected_counts = tl.where(slot_ok & (updated >= 0), CS, 0)
        tl.store(counts_row + N_OUTLIER + slots, selected_counts.to(tl.int32), mask=slot_ok)
        ring = tl.arange(0, BLOCK_LOCAL)
        ring_ok = ring < N_LOCAL
        ring_chunk = base + ((ring - base) % N_LOCAL + N_LOCAL) % N_LOCAL
        window_counts = tl.where(ring_chunk >= 0, tl.minimum(tl.maximum(position + 1 - ring_chunk * CS, 0), CS), 0)
        window_counts = tl.where(ring_ok, window_counts, 0)
        tl.store(counts_row + N_OUTLIER + N_SELECTED + ring, window_counts.to(tl.int32), mask=ring_ok)
        attended = tl.sum(outlier_counts, 0) + tl.sum(selected_counts, 0) + tl.sum(window_counts, 0)
        tl.store(loaded_ptr + head * 2, attended.to(tl.int64))
        tl.store(loaded_ptr + head * 2 + 1, tl.sum(missing.to(tl.int64), 0))

    @triton.jit
    def _finish_kernel(
        pool_keys_ptr, pool_values_ptr, key_ptr, value_ptr, coefficients_ptr, basis_ptr, inv_freq_ptr,
        copy_pages_ptr, copy_slots_ptr, loaded_ptr, totals_ptr, position_ptr, rows_ptr, rope_scaling, inv_heads,
        block_bytes,
        stride_pool_slot, stride_pool_head, stride_key_head, stride_value_head, stride_coefficient_row,
        stride_basis_rank, stride_basis_column,
        N_COLUMNS: tl.constexpr, BATCHED: tl.constexpr,
        CS: tl.constexpr, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, N_KV_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr,
        N_TOP: tl.constexpr, RANK: tl.constexpr, BLOCK_RANK: tl.constexpr, N_LOCAL: tl.constexpr,
        WINDOW_SLOT0: tl.constexpr, HAS_ROPE: tl.constexpr, ROUNDING: tl.constexpr, PRECISION: tl.constexpr,
    ):
        head = tl.program_id(0).to(tl.int64)
        entry = tl.program_id(1)
        row = tl.program_id(2)  # FINISH_ROW_COLUMNS
        pool_keys_ptr = at_row(pool_keys_ptr, rows_ptr, row, 0, N_COLUMNS, BATCHED)
        pool_values_ptr = at_row(pool_values_ptr, rows_ptr, row, 1, N_COLUMNS, BATCHED)
        key_ptr = at_row(key_ptr, rows_ptr, row, 2, N_COLUMNS, BATCHED)
        value_ptr = at_row(value_ptr, rows_ptr, row, 3, N_COLUMNS, BATCHED)
        coefficients_ptr = at_row(coefficients_ptr, rows_ptr, row, 4, N_COLUMNS, BATCHED)
        basis_ptr = at_row(basis_ptr, rows_ptr, row, 5, N_COLUMNS, BATCHED)
        copy_pages_ptr = at_row(copy_pages_ptr, rows_ptr, row, 6, N_COLUMNS, BATCHED)
        copy_slots_ptr = at_row(copy_slots_ptr, rows_ptr, row, 7, N_COLUMNS, BATCHED)
        loaded_ptr = at_row(loaded_ptr, rows_ptr, row, 8, N_COLUMNS, BATCHED)
        totals_ptr = at_row(totals_ptr, rows_ptr, row, 9, N_COLUMNS, BATCHED)
        position_ptr = at_row_unaligned(position_ptr, rows_ptr, row, 10, N_COLUMNS, BATCHED)
        dtype = pool_keys_ptr.dtype.element_ty
        position = tl.load(position_ptr).to(tl.int64)
        if entry == 0:  # the new token of this KV head into its window slot
            dims = tl.arange(0, BLOCK_DIM)
            dim_ok = dims < HEAD_DIM
            ring_slot = (WINDOW_SLOT0 + (position // CS) % N_LOCAL).to(tl.int64)
            at = ring_slot * stride_pool_slot + head * stride_pool_head + (position % CS) * HEAD_DIM + dims
            tl.store(pool_keys_ptr + at, tl.load(key_ptr + head * stride_key_head + dims, mask=dim_ok), mask=dim_ok)
            tl.store(pool_values_ptr + at, tl.load(value_ptr + head * stride_value_head + dims, mask=dim_ok),
                     mask=dim_ok)
            if head == 0:  # the step's counters, from the plan's per-head counts
                heads = tl.arange(0, BLOCK_HEADS)
                head_ok = heads < N_KV_HEADS
                attended = tl.sum(tl.load(loaded_ptr + heads * 2, mask=head_ok, other=0), 0)
                n_loaded = tl.sum(tl.load(loaded_ptr + heads * 2 + 1, mask=head_ok, other=0), 0)
                tl.store(totals_ptr, tl.load(totals_ptr) + 1.0)
                mean_attended = attended.to(tl.float32) * inv_heads
                tl.store(totals_ptr + 1, tl.load(totals_ptr + 1) + mean_attended.to(tl.float64))
                tl.store(totals_ptr + 2, tl.load(totals_ptr + 2) + n_loaded.to(tl.float64))
                tl.store(totals_ptr + 3, tl.load(totals_ptr + 3) + (n_loaded * block_bytes).to(tl.float64))
        slot = tl.load(copy_slots_ptr + head * N_TOP + entry)
        if slot >= 0:  # a loaded chunk: its keys from its coefficients, rotated at its positions
            chunk = tl.load(copy_pages_ptr + head * N_TOP + entry)
            rows = tl.arange(0, BLOCK_ROWS)
            row_ok = rows < CS
            halves = tl.arange(0, BLOCK_HALF)
            half_ok = halves < HALF
            tokens = chunk * CS + rows
            keys1 = tl.zeros([BLOCK_ROWS, BLOCK_HALF], dtype=tl.float32)
            keys2 = tl.zeros([BLOCK_ROWS, BLOCK_HALF], dtype=tl.float32)
            for start in range(0, RANK, BLOCK_RANK):
                ranks = start + tl.arange(0, BLOCK_RANK)
                rank_ok = ranks < RANK
                coefficients = tl.load(coefficients_ptr + tokens[:, None] * stride_coefficient_row + ranks[None, :],
                                       mask=row_ok[:, None] & rank_ok[None, :], other=0.0).to(tl.float32)
                columns = basis_ptr + ranks[:, None] * stride_basis_rank + (head * HEAD_DIM + halves[None, :]) \
                    * stride_basis_column
                basis_ok = rank_ok[:, None] & half_ok[None, :]
                basis1 = tl.load(columns, mask=basis_ok, other=0.0).to(tl.float32)
                basis2 = tl.load(columns + HALF * stride_basis_column, mask=basis_ok, other=0.0).to(tl.float32)
                keys1 += tl.dot(coefficients, basis1, input_precision=PRECISION)
                keys2 += tl.dot(coefficients, basis2, input_precision=PRECISION)
            if HAS_ROPE:  # Rotary.apply: x cos + rotate_half(x) sin
                frequency = tl.load(inv_freq_ptr + halves, mask=half_ok, other=0.0)
                angle = tokens.to(tl.float32)[:, None] * frequency[None, :]
                cos = tl.cos(angle) * rope_scaling
                sin = tl.sin(angle) * rope_scaling
                out1 = keys1 * cos + (-keys2) * sin
                out2 = keys2 * cos + keys1 * sin
            else:
                out1, out2 = keys1, keys2
            block = pool_keys_ptr + slot * stride_pool_slot + head * stride_pool_head
            ok = row_ok[:, None] & half_ok[None, :]
            tl.store(block + rows[:, None] * HEAD_DIM + halves[None, :], rounded(out1, ROUNDING).to(dtype), mask=ok)
            tl.store(block + rows[:, None] * HEAD_DIM + HALF + halves[None, :], rounded(out2, ROUNDING).to(dtype),
                     mask=ok)


def _rope_arguments(rotary, inv_freq, device):
    """``(has_rope, inv_freq tensor, scaling)`` for the kernels (a dummy tensor without RoPE)."""
    if inv_freq is None:
        return False, torch.zeros(1, dtype=torch.float32, device=device), 1.0
    return True, inv_freq, float(getattr(rotary, "attention_scaling", 1.0))


def _dot_precision(dtype: torch.dtype) -> str:
    """16-bit values are exact in TF32, so their products are exact on tensor cores; float32 needs IEEE products."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_layouts(pool_keys, pool_values, coefficients, basis) -> None:
    n_slots, n_kv_heads, chunk_size, head_dim = pool_keys.shape
    if pool_keys.stride() != pool_values.stride() or pool_keys.stride(-1) != 1 or pool_keys.stride(-2) != head_dim:
        raise ValueError("shadowkv_step: the pool's keys and values of one layout, each chunk block contiguous")
    if coefficients.stride(-1) != 1 or basis.shape[1] != n_kv_heads * head_dim:
        raise ValueError("shadowkv_step: coefficients contiguous in their last dimension, a basis [r, Hkv * D]")
    if head_dim % 2:
        raise ValueError("shadowkv_step: an even head dimension (RoPE turns channel pairs)")


def turn_window_triton(layout: ShadowKVSlots, position, pool_keys, pool_values, landmarks, store_values,
                       coefficients, basis, rotary, inv_freq, rows: RowTable | None = None) -> None:
    """The Triton version of ``turn_window_reference``; with ``rows`` (``TURN_ROW_COLUMNS``), for every row of a
    batch, the tensors given being row 0's."""
    require_triton()
    if rows is not None:
        rows.check(TURN_ROW_COLUMNS, "turn_window")
    rows_ptr, n_rows, n_columns, batched = table_arguments(rows, position)
    _check_layouts(pool_keys, pool_values, coefficients, basis)
    if store_values.stride()[2:] != pool_values.stride()[2:] or landmarks.stride(-1) != 1:
        raise ValueError("shadowkv_step: store chunk blocks laid out as the pool's, landmarks contiguous rows")
    n_kv_heads, head_dim = pool_keys.shape[1], pool_keys.shape[3]
    rank = basis.shape[0]
    block_rank = 32
    has_rope, frequencies, rope_scaling = _rope_arguments(rotary, inv_freq, pool_keys.device)
    half = head_dim // 2
    grid = (n_kv_heads + triton.cdiv(rank, block_rank), 1, n_rows)
    _turn_window_kernel[grid](
        pool_keys, pool_values, landmarks, store_values, coefficients, basis, frequencies, position, rows_ptr,
        1.0 / layout.chunk_size, rope_scaling, rope_scaling ** 2,
        pool_keys.stride(0), pool_keys.stride(1), landmarks.stride(0), landmarks.stride(1), store_values.stride(0),
        store_values.stride(1), coefficients.stride(0), basis.stride(0), basis.stride(1),
        N_COLUMNS=n_columns, BATCHED=batched,
        CS=layout.chunk_size, BLOCK_ROWS=max(16, triton.next_power_of_2(layout.chunk_size)), HEAD_DIM=head_dim,
        BLOCK_DIM=triton.next_power_of_2(head_dim), HALF=half, BLOCK_HALF=max(16, triton.next_power_of_2(half)),
        N_KV_HEADS=n_kv_heads, RANK=rank, BLOCK_RANK=block_rank, N_LOCAL=layout.n_local,
        WINDOW_SLOT0=layout.window_slot0, HAS_ROPE=has_rope, ROUNDING=ROUNDING[coefficients.dtype], num_warps=4,
    )


def select_and_plan_triton(layout: ShadowKVSlots, position, query, landmarks, is_outlier, outlier_ids, slot_chunk,
                           scaling: float, plan: ShadowKVStepPlan, rows: ShadowKVRowTables | None = None) -> None:
    """The Triton version of ``select_and_plan_reference``: the scores by blocks of chunks, each block's top, then
    per KV head the merge and the plan; with ``rows``, for every row of a batch (the tensors given, ``plan``'s
    included, being row 0's)."""
    require_triton()
    score_rows, rank_rows, plan_rows = (None, None, None) if rows is None else (rows.score, rows.rank, rows.plan)
    for table, columns, name in ((score_rows, SCORE_ROW_COLUMNS, "score"), (rank_rows, RANK_ROW_COLUMNS, "rank"),
                                 (plan_rows, PLAN_ROW_COLUMNS, "plan")):
        if table is not None:
            table.check(columns, f"select_and_plan ({name})")
    n_kv_heads, n_chunks, head_dim = landmarks.shape
    if n_chunks != plan.n_chunks or query.stride(-1) != 1 or landmarks.stride(-1) != 1:
        raise ValueError("shadowkv_step: a plan made for these landmarks, query and landmarks contiguous rows")
    if slot_chunk.dtype != torch.long or outlier_ids.dtype != torch.long or is_outlier.dtype != torch.bool:
        raise ValueError("shadowkv_step: int64 slot table and outlier ids, a bool outlier mask")
    group = query.shape[0] // n_kv_heads
    outlier = is_outlier.view(torch.uint8)
    rows_ptr, n_rows, n_columns, batched = table_arguments(score_rows, position)
    launch = plan.score_launch
    # Triton's interpreter multiplies 16-bit tiles wrongly (it reads their bits as integers): there they are widened.
    dot_16bit = (launch.products == "dot_16bit" and landmarks.element_size() == 2 and query.dtype == landmarks.dtype
                 and not interpreted())
    fma = launch.products == "fma"
    _score_kernel[(n_kv_heads, plan.n_score_blocks, n_rows)](
        query, landmarks, outlier, plan.scores, plan.block_max, plan.block_sum, position, rows_ptr, n_chunks,
        float(scaling),
        query.stride(0), landmarks.stride(0), landmarks.stride(1), outlier.stride(0), plan.scores.stride(0),
        plan.scores.stride(1), plan.block_max.stride(0), plan.block_max.stride(1),
        N_COLUMNS=n_columns, BATCHED=batched,
        CS=layout.chunk_size, N_LOCAL=layout.n_local, GROUP=group,
        BLOCK_GROUP=triton.next_power_of_2(group) if fma else max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_DIM=max(16, triton.next_power_of_2(head_dim)), BLOCK_CHUNKS=plan.score_chunks,
        TILE=launch.tile, PRECISION=_dot_precision(landmarks.dtype),
        DOT_16BIT=dot_16bit, FMA=fma,
        num_warps=launch.num_warps, **({} if launch.num_stages is None else {"num_stages": launch.num_stages}),
    )
    rows_ptr, n_rows, n_columns, batched = table_arguments(rank_rows, position)
    _rank_kernel[(n_kv_heads, plan.n_blocks, n_rows)](
        plan.scores, plan.block_max, plan.block_sum, plan.probabilities, plan.block_keys, rows_ptr, n_chunks,
        plan.n_score_blocks,
        plan.scores.stride(0), plan.scores.stride(1), plan.block_max.stride(0), plan.block_max.stride(1),
        plan.probabilities.stride(0), plan.block_keys.stride(0), plan.block_keys.stride(1),
        N_COLUMNS=n_columns, BATCHED=batched,
        GROUP=group, BLOCK_GROUP=triton.next_power_of_2(group), BLOCK_CHUNKS=plan.block_chunks,
        BLOCK_BLOCKS=triton.next_power_of_2(plan.n_score_blocks), BLOCK_TOP=plan.block_top,
        TOP_POW2=triton.next_power_of_2(plan.block_top),
        num_warps=8 if plan.block_chunks >= 1024 else 4,
    )
    n_keys = plan.n_blocks * plan.block_top
    rows_ptr, n_rows, n_columns, batched = table_arguments(plan_rows, position)
    _plan_kernel[(n_kv_heads, 1, n_rows)](
        plan.block_keys, plan.top, outlier, outlier_ids, slot_chunk, plan.copy_pages, plan.copy_slots, plan.counts,
        plan.loaded, position, rows_ptr, n_keys,
        plan.block_keys.stride(0), plan.top.stride(0), outlier.stride(0), outlier_ids.stride(0), slot_chunk.stride(0),
        plan.counts.stride(0),
        N_COLUMNS=n_columns, BATCHED=batched,
        CS=layout.chunk_size, N_OUTLIER=layout.n_outlier, N_SELECTED=layout.n_selected, N_LOCAL=layout.n_local,
        N_TOP=plan.n_top, BLOCK_KEYS=triton.next_power_of_2(n_keys), BLOCK_TOP=triton.next_power_of_2(plan.n_top),
        BLOCK_SLOTS=triton.next_power_of_2(layout.n_selected),
        BLOCK_OUTLIER=triton.next_power_of_2(max(1, layout.n_outlier)),
        BLOCK_LOCAL=triton.next_power_of_2(layout.n_local), num_warps=4 if layout.n_selected <= 64 else 8,
    )


def finish_step_triton(layout: ShadowKVSlots, position, key, value, pool_keys, pool_values, coefficients, basis,
                       rotary, inv_freq, plan: ShadowKVStepPlan, totals: torch.Tensor, block_bytes: int,
                       rows: RowTable | None = None) -> None:
    """The Triton version of ``finish_step_reference``: one program per (KV head, ranked chunk); with ``rows``
    (``FINISH_ROW_COLUMNS``), per row of a batch too, the tensors given being row 0's."""
    require_triton()
    if rows is not None:
        rows.check(FINISH_ROW_COLUMNS, "finish_step")
    rows_ptr, n_rows, n_columns, batched = table_arguments(rows, position)
    _check_layouts(pool_keys, pool_values, coefficients, basis)
    if key.stride(-1) != 1 or value.stride(-1) != 1 or totals.dtype != torch.float64:
        raise ValueError("shadowkv_step: key and value contiguous in the last dimension, float64 totals")
    n_kv_heads, head_dim = pool_keys.shape[1], pool_keys.shape[3]
    half = head_dim // 2
    has_rope, frequencies, rope_scaling = _rope_arguments(rotary, inv_freq, pool_keys.device)
    _finish_kernel[(n_kv_heads, plan.n_top, n_rows)](
        pool_keys, pool_values, key, value, coefficients, basis, frequencies, plan.copy_pages, plan.copy_slots,
        plan.loaded, totals, position, rows_ptr, rope_scaling, 1.0 / n_kv_heads, block_bytes,
        pool_keys.stride(0), pool_keys.stride(1), key.stride(0), value.stride(0), coefficients.stride(0),
        basis.stride(0), basis.stride(1),
        N_COLUMNS=n_columns, BATCHED=batched,
        CS=layout.chunk_size, BLOCK_ROWS=max(16, triton.next_power_of_2(layout.chunk_size)), HEAD_DIM=head_dim,
        BLOCK_DIM=triton.next_power_of_2(head_dim), HALF=half, BLOCK_HALF=max(16, triton.next_power_of_2(half)),
        N_KV_HEADS=n_kv_heads, BLOCK_HEADS=triton.next_power_of_2(n_kv_heads), N_TOP=plan.n_top,
        RANK=basis.shape[0], BLOCK_RANK=32, N_LOCAL=layout.n_local, WINDOW_SLOT0=layout.window_slot0,
        HAS_ROPE=has_rope, ROUNDING=ROUNDING[pool_keys.dtype], PRECISION=_dot_precision(pool_keys.dtype),
        num_warps=4,
    )
