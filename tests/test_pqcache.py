"""PQCache's definitions against direct computations: k-means and product-quantised scores, the tokens a step
chooses, the block cache's LFU rule and what it holds, and the CPU path against the GPU's.

Layers are driven directly (no model) with random tensors, 4 query heads over 2 KV heads.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baselines.pqcache import budget_split
from eval.plugins import build_method
from icecache.core.method import ModelInfo, SequenceContext
from icecache.core.product_quantization import cluster_sums, code_rows, kmeans, pq_build, pq_scores, smallest_draws

INFO = ModelInfo(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8)
GROUP = INFO.n_heads // INFO.n_kv_heads
SCALING = INFO.head_dim**-0.5
SMALL = {"name": "pqcache", "budget": 32, "n_sink_tokens": 4, "n_bits": 3, "cache_block_size": 8,
         "cache_tokens": 32, "cache_topk_blocks": 4}


def make_layer(config: dict, info: ModelInfo = INFO, max_total_tokens: int | None = None):
    method = build_method({**config, "n_dense_layers": 0}, info)
    return method.make_layer(0, SequenceContext(trace_selection=True, max_total_tokens=max_total_tokens))


def random_qkv(gen, n_tokens, info: ModelInfo = INFO, device="cpu"):
    shape_q = (1, info.n_heads, n_tokens, info.head_dim)
    shape_kv = (1, info.n_kv_heads, n_tokens, info.head_dim)
    return tuple(torch.randn(shape, generator=gen).to(device) for shape in (shape_q, shape_kv, shape_kv))


def brute_force_codes(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest centroid of every point, one distance at a time (``points [N, d]``, ``centroids [C, d]``)."""
    return torch.tensor([min(range(len(centroids)), key=lambda c: float(((p - centroids[c]) ** 2).sum()))
                         for p in points])


# ---------------------------------------------------------------------------------------------------- k-means, PQ
def test_kmeans_finds_separated_clusters_and_ends_at_a_lloyd_fixed_point():
    gen = torch.Generator().manual_seed(0)
    means = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]])
    points = (means.repeat_interleave(25, dim=0) + 0.5 * torch.randn(100, 2, generator=gen))[None]
    centroids, codes = kmeans(points, 4, 20, torch.Generator().manual_seed(1))
    # Each blob is one cluster, whose centroid is the mean of its points.
    for blob in range(4):
        members = codes[0, blob * 25 : (blob + 1) * 25]
        assert (members == members[0]).all()
        torch.testing.assert_close(centroids[0, members[0]], points[0, blob * 25 : (blob + 1) * 25].mean(0))
    assert torch.equal(codes[0], brute_force_codes(points[0], centroids[0]))


def test_kmeans_codes_are_nearest_centroids_and_a_small_set_is_encoded_exactly():
    gen = torch.Generator().manual_seed(2)
    points = torch.randn(3, 40, 4, generator=gen)
    centroids, codes = kmeans(points, 8, 3, torch.Generator().manual_seed(3))
    for group in range(3):
        assert torch.equal(codes[group], brute_force_codes(points[group], centroids[group]))
    # Fewer points than centroids: every point is a centroid, so it decodes to itself.
    few = torch.randn(2, 5, 4, generator=gen)
    centroids, codes = kmeans(few, 8, 4, torch.Generator().manual_seed(4))
    decoded = centroids.gather(1, codes[..., None].expand(-1, -1, 4))
    torch.testing.assert_close(decoded, few)


def test_the_initial_draw_is_a_stable_sorts_first_indices_equal_draws_included():
    # 131,072 draws per row: equal values among the 64 smallest come up in most draws of 16 rows.
    draws = torch.rand(16, 131072, generator=torch.Generator().manual_seed(5))
    rows_with_ties = sum(int(draws[r].sort().values[:64].unique().numel() < 64) for r in range(16))
    assert rows_with_ties > 0
    assert torch.equal(smallest_draws(draws, 64), draws.argsort(dim=-1, stable=True)[:, :64])
    # Hand-made ties: equal values go in index order.
    tied = torch.tensor([[0.5, 0.25, 0.5, 0.25, 0.75]])
    assert smallest_draws(tied, 4).tolist() == [[1, 3, 0, 2]]


