"""PQCache's selection votes: per query head the softmax of the product-quantised scores over the candidate
tokens, summed over each KV head's query heads.

``pq_votes(query [Hq, D], centroids [Hkv, m, C, d], rows [Hkv, m, T], first, end, scaling) -> [Hkv, T]`` float32:
token ``t`` is a candidate when ``first <= t < end`` (``end`` a one-element device tensor, so that a replayed CUDA
graph sees the step's value); a candidate's vote is ``sum_g softmax_t(scaling * s_g)`` over the query heads ``g`` of
its KV head, with ``s`` the approximate scores of ``product_quantization.pq_scores`` (``rows`` are
``code_rows``); any other token gets ``-1``, so that no candidate at all gives ``-1`` everywhere rather than NaN.

* ``pq_votes_reference``: PyTorch (the lookup table, ``index_select``, softmax, group sum), which defines the
  semantics and is what the CPU runs.
* ``pq_votes_triton``: two kernels over blocks of tokens, one program per (KV head, block). The first looks the
  scores up in the ``[Hkv * m * C, g]`` table and writes each query head's block maximum and sum of exponentials;
  the second combines a head's blocks into its softmax denominator, looks the scores up again and writes the
  votes. It replaces a dozen passes over ``[Hkv, m, T, g]``-sized intermediates by two reads of the codes: on an
  H200, at 32k tokens and Llama-3.1-8B's 8 KV heads, the reference's ``index_select`` of the table alone took about
  320 us per layer, half of PQCache's decode step, and each kernel here under 10 us. The scores are the
  reference's bits (the same table, the same sum over sub-spaces, the same scaling), so tokens with the same codes
  still tie exactly; the exponentials and the softmax sums differ from the reference's by float32 rounding.
* ``pq_votes``: the dispatch (the Triton kernels for CUDA tensors when ``triton_runtime.available()``, else the
  reference). No launch state: every call goes through Triton's launch path.
"""

from __future__ import annotations

import torch

from ..product_quantization import pq_scores, pq_table
from .triton_runtime import available as triton_available
from .triton_runtime import require_triton, tl, triton

#: Tokens per program.
BLOCK_TOKENS = 1024


def pq_votes_reference(query: torch.Tensor, centroids: torch.Tensor, rows: torch.Tensor, first: int,
                       end: torch.Tensor, scaling: float) -> torch.Tensor:
    """The votes by PyTorch operations (see the module's docstring)."""
    n_kv_heads = centroids.shape[0]
    positions = torch.arange(rows.shape[-1], device=rows.device)
    candidate = (positions >= first) & (positions < end)
    logits = (pq_scores(query, centroids, rows) * scaling).masked_fill(~candidate, float("-inf"))
    votes = torch.softmax(logits, dim=-1).view(n_kv_heads, -1, logits.shape[-1]).sum(dim=1)
    return torch.where(candidate, votes, -1.0)


