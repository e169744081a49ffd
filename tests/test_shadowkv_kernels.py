"""ShadowKV's step kernels (``core.kernels.shadowkv_step``): the Triton window turn, selection with its plan, and
step finish against their PyTorch references on random states, and a layer's decode steps with the kernels against
the same steps with the references.

Exact where the kernels copy or decide (the host copy of values, the token write, the top chunks on scores without
ties, the slot table, the copy list, the valid counts, the counters); within float32 rounding where they sum
(coefficients, probabilities, rebuilt keys). The landmark's mean follows PyTorch's CUDA order; on a CPU the keys are
chosen so that every sum is exact, since PyTorch's CPU sum runs in another order.

The tests marked ``gpu`` run the Triton kernels themselves: on CUDA, or on CPU in Triton's interpreter
(``TRITON_INTERPRET=1 pytest -m gpu tests/test_shadowkv_kernels.py`` with Triton installed).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from icecache.core.kernels import shadowkv_step
from icecache.core.kernels.shadowkv_step import (
    ScoreLaunch,
    ShadowKVSlots,
    ShadowKVStepPlan,
    finish_step_reference,
    finish_step_triton,
    landmark_scores,
    select_and_plan_reference,
    select_and_plan_triton,
    turn_window_reference,
    turn_window_triton,
)
from icecache.core.rope import Rotary
from tests.conftest import count_triton_calls, kernel_device

HEAD_DIM, N_KV_HEADS, GROUP = 16, 2, 3
ROTARY = Rotary(inv_freq=tuple(float(f) for f in 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))),
                attention_scaling=1.25)
LAYOUT = ShadowKVSlots(chunk_size=8, n_outlier=2, n_selected=6, n_local=3)


class NoRotary:
    def apply(self, x, positions, inv_freq=None):
        return x.float()

    invert = apply


def exact_sum_keys(shape, gen, dtype, device) -> torch.Tensor:
    """Plain random keys on CUDA; on a CPU, multiples of 1/4 (float32) or bf16 of one binade, whose sums of a chunk
    are exact in any order."""
    if device.type == "cuda":
        return torch.randn(shape, generator=gen).to(device, dtype)
    if dtype == torch.float32:
        return (torch.randint(-8, 9, shape, generator=gen) / 4).to(device, dtype)
    magnitude = 1 + torch.rand(shape, generator=gen)
    return (magnitude * torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)).to(device, dtype)


def tolerance(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


def window_state(gen, device, dtype, n_chunks, rank):
    n_slots = LAYOUT.n_attended_slots + 1
    return dict(
        pool_keys=exact_sum_keys((n_slots, N_KV_HEADS, LAYOUT.chunk_size, HEAD_DIM), gen, dtype, device),
        pool_values=torch.randn(n_slots, N_KV_HEADS, LAYOUT.chunk_size, HEAD_DIM, generator=gen).to(device, dtype),
        landmarks=torch.randn(N_KV_HEADS, n_chunks + 1, HEAD_DIM, generator=gen).to(device, dtype),
        store_values=torch.randn(n_chunks + 1, N_KV_HEADS, LAYOUT.chunk_size, HEAD_DIM,
                                 generator=gen).to(device, dtype),
        coefficients=torch.randn((n_chunks + 1) * LAYOUT.chunk_size, rank, generator=gen).to(device, dtype),
        basis=torch.randn(rank, N_KV_HEADS * HEAD_DIM, generator=gen).to(device, dtype),
    )


def cloned(state: dict) -> dict:
    return {name: tensor.clone() for name, tensor in state.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("position", [24 * 8, 24 * 8 + 5, 2 * 8])  # a chunk starts; mid-chunk; none leaves yet
def test_triton_turn_window_matches_the_reference(dtype, rope, position):
    device = kernel_device()
    gen = torch.Generator().manual_seed(position + 3 * rope)
    rank = 40  # two blocks of the rank, the second partial
    state = window_state(gen, device, dtype, n_chunks=30, rank=rank)
    rotary, inv_freq = (ROTARY, ROTARY.frequencies(device)) if rope else (NoRotary(), None)
    at = torch.tensor([position], device=device)
    results = []
    for run in (turn_window_triton, turn_window_reference):
        mine = cloned(state)
        run(LAYOUT, at, mine["pool_keys"], mine["pool_values"], mine["landmarks"], mine["store_values"],
            mine["coefficients"], mine["basis"], rotary, inv_freq)
        results.append(mine)
    fused, reference = results
    # Chunk 30 is the scratch chunk: the reference writes it when no chunk leaves, the kernel writes nothing then.
    chunks, rows = slice(0, 30), slice(0, 30 * 8)
    for name in ("pool_keys", "pool_values", "basis"):
        assert torch.equal(fused[name], reference[name]), name
    assert torch.equal(fused["landmarks"][:, chunks], reference["landmarks"][:, chunks])
    assert torch.equal(fused["store_values"][chunks], reference["store_values"][chunks])
    torch.testing.assert_close(fused["coefficients"][rows], reference["coefficients"][rows], **tolerance(dtype))
    leaving = position // 8 - LAYOUT.n_local
    if position % 8 or leaving < 0:  # no chunk leaves: the kernel changes nothing
        for name in state:
            assert torch.equal(fused[name], state[name]), name
        return
    written = slice(leaving * 8, (leaving + 1) * 8)
    untouched = torch.ones(fused["coefficients"].shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(fused["coefficients"][untouched], state["coefficients"][untouched])
    assert not torch.equal(fused["landmarks"][:, leaving], state["landmarks"][:, leaving])


def selection_state(gen, device, n_chunks, position, n_held):
    """Landmarks, a query, outliers among the candidates, and a slot table holding ``n_held`` distinct candidates
    (some of them among the top chunks, so that they stay) and empty slots."""
    landmarks = torch.randn(N_KV_HEADS, n_chunks + 1, HEAD_DIM, generator=gen).to(device)
    query = torch.randn(N_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(device)
    base = position // LAYOUT.chunk_size - LAYOUT.n_local + 1
    is_outlier = torch.zeros(N_KV_HEADS, n_chunks + 1, dtype=torch.bool)
    outlier_ids = torch.full((N_KV_HEADS, LAYOUT.n_outlier), -1, dtype=torch.long)
    slot_chunk = torch.full((N_KV_HEADS, LAYOUT.n_selected + 1), -1, dtype=torch.long)
    candidates = torch.arange(n_chunks + 1)[None, :] < base
    scores = landmark_scores(query.cpu(), landmarks.cpu(), candidates.expand(N_KV_HEADS, -1), 0.25)
    for head in range(N_KV_HEADS):
        order = torch.randperm(max(base, 1), generator=gen)
        outliers = order[: LAYOUT.n_outlier - 1]  # one outlier slot left empty
        outlier_ids[head, : outliers.numel()] = outliers
        is_outlier[head, outliers] = True
        ranked = [c for c in scores[head].argsort(descending=True).tolist() if c < base and not is_outlier[head, c]]
        others = [c for c in order.tolist() if c not in ranked[: LAYOUT.n_selected] and not is_outlier[head, c]]
        held = (ranked[:2] + ranked[4:5] + others)[:n_held]  # two of the best, the fifth, then unlikely ones
        slots = torch.randperm(LAYOUT.n_selected, generator=gen)[: len(held)]
        slot_chunk[head, slots] = torch.tensor(held, dtype=torch.long)
    return query, landmarks, is_outlier.to(device), outlier_ids.to(device), slot_chunk.to(device)


@pytest.mark.parametrize("n_chunks,n_kv_heads", [(9, 2), (701, 2), (4097, 8), (16385, 8), (65537, 8)])
def test_the_scoring_blocks_tile_the_ranking_blocks_and_fill_the_gpu(n_chunks, n_kv_heads):
    """The scoring kernel's blocks (one program each) cover the chunks, split the ranking's blocks evenly, and at
    long contexts number some hundreds of programs, not the ranking's few dozen."""
    plan = ShadowKVStepPlan(LAYOUT, n_kv_heads, GROUP, n_chunks, torch.device("cpu"))
    assert plan.block_chunks % plan.score_chunks == 0
    assert (plan.n_score_blocks - 1) * plan.score_chunks < n_chunks <= plan.n_score_blocks * plan.score_chunks
    assert n_kv_heads * plan.n_score_blocks >= min(512, n_kv_heads * -(-n_chunks // shadowkv_step.SCORE_TILE))
    assert plan.n_score_blocks >= plan.n_blocks


def test_a_score_launch_refuses_unknown_products_and_bad_tiles():
    with pytest.raises(ValueError, match="products must be one of dot, dot_16bit, fma"):
        ScoreLaunch(products="wmma")
    with pytest.raises(ValueError, match="tile a power of two"):
        ScoreLaunch(tile=48)


@pytest.mark.gpu
@pytest.mark.parametrize("launch,dtype", [(ScoreLaunch(), torch.float32),
                                          (ScoreLaunch(programs=64, tile=128, num_warps=8, num_stages=3),
                                           torch.float32),
                                          (ScoreLaunch(products="dot_16bit"), torch.bfloat16),
                                          (ScoreLaunch(products="fma", tile=32, num_warps=8), torch.float32),
                                          (ScoreLaunch(products="fma"), torch.bfloat16)],
                         ids=["default", "other_launch", "dot_16bit", "fma", "fma_bf16"])
@pytest.mark.parametrize("n_chunks,position,n_held", [(40, 37 * 8 + 3, 4), (40, 37 * 8, 6), (700, 690 * 8 + 7, 5),
                                                     (5000, 4990 * 8 + 1, 6), (8, 9 * 8, 0)])
def test_triton_select_and_plan_matches_the_reference(n_chunks, position, n_held, launch, dtype):
    """Scores without ties: the same top chunks in the same order, slot table, copy list, counts and loads; the
    probabilities within float32 rounding. 700 and 5000 chunks score in several blocks; 8 chunks rank padding. The
    scoring's launch settings (blocks, tile, warps, stages; tensor-core products, in 16 bits for 16-bit inputs, or
    products on the ordinary cores) change no decision."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(n_chunks + n_held)
    query, landmarks, is_outlier, outlier_ids, slot_chunk = selection_state(gen, device, n_chunks, position, n_held)
    query, landmarks = query.to(dtype), landmarks.to(dtype)
    at = torch.tensor([position], device=device)
    results = []
    for run in (select_and_plan_triton, select_and_plan_reference):
        plan = ShadowKVStepPlan(LAYOUT, N_KV_HEADS, GROUP, n_chunks + 1, device, score_launch=launch)
        table = slot_chunk.clone()
        run(LAYOUT, at, query, landmarks, is_outlier, outlier_ids, table, 0.25, plan)
        results.append((plan, table))
    (fused, fused_table), (reference, reference_table) = results
    base = position // 8 - LAYOUT.n_local + 1
    candidates = (torch.arange(n_chunks + 1, device=device) < base)[None, :] & ~is_outlier
    expected = landmark_scores(query, landmarks, candidates, 0.25)
    torch.testing.assert_close(fused.probabilities[:, : n_chunks + 1], expected, atol=1e-6, rtol=1e-5)
    wanted = candidates.gather(1, reference.top)
    assert torch.equal(fused.top[wanted], reference.top[wanted])  # the rest are non-candidates at probability 0
    assert torch.equal(fused_table, reference_table)
    assert torch.equal(fused.copy_slots, reference.copy_slots)
    kept = reference.copy_slots >= 0
    assert torch.equal(fused.copy_pages[kept], reference.copy_pages[kept])
    for name in ("counts", "loaded"):
        assert torch.equal(getattr(fused, name), getattr(reference, name)), name
    if n_held:  # some chosen chunks stayed, some were loaded
        assert 0 < int(reference.loaded[:, 1].sum()) < N_KV_HEADS * LAYOUT.n_selected


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [True, False])
def test_triton_finish_step_matches_the_reference(dtype, rope):
    device = kernel_device()
    gen = torch.Generator().manual_seed(17 + rope)
    n_chunks, rank = 50, 40
    state = window_state(gen, device, dtype, n_chunks=n_chunks, rank=rank)
    rotary, inv_freq = (ROTARY, ROTARY.frequencies(device)) if rope else (NoRotary(), None)
    plan = ShadowKVStepPlan(LAYOUT, N_KV_HEADS, GROUP, n_chunks + 1, device)
    plan.copy_pages.copy_(torch.randint(0, n_chunks, (plan.copy_pages.numel(),), generator=gen))
    slots = LAYOUT.n_outlier + torch.stack([torch.randperm(LAYOUT.n_selected, generator=gen) for _ in range(2)])
    slots[:, ::3] = -1  # resident already
    plan.copy_slots.copy_(slots.flatten())
    plan.loaded.copy_(torch.randint(0, 60, (N_KV_HEADS, 2), generator=gen))
    key, value = (torch.randn(N_KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype) for _ in range(2))
    at = torch.tensor([45 * 8 + 3], device=device)
    results = []
    for run in (finish_step_triton, finish_step_reference):
        mine = cloned(state)
        totals = torch.tensor([3.0, 100.0, 7.0, 700.0], dtype=torch.float64, device=device)
        run(LAYOUT, at, key, value, mine["pool_keys"], mine["pool_values"], mine["coefficients"], mine["basis"],
            rotary, inv_freq, plan, totals, 512)
        results.append((mine, totals))
    (fused, fused_totals), (reference, reference_totals) = results
    assert torch.equal(fused_totals, reference_totals)
    assert torch.equal(fused["pool_values"], reference["pool_values"])
    loaded = torch.zeros(LAYOUT.n_attended_slots + 1, N_KV_HEADS, dtype=torch.bool)
    for head in range(N_KV_HEADS):
        for slot in slots[head].tolist():
            if slot >= 0:
                loaded[slot, head] = True
    loaded[-1] = True  # the reference's scratch slot takes the entries with nothing to load
    torch.testing.assert_close(fused["pool_keys"][loaded[:-1].nonzero(as_tuple=True)],
                               reference["pool_keys"][loaded[:-1].nonzero(as_tuple=True)], **tolerance(dtype))
    assert torch.equal(fused["pool_keys"][~loaded], reference["pool_keys"][~loaded])  # the token write included
    ring_slot = LAYOUT.window_slot0 + 45 % LAYOUT.n_local
    assert torch.equal(fused["pool_keys"][ring_slot, :, 3], key)


def shadowkv_layer(device, dtype):
    from eval.plugins import build_method
    from icecache.core.method import ModelInfo, SequenceContext

    info = ModelInfo(n_layers=1, n_heads=N_KV_HEADS * GROUP, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM,
                     rotary=ROTARY, device=device, dtype=dtype)
    info = dataclasses.replace(info, device=device)
    config = {"name": "shadowkv", "budget": 64, "rank": 8, "n_local_chunks": 2, "n_dense_layers": 0}
    return build_method(config, info).make_layer(0, SequenceContext(trace_selection=True))


@pytest.mark.gpu
def test_shadowkv_steps_with_the_kernels_match_the_steps_with_the_references(monkeypatch):
    """A prompt, then steps that turn the window and load chunks: the same chunks attended, the same slot tables and
    counters, outputs within float32 rounding."""
    device = kernel_device()
    gen = torch.Generator().manual_seed(5)
    layers = {use: shadowkv_layer(device, torch.float32) for use in (True, False)}

    def qkv(n_tokens):
        return tuple(torch.randn(1, heads, n_tokens, HEAD_DIM, generator=gen).to(device)
                     for heads in (N_KV_HEADS * GROUP, N_KV_HEADS, N_KV_HEADS))

    prompt, steps = qkv(300), [qkv(1) for _ in range(30)]
    calls = count_triton_calls(monkeypatch, shadowkv_step, ("turn_window", "select_and_plan", "finish_step"))
    outputs = {use: [] for use in layers}
    for use, layer in layers.items():
        monkeypatch.setattr(shadowkv_step, "runs_triton", lambda tensor, use=use: use)
        layer.forward(*prompt, None, 0.25)
        for step in steps:
            outputs[use].append((layer.forward(*step, None, 0.25), layer.last_attended.clone(),
                                 layer.slot_chunk.clone()))
    assert calls == {name: len(steps) for name in calls}
    for (out, attended, table), (out_ref, attended_ref, table_ref) in zip(outputs[True], outputs[False]):
        assert torch.equal(attended, attended_ref) and torch.equal(table, table_ref)
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    fused, reference = layers[True], layers[False]
    assert fused.seq.counters.as_dict() == reference.seq.counters.as_dict()
    assert fused.seq.counters.as_dict()["pages_loaded"] > 0
    attended = fused.layout.n_attended_slots
    torch.testing.assert_close(fused.pool_keys[:attended], reference.pool_keys[:attended])
    scratch_rows = fused.layout.chunk_size  # the last chunk's: the scratch chunk, which only the reference writes
    torch.testing.assert_close(fused.coefficients[:-scratch_rows], reference.coefficients[:-scratch_rows])