def test_pq_scores_are_the_sum_of_subspace_products_with_the_codes_centroids():
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 30, 8, generator=gen)  # [Hkv, N, D], 2 sub-spaces of 4 channels
    centroids, codes = pq_build(keys, 2, 3, 5, torch.Generator().manual_seed(6))
    query = torch.randn(4, 8, generator=gen)
    scores = pq_scores(query, centroids, code_rows(codes, 8))
    for head in range(4):
        kv = head // GROUP
        for t in range(30):
            direct = sum(float(query[head, 4 * j : 4 * (j + 1)] @ centroids[kv, j, codes[kv, j, t]]) for j in range(2))
            assert scores[head, t].item() == pytest.approx(direct, abs=1e-5)
        # The codes are the keys' nearest centroids, sub-space by sub-space.
        for j in range(2):
            assert torch.equal(codes[kv, j], brute_force_codes(keys[kv, :, 4 * j : 4 * (j + 1)], centroids[kv, j]))
    # With as many centroids as keys every key is its own centroid: the scores are the exact q . k.
    exact_centroids, exact_codes = pq_build(keys[:, :6], 2, 3, 2, torch.Generator().manual_seed(7))
    exact = pq_scores(query, exact_centroids, code_rows(exact_codes, 8))
    torch.testing.assert_close(exact, torch.einsum("hd,htd->ht", query, keys[:, :6].repeat_interleave(GROUP, 0)))


def test_cluster_sums_by_product_are_the_scattered_sums():
    """The one-hot product (what CUDA runs, for the same bits at every run) against the CPU's scatter_add_, over
    more points than one chunk and with an empty cluster."""
    gen = torch.Generator().manual_seed(13)
    # Whole slices and a rest in the first chunk and in the second (17000), whole slices and a rest (2500), a rest
    # only (300).
    for n_points in (17000, 2500, 300):
        points = torch.randn(3, n_points, 4, generator=gen)
        codes = torch.randint(0, 7, (3, n_points), generator=gen)  # cluster 7 of 8 stays empty
        scattered = cluster_sums(points, codes, 8)
        torch.testing.assert_close(cluster_sums(points, codes, 8, by_product=True), scattered, rtol=1e-5, atol=1e-3)
        assert (scattered[:, 7] == 0).all()
        # Small whole numbers add up exactly in any order: every point is counted once, in its own cluster.
        whole = torch.randint(-8, 9, (3, n_points, 4), generator=gen).float()
        assert torch.equal(cluster_sums(whole, codes, 8, by_product=True), cluster_sums(whole, codes, 8))


# --------------------------------------------------------------------------------------------------------- the layer
def check_attended(layer, attended: torch.Tensor, query: torch.Tensor, keys: torch.Tensor) -> None:
    """PQCache's choice by hand: sinks + local window + per KV head the top n_topk middle tokens by the summed
    softmax of the approximate scores, the keys encoded by brute force against the layer's centroids. Keys with the
    same codes score the same, so a tie at the n_topk-th vote may go either way: the tokens above it must be chosen,
    those below it not, and n_topk in all."""
    n_tokens = keys.shape[1]
    n_sink = layer.config.n_sink_tokens
    n_local, n_topk = budget_split(layer.config)
    window_start = n_tokens - n_local
    assert attended[:, :n_sink].all() and attended[:, window_start:].all()
    candidates = torch.arange(n_sink, window_start)
    for kv in range(INFO.n_kv_heads):
        approx = torch.zeros(GROUP, len(candidates))
        for j in range(layer.config.n_subspaces):
            channels = slice(4 * j, 4 * (j + 1))
            codes = brute_force_codes(keys[kv, candidates, channels], layer.centroids[kv, j])
            for g in range(GROUP):
                approx[g] += layer.centroids[kv, j, codes] @ query[kv * GROUP + g, channels]
        votes = torch.softmax(approx * SCALING, dim=-1).sum(0)
        threshold = votes.topk(n_topk).values[-1]
        for head in range(kv * GROUP, (kv + 1) * GROUP):
            chosen = attended[head, candidates]
            assert int(chosen.sum()) == n_topk
            assert chosen[votes > threshold * (1 + 1e-5)].all()
            assert not chosen[votes < threshold * (1 - 1e-5)].any()
        assert torch.equal(attended[kv * GROUP], attended[(kv + 1) * GROUP - 1])  # one choice per KV head


