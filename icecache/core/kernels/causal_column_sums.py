"""Column sums of the causal softmax attention of a chunk of prompt queries: H2O's accumulated attention at prefill.

``causal_column_sums(query [Hq, S, D], keys [Hkv, T, D], scaling) -> [Hq, T]`` (float32): for S queries that are
the last S of T positions, each key's summed causal softmax probability over the S rows.

* ``causal_column_sums_reference``: PyTorch, ``chunk_size`` rows at a time; runs everywhere and defines the
  semantics.
* ``causal_column_sums_triton``: two passes that never build the ``[S, T]`` probability matrix: a first computes
  each row's log-sum-exp, a second sums ``exp(s - lse)`` down the columns, tile by tile. The tile shapes are
  autotuned by Triton once per geometry (its own tuning record, kept with the kernel). Given the rows' log-sum-exps
  (``row_lse``: those the prefill's attention kernel returned, ``attention.dense_attention_and_lse``), the first
  pass is skipped; they come from the same products summed in another order, so the sums differ by float32
  rounding.
* ``causal_column_sums``: the dispatch, the Triton kernels on CUDA when ``triton_runtime.available()``, the
  reference otherwise.

The products of 16-bit inputs are exact in float32 on both paths, so the two differ only in the order of float32
sums.
"""

from __future__ import annotations

import math

import torch

from .triton_runtime import available as triton_available
from .triton_runtime import last_dim_contiguous, require_triton, tl, triton

_LOG2_E = math.log2(math.e)


def causal_column_sums_reference(query: torch.Tensor, keys: torch.Tensor, scaling: float,
                                 chunk_size: int = 256) -> torch.Tensor:
    """Column sums of the causal softmax attention: ``query [Hq, S, D]`` are the last S of ``keys [Hkv, T, D]``.

    Returns ``[Hq, T]`` float32: for each query head and key, the summed probability over the S query rows.
    Works on ``chunk_size`` rows at a time, so memory is ``Hq * chunk_size * T`` rather than ``Hq * S * T``.
    """
    n_heads, n_queries, head_dim = query.shape
    n_kv_heads, n_keys = keys.shape[:2]
    group = n_heads // n_kv_heads
    k = keys.float()
    total = query.new_zeros(n_kv_heads, group, n_keys, dtype=torch.float32)
    columns = torch.arange(n_keys, device=query.device)
    offset = n_keys - n_queries  # query row i sits at position offset + i
    for begin in range(0, n_queries, chunk_size):
        q = query[:, begin : begin + chunk_size].float().view(n_kv_heads, group, -1, head_dim)
        rows = torch.arange(begin, begin + q.shape[2], device=query.device) + offset
        scores = torch.einsum("hgsd,htd->hgst", q, k) * scaling
        scores = scores.masked_fill(columns[None, :] > rows[:, None], float("-inf"))
        total += torch.softmax(scores, dim=-1).sum(dim=2)
    return total.reshape(n_heads, n_keys)


