"""Attention scores that selection methods need, without materialising what they do not need.

* ``gqa_scores``: ``scale * q . k`` of every query head against every key of its KV head, the keys at or past a
  device-side count set to ``-inf`` (oracle TOP-k scores every resident key; Quest scores page bounds with it). The
  count is a device tensor, so a CUDA graph that replays the call sees the current length.
* ``page_bounds``: Quest's per-page bound ``q+ . M + q- . m`` from per-page key maxima and minima, in one pass.
* ``causal_column_sums``: for a chunk of prompt queries, the sum over the chunk's rows of the causal softmax
  attention each key receives (H2O's accumulated attention at prefill). The Triton version never builds the
  ``[S, T]`` probability matrix: a first pass computes each row's log-sum-exp, a second sums ``exp(s - lse)``
  down the columns, tile by tile.

Each has a PyTorch reference, which runs everywhere, defines the semantics and is what CI tests; on CUDA with
Triton the kernels are used and ``make test-gpu`` compares them with the references. The products of 16-bit inputs
are exact in float32 on both paths, so the two differ only in the order of float32 sums.
"""

from __future__ import annotations

import math

import torch

from . import triton_kernels

triton, tl = triton_kernels.triton, triton_kernels.tl

_LOG2_E = math.log2(math.e)


def gqa_scores_reference(query: torch.Tensor, keys: torch.Tensor, scale: float, n_valid: torch.Tensor) -> torch.Tensor:
    """``query [Hq, D]``, ``keys [Hkv, T, D]``, ``n_valid`` a one-element integer tensor -> float32 ``[Hq, T]``:
    ``scale * q_h . k_t`` for ``t < n_valid``, ``-inf`` beyond. Query head ``h`` reads KV head ``h // (Hq / Hkv)``."""
    n_heads, head_dim = query.shape
    n_kv_heads, n_keys = keys.shape[:2]
    q = query.float().view(n_kv_heads, n_heads // n_kv_heads, head_dim)
    scores = torch.einsum("hgd,htd->hgt", q, keys.float()).reshape(n_heads, n_keys) * scale
    beyond = torch.arange(n_keys, device=keys.device) >= n_valid.reshape(1).to(keys.device)
    return scores.masked_fill(beyond[None, :], float("-inf"))


def gqa_scores(query: torch.Tensor, keys: torch.Tensor, scale: float, n_valid: torch.Tensor) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA when available, the PyTorch reference otherwise."""
    if query.is_cuda and triton_kernels.available():
        return gqa_scores_triton(query, keys, scale, n_valid)
    return gqa_scores_reference(query, keys, scale, n_valid)


def page_bounds_reference(query: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor,
                          n_valid: torch.Tensor) -> torch.Tensor:
    """Quest's bound ``sum_d max(q_d M_d, q_d m_d) = q+ . M + q- . m`` (``q+ = max(q, 0)``, ``q- = min(q, 0)``; equal
    since ``M >= m``) for ``query [Hq, D]`` and per-page metadata ``[Hkv, P, D]`` -> float32 ``[Hq, P]``, ``-inf``
    for pages at or past ``n_valid``."""
    return (gqa_scores_reference(query.clamp(min=0), page_max, 1.0, n_valid)
            + gqa_scores_reference(query.clamp(max=0), page_min, 1.0, n_valid))


def page_bounds(query: torch.Tensor, page_max: torch.Tensor, page_min: torch.Tensor,
                n_valid: torch.Tensor) -> torch.Tensor:
    """Dispatch: one Triton kernel (both metadata tiles, both dots) on CUDA when available, else the reference."""
    if query.is_cuda and triton_kernels.available():
        return gqa_scores_triton(query, page_max, 1.0, n_valid, second_keys=page_min)
    return page_bounds_reference(query, page_max, page_min, n_valid)


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


def causal_column_sums(query: torch.Tensor, keys: torch.Tensor, scaling: float, chunk_size: int = 256) -> torch.Tensor:
    """Dispatch: the two-pass Triton kernels on CUDA when available, the chunked PyTorch reference otherwise."""
    if query.is_cuda and triton_kernels.available():
        return causal_column_sums_triton(query, keys, scaling)
    return causal_column_sums_reference(query, keys, scaling, chunk_size)


if triton is not None:

    @triton.jit
    def _gqa_scores_kernel(
        query_ptr, key_ptr, second_key_ptr, n_valid_ptr, out_ptr,
        n_keys, scale,
        stride_qh, stride_kh, stride_kt, stride_oh,
        GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        BLOCK_T: tl.constexpr, IEEE_FP32: tl.constexpr, SIGN_SPLIT: tl.constexpr,
    ):
        # SIGN_SPLIT: max(q, 0) against the first keys plus min(q, 0) against the second (Quest's page bound).
        kv_head = tl.program_id(0)
        block = tl.program_id(1)
        rows = tl.arange(0, BLOCK_GROUP)
        dims = tl.arange(0, BLOCK_DIM)
        heads = kv_head * GROUP + rows
        row_ok = rows < GROUP
        dim_ok = dims < HEAD_DIM
        query = tl.load(query_ptr + heads[:, None] * stride_qh + dims[None, :],
                        mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
        in_range = tokens < n_keys
        rows_of_keys = kv_head.to(tl.int64) * stride_kh + tokens[:, None].to(tl.int64) * stride_kt + dims[None, :]
        keys = tl.load(key_ptr + rows_of_keys, mask=in_range[:, None] & dim_ok[None, :], other=0.0)
        first = tl.maximum(query, 0.0).to(query.dtype) if SIGN_SPLIT else query
        if IEEE_FP32:
            scores = tl.dot(first.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(first, tl.trans(keys.to(query.dtype)))
        if SIGN_SPLIT:
            second_keys = tl.load(second_key_ptr + rows_of_keys, mask=in_range[:, None] & dim_ok[None, :], other=0.0)
            second = tl.minimum(query, 0.0).to(query.dtype)
            if IEEE_FP32:
                scores += tl.dot(second.to(tl.float32), tl.trans(second_keys.to(tl.float32)), input_precision="ieee")
            else:
                scores += tl.dot(second, tl.trans(second_keys.to(query.dtype)))
        n_valid = tl.load(n_valid_ptr)
        scores = tl.where((tokens < n_valid)[None, :], scores * scale, float("-inf"))
        tl.store(out_ptr + heads[:, None].to(tl.int64) * stride_oh + tokens[None, :], scores,
                 mask=row_ok[:, None] & in_range[None, :])


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


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def gqa_scores_triton(query: torch.Tensor, keys: torch.Tensor, scale: float, n_valid: torch.Tensor,
                      block_tokens: int = 128, second_keys: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton version of ``gqa_scores_reference`` (CUDA tensors); with ``second_keys`` (same layout as ``keys``)
    that of ``page_bounds_reference`` (``scale`` applies to the sum)."""
    triton_kernels._require_triton()
    query, keys = _last_dim_contiguous(query), _last_dim_contiguous(keys)
    if second_keys is not None:
        second_keys = _last_dim_contiguous(second_keys)
        if second_keys.shape != keys.shape or second_keys.stride() != keys.stride():
            raise ValueError("second_keys must have the layout of keys")
    n_heads, head_dim = query.shape
    n_kv_heads, n_keys = keys.shape[:2]
    group = n_heads // n_kv_heads
    out = torch.empty(n_heads, n_keys, dtype=torch.float32, device=query.device)
    if n_keys == 0:
        return out
    n_valid = n_valid.reshape(1).to(device=query.device)
    fp32 = query.dtype == torch.float32 or keys.dtype == torch.float32
    grid = (n_kv_heads, triton.cdiv(n_keys, block_tokens))
    _gqa_scores_kernel[grid](
        query, keys, keys if second_keys is None else second_keys, n_valid, out, n_keys, float(scale),
        query.stride(0), keys.stride(0), keys.stride(1), out.stride(0),
        GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_DIM=triton.next_power_of_2(head_dim), BLOCK_T=block_tokens, IEEE_FP32=fp32,
        SIGN_SPLIT=second_keys is not None, num_warps=8 if fp32 else 4,
    )
    return out


