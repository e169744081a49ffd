"""scripts/diagnostics/page_quality.py: the balanced k-means, the mass of a layout's best pages, IceCache's frame,
and the DCI layout it rebuilds, which must be the one IceCache's layer selects its pages from. CPU, random data and
the tiny models."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tests.conftest import load_script

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pq():
    return load_script("diagnostics/page_quality")


def test_capacity_assignment_holds_the_capacity_and_is_nearest_when_room_allows(pq):
    distances = torch.rand(200, 30, generator=torch.Generator().manual_seed(0))
    labels = pq.capacity_assignment(distances, 7)
    assert (labels >= 0).all() and torch.bincount(labels, minlength=30).max() <= 7
    assert torch.equal(pq.capacity_assignment(distances, 200), distances.argmin(1))  # room for all: nearest
    with pytest.raises(ValueError):
        pq.capacity_assignment(distances, 6)  # 30 x 6 < 200


def test_balanced_kmeans_recovers_separated_groups_of_the_page_size(pq):
    generator = torch.Generator().manual_seed(1)
    centres = 50 * torch.randn(12, 8, generator=generator)
    truth = torch.arange(12).repeat_interleave(16)
    points = centres[truth] + 0.1 * torch.randn(truth.numel(), 8, generator=generator)
    order = torch.randperm(truth.numel(), generator=generator)
    labels = pq.balanced_kmeans(points[order], 16, iterations=30, seed=3)
    assert torch.bincount(labels).max() <= 16
    pairs = {(int(t), int(c)) for t, c in zip(truth[order], labels)}
    assert len(pairs) == 12 and len({c for _, c in pairs}) == 12  # each group is one cluster, and whole


def test_balanced_kmeans_never_exceeds_the_page_size_on_unstructured_keys(pq):
    points = torch.randn(1000, 16, generator=torch.Generator().manual_seed(2))
    labels = pq.balanced_kmeans(points, 16, iterations=5)
    counts = torch.bincount(labels)
    assert counts.numel() <= 63 and counts.max() <= 16 and counts.sum() == 1000


def test_best_pages_mass_is_the_best_choice_of_pages(pq):
    generator = torch.Generator().manual_seed(4)
    probs = torch.softmax(3 * torch.randn(4, 40, generator=generator, dtype=torch.float64), dim=1)
    labels = torch.randint(0, 9, (2, 40), generator=generator)  # 2 KV heads, 2 query heads each
    best = pq.best_pages_mass(probs, labels, group=2, n_pages=3)
    for head in range(4):
        masses = [float(probs[head][labels[head // 2] == page].sum()) for page in range(9)]
        brute = max(sum(choice) for choice in itertools.combinations(masses, 3))
        assert float(best[head]) == pytest.approx(brute, abs=1e-12)


def test_no_layout_holds_more_than_the_best_tokens_and_pages_of_one_are_tokens(pq):
    generator = torch.Generator().manual_seed(5)
    probs = torch.softmax(2 * torch.randn(2, 256, generator=generator, dtype=torch.float64), dim=1)
    top = probs.topk(64, dim=1).values.sum(1)
    random_pages = torch.randperm(256, generator=generator).view(1, 256) // 16
    for labels in (pq.positional_pages(1, 256, 16), random_pages):
        assert (pq.best_pages_mass(probs, labels, group=2, n_pages=4) <= top + 1e-12).all()
    singles = pq.positional_pages(1, 256, 1)
    assert torch.allclose(pq.best_pages_mass(probs, singles, group=2, n_pages=64), top)


def test_icecache_frame_partitions_the_prompt(pq):
    from icecache.method import IceCacheConfig

    cfg = IceCacheConfig(budget=256)
    for n_tokens in (300, 320):  # a partial last page, and none
        sink_len, middle_end = pq.icecache_regions(n_tokens, cfg)
        assert sink_len == 32 and n_tokens - middle_end == (16 + n_tokens % 16 if n_tokens % 16 else 32)
        middle = pq.positional_pages(2, middle_end - sink_len, 16)
        labels = pq.framed_pages(middle, sink_len, middle_end, n_tokens, 16)
        assert labels.shape == (2, n_tokens)
        counts = torch.bincount(labels[0])
        assert counts.max() <= 16 and counts.sum() == n_tokens
        assert labels[0, :16].unique().numel() == 1 and labels[0, 16:32].unique().numel() == 1
        window = labels[0, middle_end:]
        assert window.unique().numel() == 2 and not set(window.tolist()) & set(labels[0, :middle_end].tolist())


def test_the_dci_layout_is_the_one_icecache_selects_its_pages_from(pq):
    """IceCache attends whole leaves of its index: at its first decode steps (before its window inserts a page)
    the middle positions a query head attends are a union of whole leaves of the rebuilt layout, never part of
    one, and there are at most K of them. Positional pages do not pass the same check."""
    from eval.plugins import build_method
    from icecache.core.cache import HarnessCache
    from icecache.core.generation import GenerationRequest, greedy_generate
    from tests.conftest import tiny_model

    model, _, info = tiny_model("qwen2")
    method = build_method({"name": "icecache", "budget": 128}, info)
    cfg = method.config
    cache = HarnessCache(method, trace_selection=True)
    prompt_keys, attended = {}, {}
    for kv in cache.layer_kvs[cfg.n_dense_layers:]:
        def prefill(query, key, value, mask, scaling, kv=kv, original=kv.prefill):
            prompt_keys[kv.layer_idx] = key[0].clone()
            return original(query, key, value, mask, scaling)

        def decode(query, key, value, scaling, kv=kv, original=kv.decode):
            out = original(query, key, value, scaling)
            attended.setdefault(kv.layer_idx, []).append(kv.last_attended.clone())
            return out
        kv.prefill, kv.decode = prefill, decode
    n_prompt = 300  # 300 % 16 = 12: the window fills only at the fifth decode step
    ids = torch.randint(0, 500, (n_prompt,), generator=torch.Generator().manual_seed(9)).tolist()
    greedy_generate(model, cache, GenerationRequest(ids, 4))
    n_selected = 128 // 16 - cfg.n_sink_pages - cfg.n_window_pages
    positional_whole = True
    for layer, keys in prompt_keys.items():
        layouts = pq.build_layouts(keys, cfg, kmeans_iterations=2)
        begin, end = layouts.sink_len, layouts.middle_end
        for step in attended[layer]:
            assert step[:, :begin].all() and step[:, end:n_prompt].all()
            for head in range(info.n_heads):
                chosen = step[head, begin:end]
                leaves = layouts.leaves[head // info.group_size]
                touched = leaves[chosen].unique()
                assert 0 < touched.numel() <= n_selected
                assert torch.equal(chosen, torch.isin(leaves, touched))  # whole leaves only
                pages = layouts.positional[0, begin:end]
                positional_whole &= torch.equal(chosen, torch.isin(pages, pages[chosen].unique()))
    assert not positional_whole


def test_layout_masses_are_ordered_as_their_definitions(pq):
    from icecache.method import IceCacheConfig

    cfg = IceCacheConfig(budget=128)
    generator = torch.Generator().manual_seed(6)
    keys = torch.randn(2, 420, 16, generator=generator)
    queries = torch.randn(5, 4, 16, generator=generator)
    n_prompt = 415
    layouts = pq.build_layouts(keys[:, :n_prompt], cfg, kmeans_iterations=5)
    result = pq.layer_quality(layouts, queries, keys, n_prompt, 0.25, 128, cfg, n_selected=4)
    assert set(result) == set(pq.LAYOUTS)
    for name in ("positional", "dci", "kmeans"):
        assert 0 < result[name] <= result["token_topk"] + 1e-12
    # dci_fixed is one choice of 8 pages of the dci layout (2 sink + 4 leaves + 2 window), the search's another
    assert result["dci_search"] <= result["dci_fixed"] + 1e-12 <= result["dci"] + 2e-12