def causal_column_sums(query: torch.Tensor, keys: torch.Tensor, scaling: float, chunk_size: int = 256,
                       row_lse: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: the Triton kernels on CUDA when available (one pass when ``row_lse [Hq, S]``, natural log, is
    given), the chunked PyTorch reference otherwise (which computes its own)."""
    if query.is_cuda and triton_available():
        return causal_column_sums_triton(query, keys, scaling, row_lse)
    return causal_column_sums_reference(query, keys, scaling, chunk_size)


if triton is not None:

    # Prefill-sized problems (thousands of rows and columns): tile shapes chosen once per geometry on first use.
    # Both kernels only write their outputs, so the tuning runs leave no trace.
    _PREFILL_TILES = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
                      for m, n, w, st in ((64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 4, 3), (64, 128, 8, 2))]

    @triton.autotune(configs=_PREFILL_TILES, key=["HEAD_DIM", "GROUP", "IEEE_FP32"])
    @triton.jit
    def _row_lse_kernel(
        query_ptr, key_ptr, lse_ptr,
        n_queries, n_keys, qk_scale_log2,
        stride_qh, stride_qs, stride_kh, stride_kt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_FP32: tl.constexpr,
    ):
        head = tl.program_id(0)
        row_block = tl.program_id(1)
        kv_head = head // GROUP
        offset = n_keys - n_queries
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_queries
        dims = tl.arange(0, BLOCK_DIM)
        dim_ok = dims < HEAD_DIM
        query = tl.load(query_ptr + head.to(tl.int64) * stride_qh + rows[:, None].to(tl.int64) * stride_qs
                        + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        positions = rows + offset
        running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        # Keys past the block's last row are masked; past n_keys (the last block only) the loads are masked too.
        for start in range(0, offset + (row_block + 1) * BLOCK_M, BLOCK_N):
            columns = start + tl.arange(0, BLOCK_N)
            keys = tl.load(key_ptr + kv_head.to(tl.int64) * stride_kh + columns[:, None].to(tl.int64) * stride_kt
                           + dims[None, :], mask=(columns < n_keys)[:, None] & dim_ok[None, :], other=0.0)
            if IEEE_FP32:
                scores = tl.dot(query.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(query, tl.trans(keys.to(query.dtype)))
            visible = (columns[None, :] <= positions[:, None]) & (columns < n_keys)[None, :]
            scores = tl.where(visible, scores * qk_scale_log2, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp2(running_max - shift) + tl.sum(tl.exp2(scores - shift[:, None]), 1)
            running_max = new_max
        lse = running_max + tl.log2(running_sum)
        tl.store(lse_ptr + head.to(tl.int64) * n_queries + rows, lse, mask=row_ok)

    @triton.autotune(configs=_PREFILL_TILES, key=["HEAD_DIM", "GROUP", "IEEE_FP32"])
    @triton.jit
    def _column_sums_kernel(
        query_ptr, key_ptr, lse_ptr, out_ptr,
        n_queries, n_keys, qk_scale_log2,
        stride_qh, stride_qs, stride_kh, stride_kt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_FP32: tl.constexpr,
    ):
        head = tl.program_id(0)
        column_block = tl.program_id(1)
        kv_head = head // GROUP
        offset = n_keys - n_queries
        columns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
        column_ok = columns < n_keys
        dims = tl.arange(0, BLOCK_DIM)
        dim_ok = dims < HEAD_DIM
        keys = tl.load(key_ptr + kv_head.to(tl.int64) * stride_kh + columns[:, None].to(tl.int64) * stride_kt
                       + dims[None, :], mask=column_ok[:, None] & dim_ok[None, :], other=0.0)
        totals = tl.zeros([BLOCK_N], dtype=tl.float32)
        # Rows before the block's first column see none of it: start at the first row block that can.
        first_row = tl.maximum(column_block * BLOCK_N - offset, 0)
        for start in range((first_row // BLOCK_M) * BLOCK_M, n_queries, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < n_queries
            query = tl.load(query_ptr + head.to(tl.int64) * stride_qh + rows[:, None].to(tl.int64) * stride_qs
                            + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
            lse = tl.load(lse_ptr + head.to(tl.int64) * n_queries + rows, mask=row_ok, other=0.0)
            if IEEE_FP32:
                scores = tl.dot(query.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(query, tl.trans(keys.to(query.dtype)))
            visible = (columns[None, :] <= (rows + offset)[:, None]) & row_ok[:, None] & column_ok[None, :]
            probs = tl.where(visible, tl.exp2(scores * qk_scale_log2 - lse[:, None]), 0.0)
            totals += tl.sum(probs, 0)
        tl.store(out_ptr + head.to(tl.int64) * n_keys + columns, totals, mask=column_ok)


def causal_column_sums_triton(query: torch.Tensor, keys: torch.Tensor, scaling: float,
                              row_lse: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of ``causal_column_sums_reference`` (CUDA tensors); ``row_lse [Hq, S]`` (natural log): the
    rows' log-sum-exps of their scaled scores, given instead of computed."""
    require_triton()
    query, keys = last_dim_contiguous(query), last_dim_contiguous(keys)
    n_heads, n_queries, head_dim = query.shape
    n_kv_heads, n_keys = keys.shape[:2]
    if n_queries > n_keys:
        raise ValueError(f"{n_queries} queries cannot be the last of {n_keys} keys")
    out = torch.zeros(n_heads, n_keys, dtype=torch.float32, device=query.device)
    if n_queries == 0:
        return out
    fp32 = query.dtype == torch.float32 or keys.dtype == torch.float32
    common = dict(GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_DIM=triton.next_power_of_2(head_dim),
                  IEEE_FP32=fp32)
    strides = (query.stride(0), query.stride(1), keys.stride(0), keys.stride(1))
    scale_log2 = float(scaling) * _LOG2_E
    if row_lse is not None:  # the kernels work in log2 units
        if row_lse.shape != (n_heads, n_queries):
            raise ValueError(f"row_lse has shape {tuple(row_lse.shape)}, not {(n_heads, n_queries)}")
        lse = (row_lse.float() * _LOG2_E).contiguous()
    else:
        lse = torch.empty(n_heads, n_queries, dtype=torch.float32, device=query.device)
        _row_lse_kernel[lambda meta: (n_heads, triton.cdiv(n_queries, meta["BLOCK_M"]))](
            query, keys, lse, n_queries, n_keys, scale_log2, *strides, **common)
    _column_sums_kernel[lambda meta: (n_heads, triton.cdiv(n_keys, meta["BLOCK_N"]))](
        query, keys, lse, out, n_queries, n_keys, scale_log2, *strides, **common)
    return out
