"""ArkVale's step kernels (``core.kernels.arkvale_step``): the Triton page start and recall plan against their PyTorch
references, bitwise, on random states, and a layer's decode steps with the kernels against the same steps with the
references.

The tests marked ``gpu`` run the Triton kernels themselves (the ``*_triton`` functions, or the dispatch forced onto
them): on CUDA, or on CPU in Triton's interpreter (``TRITON_INTERPRET=1 pytest -m gpu tests/test_arkvale_kernels.py``
with Triton installed). On a CPU the float32 sum of a digest's mean runs in another order in PyTorch, so there the
keys are chosen where every sum is exact (multiples of 1/4, or bf16 values of one binade's spread); on CUDA the
kernel follows PyTorch's own order and the keys are plain random numbers.
"""

from __future__ import annotations

import pytest
import torch

from icecache.core.kernels import arkvale_step
from icecache.core.kernels.arkvale_step import (
    ArkValeSlots,
    page_start_reference,
    page_start_triton,
    recall_plan_reference,
    recall_plan_triton,
)
from icecache.core.method import ModelInfo, SequenceContext
from tests.conftest import count_triton_calls, kernel_device


def random_keys(shape, gen, dtype, device) -> torch.Tensor:
    """Keys for the digests: plain random numbers on CUDA; on a CPU, values whose float32 sums are exact."""
    if device.type == "cuda":
        return torch.randn(shape, generator=gen).to(device, dtype)
    if dtype == torch.float32:
        return (torch.randint(-8, 9, shape, generator=gen) / 4).to(device, dtype)
    # bf16 of [1, 2) and its negatives: deviations are multiples of 2^-7 below 2, whose sums of 16 are exact.
    magnitude = 1 + torch.rand(shape, generator=gen)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return (magnitude * sign).to(device, dtype)


def random_slot_page(layout: ArkValeSlots, n_pages: int, n_empty: int, gen) -> torch.Tensor:
    """A slot table: distinct middle pages (the last ``n_empty`` middle slots empty), sink and window pages."""
    slot_page = torch.full((layout.n_slots + 1, layout.n_groups), -1, dtype=torch.long)
    n_held = min(layout.n_middle, n_pages)
    for group in range(layout.n_groups):
        pages = torch.randperm(n_pages, generator=gen)[:n_held] + layout.n_sink
        slot_page[layout.middle_start : layout.middle_start + n_held, group] = pages
    if n_empty:
        slot_page[layout.middle_stop - n_empty : layout.middle_stop] = -1
    slot_page[: layout.n_sink] = torch.arange(layout.n_sink)[:, None]
    slot_page[layout.middle_stop : layout.n_slots] = n_pages + layout.n_sink + torch.arange(layout.n_window)[:, None]
    slot_page[layout.scratch_slot] = torch.randint(0, n_pages, (layout.n_groups,), generator=gen)
    return slot_page


def assert_same(mine: dict, theirs: dict) -> None:
    for name in theirs:
        assert mine[name].dtype == theirs[name].dtype, name
        assert torch.equal(mine[name], theirs[name]), name


# ---------------------------------------------------------------------------------------------------- page start


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size,n_sink,n_window", [(8, 1, 2), (16, 1, 2), (16, 0, 1), (4, 2, 3)])
@pytest.mark.parametrize("offset", [0, 3])  # a step that starts a page, one that does not
@pytest.mark.parametrize("n_empty", [0, 2, "all"])  # a full middle, a not yet full one, an empty one
@pytest.mark.parametrize("page", [0, 1, 2, 9])  # the first page (nothing finished), sink and window turns
def test_triton_page_start_matches_the_reference(dtype, page_size, n_sink, n_window, offset, n_empty, page):
    device = kernel_device()
    offset = offset % page_size
    gen = torch.Generator().manual_seed(page_size * 100 + n_sink * 10 + n_window + offset + page * 7)
    n_slots, n_kv_heads, head_dim, n_pages = n_sink + n_window + 5, 4, 16, 12
    layout = ArkValeSlots(page_size, n_sink, n_window, n_slots, 2, 2)
    n_empty = layout.n_middle if n_empty == "all" else n_empty
    pool_shape = (n_slots + 1, n_kv_heads, page_size, head_dim)
    state = {
        "pool_keys": random_keys(pool_shape, gen, dtype, device),
        "pool_values": torch.randn(pool_shape, generator=gen).to(device, dtype),
        "slot_page": random_slot_page(layout, n_pages, n_empty, gen).to(device),
        "store_keys": torch.randn(n_pages + 1, n_kv_heads, page_size, head_dim, generator=gen).to(device, dtype),
        "store_values": torch.randn(n_pages + 1, n_kv_heads, page_size, head_dim, generator=gen).to(device, dtype),
        "digest_hi": torch.randn(n_kv_heads, n_pages + 1, head_dim, generator=gen).to(device, dtype),
        "digest_lo": torch.randn(n_kv_heads, n_pages + 1, head_dim, generator=gen).to(device, dtype),
        "end": torch.full((1,), -7, dtype=torch.long, device=device),
    }
    # The token as a decode step passes it: a [Hkv, D] view of [1, Hkv, 1, D].
    key = random_keys((1, n_kv_heads, 1, head_dim), gen, dtype, device)[0, :, 0]
    value = torch.randn(1, n_kv_heads, 1, head_dim, generator=gen).to(device, dtype)[0, :, 0]
    position = torch.tensor([page * page_size + offset], device=device)
    theirs = {name: tensor.clone() for name, tensor in state.items()}
    args = ("pool_keys", "pool_values", "slot_page", "store_keys", "store_values", "digest_hi", "digest_lo", "end")
    page_start_triton(layout, position, key, value, *(state[name] for name in args))
    page_start_reference(layout, position, key, value, *(theirs[name] for name in args))
    assert_same(state, theirs)


