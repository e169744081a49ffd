"""Sparse paged decode attention and the page scatter (icecache.core.kernels.paged_decode_attention /
page_scatter), and dense prefill attention.

The CPU tests check the PyTorch references against direct computations. The tests marked ``gpu`` check the Triton
kernels against those references: on CUDA, or on CPU in Triton's interpreter when ``TRITON_INTERPRET=1`` is set
(``TRITON_INTERPRET=1 pytest -m gpu tests/test_paged_attention.py`` with Triton installed).
"""

from __future__ import annotations

import math

import pytest
import torch

from icecache.core.kernels import triton_runtime
from icecache.core.kernels.page_scatter import (
    PageScatterPlan,
    scatter_pages,
    scatter_pages_reference,
    scatter_pages_triton,
)
from icecache.core.kernels.paged_decode_attention import (
    DEFAULT_BLOCK_TOKENS,
    PagedAttentionPlan,
    choose_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from tests.conftest import kernel_device

# ---------------------------------------------------------------------------------------------------------------
# Helpers: a paged layout of random tokens, IceCache style (each KV head cuts its tokens into pages differently)
# ---------------------------------------------------------------------------------------------------------------


def paged_layout(n_kv_heads: int, n_tokens: int, page_size: int, head_dim: int, gen: torch.Generator):
    """Random keys/values ``[Hkv, T, D]`` and their pages ``[P, Hkv, S, D]``.

    Each head takes its tokens in its own random order and cuts them into pages of 1..page_size tokens (DCI
    leaves hold a varying number). Unused slots, and pages a head does not use, hold large garbage so that a slot
    attended by mistake changes the result visibly. Returns keys, values, key_pages, value_pages and
    ``page_tokens[h][p]``, the token ids in page ``p`` of head ``h``, slot order.
    """
    keys = torch.randn(n_kv_heads, n_tokens, head_dim, generator=gen)
    values = torch.randn(n_kv_heads, n_tokens, head_dim, generator=gen)
    page_tokens = []
    for _ in range(n_kv_heads):
        order = torch.randperm(n_tokens, generator=gen).tolist()
        pages, start = [], 0
        while start < n_tokens:
            fill = int(torch.randint(1, page_size + 1, (1,), generator=gen))
            pages.append(order[start : start + fill])
            start += fill
        page_tokens.append(pages)
    n_pages = max(len(pages) for pages in page_tokens)
    key_pages = 100 * torch.randn(n_pages, n_kv_heads, page_size, head_dim, generator=gen)
    value_pages = 100 * torch.randn(n_pages, n_kv_heads, page_size, head_dim, generator=gen)
    for head, pages in enumerate(page_tokens):
        for page, tokens in enumerate(pages):
            key_pages[page, head, : len(tokens)] = keys[head, tokens]
            value_pages[page, head, : len(tokens)] = values[head, tokens]
    return keys, values, key_pages, value_pages, page_tokens


def random_selection(page_tokens, n_entries: int, gen: torch.Generator, n_padding: int):
    """Per head, ``n_entries - n_padding`` distinct pages in random order plus ``n_padding`` padding entries (-1)
    at random positions. A page's valid count is drawn in 1..its fill, so some pages are attended only in part.
    Padding entries get a random count, which must be ignored. Returns page_table, valid_counts ``[Hkv, N]`` and
    ``attended[h]``, the token ids head ``h`` attends to."""
    n_kv_heads = len(page_tokens)
    table = torch.full((n_kv_heads, n_entries), -1, dtype=torch.long)
    counts = torch.randint(0, 17, (n_kv_heads, n_entries), generator=gen)
    attended = []
    for head, pages in enumerate(page_tokens):
        n_selected = min(n_entries - n_padding, len(pages))
        chosen = torch.randperm(len(pages), generator=gen)[:n_selected].tolist()
        positions = torch.randperm(n_entries, generator=gen)[:n_selected].tolist()
        tokens = []
        for page, position in zip(chosen, positions):
            count = int(torch.randint(1, len(pages[page]) + 1, (1,), generator=gen))
            table[head, position] = page
            counts[head, position] = count
            tokens += pages[page][:count]
        attended.append(tokens)
    return table, counts, attended


def direct_attention(query, keys, values, attended, scaling):
    """Softmax attention of each query head over exactly its KV head's ``attended`` tokens, in float64."""
    n_heads, n_kv_heads = query.shape[0], keys.shape[0]
    out = torch.empty(query.shape, dtype=torch.float64)
    for head in range(n_heads):
        kv_head = head // (n_heads // n_kv_heads)
        tokens = attended[kv_head]
        scores = keys[kv_head, tokens].double() @ query[head].double() * scaling
        out[head] = torch.softmax(scores, dim=0) @ values[kv_head, tokens].double()
    return out


# ---------------------------------------------------------------------------------------------------------------
# CPU: the reference attention is dense attention restricted to the selected tokens
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("page_size", [16, 8])
@pytest.mark.parametrize("table_dtype", [torch.long, torch.int32])
def test_reference_equals_attention_over_exactly_the_selected_tokens(group, page_size, table_dtype):
    gen = torch.Generator().manual_seed(group * 100 + page_size)
    n_kv_heads, head_dim, n_tokens = 2, 32, 300
    keys, values, key_pages, value_pages, page_tokens = paged_layout(n_kv_heads, n_tokens, page_size, head_dim, gen)
    table, counts, attended = random_selection(page_tokens, n_entries=12, gen=gen, n_padding=3)
    query = torch.randn(n_kv_heads * group, head_dim, generator=gen)
    scaling = head_dim**-0.5

    out = paged_decode_attention_reference(
        query, key_pages, value_pages, table.to(table_dtype), counts.to(table_dtype), scaling
    )
    expected = direct_attention(query, keys, values, attended, scaling)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_single_page_single_token_returns_that_value():
    # One valid slot: the softmax weight is 1, so every query head of the group returns that slot's value exactly.
    gen = torch.Generator().manual_seed(0)
    key_pages = torch.randn(3, 1, 4, 8, generator=gen)
    value_pages = torch.randn(3, 1, 4, 8, generator=gen)
    table = torch.tensor([[-1, 2, -1]])
    counts = torch.tensor([[4, 1, 4]])
    out = paged_decode_attention_reference(torch.randn(2, 8, generator=gen), key_pages, value_pages, table, counts, 1.0)
    torch.testing.assert_close(out, value_pages[2, 0, 0].expand(2, 8))


def test_dispatcher_uses_the_reference_on_cpu():
    gen = torch.Generator().manual_seed(1)
    keys, values, key_pages, value_pages, page_tokens = paged_layout(2, 64, 16, 16, gen)
    table, counts, _ = random_selection(page_tokens, n_entries=4, gen=gen, n_padding=1)
    query = torch.randn(4, 16, generator=gen)
    args = (query, key_pages, value_pages, table, counts, 0.25)
    plan = PagedAttentionPlan()
    assert torch.equal(paged_decode_attention(*args, plan), paged_decode_attention_reference(*args))
    assert not plan._geometries and not plan._scratch  # the reference needs no launch state


def test_scatter_dispatcher_uses_the_reference_for_a_cpu_pool():
    blocks = torch.arange(1.0, 3.0).view(2, 1, 1).expand(2, 2, 2)
    pools = [torch.zeros(3, 2, 2, 2) for _ in range(4)]
    slots, heads = torch.tensor([2, -1]), torch.tensor([1, 0])
    plan = PageScatterPlan()
    scatter_pages(blocks, -blocks, pools[0], pools[1], slots, heads, plan)
    scatter_pages_reference(blocks, -blocks, pools[2], pools[3], slots, heads)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3]) and not plan._compiled