def test_a_step_attends_sinks_window_and_the_top_tokens_by_summed_approximate_softmax():
    gen = torch.Generator().manual_seed(8)
    config = {**SMALL, "n_subspaces": 2}  # budget 32: 4 sinks + 14 local + 14 selected
    assert budget_split(build_method({**config, "n_dense_layers": 0}, INFO).config) == (14, 14)
    layer = make_layer(config)
    q, k, v = random_qkv(gen, 90)
    layer.seq.more_prefill_chunks = True  # the prompt in two chunks
    layer.forward(q[:, :, :50], k[:, :, :50], v[:, :, :50], None, SCALING)
    layer.seq.more_prefill_chunks = False
    layer.forward(q[:, :, 50:], k[:, :, 50:], v[:, :, 50:], None, SCALING)
    keys, values = k[0], v[0]
    for _ in range(10):
        q1, k1, v1 = random_qkv(gen, 1)
        keys, values = torch.cat([keys, k1[0]], dim=1), torch.cat([values, v1[0]], dim=1)
        out = layer.forward(q1, k1, v1, None, SCALING)
        n_tokens = keys.shape[1]
        expected = layer.last_attended
        check_attended(layer, expected, q1[0, :, 0], keys)
        assert int(expected.sum(-1).max()) == 32
        # Exact attention over exactly those tokens, wherever their keys and values came from (host or cache).
        scores = torch.einsum("hd,htd->ht", q1[0, :, 0], keys.repeat_interleave(GROUP, 0)) * SCALING
        probs = torch.softmax(scores.masked_fill(~expected, float("-inf")), dim=-1)
        torch.testing.assert_close(out[0, 0], torch.einsum("ht,htd->hd", probs, values.repeat_interleave(GROUP, 0)))
    # New tokens' codes are their keys' nearest centroids.
    for j in range(2):
        rows = layer.code_rows[:, j, 90:n_tokens]
        for kv in range(2):
            codes = rows[kv] - (kv * 2 + j) * 8
            assert torch.equal(codes.long(), brute_force_codes(keys[kv, 90:, 4 * j : 4 * (j + 1)],
                                                               layer.centroids[kv, j]))


def lfu_model(slots: list, offered: list[int], step: int) -> None:
    """The block cache's rule, one step, on ``slots`` (per cache slot ``[block, uses, stamp]`` or None): the offered
    blocks (those with chosen tokens, most chosen first) are inserted; a held one gains a use; a new one takes the
    lowest empty slot, else evicts the slot with the fewest uses, the oldest among equals (then the lowest slot),
    that holds no offered block."""
    for entry in slots:
        if entry is not None and entry[0] in offered:
            entry[1:] = [entry[1] + 1, step]
    held = {entry[0] for entry in slots if entry is not None}
    for block in offered:
        if block in held:
            continue
        empty = [i for i, entry in enumerate(slots) if entry is None]
        if empty:
            victim = empty[0]
        else:
            victim = min((i for i, entry in enumerate(slots) if entry[0] not in offered),
                         key=lambda i: (slots[i][1], slots[i][2], i))
        slots[victim] = [block, 1, step]


def cache_slots(layer) -> list:
    return [None if block < 0 else [block, uses, stamp] for block, uses, stamp in
            zip(layer.slot_block[:-1].tolist(), layer.slot_uses[:-1].tolist(), layer.slot_stamp[:-1].tolist())]


