"""Scaled dot products of every query head against every key of its KV head, and Quest's page bound, in one kernel.

* ``gqa_scores(query [Hq, D], keys [Hkv, T, D], scale, n_valid) -> [Hq, T]`` (float32): ``scale * q . k``, the keys
  at or past ``n_valid`` (a one-element device tensor, so a CUDA graph that replays the call sees the current
  length) at ``-inf``. Oracle TOP-k scores every resident key with it; OmniKV its candidates.
* ``page_bounds(query, page_max, page_min, n_valid) -> [Hq, P]``: Quest's per-page bound ``q+ . M + q- . m`` from
  per-page key maxima and minima ``[Hkv, P, D]``, in one pass (Quest, ArkVale).

Each has a PyTorch reference (``gqa_scores_reference``, ``page_bounds_reference``), which runs everywhere and
defines the semantics; ``gqa_scores_triton`` is the Triton kernel of both (``second_keys`` for the bound: both
metadata tiles loaded and both dots summed in one program); ``gqa_scores`` and ``page_bounds`` dispatch to it on
CUDA when ``triton_runtime.available()``. The products of 16-bit inputs are exact in float32 on both paths, so the
two differ only in the order of float32 sums. No launch state: every call goes through Triton's launch path. With a
``RowTable`` (``rows``, columns ``GQA_ROW_COLUMNS``), one launch scores every row of a batch (``row_table``).
"""

from __future__ import annotations

import torch

from .row_table import RowTable, at_row, table_arguments
from .triton_runtime import available as triton_available
from .triton_runtime import last_dim_contiguous, require_triton, tl, triton

#: The tensors the kernel finds per row of a batch, in its pointer order.
GQA_ROW_COLUMNS = ("query", "keys", "second_keys", "n_valid", "out")


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
    if query.is_cuda and triton_available():
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
    if query.is_cuda and triton_available():
        return gqa_scores_triton(query, page_max, 1.0, n_valid, second_keys=page_min)
    return page_bounds_reference(query, page_max, page_min, n_valid)


if triton is not None:

    @triton.jit
    def _gqa_scores_kernel(
        query_ptr, key_ptr, second_key_ptr, n_valid_ptr, out_ptr, rows_ptr,
        n_keys, scale,
        stride_qh, stride_kh, stride_kt, stride_oh,
        GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_DIM: tl.constexpr,
        BLOCK_T: tl.constexpr, IEEE_FP32: tl.constexpr, SIGN_SPLIT: tl.constexpr, N_COLUMNS: tl.constexpr,
        BATCHED: tl.constexpr,
    ):
        # SIGN_SPLIT: max(q, 0) against the first keys plus min(q, 0) against the second (Quest's page bound).
        kv_head = tl.program_id(0)
        block = tl.program_id(1)
        row = tl.program_id(2)  # GQA_ROW_COLUMNS
        query_ptr = at_row(query_ptr, rows_ptr, row, 0, N_COLUMNS, BATCHED)
        key_ptr = at_row(key_ptr, rows_ptr, row, 1, N_COLUMNS, BATCHED)
        second_key_ptr = at_row(second_key_ptr, rows_ptr, row, 2, N_COLUMNS, BATCHED)
        n_valid_ptr = at_row(n_valid_ptr, rows_ptr, row, 3, N_COLUMNS, BATCHED)
        out_ptr = at_row(out_ptr, rows_ptr, row, 4, N_COLUMNS, BATCHED)
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


def gqa_scores_triton(query: torch.Tensor, keys: torch.Tensor, scale: float, n_valid: torch.Tensor,
                      block_tokens: int = 128, second_keys: torch.Tensor | None = None, *,
                      out: torch.Tensor | None = None, rows: RowTable | None = None) -> torch.Tensor:
    """The Triton version of ``gqa_scores_reference`` (CUDA tensors); with ``second_keys`` (same layout as ``keys``)
    that of ``page_bounds_reference`` (``scale`` applies to the sum). ``out``: where to write (float32 ``[Hq, T]``,
    unit stride along the keys). With ``rows`` (``GQA_ROW_COLUMNS``), every row of a batch, the tensors given being
    row 0's (``out`` and ``n_valid`` given as the kernel reads them: ``[1]`` on the device)."""
    require_triton()
    if rows is not None:
        rows.check(GQA_ROW_COLUMNS, "gqa_scores")
        if out is None or second_keys is None or any(t.stride(-1) != 1 for t in (query, keys, second_keys)):
            raise ValueError("gqa_scores: a batch's call gives out and second_keys, every row contiguous along D")
    query, keys = last_dim_contiguous(query), last_dim_contiguous(keys)
    if second_keys is not None:
        second_keys = last_dim_contiguous(second_keys)
        if second_keys.shape != keys.shape or second_keys.stride() != keys.stride():
            raise ValueError("second_keys must have the layout of keys")
    n_heads, head_dim = query.shape
    n_kv_heads, n_keys = keys.shape[:2]
    group = n_heads // n_kv_heads
    if out is None:
        out = torch.empty(n_heads, n_keys, dtype=torch.float32, device=query.device)
    elif out.shape != (n_heads, n_keys) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"gqa_scores: out must be float32 [{n_heads}, {n_keys}] with unit stride along the keys")
    if n_keys == 0:
        return out
    n_valid = n_valid.reshape(1).to(device=query.device)
    fp32 = query.dtype == torch.float32 or keys.dtype == torch.float32
    rows_ptr, n_rows, n_columns, batched = table_arguments(rows, n_valid)
    grid = (n_kv_heads, triton.cdiv(n_keys, block_tokens), n_rows)
    _gqa_scores_kernel[grid](
        query, keys, keys if second_keys is None else second_keys, n_valid, out, rows_ptr, n_keys, float(scale),
        query.stride(0), keys.stride(0), keys.stride(1), out.stride(0),
        GROUP=group, BLOCK_GROUP=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_DIM=triton.next_power_of_2(head_dim), BLOCK_T=block_tokens, IEEE_FP32=fp32,
        SIGN_SPLIT=second_keys is not None, N_COLUMNS=n_columns, BATCHED=batched, num_warps=8 if fp32 else 4,
    )
    return out
