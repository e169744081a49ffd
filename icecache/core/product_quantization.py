"""Product quantisation of attention keys: k-means codebooks per sub-space, codes, and approximate ``q . k``.

A head's ``D`` channels are cut into ``m`` contiguous sub-vectors of ``d = D / m`` channels; each sub-space has its
own codebook of ``C = 2**bits`` centroids, learnt by k-means (Lloyd's iterations, squared Euclidean distance) over
the keys it will encode, and a key is stored as the ``m`` indices of its nearest centroids. The inner product of a
query with an encoded key is approximated by ``sum_j q_j . c_j[code_j]``: one ``[m, C]`` table of query-centroid
products per query head, then one table lookup per sub-space and key.

Everything here is plain PyTorch and runs on any device. PQCache builds its codebooks (``pq_build``) on the
model's device, on a side stream beside the prefill (on the CPU for a model on the CPU), and encodes later keys and
scores there too (``pq_encode``, ``pq_scores``).

k-means gives the same result wherever it runs, up to float32 rounding: the random initial draw is made on the CPU
from the caller's generator and only its indices are moved, and a cluster's sum is order-independent up to rounding.
On CUDA the sums are one product with the one-hot assignment matrix, not ``scatter_add_``, whose float atomics
add in a different order at every run: the product is the same at every run, so the codebooks and every token
chosen from them are too. A point whose two nearest centroids are equal to rounding may take the other one on the
other device, and a point that changes cluster moves both centroids.
"""

from __future__ import annotations

import torch

from .host_memory import to_device_without_waiting

#: Points whose distances to the centroids are computed at once (bounds k-means' memory at long prompts).
_ASSIGN_CHUNK = 16384


