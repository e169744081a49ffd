"""Triton helpers that reproduce PyTorch's CUDA arithmetic where a kernel must agree with its reference to the bit.

* ``rounded``: a float32 value rounded to the cache dtype (to nearest even) and widened back, where PyTorch stores
  an intermediate in that dtype. bfloat16 is rounded by its bits, because Triton's interpreter truncates a cast to
  bfloat16 (on the GPU the cast rounds to nearest even; the two agree).
* ``ROUNDING``: the ``ROUNDING`` argument of ``rounded`` for each cache dtype.
* ``mean_of_rows``: the float32 mean over the rows of a small ``[n, D]`` block in the order of PyTorch's CUDA
  reduction over a non-innermost dimension of at most 32 elements per output (one thread, four interleaved
  accumulators: row ``t`` goes to accumulator ``t % 4`` in increasing ``t``, then the accumulators are added in
  order), times the float32 factor ``1 / n``. For more rows PyTorch may split the sum over threads, and the means
  can then differ in the last bit.
"""

from __future__ import annotations

import torch

from .triton_runtime import tl, triton

ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

if triton is not None:

    @triton.jit
    def rounded(x, ROUNDING: tl.constexpr):
        """float32 ``x`` rounded to the cache dtype, as float32: ROUNDING 0 float32 (nothing to do), 1 bfloat16,
        2 float16."""
        if ROUNDING == 1:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            return bits.to(tl.float32, bitcast=True)
        elif ROUNDING == 2:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def mean_of_rows(row_ptr, row_stride, dims, dim_ok, mean_factor, N_ROWS: tl.constexpr,
                     BLOCK_DIM: tl.constexpr):
        """float32 ``[BLOCK_DIM]``: the mean of rows ``row_ptr + t * row_stride + dims`` for ``t < N_ROWS``
        (masked by ``dim_ok``), summed in PyTorch's CUDA order."""
        acc0 = tl.zeros([BLOCK_DIM], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_DIM], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_DIM], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_DIM], dtype=tl.float32)
        for row in tl.static_range(N_ROWS):
            x = tl.load(row_ptr + row * row_stride + dims, mask=dim_ok, other=0.0).to(tl.float32)
            if row % 4 == 0:
                acc0 += x
            elif row % 4 == 1:
                acc1 += x
            elif row % 4 == 2:
                acc2 += x
            else:
                acc3 += x
        return (((acc0 + acc1) + acc2) + acc3) * mean_factor
else:  # Triton absent: the names exist for the kernels' modules to import; nothing can call them
    rounded = mean_of_rows = None