@pytest.mark.gpu
def test_triton_page_start_digest_rounds_as_pytorch_on_random_bf16_pages():
    """Many digests of plain random bf16 pages (every rounding step exercised) against ``page_digests``: bitwise on
    CUDA, where the kernel follows PyTorch's summation order."""
    device = kernel_device()
    if device.type != "cuda":
        pytest.skip("PyTorch's CPU sum runs in another order: bitwise agreement is for CUDA")
    gen = torch.Generator().manual_seed(9)
    layout = ArkValeSlots(16, 1, 2, 16, 1, 8)
    for step in range(40):
        pool_keys = (torch.randn(17, 8, 16, 128, generator=gen) * (step + 1)).to(device, torch.bfloat16)
        pool_values = torch.zeros_like(pool_keys)
        slot_page = torch.full((17, 1), -1, dtype=torch.long, device=device)
        store = torch.zeros(40, 8, 16, 128, dtype=torch.bfloat16, device=device)
        hi = torch.zeros(8, 40, 128, dtype=torch.bfloat16, device=device)
        lo = torch.zeros_like(hi)
        position = torch.tensor([(step % 30 + 1) * 16], device=device)
        token = torch.zeros(8, 128, dtype=torch.bfloat16, device=device)
        page_start_triton(layout, position, token, token, pool_keys, pool_values, slot_page, store, store.clone(),
                          hi, lo, torch.zeros(1, dtype=torch.long, device=device))
        finished = step % 30
        source = 0 if finished < 1 else 14 + finished % 2
        expected_hi, expected_lo = arkvale_step.page_digests(pool_keys[source : source + 1])
        assert torch.equal(hi[:, finished], expected_hi[0]) and torch.equal(lo[:, finished], expected_lo[0])


# --------------------------------------------------------------------------------------------------- recall plan