def test_the_block_cache_inserts_by_lfu_and_holds_the_host_blocks():
    gen = torch.Generator().manual_seed(9)
    layer = make_layer({**SMALL, "cache_tokens": 24, "cache_topk_blocks": 3})  # 3 slots of 8 tokens
    q, k, v = random_qkv(gen, 100)
    layer.forward(q, k, v, None, SCALING)
    q1, k1, v1 = random_qkv(gen, 1)
    layer.forward(q1, k1, v1, None, SCALING)  # the first step: codebooks in place, a first selection cached
    model = cache_slots(layer)
    # Chosen tokens per step as (block, how many of its tokens), with distinct counts so the offer order is plain;
    # the blocks repeat and compete so that uses and ages decide evictions.
    steps = [[(2, 5), (3, 3), (4, 1)], [(5, 6), (2, 4), (6, 2)], [(7, 7), (8, 3), (5, 1)], [(9, 2), (7, 1)],
             [(3, 4), (9, 3), (2, 1)]]
    for step, wanted in enumerate(steps):
        position = 101 + step
        picks = torch.zeros(2, 14, dtype=torch.long)
        chosen = torch.zeros(2, 14, dtype=torch.bool)
        column = 0
        for block, count in wanted:
            for i in range(count):  # spread over both KV heads: the count is over all heads
                picks[column % 2, column // 2] = block * 8 + i
                chosen[column % 2, column // 2] = True
                column += 1
        loaded = layer._update_cache(picks // 8, chosen, torch.tensor([position]))
        before = {entry[0] for entry in model if entry is not None}
        lfu_model(model, [block for block, _ in wanted], position)
        assert cache_slots(layer) == model, f"step {step}"
        assert int(loaded) == len({entry[0] for entry in model if entry is not None} - before)
        for slot, block in enumerate(layer.slot_block[:-1].tolist()):
            assert layer.block_slot[block] == slot
            assert torch.equal(layer.cache_keys[slot], layer.host_keys[:, block * 8 : (block + 1) * 8])
            assert torch.equal(layer.cache_values[slot], layer.host_values[:, block * 8 : (block + 1) * 8])
        assert int((layer.block_slot[:-1] >= 0).sum()) == 3  # evicted blocks are no longer mapped


def test_cache_hits_replace_transfers_and_change_nothing_attended():
    gen = torch.Generator().manual_seed(10)
    cached, uncached = make_layer(SMALL), make_layer({**SMALL, "cache_tokens": 0})
    q, k, v = random_qkv(gen, 120)
    for layer in (cached, uncached):
        layer.forward(q, k, v, None, SCALING)
    query = torch.randn(1, 4, 1, 8, generator=gen)  # one query over several steps: the same blocks come back
    window, total_hits = cached.window, 0
    for step in range(8):
        _, k1, v1 = random_qkv(gen, 1)
        before_loaded = cached.seq.counters.as_dict()["pages_loaded"]
        before = set(cached.slot_block[:-1].tolist()) - {-1}
        out = cached.forward(query, k1, v1, None, SCALING)
        torch.testing.assert_close(out, uncached.forward(query, k1, v1, None, SCALING), rtol=0, atol=0)
        assert torch.equal(cached.last_attended, uncached.last_attended)
        picks = cached.slot_positions[:, window:]
        chosen = picks >= 0
        hits = int((chosen & torch.isin(picks // 8, torch.tensor(sorted(before)))).sum()) if before else 0
        inserted = len(set(cached.slot_block[:-1].tolist()) - {-1} - before)
        # Transfers: every chosen (token, KV head) not in the cache before the step, and each block copied in.
        loaded = cached.seq.counters.as_dict()["pages_loaded"] - before_loaded
        assert loaded == int(chosen.sum()) - hits + INFO.n_kv_heads * inserted, f"step {step}"
        total_hits += hits
    assert total_hits > 0
    assert uncached.seq.counters.as_dict()["pages_loaded"] == INFO.n_kv_heads * 14 * 8


def test_a_store_grown_outside_the_generation_loop_changes_no_step():
    gen = torch.Generator().manual_seed(11)
    grown = make_layer(SMALL)  # no announced length: sized for 256 tokens, then grown
    sized = make_layer(SMALL, max_total_tokens=300)
    q, k, v = random_qkv(gen, 250)
    for layer in (grown, sized):
        layer.forward(q, k, v, None, SCALING)
    for _ in range(12):
        q1, k1, v1 = random_qkv(gen, 1)
        torch.testing.assert_close(grown.forward(q1, k1, v1, None, SCALING), sized.forward(q1, k1, v1, None, SCALING))
        assert torch.equal(grown.last_attended, sized.last_attended)
    assert grown.capacity > 256


@pytest.mark.parametrize("setting, message", [
    ({"n_subspaces": 3}, "n_subspaces=3 must divide head_dim=8"),
    ({"cache_tokens": 20}, "cache_tokens=20 must be a multiple of cache_block_size=8"),
    ({"cache_topk_blocks": 5}, r"cache_topk_blocks=5 must lie in \[1, 4\]"),
    ({"local_ratio": 1.0}, "local_ratio=1.0"),
    ({"kmeans_on": "gpu"}, r"kmeans_on='gpu' must be one of \['device', 'host'\]"),
])
def test_settings_that_cannot_work_are_refused(setting, message):
    from icecache.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        build_method({**SMALL, **setting}, INFO)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("slow_cache_update", [False, True])
@pytest.mark.parametrize("kmeans_on", ["device", "host"])
def test_the_gpu_layer_chooses_and_attends_what_the_cpu_layer_does(monkeypatch, slow_cache_update, kmeans_on):
    """float32 on both: each layer clusters the same keys from the same initial draw, the GPU layer on a side
    stream of the GPU (``device``: the same codebooks up to float32 rounding on these keys, no point near a tie) or on
    its host worker from the pinned store (``host``: the CPU layer's codebooks bit for bit), so the same tokens, read
    on the GPU from the pinned store in place and from the block cache. The GPU's block-cache updates run on a side
    stream, and held there by a long kernel they are still done before a fetch reads the cache: the same tokens and
    counters."""
    from baselines.pqcache import PQCacheKV

    update = PQCacheKV._update_cache
    updated_on = []

    def watched_update(self, blocks, chosen, position):
        if blocks.is_cuda:
            updated_on.append(torch.cuda.current_stream(blocks.device))
            if slow_cache_update:
                torch.cuda._sleep(100_000_000)
        return update(self, blocks, chosen, position)

    monkeypatch.setattr(PQCacheKV, "_update_cache", watched_update)
    # Head dim 16: the paged kernel's tile product needs at least 16 (every real model has 64 or more).
    cpu_info = ModelInfo(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16)
    gpu_info = dataclasses.replace(cpu_info, device=torch.device("cuda"))
    layers = {"cpu": make_layer(SMALL, cpu_info, 200),
              "cuda": make_layer({**SMALL, "kmeans_on": kmeans_on}, gpu_info, 200)}
    gen = torch.Generator().manual_seed(12)
    q, k, v = random_qkv(gen, 150, cpu_info)
    for device, layer in layers.items():
        layer.forward(q.to(device), k.to(device), v.to(device), None, SCALING)
    for _ in range(20):
        q1, k1, v1 = random_qkv(gen, 1, cpu_info)
        outs = {device: layer.forward(q1.to(device), k1.to(device), v1.to(device), None, SCALING)
                for device, layer in layers.items()}
        assert torch.equal(layers["cuda"].last_attended.cpu(), layers["cpu"].last_attended)
        torch.testing.assert_close(outs["cuda"].cpu(), outs["cpu"], atol=1e-5, rtol=1e-5)
    counters = {device: layer.seq.counters.as_dict() for device, layer in layers.items()}
    assert counters["cuda"] == counters["cpu"]
    assert len(updated_on) == 20 and all(stream != torch.cuda.default_stream() for stream in updated_on)

    torch.testing.assert_close(layers["cuda"].centroids.cpu(), layers["cpu"].centroids, rtol=1e-5, atol=1e-5)
    if kmeans_on == "host":
        assert torch.equal(layers["cuda"].centroids.cpu(), layers["cpu"].centroids)
        assert torch.equal(layers["cuda"].code_rows.cpu(), layers["cpu"].code_rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("passes", ["kernels", "references"])
def test_gpu_kmeans_gives_the_cpu_codebooks_up_to_near_ties_and_the_same_bits_at_every_run(passes):
    """A prompt's k-means on the GPU against the CPU's from the same draw (PQCache's sizes: 6 bits, 10 iterations,
    8 KV heads of 128 channels, bfloat16 keys), with the fused passes the layer runs (``kernels``) or the PyTorch
    references on CUDA: at most one code in a thousand differs (a point whose two nearest centroids are equal to
    float32 rounding can take either; every one it takes then moves its centroids a little), every GPU code is the
    nearest of its GPU centroids up to rounding (checked in float64), and two GPU runs give the same bits."""
    from icecache.core.kernels import kmeans_passes

    build = kmeans_passes.pq_build if passes == "kernels" else pq_build
    gen = torch.Generator().manual_seed(15)
    keys = torch.randn(8, 6000, 128, generator=gen).to(torch.bfloat16)
    cpu_centroids, cpu_codes = pq_build(keys, 2, 6, 10, torch.Generator().manual_seed(3))
    runs = [build(keys.cuda(), 2, 6, 10, torch.Generator().manual_seed(3)) for _ in range(2)]
    (centroids, codes), (again_centroids, again_codes) = [(c.cpu(), k.cpu()) for c, k in runs]
    assert torch.equal(centroids, again_centroids) and torch.equal(codes, again_codes)
    assert (codes != cpu_codes).float().mean().item() <= 1e-3
    sub = keys.double().view(8, 6000, 2, 64).permute(0, 2, 1, 3)  # [Hkv, m, N, d]
    exact = centroids.double()  # |x - c|^2 in float64, [Hkv, m, N, C]
    distances = ((sub * sub).sum(-1)[..., None] - 2 * sub @ exact.transpose(-1, -2)
                 + (exact * exact).sum(-1)[:, :, None, :])
    chosen = distances.gather(-1, codes[..., None]).squeeze(-1)
    assert (chosen <= distances.min(-1).values * (1 + 1e-5) + 1e-6).all()