def causal_column_sums_triton(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """The Triton version of ``causal_column_sums_reference`` (CUDA tensors)."""
    triton_kernels._require_triton()
    query, keys = _last_dim_contiguous(query), _last_dim_contiguous(keys)
    n_heads, n_queries, head_dim = query.shape
    n_kv_heads, n_keys = keys.shape[:2]
    if n_queries > n_keys:
        raise ValueError(f"{n_queries} queries cannot be the last of {n_keys} keys")
    out = torch.zeros(n_heads, n_keys, dtype=torch.float32, device=query.device)
    if n_queries == 0:
        return out
    lse = torch.empty(n_heads, n_queries, dtype=torch.float32, device=query.device)
    fp32 = query.dtype == torch.float32 or keys.dtype == torch.float32
    common = dict(GROUP=n_heads // n_kv_heads, HEAD_DIM=head_dim, BLOCK_DIM=triton.next_power_of_2(head_dim),
                  IEEE_FP32=fp32)
    strides = (query.stride(0), query.stride(1), keys.stride(0), keys.stride(1))
    scale_log2 = float(scaling) * _LOG2_E
    _row_lse_kernel[lambda meta: (n_heads, triton.cdiv(n_queries, meta["BLOCK_M"]))](
        query, keys, lse, n_queries, n_keys, scale_log2, *strides, **common)
    _column_sums_kernel[lambda meta: (n_heads, triton.cdiv(n_keys, meta["BLOCK_N"]))](
        query, keys, lse, out, n_queries, n_keys, scale_log2, *strides, **common)
    return out
