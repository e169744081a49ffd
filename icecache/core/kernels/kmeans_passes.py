"""The two passes of a Lloyd iteration over the points (PQCache's prompt k-means), each one kernel on CUDA.

``product_quantization.kmeans`` assigns every point to its nearest centroid (``nearest_centroids``) and sums each
cluster's points (``cluster_sums``); those PyTorch references write a ``[G, N, C]`` distance matrix and pass over it
three more times (the doubling, the subtraction, the arg-min), and build the sums from one-hot slices in global
memory. At 32k tokens of Llama-3.1-8B's 8 KV heads that is ~60 MB per pass, ~30 launches per iteration and, measured
in a prefill profile on an H200, 0.6 s of GPU time per 32k prefill on a side stream that the prefill's own kernels
share the SMs with: PQCache's TTFT paid for it. Here each pass reads the points once:

* ``nearest_centroids_triton``: one program per (set, block of points) holds the set's centroids and their squared
  norms, takes the block's products with them (``tl.dot`` in IEEE float32) and writes each point's arg-min of
  ``|c|^2 - 2 x.c`` (ties to the lower index, as the reference).
* ``cluster_sums_triton``: one program per (set, span of points) accumulates the one-hot product of the span's codes
  with its points slice by slice in registers and writes one partial ``[C, d]``; the partials are then added in span
  order. Every sum has one fixed order, so a run gives the same bits as the last (CUDA's ``scatter_add_`` adds with
  atomics in a different order each time).

Both compute what the references compute up to float32 rounding: a point whose two nearest centroids are equal to
rounding may take the other one (the tests check every code is the nearest of its centroids in float64, up to
rounding), and sums differ in their last bits. ``nearest_centroids`` and ``cluster_sums`` dispatch (the kernels for
CUDA tensors when ``triton_runtime.available()``, else the references); ``pq_build`` is
``product_quantization.pq_build`` with both.
"""

from __future__ import annotations

import torch

from .. import product_quantization
from .triton_runtime import available as triton_available
from .triton_runtime import require_triton, tl, triton

#: Points per program of the assignment.
ASSIGN_BLOCK = 128
#: Points a program of the sums adds, ``SUM_SLICE`` at a time.
SUM_SPAN, SUM_SLICE = 2048, 64


def _padded(n: int) -> int:
    """The block size that holds ``n`` (``tl.dot`` needs at least 16 along each dimension)."""
    return max(16, triton.next_power_of_2(n))


if triton is not None:

    @triton.jit
    def _nearest_kernel(points_ptr, centroids_ptr, codes_ptr, n_points, N_CENTROIDS: tl.constexpr,
                        DIM: tl.constexpr, C_P2: tl.constexpr, D_P2: tl.constexpr, BLOCK: tl.constexpr):
        group = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        rows = block * BLOCK + tl.arange(0, BLOCK)
        dims = tl.arange(0, D_P2)
        labels = tl.arange(0, C_P2)
        centroids = tl.load(centroids_ptr + (group * N_CENTROIDS + labels[:, None]) * DIM + dims[None, :],
                            mask=(labels[:, None] < N_CENTROIDS) & (dims[None, :] < DIM), other=0.0)
        norms = tl.sum(centroids * centroids, axis=1)  # [C_P2]
        inside = rows < n_points
        points = tl.load(points_ptr + (group * n_points + rows[:, None]) * DIM + dims[None, :],
                         mask=inside[:, None] & (dims[None, :] < DIM), other=0.0)
        products = tl.dot(points, tl.trans(centroids), input_precision="ieee")  # [BLOCK, C_P2]
        distance = norms[None, :] - 2.0 * products
        distance = tl.where(labels[None, :] < N_CENTROIDS, distance, float("inf"))
        codes = tl.argmin(distance, axis=1, tie_break_left=True)
        tl.store(codes_ptr + group * n_points + rows, codes.to(tl.int64), mask=inside)

    @triton.jit
    def _sums_kernel(points_ptr, codes_ptr, partial_ptr, n_points, n_spans, N_CENTROIDS: tl.constexpr,
                     DIM: tl.constexpr, C_P2: tl.constexpr, D_P2: tl.constexpr, SPAN: tl.constexpr,
                     SLICE: tl.constexpr):
        group = tl.program_id(0).to(tl.int64)
        span = tl.program_id(1)
        dims = tl.arange(0, D_P2)
        labels = tl.arange(0, C_P2)
        total = tl.zeros((C_P2, D_P2), dtype=tl.float32)
        for begin in range(0, SPAN, SLICE):  # in point order
            rows = span * SPAN + begin + tl.arange(0, SLICE)
            inside = rows < n_points
            codes = tl.load(codes_ptr + group * n_points + rows, mask=inside, other=-1)
            points = tl.load(points_ptr + (group * n_points + rows[:, None]) * DIM + dims[None, :],
                             mask=inside[:, None] & (dims[None, :] < DIM), other=0.0)
            one_hot = (labels[:, None] == codes[None, :]).to(tl.float32)  # [C_P2, SLICE]
            total += tl.dot(one_hot, points, input_precision="ieee")
        out = ((group * n_spans + span) * N_CENTROIDS + labels[:, None]) * DIM + dims[None, :]
        tl.store(partial_ptr + out, total, mask=(labels[:, None] < N_CENTROIDS) & (dims[None, :] < DIM))


