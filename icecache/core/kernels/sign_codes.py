"""Sign codes: the SimHash buckets of projected vectors, ``K`` sign bits per table packed into one integer.

``sign_codes(projected [R, L * K] float32, K) -> [R, L]`` int32: in table ``l`` bit ``j`` is set when
``projected[r, l * K + j] > 0`` (a NaN sets no bit).

* ``sign_codes_reference``: PyTorch (the comparison, a view as ``[R, L, K]``, a weighted sum), which defines the
  semantics and is what the CPU runs.
* ``sign_codes_triton``: one kernel over tiles of rows and tables that compares and packs in registers. The reference
  writes the bits as int32 (four bytes per sign), multiplies them by their weights and reduces over ``K``: at 32k
  tokens, 8 KV heads and MagicPIG's 150 tables of 10 bits, three passes over 1.6 GB per layer beside the prefill,
  about 4 ms per layer on an H200 (``scripts/diagnostics/step_profile.py --prefill``). The codes are the reference's
  exactly (the same comparisons of the same floats).
* ``sign_codes``: the dispatch (the kernel for CUDA tensors when ``triton_runtime.available()``, else the reference).
"""

from __future__ import annotations

import torch

from .triton_runtime import available as triton_available
from .triton_runtime import require_triton, tl, triton

#: Rows and tables per program.
BLOCK_ROWS = 64
BLOCK_TABLES = 32


def sign_codes_reference(projected: torch.Tensor, K: int) -> torch.Tensor:
    """The codes by PyTorch operations (see the module's docstring)."""
    bits = (projected > 0).view(*projected.shape[:-1], projected.shape[-1] // K, K).to(torch.int32)
    weights = 2 ** torch.arange(K, dtype=torch.int32, device=projected.device)
    return (bits * weights).sum(-1, dtype=torch.int32)


if triton is not None:

    @triton.jit
    def _sign_codes_kernel(projected_ptr, codes_ptr, n_rows, n_tables, K: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_L: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        tables = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        inside = (rows[:, None] < n_rows) & (tables[None, :] < n_tables)
        first = rows.to(tl.int64)[:, None] * (n_tables * K) + tables[None, :] * K
        codes = tl.zeros((BLOCK_R, BLOCK_L), dtype=tl.int32)
        for j in tl.static_range(K):
            value = tl.load(projected_ptr + first + j, mask=inside, other=0.0)
            codes = codes | ((value > 0).to(tl.int32) << j)
        tl.store(codes_ptr + rows.to(tl.int64)[:, None] * n_tables + tables[None, :], codes, mask=inside)


def sign_codes_triton(projected: torch.Tensor, K: int) -> torch.Tensor:
    """The Triton kernel of ``sign_codes_reference`` (``projected`` float32; made contiguous if it is not)."""
    require_triton()
    if projected.dtype != torch.float32:
        raise ValueError(f"sign_codes_triton needs float32 projections, got {projected.dtype}")
    if not 1 <= K <= 31 or projected.shape[-1] % K:
        raise ValueError(f"the last dimension ({projected.shape[-1]}) must be a multiple of K={K}, 1 <= K <= 31")
    flat = projected.reshape(-1, projected.shape[-1]).contiguous()
    n_rows, n_tables = flat.shape[0], flat.shape[1] // K
    codes = torch.empty(n_rows, n_tables, dtype=torch.int32, device=projected.device)
    if n_rows and n_tables:
        grid = (triton.cdiv(n_rows, BLOCK_ROWS), triton.cdiv(n_tables, BLOCK_TABLES))
        _sign_codes_kernel[grid](flat, codes, n_rows, n_tables, K=K, BLOCK_R=BLOCK_ROWS, BLOCK_L=BLOCK_TABLES)
    return codes.view(*projected.shape[:-1], n_tables)


def sign_codes(projected: torch.Tensor, K: int) -> torch.Tensor:
    """The kernel for float32 CUDA tensors when the Triton kernels can run, the reference otherwise."""
    if projected.is_cuda and projected.dtype == torch.float32 and triton_available():
        return sign_codes_triton(projected, K)
    return sign_codes_reference(projected, K)
