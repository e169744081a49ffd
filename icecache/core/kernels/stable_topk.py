"""The ``k`` largest scores of each row, best first, equal scores in index order: the first ``k`` of a stable
descending sort, on every device.

``torch.topk`` leaves the order of equal values open, so the reference runs it on int64 keys that are all
different: the score's bits made order-preserving as a signed int32 (a negative float's magnitude bits flipped) in
the high half, and ``2**32 - 1 - index`` in the low half. Key order is the stable sort's order (a higher score
first, then a lower index), and no two keys are equal, so the ``k`` largest keys, best first, are exactly the
stable sort's first ``k``.

On CUDA that top-k of int64 keys is a radix select of eight 8-bit passes, each three kernels over the whole row:
in PQCache's decode step at 32k tokens (one top-k of ``[8, 32768]`` per layer) the step profile on an H200 counted
about 2.2 ms a step in them (``results/bench/step_profile_h200_20261203-134514.json``). The Triton version makes the
same keys in registers and keeps the top of blocks of the row with Triton's bitonic top-k, then the top of the
blocks' tops, in as many passes as the row needs (one pass divides the candidates by ``BLOCK / K``). Since the keys
are distinct, every pass keeps exactly the keys the full order would, and the result is the reference's to the
bit: indices, order and all.
"""

from __future__ import annotations

import torch

from .triton_runtime import available as triton_available
from .triton_runtime import require_triton, tl, triton

#: Keys a program of a pass ranks (a power of two).
BLOCK = 4096


def stable_topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[R, k]`` int64 indices of the ``k`` largest of each row of float32 ``scores [R, N]`` (no NaN;
    ``N < 2**32``), best first, equal scores in index order:
    ``scores.sort(descending=True, stable=True).indices[:, :k]``."""
    bits = scores.view(torch.int32)
    bits = torch.where(bits == -(2**31), 0, bits)  # -0.0 is +0.0's equal: the same key but for the index
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    index_key = (2**32 - 1) - torch.arange(scores.shape[-1], device=scores.device)
    # One kernel: index_key + ordered * 2**32, in int64 (the int32 ordered bits are promoted first).
    return torch.add(index_key, ordered, alpha=2**32).topk(k, dim=-1).indices


if triton is not None:

    @triton.jit
    def _block_top_kernel(source_ptr, out_ptr, n_in, stride_source_row, stride_out_row,
                          FROM_SCORES: tl.constexpr, LAST: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        places = block * BLOCK + tl.arange(0, BLOCK)
        inside = places < n_in
        if FROM_SCORES:  # the first pass: the keys of the scores at these columns
            bits = tl.load(source_ptr + row * stride_source_row + places, mask=inside, other=0.0).to(
                tl.int32, bitcast=True)
            bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 as +0.0
            ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
            keys = (ordered << 32) + (0xFFFFFFFF - places.to(tl.int64))
        else:  # a later pass: the keys the pass before kept
            keys = tl.load(source_ptr + row * stride_source_row + places, mask=inside, other=0)
        keys = tl.where(inside, keys, -9223372036854775808)
        top = tl.topk(keys, K_POW2)  # descending
        kept = tl.arange(0, K_POW2)
        if LAST:  # one block left: its first K keys' columns
            tl.store(out_ptr + row * stride_out_row + kept, 0xFFFFFFFF - (top & 0xFFFFFFFF), mask=kept < K)
        else:
            tl.store(out_ptr + row * stride_out_row + block * K_POW2 + kept, top)


def _pass_block(n_in: int, k_pow2: int) -> int:
    """The keys one program ranks in a pass over ``n_in`` candidates: the whole row when it is short."""
    return max(k_pow2, min(BLOCK, triton.next_power_of_2(n_in)))


def stable_topk_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The Triton version of ``stable_topk_reference`` (CUDA tensors, or CPU ones in Triton's interpreter)."""
    require_triton()
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError("stable_topk: float32 scores [rows, n]")
    n_rows, n = scores.shape
    if not 0 <= k <= n or n >= 2**32:
        raise ValueError(f"stable_topk: k={k} must lie in [0, {n}], and n < 2**32")
    if k == 0:
        return torch.empty(n_rows, 0, dtype=torch.long, device=scores.device)
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    k_pow2 = max(2, triton.next_power_of_2(k))  # Triton's top-k of one key would reduce a block to a scalar
    out = torch.empty(n_rows, k, dtype=torch.long, device=scores.device)
    source, n_in, from_scores = scores, n, True
    while True:
        block = _pass_block(n_in, k_pow2)
        n_blocks = -(-n_in // block)
        last = n_blocks == 1
        target = out if last else torch.empty(n_rows, n_blocks * k_pow2, dtype=torch.long, device=scores.device)
        _block_top_kernel[(n_rows, n_blocks)](
            source, target, n_in, source.stride(0), target.stride(0),
            FROM_SCORES=from_scores, LAST=last, K=k, K_POW2=k_pow2, BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
        if last:
            return out
        source, n_in, from_scores = target, n_blocks * k_pow2, False


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``stable_topk_reference``'s result: by the Triton kernels for CUDA tensors where they run, else by it."""
    if scores.is_cuda and triton_available():
        return stable_topk_triton(scores, k)
    return stable_topk_reference(scores, k)
