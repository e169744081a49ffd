"""The selection kernels of the shared core (``core.kernels``: gqa_scores, causal_column_sums, block_copy, h2o_step,
pq_votes, sign_codes) against direct computations, and on a CUDA host (``make test-gpu``) their Triton versions
against the PyTorch references: fresh random inputs, partial blocks and masked tails included, outputs poisoned
before each run."""

from __future__ import annotations

import pytest
import torch

from icecache.core.kernels import triton_runtime
from icecache.core.kernels.block_copy import copy_blocks, copy_blocks_reference, copy_blocks_triton
from icecache.core.kernels.causal_column_sums import causal_column_sums, causal_column_sums_reference
from icecache.core.kernels.gqa_scores import gqa_scores, gqa_scores_reference
from icecache.core.paged import mapped_device_view
from tests.conftest import kernel_device


def test_gqa_scores_reference_is_scaled_dot_products_masked_past_the_count():
    gen = torch.Generator().manual_seed(0)
    query, keys = torch.randn(6, 16, generator=gen), torch.randn(2, 40, 16, generator=gen)
    scores = gqa_scores_reference(query, keys, 0.5, torch.tensor([33]))
    for head in range(6):
        for token in range(40):
            expected = 0.5 * float(query[head] @ keys[head // 3, token]) if token < 33 else float("-inf")
            assert scores[head, token].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_causal_column_sums_reference_equals_the_full_probability_matrix():
    gen = torch.Generator().manual_seed(1)
    query, keys = torch.randn(4, 30, 8, generator=gen), torch.randn(2, 50, 8, generator=gen)
    full = torch.einsum("hsd,htd->hst", query, keys.repeat_interleave(2, dim=0)) * 0.3
    positions = torch.arange(20, 50)  # the 30 queries are the last 30 of 50 positions
    full = full.masked_fill(torch.arange(50)[None, :] > positions[:, None], float("-inf"))
    expected = torch.softmax(full, dim=-1).sum(dim=1)
    torch.testing.assert_close(causal_column_sums_reference(query, keys, 0.3, chunk_size=7), expected)


def test_copy_blocks_reference_copies_the_named_blocks_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(2)
    source_k, source_v = torch.randn(6, 2, 4, 8, generator=gen), torch.randn(6, 2, 4, 8, generator=gen)
    target_k, target_v = torch.zeros(5, 2, 4, 8), torch.zeros(5, 2, 4, 8)  # slot 4 is the scratch slot
    pages, slots, heads = torch.tensor([3, 1, 5, 0]), torch.tensor([0, -1, 2, 3]), torch.tensor([1, 0, 0, 1])
    copy_blocks_reference(source_k, source_v, pages, target_k, target_v, slots, heads)
    for page, slot, head in zip(pages.tolist(), slots.tolist(), heads.tolist()):
        if slot >= 0:
            assert torch.equal(target_k[slot, head], source_k[page, head])
            assert torch.equal(target_v[slot, head], source_v[page, head])
    untouched = torch.ones(5, 2, dtype=torch.bool)
    untouched[[0, 2, 3], [1, 0, 1]] = False
    untouched[4] = False  # the scratch slot may take skipped entries
    assert (target_k[untouched] == 0).all() and (target_v[untouched] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_keys,n_valid,group", [(1, 1, 1), (300, 257, 4), (4100, 4100, 2), (700, 1, 8)])
@pytest.mark.gpu
def test_triton_gqa_scores_match_the_reference(dtype, n_keys, n_valid, group):
    if not triton_runtime.available():
        pytest.skip("needs CUDA and Triton")
    gen = torch.Generator().manual_seed(n_keys + group)
    query = torch.randn(2 * group, 64, generator=gen).to("cuda", dtype)
    keys = torch.randn(2, n_keys, 64, generator=gen).to("cuda", dtype)
    count = torch.tensor([n_valid], device="cuda")
    expected = gqa_scores_reference(query, keys, 0.125, count)
    out = gqa_scores(query, keys, 0.125, count)
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(out[finite], expected[finite], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_queries,n_keys,group", [(1, 1, 1), (37, 37, 4), (200, 1000, 2), (130, 130, 1)])
@pytest.mark.gpu
def test_triton_causal_column_sums_match_the_reference(dtype, n_queries, n_keys, group):
    if not triton_runtime.available():
        pytest.skip("needs CUDA and Triton")
    gen = torch.Generator().manual_seed(n_queries * 7 + n_keys)
    query = torch.randn(2 * group, n_queries, 64, generator=gen).to("cuda", dtype)
    keys = torch.randn(2, n_keys, 64, generator=gen).to("cuda", dtype)
    expected = causal_column_sums_reference(query, keys, 0.125)
    out = causal_column_sums(query, keys, 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    # Each query row's probabilities sum to one, so the columns sum to the number of rows.
    torch.testing.assert_close(out.sum(-1), torch.full((2 * group,), float(n_queries), device="cuda"), rtol=1e-4,
                               atol=1e-3)


@pytest.mark.gpu
def test_triton_causal_column_sums_from_the_attentions_row_lse_match_the_two_passes():
    """H2O's prompt scores of a chunk after earlier tokens, from the rows' log-sum-exps that the prefill's flash
    kernel returns, against the kernels' own two passes: equal up to float32 rounding."""
    if not triton_runtime.available():
        pytest.skip("needs CUDA and Triton")
    from icecache.core.attention import dense_attention_and_lse

    gen = torch.Generator().manual_seed(3)
    query = torch.randn(1, 8, 300, 64, generator=gen).to("cuda", torch.bfloat16)
    keys = torch.randn(1, 2, 1000, 64, generator=gen).to("cuda", torch.bfloat16)
    _, lse = dense_attention_and_lse(query, keys, keys, 0.125)
    assert lse is not None
    given = causal_column_sums(query[0], keys[0], 0.125, row_lse=lse[0])
    torch.testing.assert_close(given, causal_column_sums(query[0], keys[0], 0.125), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(given, causal_column_sums_reference(query[0], keys[0], 0.125), rtol=1e-4, atol=1e-5)


# One program an entry; 16 entries a program (24 entries: a whole program of 16 and one whose last 8 are past the
# list); programs taking the entries in turn, a block several chunks at a time (the last chunk partial at head_dim
# 48: 768 elements in chunks of 512), one program for all, more programs than entries.
COPY_LAUNCHES = [{}, {"entries_per_program": 16}, {"programs": 5, "chunk_elements": 256},
                 {"programs": 5, "chunk_elements": 512}, {"programs": 1}, {"programs": 40, "chunk_elements": 128}]


@pytest.mark.parametrize("launch", COPY_LAUNCHES, ids=lambda launch: "-".join(f"{k}={v}" for k, v in launch.items())
                         or "one_a_program")
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("mapped_source", [False, True])
@pytest.mark.gpu
def test_triton_copy_blocks_matches_the_reference_from_device_or_mapped_host_memory(mapped_source, head_dim,
                                                                                     launch):
    device = kernel_device()
    if mapped_source and device.type != "cuda":
        pytest.skip("mapped host memory needs CUDA")
    gen = torch.Generator().manual_seed(5)
    source = [torch.randn(40, 4, 16, head_dim, generator=gen).to(torch.bfloat16) for _ in range(2)]
    if mapped_source:  # the CPU store that ArkVale reads in place
        source = [s.pin_memory() for s in source]
        views = [mapped_device_view(s, device) for s in source]
    else:
        views = [s.to(device) for s in source]
    pages = torch.randint(0, 40, (24,), generator=gen).to(device)
    slots = torch.randperm(12, generator=gen)[:24 // 2].repeat(2).to(device)
    heads = torch.cat([torch.zeros(12, dtype=torch.long), torch.ones(12, dtype=torch.long)]).to(device)
    slots[::5] = -1
    poison = [torch.full((13, 4, 16, head_dim), float("nan"), dtype=torch.bfloat16, device=device) for _ in range(2)]
    reference = [p.clone() for p in poison]
    if device.type == "cuda" and set(launch) <= {"programs"}:  # the dispatch, which passes `programs` on
        copy_blocks(*views, pages, *poison, slots, heads, **launch)
    else:  # under Triton's interpreter the dispatch would take the reference
        copy_blocks_triton(*views, pages, *poison, slots, heads, **launch)
    copy_blocks_reference(*views, pages, *reference, slots, heads)
    if device.type == "cuda":
        torch.cuda.synchronize()
    for ours, theirs in zip(poison, reference):
        assert torch.equal(ours[:12].isnan(), theirs[:12].isnan())  # skipped blocks untouched (slot 12: scratch)
        torch.testing.assert_close(ours[:12].nan_to_num(0), theirs[:12].nan_to_num(0), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_slots,n_empty,group", [(64, 0, 4), (256, 0, 2), (100, 30, 1), (40, 39, 8)])
def test_triton_h2o_step_matches_the_reference(dtype, n_slots, n_empty, group):
    """Output, accumulated scores, the next slot and the evicted position, over several steps (ties: lowest slot)."""
    from icecache.core.kernels.h2o_step import h2o_step, h2o_step_reference

    if not triton_runtime.available():
        pytest.skip("needs CUDA and Triton")
    gen = torch.Generator().manual_seed(n_slots + n_empty)
    keys = torch.randn(2, n_slots, 64, generator=gen).to("cuda", dtype)
    values = torch.randn(2, n_slots, 64, generator=gen).to("cuda", dtype)
    positions = torch.stack([torch.randperm(n_slots, generator=gen) for _ in range(2)]).cuda()
    positions[:, n_slots - n_empty:] = -1  # the last slots empty (a short prompt)
    scores = torch.rand(2 * group, n_slots, generator=gen).cuda() * (positions >= 0).repeat_interleave(group, 0)
    free = torch.zeros(2, dtype=torch.long, device="cuda")
    state = [positions, scores, free]
    theirs = [t.clone() for t in state]
    for step in range(4):
        query = torch.randn(2 * group, 64, generator=gen).to("cuda", dtype)
        position = torch.tensor([n_slots + step], device="cuda")
        out = h2o_step(query, keys, values, *state, position, 0.125, 8)
        expected = h2o_step_reference(query, keys, values, *theirs, position, 0.125, 8)
        # The probabilities meet 16-bit values in tf32 (as in the paged attention kernel): ~1e-3 relative.
        if dtype == torch.bfloat16:
            assert ((out - expected).norm() / expected.norm()).item() < 2e-3
        else:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[1], theirs[1], rtol=1e-4, atol=1e-5)
        assert torch.equal(state[2], theirs[2]) and torch.equal(state[0], theirs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_pages,n_finished,group", [(1, 0, 1), (300, 257, 4), (2049, 2049, 2)])
def test_triton_page_bounds_match_the_reference(dtype, n_pages, n_finished, group):
    """Quest's bound in one pass over both metadata tiles against q+ . M + q- . m from the reference."""
    from icecache.core.kernels.gqa_scores import page_bounds, page_bounds_reference

    if not triton_runtime.available():
        pytest.skip("needs CUDA and Triton")
    gen = torch.Generator().manual_seed(n_pages + group)
    query = torch.randn(2 * group, 128, generator=gen).to("cuda", dtype)
    corners = torch.randn(2, 2, n_pages, 128, generator=gen)
    page_max, page_min = corners.amax(0).to("cuda", dtype), corners.amin(0).to("cuda", dtype)
    count = torch.tensor([n_finished], device="cuda")
    expected = page_bounds_reference(query, page_max, page_min, count)
    out = page_bounds(query, page_max, page_min, count)
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(out[finite], expected[finite], rtol=2e-5, atol=2e-4)


def test_page_bounds_reference_is_the_per_channel_box_bound():
    from icecache.core.kernels.gqa_scores import page_bounds_reference

    gen = torch.Generator().manual_seed(3)
    query, corners = torch.randn(4, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    page_max, page_min = corners.amax(0), corners.amin(0)  # [Hkv, P, D]
    bounds = page_bounds_reference(query, page_max, page_min, torch.tensor([4]))
    for head in range(4):
        for page in range(5):
            box = torch.maximum(query[head] * page_max[head // 2, page], query[head] * page_min[head // 2, page])
            expected = float(box.sum()) if page < 4 else float("-inf")
            assert bounds[head, page].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def pq_votes_inputs(gen, n_tokens: int, group: int, device: torch.device):
    """Random query and codebooks of 2 KV heads (2 sub-spaces of 8 centroids, head_dim 16) and random codes, a
    run of tokens copying one token's codes (exact ties)."""
    from icecache.core.product_quantization import code_rows

    query = torch.randn(2 * group, 16, generator=gen)
    centroids = torch.randn(2, 2, 8, 8, generator=gen)
    codes = torch.randint(0, 8, (2, 2, n_tokens), generator=gen)
    codes[..., 10:20] = codes[..., 9:10]
    return query.to(device), centroids.to(device), code_rows(codes, 8).to(device)


def test_pq_votes_reference_is_the_group_sum_of_per_head_softmaxes_over_the_candidates():
    from icecache.core.kernels.pq_votes import pq_votes_reference
    from icecache.core.product_quantization import pq_scores

    gen = torch.Generator().manual_seed(6)
    query, centroids, rows = pq_votes_inputs(gen, 40, 3, torch.device("cpu"))
    votes = pq_votes_reference(query, centroids, rows, 4, torch.tensor([30]), 0.5)
    scores = pq_scores(query, centroids, rows) * 0.5
    for kv in range(2):
        expected = sum(torch.softmax(scores[kv * 3 + g, 4:30], dim=0) for g in range(3))
        torch.testing.assert_close(votes[kv, 4:30], expected)
    assert (votes[:, :4] == -1).all() and (votes[:, 30:] == -1).all()
    none = pq_votes_reference(query, centroids, rows, 4, torch.tensor([4]), 0.5)  # no candidate: -1, not NaN
    assert (none == -1).all()


def pq_votes_device() -> torch.device:
    """CUDA when the Triton kernels can run there, CPU under Triton's interpreter, otherwise skip."""
    if triton_runtime.available():
        return torch.device("cuda")
    if triton_runtime.interpreted():
        return torch.device("cpu")
    pytest.skip("needs CUDA and Triton (or TRITON_INTERPRET=1 with Triton installed)")


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens,first,end,group", [(1, 0, 1, 1), (40, 4, 30, 3), (2500, 4, 2300, 4),
                                                      (3000, 32, 3000, 8), (2100, 5, 5, 4)])
def test_triton_pq_votes_match_the_reference(n_tokens, first, end, group):
    """Partial and candidate-free blocks, groups that are no power of two, no candidate at all; tokens with the
    same codes get the same vote bits (their scores are the reference's bits)."""
    from icecache.core.kernels.pq_votes import pq_votes_reference, pq_votes_triton

    device = pq_votes_device()
    gen = torch.Generator().manual_seed(n_tokens + group)
    query, centroids, rows = pq_votes_inputs(gen, n_tokens, group, device)
    end_tensor = torch.tensor([end], device=device)
    votes = pq_votes_triton(query, centroids, rows, first, end_tensor, 0.3)
    expected = pq_votes_reference(query, centroids, rows, first, end_tensor, 0.3)
    torch.testing.assert_close(votes, expected, rtol=2e-5, atol=1e-7)
    assert torch.equal(votes == -1, expected == -1)
    if first <= 9 and end >= 20:
        assert (votes[:, 10:20] == votes[:, 9:10]).all()


def test_sign_codes_reference_packs_each_tables_positive_signs_lowest_bit_first():
    from icecache.core.kernels.sign_codes import sign_codes_reference

    projected = torch.tensor([[0.5, -1.0, 2.0, 0.0, -0.0, float("nan"), 3.0, 1e-30, -2.0]])  # 3 tables of 3 bits
    codes = sign_codes_reference(projected, 3)
    assert codes.dtype == torch.int32
    assert codes.tolist() == [[0b101, 0b000, 0b011]]  # 0, -0 and NaN set no bit; the smallest positive does
    assert sign_codes_reference(torch.zeros(0, 20), 10).shape == (0, 2)  # no rows


@pytest.mark.gpu
@pytest.mark.parametrize("shape,K", [((1, 10), 10), ((3, 65, 40), 4), ((2, 130, 1500), 10), ((5, 37, 33), 11),
                                     ((70, 16), 16), ((0, 20), 10)])
def test_triton_sign_codes_match_the_reference(shape, K):
    """Partial tiles of rows and tables, one table, K from 4 to 16, no rows; signs of zeros and NaNs included."""
    from icecache.core.kernels.sign_codes import sign_codes_reference, sign_codes_triton

    device = pq_votes_device()
    gen = torch.Generator().manual_seed(sum(shape) + K)
    projected = torch.randn(*shape, generator=gen)
    if projected.numel():
        flat = projected.view(-1)
        flat[:: 7] = 0.0
        flat[3:: 11] = -0.0
        flat[5:: 13] = float("nan")
    projected = projected.to(device)
    codes = sign_codes_triton(projected, K)
    assert codes.shape == (*shape[:-1], shape[-1] // K) and codes.dtype == torch.int32
    assert torch.equal(codes, sign_codes_reference(projected, K))
    strided = projected.transpose(0, -2) if projected.dim() == 3 else projected  # not contiguous
    assert torch.equal(sign_codes_triton(strided, K), sign_codes_reference(strided, K))