def _checked(points: torch.Tensor, other: torch.Tensor, name: str) -> None:
    require_triton()
    if points.dtype != torch.float32 or not points.is_contiguous() or not other.is_contiguous():
        raise ValueError(f"{name} needs contiguous float32 points [G, N, d] and a contiguous second argument")


def nearest_centroids_triton(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``product_quantization.nearest_centroids`` in one kernel (module docstring)."""
    centroids = centroids.float().contiguous()
    _checked(points, centroids, "nearest_centroids_triton")
    n_sets, n_points, dim = points.shape
    n_centroids = centroids.shape[1]
    codes = torch.empty(n_sets, n_points, dtype=torch.long, device=points.device)
    if n_points:
        grid = (n_sets, triton.cdiv(n_points, ASSIGN_BLOCK))
        _nearest_kernel[grid](points, centroids, codes, n_points, N_CENTROIDS=n_centroids, DIM=dim,
                              C_P2=_padded(n_centroids), D_P2=_padded(dim), BLOCK=ASSIGN_BLOCK, num_warps=4)
    return codes


def cluster_sums_triton(points: torch.Tensor, codes: torch.Tensor, n_centroids: int) -> torch.Tensor:
    """``product_quantization.cluster_sums`` in one kernel and a sum over spans (module docstring)."""
    _checked(points, codes, "cluster_sums_triton")
    n_sets, n_points, dim = points.shape
    n_spans = max(1, triton.cdiv(n_points, SUM_SPAN))
    partial = torch.zeros(n_sets, n_spans, n_centroids, dim, dtype=torch.float32, device=points.device)
    if n_points:
        _sums_kernel[(n_sets, n_spans)](points, codes, partial, n_points, n_spans, N_CENTROIDS=n_centroids, DIM=dim,
                                        C_P2=_padded(n_centroids), D_P2=_padded(dim), SPAN=SUM_SPAN, SLICE=SUM_SLICE,
                                        num_warps=4)
    return partial.sum(dim=1)


def nearest_centroids(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Dispatch: the kernel for CUDA tensors when Triton can run, otherwise the reference."""
    if points.is_cuda and triton_available():
        return nearest_centroids_triton(points.contiguous(), centroids)
    return product_quantization.nearest_centroids(points, centroids)


def cluster_sums(points: torch.Tensor, codes: torch.Tensor, n_centroids: int) -> torch.Tensor:
    """Dispatch: the kernel for CUDA tensors when Triton can run, otherwise the reference."""
    if points.is_cuda and triton_available():
        return cluster_sums_triton(points.contiguous(), codes.contiguous(), n_centroids)
    return product_quantization.cluster_sums(points, codes, n_centroids)


def pq_build(keys: torch.Tensor, n_subspaces: int, n_bits: int, n_iters: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``product_quantization.pq_build`` with the passes above."""
    return product_quantization.pq_build(keys, n_subspaces, n_bits, n_iters, generator, nearest=nearest_centroids,
                                          sums=cluster_sums)
