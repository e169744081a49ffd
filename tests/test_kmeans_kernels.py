"""The k-means passes' kernels (``core.kernels.kmeans_passes``) against their PyTorch references
(``core.product_quantization``): every code the nearest centroid in float64 up to float32 rounding, and the reference's
own code wherever its margin is clear of rounding; cluster sums within float32 rounding and the same bits at every run;
a whole k-means that ends at a Lloyd fixed point with the reference's codes but for near ties. Shapes cover blocks
cut by the end of the points, dimensions and centroid counts under the kernels' padded sizes, and PQCache's own
(64 centroids of 64 channels).

The tests marked ``gpu`` run the Triton kernels themselves: on CUDA, or on CPU in Triton's interpreter
(``TRITON_INTERPRET=1 pytest -m gpu tests/test_kmeans_kernels.py`` with Triton installed).
"""

from __future__ import annotations

import pytest
import torch

from icecache.core import product_quantization
from icecache.core.kernels import kmeans_passes
from tests.conftest import kernel_device

# (sets, points, channels, centroids): a partial last block, padded channels and centroids, PQCache's sizes (a
# 32k-token prompt's too).
SHAPES = [(3, 300, 4, 8), (2, 1000, 64, 64), (4, 2500, 8, 16), (1, 17, 16, 32), (2, 32768, 32, 64)]


def float64_distances(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``[G, N, C]`` squared distances in float64."""
    return torch.cdist(points.double(), centroids.double()) ** 2


def random_points(shape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    n_sets, n_points, dim, n_centroids = shape
    gen = torch.Generator().manual_seed(seed)
    points = torch.randn(n_sets, n_points, dim, generator=gen)
    centroids = torch.randn(n_sets, n_centroids, dim, generator=gen) * 0.5
    return points, centroids


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_each_code_is_the_nearest_centroid_and_the_references_where_its_margin_is_clear(shape):
    device = kernel_device()
    points, centroids = random_points(shape, seed=shape[1])
    codes = kmeans_passes.nearest_centroids_triton(points.to(device), centroids.to(device)).cpu()
    reference = product_quantization.nearest_centroids(points, centroids)
    distances = float64_distances(points, centroids)
    chosen = distances.gather(-1, codes[..., None]).squeeze(-1)
    best = distances.min(dim=-1).values
    assert (chosen <= best + 1e-5 * (1 + best)).all()
    two = distances.topk(2, dim=-1, largest=False).values
    clear = (two[..., 1] - two[..., 0]) > 1e-4 * (1 + two[..., 0])
    assert clear.float().mean() > 0.99
    assert torch.equal(codes[clear], reference[clear])


@pytest.mark.gpu
def test_equal_distances_go_to_the_lower_centroid():
    device = kernel_device()
    points = torch.zeros(1, 40, 4)
    centroids = torch.tensor([[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]]])  # all as far from 0
    codes = kmeans_passes.nearest_centroids_triton(points.to(device), centroids.to(device)).cpu()
    assert torch.equal(codes, torch.zeros(1, 40, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_cluster_sums_are_the_references_within_rounding_and_the_same_bits_again(shape):
    device = kernel_device()
    points, centroids = random_points(shape, seed=7 + shape[1])
    codes = product_quantization.nearest_centroids(points, centroids)
    runs = [kmeans_passes.cluster_sums_triton(points.to(device), codes.to(device), shape[3]).cpu() for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    exact = torch.zeros(shape[0], shape[3], shape[2], dtype=torch.float64)
    exact.scatter_add_(1, codes[..., None].expand(-1, -1, shape[2]), points.double())
    torch.testing.assert_close(runs[0].double(), exact, rtol=1e-5, atol=1e-4)
    empty = torch.ones(shape[0], shape[3], dtype=torch.bool).scatter_(1, codes, False)
    assert (runs[0][empty] == 0).all()


@pytest.mark.gpu
def test_a_kmeans_with_the_kernels_ends_at_a_lloyd_fixed_point_with_the_references_codes_but_near_ties():
    """PQCache's clustering (6 bits, 10 iterations, 2 sub-spaces) of bfloat16 keys, both from the same draw."""
    device = kernel_device()
    keys = torch.randn(2, 3000, 32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    centroids, codes = product_quantization.pq_build(keys.to(device), 2, 6, 10, torch.Generator().manual_seed(3),
                                                     nearest=kmeans_passes.nearest_centroids_triton,
                                                     sums=kmeans_passes.cluster_sums_triton)
    ref_centroids, ref_codes = product_quantization.pq_build(keys, 2, 6, 10, torch.Generator().manual_seed(3))
    codes, centroids = codes.cpu(), centroids.cpu()
    assert (codes != ref_codes).float().mean().item() <= 1e-3
    torch.testing.assert_close(centroids, ref_centroids, rtol=1e-4, atol=1e-4)
    # The codes are the nearest of the final centroids (the last assignment).
    sub = keys.float().view(2, 3000, 2, 16).permute(0, 2, 1, 3).reshape(4, 3000, 16)
    distances = float64_distances(sub, centroids.reshape(4, 64, 16))
    chosen = distances.gather(-1, codes.reshape(4, 3000, 1)).squeeze(-1)
    best = distances.min(dim=-1).values
    assert (chosen <= best + 1e-5 * (1 + best)).all()


def test_on_the_cpu_the_passes_are_the_references_bit_for_bit():
    """The dispatch sends CPU tensors to the references: a CPU run's codebooks do not change."""
    points, centroids = random_points((2, 500, 8, 16), seed=3)
    codes = kmeans_passes.nearest_centroids(points, centroids)
    assert torch.equal(codes, product_quantization.nearest_centroids(points, centroids))
    assert torch.equal(kmeans_passes.cluster_sums(points, codes, 16),
                       product_quantization.cluster_sums(points, codes, 16))
    keys = torch.randn(2, 400, 16, generator=torch.Generator().manual_seed(2))
    built = kmeans_passes.pq_build(keys, 2, 3, 5, torch.Generator().manual_seed(1))
    expected = product_quantization.pq_build(keys, 2, 3, 5, torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(built, expected, strict=True))
