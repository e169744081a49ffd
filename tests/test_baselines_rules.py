"""Each baseline's selection rule, as its module docstring states it, against a direct PyTorch computation of it on
random tensors.

Layers are driven directly (no model): ``forward(query, key, value, mask, scaling)`` with random post-RoPE-like
tensors, on a small geometry with GQA (4 query heads, 2 KV heads).
"""

from __future__ import annotations

import pytest
import torch

from baselines.arkvale import ArkValeConfig, group_page_scores, page_digests, topk_count
from baselines.h2o import accumulated_attention
from baselines.quest import upper_bound_scores
from baselines.snapkv import pooled_votes
from eval.plugins import build_method
from icecache.core.method import ModelInfo, SequenceContext

INFO = ModelInfo(n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8)
GROUP = INFO.n_heads // INFO.n_kv_heads
SCALING = INFO.head_dim**-0.5


def make_layer(config: dict, info: ModelInfo = INFO):
    method = build_method({**config, "n_dense_layers": 0}, info)
    return method.make_layer(0, SequenceContext(trace_selection=True))


def random_qkv(gen, n_tokens, info: ModelInfo = INFO):
    shape_q = (1, info.n_heads, n_tokens, info.head_dim)
    shape_kv = (1, info.n_kv_heads, n_tokens, info.head_dim)
    query = torch.randn(shape_q, generator=gen)
    return query, torch.randn(shape_kv, generator=gen), torch.randn(shape_kv, generator=gen)


def brute_force_bound(query_head: torch.Tensor, page_keys: torch.Tensor) -> float:
    """Quest's bound for one head and one page ``[t, D]``, channel by channel."""
    total = 0.0
    for d in range(page_keys.shape[1]):
        high, low = page_keys[:, d].max(), page_keys[:, d].min()
        total += max(query_head[d] * high, query_head[d] * low).item()
    return total


# ----------------------------------------------------------------------------------------------------------- Quest
def test_quest_bound_is_an_upper_bound_attained_at_the_box_corner():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(6, 2, 16, 8, generator=gen)  # [P, Hkv, page_size, D]
    query = torch.randn(4, 8, generator=gen)
    bound = upper_bound_scores(query, keys.amax(2), keys.amin(2))  # [Hq, P]
    kv_of_head = torch.arange(4) // GROUP
    dots = torch.einsum("hd,phtd->hpt", query, keys[:, kv_of_head])  # every q.k of every page
    assert (bound[..., None] >= dots - 1e-5).all()
    # The bound is q . k* for the box corner k*_d = max if q_d > 0 else min (so it is the tightest box bound).
    corner = torch.where(query[:, None] > 0, keys.amax(2)[:, kv_of_head].transpose(0, 1),
                         keys.amin(2)[:, kv_of_head].transpose(0, 1))
    torch.testing.assert_close(bound, torch.einsum("hd,hpd->hp", query, corner))