# ---------------------------------------------------------------------------------------------------------------
# CPU: the scatter
# ---------------------------------------------------------------------------------------------------------------


def test_scatter_reference_writes_each_block_to_its_slot_and_head():
    pool_keys = torch.zeros(3, 2, 2, 2)
    pool_values = torch.zeros(3, 2, 2, 2)
    blocks = torch.arange(1.0, 3.0).view(2, 1, 1).expand(2, 2, 2)  # block i is filled with i + 1
    scatter_pages_reference(blocks, -blocks, pool_keys, pool_values, torch.tensor([2, 0]), torch.tensor([1, 1]))
    expected = torch.zeros(3, 2, 2, 2)
    expected[2, 1] = 1.0
    expected[0, 1] = 2.0
    assert torch.equal(pool_keys, expected)
    assert torch.equal(pool_values, -expected)


def test_scatter_reference_skips_entries_with_a_negative_slot():
    pool_keys, pool_values = torch.zeros(3, 2, 2, 2), torch.zeros(3, 2, 2, 2)
    blocks = torch.arange(1.0, 4.0).view(3, 1, 1).expand(3, 2, 2)
    slots, heads = torch.tensor([-1, 1, -1], dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.int32)
    scatter_pages_reference(blocks, -blocks, pool_keys, pool_values, slots, heads)
    expected = torch.zeros(3, 2, 2, 2)
    expected[1, 0] = 2.0  # only block 1 had a slot
    assert torch.equal(pool_keys, expected) and torch.equal(pool_values, -expected)