def nearest_centroids(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``points [G, N, d]``, ``centroids [G, C, d]`` -> int64 ``[G, N]``: the index of each point's nearest centroid
    (squared Euclidean distance; ties go to the lower index)."""
    points, centroids = points.float(), centroids.float()
    norms = (centroids * centroids).sum(-1)  # [G, C]
    codes = []
    for begin in range(0, points.shape[1], _ASSIGN_CHUNK):
        chunk = points[:, begin : begin + _ASSIGN_CHUNK]
        # |x - c|^2 = |x|^2 - 2 x.c + |c|^2; |x|^2 is the same for every centroid of a point.
        distance = norms[:, None, :] - 2 * torch.bmm(chunk, centroids.transpose(1, 2))
        codes.append(distance.argmin(dim=-1))
    if not codes:
        return torch.zeros(points.shape[0], 0, dtype=torch.long, device=points.device)
    return torch.cat(codes, dim=1)


def kmeans(points: torch.Tensor, n_centroids: int, n_iters: int, generator: torch.Generator | None = None, *,
           nearest=None, sums=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means on each of ``G`` independent point sets ``points [G, N, d]`` (float32).

    Initial centroids are ``n_centroids`` distinct points drawn at random (one draw per set, from ``generator``);
    with fewer points than centroids every point is a centroid and the rest repeat them, so each point is encoded
    exactly. A cluster that loses all its points keeps its centroid. Returns ``(centroids [G, C, d], codes [G, N])``
    with the codes of the final centroids. ``nearest`` and ``sums`` replace ``nearest_centroids`` and
    ``cluster_sums`` (the same arguments and results; ``core.kernels.kmeans_passes`` fuses them on CUDA)."""
    nearest = nearest or nearest_centroids
    sums_of = sums or cluster_sums
    n_sets, n_points, dim = points.shape
    points = points.float()
    if n_points == 0:
        return (points.new_zeros(n_sets, n_centroids, dim),
                torch.zeros(n_sets, 0, dtype=torch.long, device=points.device))
    # The draw is made on the CPU whatever the points' device, so that a seed picks the same initial centroids on
    # every device; only the chosen indices move (through pinned memory: no wait for the device's queued work).
    if n_points >= n_centroids:
        order = smallest_draws(torch.rand(n_sets, n_points, generator=generator), n_centroids)
    else:
        order = (torch.arange(n_centroids) % n_points).expand(n_sets, -1)
    order = to_device_without_waiting(order, points.device)
    centroids = points.gather(1, order[..., None].expand(-1, -1, dim))
    ones = points.new_ones(n_sets, n_points)
    for _ in range(n_iters):
        codes = nearest(points, centroids)
        counts = points.new_zeros(n_sets, n_centroids).scatter_add_(1, codes, ones)  # whole numbers: exact
        sums = sums_of(points, codes, n_centroids)
        centroids = torch.where(counts[..., None] > 0, sums / counts.clamp(min=1)[..., None], centroids)
    return centroids, nearest(points, centroids)


def smallest_draws(draws: torch.Tensor, k: int) -> torch.Tensor:
    """``[G, k]``: the indices of the ``k`` smallest of each row of uniform ``draws [G, N]`` (float32 from
    ``torch.rand``), in order, ties to the lower index: the first ``k`` of a stable argsort.

    A top-k of ``(value, index)`` keys rather than a sort: a tenth of the time at 128k points, and the order of
    equal draws is fixed (among the 64 smallest of 131,072 draws equal values come up every few rows, and an
    unstable sort may put them either way). ``torch.rand``'s float32 values are whole multiples of ``2**-24``,
    so ``value * 2**24 * N + index`` is a whole number that orders by value, then index."""
    n_points = draws.shape[-1]
    keys = (draws.double() * 2**24).long() * n_points + torch.arange(n_points, device=draws.device)
    return keys.topk(k, dim=-1, largest=False, sorted=True).indices


#: Points per slice of a chunk in ``cluster_sums``' product: each slice is a product of its own.
_SUM_SLICE = 1024


def cluster_sums(points: torch.Tensor, codes: torch.Tensor, n_centroids: int,
                 by_product: bool | None = None) -> torch.Tensor:
    """``[G, C, d]``: the sum of the points ``[G, N, d]`` of each cluster (``codes [G, N]``). On the CPU a
    ``scatter_add_``; on CUDA (or with ``by_product``) the product of the one-hot assignment with the points, which
    gives the same bits at every run (CUDA's ``scatter_add_`` adds with atomics, in an order that changes from run
    to run).

    The product is taken per slice of ``_SUM_SLICE`` points, as one batched product of ``G x slices`` small ones,
    and the slices' sums are then added in slice order: one ``[C, N] x [N, d]`` product per set has ``C x d``
    outputs (64 x 64 for PQCache) over thousands of points, a handful of thread blocks that leave most of the GPU
    idle for the whole reduction (0.7 ms a product on an H200, 640 products in a 32k prefill), while the slices
    give every block a short reduction of its own. Either order is fixed, so each is the same at every run."""
    n_sets, n_points, dim = points.shape
    if not (points.is_cuda if by_product is None else by_product):
        return points.new_zeros(n_sets, n_centroids, dim).scatter_add_(1, codes[..., None].expand(-1, -1, dim), points)
    labels = torch.arange(n_centroids, device=points.device)[None, None, :, None]
    sums = points.new_zeros(n_sets, n_centroids, dim)
    for begin in range(0, n_points, _ASSIGN_CHUNK):
        chunk = points[:, begin : begin + _ASSIGN_CHUNK]
        chunk_codes = codes[:, begin : begin + _ASSIGN_CHUNK]
        n_chunk = chunk.shape[1]
        n_sliced = n_chunk - n_chunk % _SUM_SLICE
        if n_sliced:
            n_slices = n_sliced // _SUM_SLICE
            # [G, slices, C, slice] one-hot times [G, slices, slice, d] points, as G x slices products
            one_hot = (chunk_codes[:, :n_sliced].reshape(n_sets, n_slices, 1, _SUM_SLICE) == labels).float()
            partial = torch.bmm(one_hot.view(n_sets * n_slices, n_centroids, _SUM_SLICE),
                                chunk[:, :n_sliced].reshape(n_sets * n_slices, _SUM_SLICE, dim))
            sums = sums + partial.view(n_sets, n_slices, n_centroids, dim).sum(dim=1)
        if n_sliced < n_chunk:  # the chunk's last points, fewer than a slice
            one_hot = (chunk_codes[:, None, n_sliced:] == labels[0]).float()  # [G, C, rest]
            sums = torch.baddbmm(sums, one_hot, chunk[:, n_sliced:])
    return sums


def split_subspaces(vectors: torch.Tensor, n_subspaces: int) -> torch.Tensor:
    """``[H, N, D]`` -> ``[H, m, N, D / m]``: the ``m`` contiguous sub-vectors of every vector."""
    n_heads, n, dim = vectors.shape
    return vectors.view(n_heads, n, n_subspaces, dim // n_subspaces).permute(0, 2, 1, 3)


def pq_build(keys: torch.Tensor, n_subspaces: int, n_bits: int, n_iters: int,
             generator: torch.Generator | None = None, *, nearest=None,
             sums=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codebooks and codes of ``keys [Hkv, N, D]``: ``(centroids [Hkv, m, C, d] float32, codes [Hkv, m, N] int64)``,
    one k-means per (KV head, sub-space); ``nearest`` and ``sums`` as for ``kmeans``."""
    n_kv_heads, n, dim = keys.shape
    sub = split_subspaces(keys.float(), n_subspaces).reshape(n_kv_heads * n_subspaces, n, dim // n_subspaces)
    centroids, codes = kmeans(sub.contiguous(), 2**n_bits, n_iters, generator, nearest=nearest, sums=sums)
    return (centroids.view(n_kv_heads, n_subspaces, 2**n_bits, dim // n_subspaces),
            codes.view(n_kv_heads, n_subspaces, n))


def pq_encode(keys: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``keys [Hkv, n, D]`` against ``centroids [Hkv, m, C, d]`` -> int64 codes ``[Hkv, m, n]``."""
    n_kv_heads, n_subspaces, n_centroids, sub_dim = centroids.shape
    sub = split_subspaces(keys.float(), n_subspaces).reshape(n_kv_heads * n_subspaces, -1, sub_dim)
    codes = nearest_centroids(sub, centroids.reshape(n_kv_heads * n_subspaces, n_centroids, sub_dim))
    return codes.view(n_kv_heads, n_subspaces, -1)


def code_rows(codes: torch.Tensor, n_centroids: int) -> torch.Tensor:
    """Codes ``[Hkv, m, n]`` as int32 rows of the flattened ``[Hkv * m * C]`` lookup table of ``pq_scores``: row
    ``(h * m + j) * C + code``. Kept in this form, a step scores every key with one ``index_select``."""
    n_kv_heads, n_subspaces = codes.shape[:2]
    base = torch.arange(n_kv_heads * n_subspaces, device=codes.device).view(n_kv_heads, n_subspaces, 1)
    return (base * n_centroids + codes).to(torch.int32)


def pq_scores(query: torch.Tensor, centroids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Approximate ``q_h . k_t`` for ``query [Hq, D]`` and keys encoded as ``rows [Hkv, m, T]`` (``code_rows``)
    against ``centroids [Hkv, m, C, d]`` -> float32 ``[Hq, T]``: ``sum_j q_hj . c_j[code_j(t)]``. Query head ``h``
    reads KV head ``h // (Hq / Hkv)``."""
    n_heads = query.shape[0]
    n_kv_heads, n_subspaces = centroids.shape[:2]
    table = pq_table(query, centroids)
    looked_up = table.index_select(0, rows.reshape(-1)).view(n_kv_heads, n_subspaces, -1, table.shape[1])
    return looked_up.sum(dim=1).permute(0, 2, 1).reshape(n_heads, -1)


def pq_table(query: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """The float32 lookup table of ``pq_scores``: ``[Hkv * m * C, g]``, row ``(h * m + j) * C + c`` holding
    ``q . c_j[c]`` for the ``g`` query heads of KV head ``h``."""
    n_heads, dim = query.shape
    n_kv_heads, n_subspaces, n_centroids, sub_dim = centroids.shape
    group = n_heads // n_kv_heads
    q = query.float().view(n_kv_heads, group, n_subspaces, sub_dim)
    return torch.einsum("hgmd,hmcd->hmcg", q, centroids.float()).reshape(-1, group)