if triton is not None:

    @triton.jit
    def _block_scores(table_ptr, rows_ptr, first, end, head, block, n_tokens, scaling,
                      N_SUBSPACES: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                      BLOCK: tl.constexpr):
        """``[GROUP_P2, BLOCK]`` scaled scores of the block's tokens (``-inf`` off the candidates and padding)
        and the candidate mask ``[BLOCK]``."""
        tokens = block * BLOCK + tl.arange(0, BLOCK)
        groups = tl.arange(0, GROUP_P2)
        inside = tokens < n_tokens
        candidate = inside & (tokens >= first) & (tokens < end)
        scores = tl.zeros((GROUP_P2, BLOCK), dtype=tl.float32)
        for j in tl.static_range(N_SUBSPACES):  # in sub-space order, as the reference sums them
            row = tl.load(rows_ptr + (head * N_SUBSPACES + j).to(tl.int64) * n_tokens + tokens, mask=inside, other=0)
            scores += tl.load(table_ptr + row.to(tl.int64)[None, :] * GROUP + groups[:, None],
                              mask=inside[None, :] & (groups[:, None] < GROUP), other=0.0)
        scores = scores * scaling
        keep = candidate[None, :] & (groups[:, None] < GROUP)
        return tl.where(keep, scores, float("-inf")), candidate

    @triton.jit
    def _pq_partials_kernel(table_ptr, rows_ptr, end_ptr, block_max_ptr, block_sum_ptr, first, n_tokens, n_blocks,
                            scaling, N_SUBSPACES: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                            BLOCK: tl.constexpr):
        head = tl.program_id(0)
        block = tl.program_id(1)
        end = tl.load(end_ptr)
        scores, _ = _block_scores(table_ptr, rows_ptr, first, end, head, block, n_tokens, scaling, N_SUBSPACES,
                                  GROUP, GROUP_P2, BLOCK)
        peak = tl.max(scores, axis=1)  # [GROUP_P2]; -inf where the block has no candidate
        shift = tl.where(peak == float("-inf"), 0.0, peak)
        total = tl.sum(tl.exp(scores - shift[:, None]), axis=1)
        groups = tl.arange(0, GROUP_P2)
        out = (head * GROUP_P2 + groups) * n_blocks + block
        tl.store(block_max_ptr + out, peak)
        tl.store(block_sum_ptr + out, total)

    @triton.jit
    def _pq_votes_kernel(table_ptr, rows_ptr, end_ptr, block_max_ptr, block_sum_ptr, votes_ptr, first, n_tokens,
                         n_blocks, scaling, N_SUBSPACES: tl.constexpr, GROUP: tl.constexpr,
                         GROUP_P2: tl.constexpr, BLOCK: tl.constexpr, BLOCKS_P2: tl.constexpr):
        head = tl.program_id(0)
        block = tl.program_id(1)
        end = tl.load(end_ptr)
        groups = tl.arange(0, GROUP_P2)
        blocks = tl.arange(0, BLOCKS_P2)
        partial = (head * GROUP_P2 + groups[:, None]) * n_blocks + blocks[None, :]
        present = blocks[None, :] < n_blocks
        peaks = tl.load(block_max_ptr + partial, mask=present, other=float("-inf"))
        sums = tl.load(block_sum_ptr + partial, mask=present, other=0.0)
        peak = tl.max(peaks, axis=1)
        shift = tl.where(peak == float("-inf"), 0.0, peak)
        denominator = tl.sum(sums * tl.exp(peaks - shift[:, None]), axis=1)  # a block without candidates adds 0
        scores, candidate = _block_scores(table_ptr, rows_ptr, first, end, head, block, n_tokens, scaling,
                                          N_SUBSPACES, GROUP, GROUP_P2, BLOCK)
        probabilities = tl.exp(scores - shift[:, None]) / tl.where(denominator > 0, denominator, 1.0)[:, None]
        votes = tl.sum(tl.where(groups[:, None] < GROUP, probabilities, 0.0), axis=0)
        tokens = block * BLOCK + tl.arange(0, BLOCK)
        tl.store(votes_ptr + head.to(tl.int64) * n_tokens + tokens, tl.where(candidate, votes, -1.0),
                 mask=tokens < n_tokens)


def pq_votes_triton(query: torch.Tensor, centroids: torch.Tensor, rows: torch.Tensor, first: int,
                    end: torch.Tensor, scaling: float) -> torch.Tensor:
    """The Triton kernels of ``pq_votes_reference`` (``rows`` contiguous int32)."""
    require_triton()
    n_kv_heads, n_subspaces, n_tokens = rows.shape
    group = query.shape[0] // n_kv_heads
    if rows.dtype != torch.int32 or not rows.is_contiguous():
        raise ValueError("pq_votes_triton needs contiguous int32 rows (code_rows)")
    table = pq_table(query, centroids).contiguous()  # [Hkv * m * C, g]
    votes = torch.empty(n_kv_heads, n_tokens, dtype=torch.float32, device=rows.device)
    if n_tokens == 0:
        return votes
    n_blocks = triton.cdiv(n_tokens, BLOCK_TOKENS)
    group_p2 = triton.next_power_of_2(group)
    block_max = torch.empty(n_kv_heads, group_p2, n_blocks, dtype=torch.float32, device=rows.device)
    block_sum = torch.empty_like(block_max)
    end = end.reshape(1).to(torch.int64)
    constants = {"N_SUBSPACES": n_subspaces, "GROUP": group, "GROUP_P2": group_p2, "BLOCK": BLOCK_TOKENS}
    grid = (n_kv_heads, n_blocks)
    _pq_partials_kernel[grid](table, rows, end, block_max, block_sum, first, n_tokens, n_blocks, scaling,
                              **constants, num_warps=4)
    _pq_votes_kernel[grid](table, rows, end, block_max, block_sum, votes, first, n_tokens, n_blocks, scaling,
                           **constants, BLOCKS_P2=triton.next_power_of_2(n_blocks), num_warps=4)
    return votes


def pq_votes(query: torch.Tensor, centroids: torch.Tensor, rows: torch.Tensor, first: int, end: torch.Tensor,
             scaling: float) -> torch.Tensor:
    """Dispatch: the Triton kernels for CUDA tensors when Triton can run, otherwise the reference."""
    if rows.is_cuda and triton_available():
        return pq_votes_triton(query, centroids, rows, first, end, scaling)
    return pq_votes_reference(query, centroids, rows, first, end, scaling)