@pytest.mark.gpu
@pytest.mark.parametrize("n_groups", [1, 2, 4])
@pytest.mark.parametrize("n_empty", [0, 3])
@pytest.mark.parametrize("ranked", [True, False])
@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("n_top", [1, 4, 7])
def test_triton_recall_plan_matches_the_reference(n_groups, n_empty, ranked, offset, n_top):
    device = kernel_device()
    gen = torch.Generator().manual_seed(n_groups * 1000 + n_empty * 100 + ranked * 10 + offset + n_top * 7)
    n_kv_heads, n_pages = 4, 40
    layout = ArkValeSlots(8, 1, 2, 12, n_groups, n_kv_heads // n_groups)
    page = n_pages - 2 if ranked else layout.n_middle  # candidates [1, page - 1): more than the middle, or not
    slot_page = random_slot_page(layout, page - 2, n_empty, gen)
    slot_page[layout.middle_stop : layout.n_slots, :] = torch.tensor([page - 1, page])[:, None]
    # Scores of a few distinct values (ties), -inf outside the candidates.
    scores = torch.randint(0, 4, (n_groups, n_pages + 1), generator=gen).float() / 2
    scores[:, :1] = float("-inf")
    scores[:, page - 1 :] = float("-inf")
    top = scores.topk(n_top, dim=-1)
    n_entries = n_groups * n_top * layout.kv_heads_per_group
    state = {
        "slot_page": slot_page.to(device),
        "copy_pages": torch.full((n_entries,), 99, dtype=torch.long, device=device),
        "copy_slots": torch.full((n_entries,), 99, dtype=torch.long, device=device),
        "table": torch.full((n_kv_heads, layout.n_slots), 99, dtype=torch.long, device=device),
        "counts": torch.full((layout.n_slots,), 99, dtype=torch.long, device=device),
        "totals": torch.tensor([3.0, 100.25, 7.0, 1024.0], dtype=torch.float64, device=device),
    }
    theirs = {name: tensor.clone() for name, tensor in state.items()}
    position = torch.tensor([page * 8 + offset], device=device)
    args = ("slot_page", "copy_pages", "copy_slots", "table", "counts", "totals")
    inputs = (scores.to(device), top.values.to(device), top.indices.to(device))
    for run, tensors in ((recall_plan_triton, state), (recall_plan_reference, theirs)):
        slot_page, *outputs = (tensors[name] for name in args)
        run(layout, position, slot_page, *inputs, *outputs, 512)
    if device.type == "cuda":  # the reference's scratch-slot entry is unspecified on CUDA (duplicate indices)
        state["slot_page"], theirs["slot_page"] = state["slot_page"][:-1], theirs["slot_page"][:-1]
    assert_same(state, theirs)


# --------------------------------------------------------------------------------------------------- whole steps


def arkvale_layer(device: torch.device, dtype: torch.dtype, n_groups: int, n_window: int):
    from eval.plugins import build_method

    info = ModelInfo(n_layers=1, n_heads=8, n_kv_heads=4, head_dim=16, device=device, dtype=dtype)
    config = {"name": "arkvale", "budget": 80, "page_size": 8, "n_groups": n_groups, "n_window_pages": n_window,
              "n_dense_layers": 0}
    return build_method(config, info).make_layer(0, SequenceContext(trace_selection=True))


@pytest.mark.gpu
@pytest.mark.parametrize("n_groups,n_window", [(1, 2), (2, 2), (4, 1)])
def test_arkvale_steps_with_the_kernels_equal_the_steps_with_the_references(monkeypatch, n_groups, n_window):
    """A prompt whose middle is not yet full, then enough steps for pages to leave the window into free slots, the
    middle to fill and pages to be recalled: every state tensor, output and counter bitwise the same."""
    device = kernel_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(n_groups * 10 + n_window)
    layers = {use: arkvale_layer(device, dtype, n_groups, n_window) for use in (True, False)}

    def qkv(n_tokens):
        query = torch.randn(1, 8, n_tokens, 16, generator=gen).to(device, dtype)
        return query, random_keys((1, 4, n_tokens, 16), gen, dtype, device), \
            torch.randn(1, 4, n_tokens, 16, generator=gen).to(device, dtype)

    prompt = qkv(45)
    # Count the kernels' calls: the forced dispatch must really run them.
    calls = count_triton_calls(monkeypatch, arkvale_step, ("page_start", "recall_plan"))
    outputs = {use: [] for use in layers}
    steps = [qkv(1) for _ in range(70)]
    for use, layer in layers.items():
        monkeypatch.setattr(arkvale_step, "runs_triton", lambda tensor, use=use: use)
        layer.forward(*prompt, None, 0.25)
        for step in steps:
            outputs[use].append((layer.forward(*step, None, 0.25), layer.last_attended.clone(),
                                 layer.slot_page.clone()))
    assert calls == {"page_start": len(steps), "recall_plan": len(steps)}
    fused, reference = layers[True], layers[False]
    for (out, attended, slots), (out_ref, attended_ref, slots_ref) in zip(outputs[True], outputs[False]):
        assert torch.equal(slots[:-1], slots_ref[:-1]) and torch.equal(attended, attended_ref)
        assert torch.equal(out, out_ref)
    for name in ("pool_keys", "pool_values", "digest_hi", "digest_lo"):
        assert torch.equal(getattr(fused, name), getattr(reference, name)), name
    n_finished = fused.seq_len // 8  # the store is not initialised beyond the pages written
    for name in ("store_keys", "store_values"):
        assert torch.equal(getattr(fused, name)[:n_finished], getattr(reference, name)[:n_finished]), name
    assert fused.seq.counters.as_dict() == reference.seq.counters.as_dict()
    assert fused.seq.counters.as_dict()["pages_loaded"] > 0