def test_quest_selects_current_page_and_brute_force_top_pages():
    gen = torch.Generator().manual_seed(1)
    layer = make_layer({"name": "quest", "budget": 32, "page_size": 8})  # 4 pages: current + top 3
    q, k, v = random_qkv(gen, 77)
    layer.forward(q, k, v, None, SCALING)
    keys = k[0]
    for _ in range(5):  # 77 .. 81 tokens: crosses a page boundary at 80
        q, k1, v1 = random_qkv(gen, 1)
        keys = torch.cat([keys, k1[0]], dim=1)
        layer.forward(q, k1, v1, None, SCALING)
        n_tokens = keys.shape[1]
        n_pages = -(-n_tokens // 8)
        current = n_pages - 1
        for head in range(4):
            ranking = sorted(
                range(current),
                key=lambda p: -brute_force_bound(q[0, head, 0], keys[head // GROUP, p * 8 : (p + 1) * 8]),
            )
            expected = torch.zeros(n_tokens, dtype=torch.bool)
            for page in ranking[:3] + [current]:
                expected[page * 8 : (page + 1) * 8] = True
            assert torch.equal(layer.last_attended[head], expected)
        # Metadata kept incrementally equals the direct max / min of each page.
        padded = torch.cat([keys, keys[:, -1:].expand(-1, n_pages * 8 - n_tokens, -1)], dim=1)
        pages = padded.view(2, n_pages, 8, 8)  # [Hkv, P, page_size, D], the layout of the metadata
        torch.testing.assert_close(layer.page_max[:, :n_pages], pages.amax(2))
        torch.testing.assert_close(layer.page_min[:, :n_pages], pages.amin(2))


def test_quest_fast_path_equals_simulation_path():
    gen = torch.Generator().manual_seed(2)
    paged = make_layer({"name": "quest", "budget": 48, "page_size": 8})
    simulated = make_layer({"name": "quest", "budget": 48, "page_size": 8, "implementation": "simulation"})
    q, k, v = random_qkv(gen, 100)
    for layer in (paged, simulated):
        layer.forward(q, k, v, None, SCALING)
    for _ in range(12):
        q, k, v = random_qkv(gen, 1)
        fast = paged.forward(q, k, v, None, SCALING)
        slow = simulated.forward(q, k, v, None, SCALING)
        assert torch.equal(paged.last_attended, simulated.last_attended)
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------- ArkVale
def test_arkvale_digest_is_centre_plus_minus_mean_absolute_deviation():
    # One channel of a 3-token page holding 1, 3, 8: centre (8 + 1) / 2 = 4.5, deviations 3.5, 1.5, 3.5,
    # mean 8.5 / 3; so hi = 4.5 + 8.5/3 and lo = 4.5 - 8.5/3. A constant channel (2, 2, 2) gives hi = lo = 2.
    page = torch.tensor([[1.0, 2.0], [3.0, 2.0], [8.0, 2.0]])[None, None]  # [1, 1, 3, 2]
    hi, lo = page_digests(page)
    torch.testing.assert_close(hi[0, 0], torch.tensor([4.5 + 8.5 / 3, 2.0]))
    torch.testing.assert_close(lo[0, 0], torch.tensor([4.5 - 8.5 / 3, 2.0]))


def test_arkvale_scores_average_the_bound_over_each_group():
    gen = torch.Generator().manual_seed(3)
    info = ModelInfo(n_layers=1, n_heads=8, n_kv_heads=4, head_dim=8)
    pages = torch.randn(5, 4, 16, 8, generator=gen)
    hi, lo = page_digests(pages)  # [P, Hkv, D]
    query = torch.randn(8, 8, generator=gen)
    for n_groups in (1, 2, 4):
        scores = group_page_scores(query, hi.transpose(0, 1), lo.transpose(0, 1), n_groups)  # digests [Hkv, P, D]
        heads_per_group = info.n_heads // n_groups
        for group in range(n_groups):
            for page in range(5):
                per_head = [
                    (torch.maximum(query[h] * hi[page, h // 2], query[h] * lo[page, h // 2])).sum().item()
                    for h in range(group * heads_per_group, (group + 1) * heads_per_group)
                ]
                assert scores[group, page].item() == pytest.approx(sum(per_head) / len(per_head), rel=1e-5)


@pytest.mark.parametrize("n_groups", [1, 2])
def test_arkvale_keeps_the_top_pages_resident_and_recalls_them_from_cpu(n_groups):
    gen = torch.Generator().manual_seed(4)
    config = {"name": "arkvale", "budget": 64, "page_size": 8, "n_groups": n_groups}
    n_topk = topk_count(ArkValeConfig(**config))  # min(1280, 32) // 8 - 1 - (2 - 1) = 2
    assert n_topk == 2
    layer = make_layer(config)
    q, k, v = random_qkv(gen, 150)
    layer.forward(q, k, v, None, SCALING)
    keys = k[0]
    for step in range(20):
        q, k1, v1 = random_qkv(gen, 1)
        keys = torch.cat([keys, k1[0]], dim=1)
        layer.forward(q, k1, v1, None, SCALING)
        n_tokens = keys.shape[1]
        n_pages = -(-n_tokens // 8)
        candidates = list(range(1, n_pages - 2))  # not the sink page, not the last two pages
        full = keys[:, : len(candidates) * 8 + 8].view(2, -1, 8, 8)  # pages 0 .. last candidate
        for group in range(n_groups):
            heads = range(group * 4 // n_groups, (group + 1) * 4 // n_groups)
            def score(p):  # cuboid-mean bound averaged over the group's query heads, by hand
                page = full[:, p]  # [Hkv, 8, D]
                centre = (page.amax(1) + page.amin(1)) / 2
                radius = (page - centre[:, None]).abs().mean(1)
                hi, lo = centre + radius, centre - radius
                return sum(torch.maximum(q[0, h, 0] * hi[h // 2], q[0, h, 0] * lo[h // 2]).sum().item()
                           for h in heads) / len(heads)
            top = sorted(candidates, key=lambda p: -score(p))[:n_topk]
            for h in heads:
                for page in top + [0, n_pages - 2, n_pages - 1]:
                    end = min((page + 1) * 8, n_tokens)
                    assert layer.last_attended[h, page * 8 : end].all(), f"step {step} head {h} page {page}"
        assert int(layer.last_attended.sum(-1).max()) <= 64
    # Recalls happened (their content is checked by invariant 4).
    assert layer.seq.counters.as_dict()["pages_loaded"] > 0


# ------------------------------------------------------------------------------------------------------------- H2O
def test_h2o_chunked_prefill_scores_equal_the_full_score_matrix():
    gen = torch.Generator().manual_seed(5)
    q, k, _ = random_qkv(gen, 50)
    # Direct: the whole causal softmax matrix, summed over query rows.
    scores = torch.einsum("hsd,htd->hst", q[0], k[0].repeat_interleave(GROUP, dim=0)) * SCALING
    causal = torch.ones(50, 50, dtype=torch.bool).tril()
    expected = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).sum(dim=1)
    for chunk in (7, 50):
        torch.testing.assert_close(accumulated_attention(q[0], k[0], SCALING, chunk), expected)
    # The last 20 rows against all 50 keys (a later prefill chunk) are the matrix's last 20 rows.
    tail = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)[:, 30:].sum(dim=1)
    torch.testing.assert_close(accumulated_attention(q[0, :, 30:], k[0], SCALING, 6), tail)


def h2o_expected_keep(scores_per_head: torch.Tensor, n_heavy: int, n_recent: int) -> list[list[int]]:
    """Per KV head: the last n_recent indices plus the top n_heavy older ones by the group-summed score."""
    kv_scores = scores_per_head.view(2, GROUP, -1).sum(1)
    n = kv_scores.shape[1]
    kept = []
    for head in range(2):
        older = sorted(range(n - n_recent), key=lambda i: -kv_scores[head, i].item())[:n_heavy]
        kept.append(sorted(older + list(range(n - n_recent, n))))
    return kept


def test_h2o_keeps_top_accumulated_scores_and_recent_window():
    gen = torch.Generator().manual_seed(6)
    budget = 40  # 20 heavy hitters + 20 recent (the new token included), so 39 kept between steps
    q, k, v = random_qkv(gen, 120)
    chunked = make_layer({"name": "h2o", "budget": budget, "score_chunk_size": 16})
    whole = make_layer({"name": "h2o", "budget": budget})
    chunked.seq.more_prefill_chunks = True
    chunked.forward(q[:, :, :70], k[:, :, :70], v[:, :, :70], None, SCALING)
    chunked.seq.more_prefill_chunks = False
    chunked.forward(q[:, :, 70:], k[:, :, 70:], v[:, :, 70:], None, SCALING)
    whole.forward(q, k, v, None, SCALING)

    prompt_scores = accumulated_attention(q[0], k[0], SCALING, 1000)
    expected = h2o_expected_keep(prompt_scores, 20, 19)
    assert whole.kept_positions().tolist() == expected
    assert chunked.kept_positions().tolist() == expected  # chunked prefill changes nothing
    torch.testing.assert_close(chunked.kept_scores(), whole.kept_scores())

    for _ in range(6):
        before_positions = whole.kept_positions()
        before_scores = whole.kept_scores()
        q1, k1, v1 = random_qkv(gen, 1)
        kept_keys = torch.cat([whole.slot_keys.gather(1, whole.kept_order()[..., None].expand(-1, -1, 8)), k1[0]],
                              dim=1)
        whole.forward(q1, k1, v1, None, SCALING)
        # Accumulate by hand: old scores (a new zero for the new token) + this step's probabilities per head.
        probs = torch.softmax(
            torch.einsum("hd,htd->ht", q1[0, :, 0], kept_keys.repeat_interleave(GROUP, dim=0)) * SCALING, dim=-1
        )
        accumulated = torch.cat([before_scores, torch.zeros(4, 1)], dim=1) + probs
        keep = h2o_expected_keep(accumulated, 20, 19)
        positions = torch.cat([before_positions, torch.full((2, 1), int(before_positions.max()) + 1)], dim=1)
        assert whole.kept_positions().tolist() == [positions[h, keep[h]].tolist() for h in range(2)]
        torch.testing.assert_close(
            whole.kept_scores(), torch.stack([accumulated[h, keep[h // GROUP]] for h in range(4)])
        )


# ---------------------------------------------------------------------------------------------------------- SnapKV
def test_snapkv_votes_and_selection_equal_a_direct_computation():
    gen = torch.Generator().manual_seed(7)
    window, kernel, budget, n_prompt = 8, 7, 30, 100
    q, k, v = random_qkv(gen, n_prompt)
    # Direct: each window query (position 92 .. 99) attends causally over keys 0..its position; sum its
    # probabilities over the 92 prefix keys, average the group's query heads, max over a 7-wide neighbourhood.
    votes = torch.zeros(2, n_prompt - window)
    for head in range(4):
        for row in range(n_prompt - window, n_prompt):
            logits = k[0, head // GROUP, : row + 1] @ q[0, head, row] * SCALING
            votes[head // GROUP] += torch.softmax(logits, dim=0)[: n_prompt - window] / GROUP
    pooled = torch.stack([
        torch.stack([votes[h, max(0, i - 3) : i + 4].max() for i in range(n_prompt - window)]) for h in range(2)
    ])
    torch.testing.assert_close(pooled_votes(q[0, :, -window:], k[0], SCALING, kernel), pooled)

    layer = make_layer({"name": "snapkv", "budget": budget, "observation_window": window, "pooling_kernel": kernel})
    layer.seq.more_prefill_chunks = True  # the window straddles two chunks (95 + 5)
    layer.forward(q[:, :, :95], k[:, :, :95], v[:, :, :95], None, SCALING)
    layer.seq.more_prefill_chunks = False
    layer.forward(q[:, :, 95:], k[:, :, 95:], v[:, :, 95:], None, SCALING)
    # Kept after the prompt: the top 22 prefix tokens by pooled vote, and the window (the first decode step's token
    # replaces its oldest one).
    for head in range(2):
        top = sorted(pooled[head].topk(budget - window).indices.tolist())
        assert layer.kept_positions()[head].tolist() == top + list(range(n_prompt - window, n_prompt))
    selected = layer.kept_positions()[:, : budget - window].clone()
    for step in range(5):
        q1, k1, v1 = random_qkv(gen, 1)
        layer.forward(q1, k1, v1, None, SCALING)
        n_tokens = n_prompt + step + 1
        recent = torch.arange(n_tokens - window, n_tokens)
        expected = torch.zeros(2, n_tokens, dtype=torch.bool)
        expected[:, recent] = True
        expected.scatter_(1, selected, True)
        assert torch.equal(layer.last_attended, expected.repeat_interleave(GROUP, dim=0))


# ------------------------------------------------------------------------------------------------------ oracle TOP-k
def test_oracle_topk_is_full_attention_at_large_budget_and_exact_topk_below():
    gen = torch.Generator().manual_seed(8)
    q, k, v = random_qkv(gen, 60)
    large = make_layer({"name": "oracle_topk", "budget": 61})
    small = make_layer({"name": "oracle_topk", "budget": 10})
    for layer in (large, small):
        layer.forward(q, k, v, None, SCALING)
    q1, k1, v1 = random_qkv(gen, 1)
    keys = torch.cat([k, k1], dim=2)[0].repeat_interleave(GROUP, dim=0)
    values = torch.cat([v, v1], dim=2)[0].repeat_interleave(GROUP, dim=0)
    scores = torch.einsum("hd,htd->ht", q1[0, :, 0], keys) * SCALING
    full = torch.einsum("ht,htd->hd", torch.softmax(scores, dim=-1), values)
    torch.testing.assert_close(large.forward(q1, k1, v1, None, SCALING)[0, 0], full)
    small.forward(q1, k1, v1, None, SCALING)
    for head in range(4):
        expected = set(sorted(range(61), key=lambda t: -scores[head, t].item())[:10])
        assert set(small.last_attended[head].nonzero().flatten().tolist()) == expected


# ----------------------------------------------------------------------------------------------------- StreamingLLM
def test_streaming_llm_keeps_exactly_sinks_and_window():
    gen = torch.Generator().manual_seed(9)
    budget = 20  # 4 sinks + 16 recent tokens
    layer = make_layer({"name": "streaming_llm", "budget": budget})
    q, k, v = random_qkv(gen, 50)
    layer.forward(q, k, v, None, SCALING)
    # The sinks and a full window of the prompt's last 16 tokens; the first step's token replaces the oldest.
    assert layer.kept_positions().tolist() == [[0, 1, 2, 3] + list(range(34, 50))] * 2
    for step in range(4):
        q1, k1, v1 = random_qkv(gen, 1)
        layer.forward(q1, k1, v1, None, SCALING)
        n_tokens = 51 + step
        expected = torch.zeros(4, n_tokens, dtype=torch.bool)
        expected[:, :4] = True
        expected[:, n_tokens - 16 :] = True
        assert torch.equal(layer.last_attended, expected)