def test_triton_module_imports_and_reports_availability():
    # On a machine without CUDA the kernels must say they are unavailable, so the dispatcher keeps the reference.
    if not torch.cuda.is_available():
        assert not triton_runtime.available()
    assert isinstance(triton_runtime.available(), bool)


# ---------------------------------------------------------------------------------------------------------------
# GPU (or Triton interpreter): kernels against the references
# ---------------------------------------------------------------------------------------------------------------


def random_pages_and_selection(gen, n_kv_heads, group, head_dim, page_size, n_entries, n_pool_pages, dtype, device):
    """Random pool, page table with about 1 entry in 6 padding (never a whole head) and partial valid counts."""
    query = torch.randn(n_kv_heads * group, head_dim, generator=gen)
    key_pages = torch.randn(n_pool_pages, n_kv_heads, page_size, head_dim, generator=gen)
    value_pages = torch.randn(n_pool_pages, n_kv_heads, page_size, head_dim, generator=gen)
    table = torch.randint(0, n_pool_pages, (n_kv_heads, n_entries), generator=gen)
    table[torch.rand(n_kv_heads, n_entries, generator=gen) < 1 / 6] = -1
    table[:, 0] = torch.randint(0, n_pool_pages, (n_kv_heads,), generator=gen)  # every head attends something
    # Mostly full pages, some partial ones (as DCI leaves hold 8 to 16 tokens).
    counts = torch.where(
        torch.rand(n_kv_heads, n_entries, generator=gen) < 0.5,
        torch.full((n_kv_heads, n_entries), page_size),
        torch.randint(1, page_size + 1, (n_kv_heads, n_entries), generator=gen),
    )
    tensors = (query, key_pages, value_pages)
    return (*(t.to(device, dtype) for t in tensors), table.to(device, torch.int32), counts.to(device, torch.int32))


TOLERANCES = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.parametrize("n_entries", [1, 16, 75, 300])
def test_triton_attention_matches_reference(dtype, head_dim, group, n_entries):
    device = kernel_device()
    gen = torch.Generator().manual_seed(n_entries * 7 + group + head_dim)
    n_kv_heads = 8 if device.type == "cuda" else 2
    args = random_pages_and_selection(gen, n_kv_heads, group, head_dim, 16, n_entries, 512, dtype, device)
    scaling = head_dim**-0.5
    out = paged_decode_attention_triton(*args, scaling, PagedAttentionPlan())
    expected = paged_decode_attention_reference(*args, scaling)
    assert out.dtype == dtype and out.shape == expected.shape
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 4, 8, 32, 64])
@pytest.mark.parametrize("n_splits", [1, 3, None])
def test_triton_attention_page_sizes_and_splits(page_size, n_splits):
    device = kernel_device()
    gen = torch.Generator().manual_seed(page_size * 10 + (n_splits or 0))
    args = random_pages_and_selection(gen, 2, 4, 64, page_size, 41, 64, torch.float16, device)
    out = paged_decode_attention_triton(*args, 0.125, PagedAttentionPlan(n_splits=n_splits))
    expected = paged_decode_attention_reference(*args, 0.125)
    tolerance = TOLERANCES[torch.float16]
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
def test_triton_attention_over_selected_tokens_equals_direct_attention():
    # The kernel against the direct computation (not only against the reference): IceCache-style per-head pages.
    device = kernel_device()
    gen = torch.Generator().manual_seed(5)
    keys, values, key_pages, value_pages, page_tokens = paged_layout(2, 500, 16, 64, gen)
    table, counts, attended = random_selection(page_tokens, n_entries=20, gen=gen, n_padding=4)
    query = torch.randn(8, 64, generator=gen)
    on_device = [t.to(device) for t in (query, key_pages, value_pages, table, counts)]
    out = paged_decode_attention_triton(*on_device, 0.125, PagedAttentionPlan())
    expected = direct_attention(query, keys, values, attended, 0.125)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_dispatcher_uses_triton_on_cuda():
    if not triton_runtime.available():
        pytest.skip("needs CUDA and Triton")
    gen = torch.Generator().manual_seed(6)
    args = random_pages_and_selection(gen, 8, 4, 128, 16, 12, 64, torch.bfloat16, "cuda")
    direct = paged_decode_attention_triton(*args, 0.1, PagedAttentionPlan())
    plan = PagedAttentionPlan()
    assert torch.equal(paged_decode_attention(*args, 0.1, plan), direct)
    assert len(plan._geometries) == 1  # the dispatcher launched through the caller's plan


@pytest.mark.gpu
@pytest.mark.parametrize(
    "transit_dtype,pool_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
    ids=["bf16", "fp32", "fp32-to-bf16"],
)
def test_triton_scatter_matches_reference(transit_dtype, pool_dtype):
    device = kernel_device()
    if transit_dtype != pool_dtype and device.type != "cuda":
        pytest.skip("Triton's interpreter truncates float32 -> bfloat16 instead of rounding to nearest")
    gen = torch.Generator().manual_seed(7)
    n_slots, n_kv_heads, n_blocks = 20, 8, 100
    targets = torch.randperm(n_slots * n_kv_heads, generator=gen)[:n_blocks]
    slots, heads = targets // n_kv_heads, targets % n_kv_heads
    slots[torch.randperm(n_blocks, generator=gen)[:30]] = -1  # unused entries of a fixed-size transfer: skipped
    transit = [torch.randn(n_blocks, 16, 128, generator=gen).to(device, transit_dtype) for _ in range(2)]
    pools = [torch.randn(n_slots, n_kv_heads, 16, 128, generator=gen).to(device, pool_dtype) for _ in range(2)]
    expected = [p.clone() for p in pools]
    plan = PageScatterPlan()
    for _ in range(2):  # the second call of the layout launches the compiled kernel directly (on CUDA)
        scatter_pages_triton(*transit, *pools, slots.to(device, torch.int32), heads.to(device, torch.int32), plan)
    scatter_pages_reference(*transit, *expected, slots.to(device), heads.to(device))
    assert torch.equal(pools[0], expected[0]) and torch.equal(pools[1], expected[1])


def test_kernel_choose_splits_covers_every_page_once():
    # Split ranges are whole blocks, none is empty, and together they cover the table: n_splits * pages_per_split
    # reaches n_table while (n_splits - 1) * pages_per_split stays below it.
    for n_table in (1, 15, 16, 17, 300, 1024):
        for pages_per_block in (1, 4, 64):
            n_splits, pages_per_split = choose_splits(n_table, 8, pages_per_block, torch.device("cpu"))
            assert pages_per_split % pages_per_block == 0
            assert (n_splits - 1) * pages_per_split < n_table <= n_splits * pages_per_split
            assert n_splits <= math.ceil(n_table / pages_per_block)


# ---------------------------------------------------------------------------------------------------------------
# Host-overhead paths: direct launches of the compiled kernels a plan keeps
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fast_launch", [True, False], ids=["direct", "jit"])
@pytest.mark.parametrize("n_entries", [16, 300])
def test_triton_attention_repeated_calls_reuse_the_plan_correctly(fast_launch, n_entries):
    # The first call of a geometry compiles and keeps its launch state in the plan; later calls launch the kept
    # kernel with new data (and the plan's split scratch), into a fresh or a caller's output. Each must match the
    # reference on its own data.
    device = kernel_device()
    plan = PagedAttentionPlan(direct_launch=fast_launch)
    assert plan._launch.enabled == (fast_launch and triton_runtime.direct_launch_supported())
    out = None
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        args = random_pages_and_selection(gen, 8 if device.type == "cuda" else 2, 4, 128, 16, n_entries, 512,
                                          torch.bfloat16, device)
        out = paged_decode_attention_triton(*args, 0.09, plan, out=out if step == 2 else None)
        expected = paged_decode_attention_reference(*args, 0.09)
        tolerance = TOLERANCES[torch.bfloat16]
        torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert len(plan._geometries) == 1
    launch = next(iter(plan._geometries.values()))
    assert plan.splits(*args[:2], args[3]) == (launch.n_splits, launch.pages_per_split)
    assert (launch.split_kernel is not None) == plan._launch.enabled


def test_plans_keep_their_settings_apart():
    # Two callers' plans: settings and launch state are each plan's own (nothing is shared through the module).
    default, forced = PagedAttentionPlan(), PagedAttentionPlan(n_splits=3, block_tokens=32, direct_launch=False)
    assert (default.n_splits, default.block_tokens) == (None, DEFAULT_BLOCK_TOKENS)
    assert (forced.n_splits, forced.block_tokens, forced._launch.enabled) == (3, 32, False)
    assert default._geometries is not forced._geometries and default._scratch is not forced._scratch


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_after_earlier_tokens_is_bottom_right_causal(device, dtype):
    """dense_attention of a prefill chunk (S queries after T - S earlier keys, GQA) equals explicit masked softmax."""
    from icecache.core.attention import dense_attention

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 8, 37, 64, generator=generator).to(device, dtype)
    key = torch.randn(1, 2, 150, 64, generator=generator).to(device, dtype)
    value = torch.randn(1, 2, 150, 64, generator=generator).to(device, dtype)
    out = dense_attention(query, key, value, 0.125)
    keys, values = key.float().repeat_interleave(4, 1), value.float().repeat_interleave(4, 1)
    scores = query.float() @ keys.transpose(-1, -2) * 0.125
    rows = torch.arange(37, device=device)[:, None] + 150 - 37
    scores = scores.masked_fill(torch.arange(150, device=device)[None, :] > rows, float("-inf"))
    expected = (scores.softmax(-1) @ values).transpose(1, 2)
    tolerance = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("n_queries", [37, 150])
def test_the_attention_with_its_row_lse_is_the_plain_attention_bit_for_bit(device, n_queries):
    """``dense_attention_and_lse`` gives ``dense_attention``'s output bits; on the GPU, for a chunk after earlier
    tokens (bfloat16, GQA: the flash kernel), also each row's log-sum-exp of its scaled causal scores; elsewhere (a
    whole prompt, a CPU) none."""
    from icecache.core.attention import dense_attention, dense_attention_and_lse

    generator = torch.Generator().manual_seed(n_queries)
    query = torch.randn(1, 8, n_queries, 64, generator=generator).to(device, torch.bfloat16)
    key = torch.randn(1, 2, 150, 64, generator=generator).to(device, torch.bfloat16)
    value = torch.randn(1, 2, 150, 64, generator=generator).to(device, torch.bfloat16)
    out, lse = dense_attention_and_lse(query, key, value, 0.125)
    assert torch.equal(out, dense_attention(query, key, value, 0.125))
    if device == "cpu" or n_queries == 150:
        assert lse is None
        return
    scores = query.float() @ key.float().repeat_interleave(4, 1).transpose(-1, -2) * 0.125
    rows = torch.arange(n_queries, device=device)[:, None] + 150 - n_queries
    scores = scores.masked_fill(torch.arange(150, device=device)[None, :] > rows, float("-inf"))
    assert lse.shape == (1, 8, n_queries) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-4, atol=1e-4)
