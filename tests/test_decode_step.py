"""IceCache's host step in C++ (icecache/method/src/decode_step.cpp) against its NumPy reference
(tests/icecache_reference.py): every buffer the step writes, bit for bit, at every step of an owner and a layer
reusing its selection, with and without the look-ahead, for each host dtype; the window ring on its own; and what
an error inside the step becomes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eval.plugins import build_method
from icecache.core.method import ModelInfo, SequenceContext
from icecache.dci import _dci
from tests import icecache_reference as reference

N_PROMPT, N_STEPS = 300, 70


def make_layers(model_dtype, cpu_kv_dtype, lookahead, trace_width=0):
    """An owner (layer 1) and a layer reusing its selection (layer 2), prefilled with random keys and values, and
    their references."""
    info = ModelInfo(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, dtype=model_dtype)
    method = build_method({"name": "icecache_reuse", "budget": 80, "n_sink_pages": 1, "n_window_pages": 2,
                           "n_dense_layers": 1, "n_reuse_layers": 2, "cpu_kv_dtype": cpu_kv_dtype,
                           "lookahead": lookahead, "lookahead_min_cosine": 0.99}, info)
    seq = SequenceContext(trace_selection=bool(trace_width), trace_width=trace_width or None)
    seq.max_total_tokens = N_PROMPT + N_STEPS + 1
    layers = [method.make_layer(1, seq), method.make_layer(2, seq)]
    gen = torch.Generator().manual_seed(5)
    group = reference.Group()
    references = []
    with torch.inference_mode():
        for layer in layers:
            k, v = (torch.randn(1, 2, N_PROMPT, 16, generator=gen).to(model_dtype) for _ in range(2))
            layer.forward(torch.randn(1, 4, N_PROMPT, 16, generator=gen).to(model_dtype), k, v, None, 0.25)
            layer.wait_until_indexed()
            references.append(reference.ReferenceStep(layer, group, k[0], v[0]))
    return seq, layers, references, gen


CASES = [(torch.bfloat16, "auto"), (torch.bfloat16, "float16"), (torch.float32, "auto"), (torch.float32, "bfloat16")]


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize(("model_dtype", "cpu_kv_dtype"), CASES)
def test_the_native_step_writes_what_the_numpy_step_writes(model_dtype, cpu_kv_dtype, lookahead):
    width = N_PROMPT + N_STEPS + 1
    seq, layers, references, gen = make_layers(model_dtype, cpu_kv_dtype, lookahead, trace_width=width)
    owner, reuser = layers
    assert owner.state.keys_in_index == (owner.state.host_dtype != torch.float16)
    assert not reuser.state.keys_in_index
    with torch.inference_mode():
        for step in range(N_STEPS):
            for layer, ref in zip(layers, references):
                query = torch.randn(1, 4, 1, 16, generator=gen).to(model_dtype)
                key, value = (torch.randn(1, 2, 1, 16, generator=gen).to(model_dtype) for _ in range(2))
                if layer.wants_previous_layer_input:
                    # every third speculation misses (a random query), the others are near the exact query
                    noise = torch.randn(query.shape, generator=gen) * (1.0 if step % 3 == 0 else 1e-3)
                    speculative = (query.float() + noise).to(model_dtype)
                    layer.previous_layer_input(torch.zeros(1, 1, 8), lambda hidden, s=speculative: s)
                    ref.start_lookahead(speculative[0, :, 0].float().numpy())
                layer.forward(query, key, value, None, 0.25)
                buffers = layer.buffers
                expected = ref.step(query[0, :, 0].float().numpy(), key[0, :, 0].float(), value[0, :, 0].float(),
                                    buffers.counts.shape[1], buffers.slots.shape[0], trace_width=width)
                n = expected["heads"].size
                assert np.array_equal(buffers.window_rows, expected["window_rows"])
                assert np.array_equal(buffers.counts, expected["counts"])
                assert np.array_equal(buffers.slots, expected["slots"])
                assert np.array_equal(buffers.heads[:n], expected["heads"])
                assert np.array_equal(buffers.keys[:n], expected["keys"])
                assert np.array_equal(buffers.values[:n], expected["values"])
                assert np.array_equal(buffers.attended, expected["attended"])
                assert np.array_equal(layer.group.selection, expected["selection"])
                assert np.array_equal(layer.state.resident, expected["resident"])
                assert np.array_equal(layer.state.positions, expected["positions"])
                assert (layer.state.window.start, layer.state.window.count) == (ref.start, ref.count)
                assert layer.state.tokens.n_tokens == ref.store_v.shape[1]
    counters = seq.counters
    totals = {name: sum(ref.counters[name] for ref in references) for name in ref.counters if name != "attended"}
    assert counters.pages_loaded == totals["pages_loaded"] > 0
    assert counters.bytes_to_gpu == totals["bytes_to_gpu"]
    assert counters.decode_layer_steps == 2 * N_STEPS
    attended = [mean for step in zip(*(ref.counters["attended"] for ref in references)) for mean in step]
    assert counters.attended_tokens == sum(attended)  # the same values added in the same order
    assert counters.extra["search_rows_read"] == totals["rows_read"]
    assert counters.extra["search_scores"] == totals["scores"]
    if lookahead:
        assert counters.extra["lookahead_searches"] == totals["lookahead_searches"] == N_STEPS
        assert counters.extra["lookahead_misses"] == totals["lookahead_misses"] > 0
        assert totals["lookahead_misses"] < N_STEPS  # some speculations held
    else:
        assert "lookahead_searches" not in counters.extra
    seq.close()


def test_the_trace_of_an_open_width_is_the_numpy_trace():
    seq, layers, references, gen = make_layers(torch.float32, "auto", False)
    seq.trace_selection = True  # no fixed width: the layer asks the step for each step's trace
    with torch.inference_mode():
        for _ in range(20):
            for layer, ref in zip(layers, references):
                query = torch.randn(1, 4, 1, 16, generator=gen)
                key, value = torch.randn(1, 2, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen)
                layer.forward(query, key, value, None, 0.25)
                ref.step(query[0, :, 0].numpy(), key[0, :, 0], value[0, :, 0], layer.buffers.counts.shape[1],
                         layer.buffers.slots.shape[0])
                width = layer.last_attended.shape[1]  # the tokens seen at the step
                expected = torch.from_numpy(ref.trace(width)).bool().repeat_interleave(2, 0)
                assert torch.equal(layer.last_attended, expected)
    seq.close()


def test_an_error_in_the_step_is_raised_after_it_and_later_steps_do_nothing():
    seq, layers, _, gen = make_layers(torch.float32, "auto", False)
    owner = layers[0]
    with torch.inference_mode():
        for layer in layers:
            layer.forward(torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen),
                          torch.randn(1, 2, 1, 16, generator=gen), None, 0.25)
        broken = torch.full((1, 4, 1, 16), float("nan"))
        with pytest.raises(RuntimeError, match=r"decode step failed on the host: layer 1: queries contains NaN"):
            owner.forward(broken, torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), None, 0.25)
        window, resident = (owner.state.window.start, owner.state.window.count), owner.state.resident
        for layer in layers:  # every later step of the sequence does nothing and raises the first error again
            with pytest.raises(RuntimeError, match="layer 1: queries contains NaN"):
                layer.forward(torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), None,
                              0.25)
        assert (owner.state.window.start, owner.state.window.count) == window
        assert np.array_equal(owner.state.resident, resident)
        with pytest.raises(RuntimeError, match="layer 1: queries contains NaN"):
            owner.between_steps()  # where a replayed step's error is raised
    seq.close()


def _window_step(owner=False):
    """A DecodeStep of 2 KV heads of one dimension whose window is 2 pages of 16 from pool slot 3, at position 100
    holding 24 tokens, over a 64-token store with keys; the host copy and the store as tensors."""
    sequence, group = _dci.NativeSequence(), _dci.ReuseGroup(2, 1)
    step = _dci.DecodeStep(sequence, group, layer=0, n_heads=2, n_kv_heads=2, head_dim=1, page_size=16,
                           n_sink_pages=1, n_selected=1, n_window_pages=2, first_window_slot=3, owner=owner,
                           keys_in_index=False, host_dtype=0, query_field_of_view=-1, query_prop_to_retrieve=0.8,
                           insert_field_of_view=20, insert_prop_to_retrieve=0.6, lookahead_min_cosine=0.9)
    host_k = torch.arange(64.0).view(2, 32, 1).clone()
    host_v = torch.zeros(2, 32, 1)
    store_k, store_v = torch.zeros(2, 64, 1), torch.zeros(2, 64, 1)
    step.set_window(host_k.data_ptr(), host_v.data_ptr(), 100, 24)
    step.set_positions(np.arange(0, 0))
    step.set_tokens(store_k.data_ptr(), store_v.data_ptr(), 64, 0, 64)
    return step, (sequence, group, host_k, host_v, store_k, store_v)


def test_the_window_ring_turns_through_its_slots_and_offloads_its_oldest_page():
    """Logical page j sits in slot first_slot + (head + j) % n_pages; offloading the oldest page turns the ring,
    moves the page into the token store and records its positions."""
    step, held = _window_step()  # ``held`` keeps alive the memory the step writes
    host_k, store_k = held[2], held[4]
    assert step.window_slot_counts().tolist() == [16, 8] and not step.window_full
    # pool rows of [slots, Hkv=2, page_size=16]: slot 4 (the second page), offset 8, heads 0 and 1
    assert step.window_append(np.full((2, 1), 500.0), np.zeros((2, 1))).tolist() == [4 * 32 + 8, 4 * 32 + 16 + 8]
    assert host_k[0, 24, 0] == 500.0
    for _ in range(7):
        step.window_append(np.zeros((2, 1)), np.zeros((2, 1)))
    assert step.window_full
    step.window_offload()
    assert store_k[0, :16, 0].tolist() == list(range(16)) and store_k[1, :16, 0].tolist() == list(range(32, 48))
    assert step.positions().tolist() == list(range(100, 116)) and step.n_tokens == 16
    assert (step.window_start, step.window_count, step.window_head) == (116, 16, 1)
    # slot 3 is the newest page now: the next token goes to its offset 0, and it counts only what is written
    assert step.window_slot_counts().tolist() == [0, 16]
    assert step.window_append(np.zeros((2, 1)), np.zeros((2, 1))).tolist() == [3 * 32, 3 * 32 + 16]
    assert step.window_slot_counts().tolist() == [1, 16]
    assert host_k[0, :8, 0].tolist() == list(range(16, 24)) and host_k[0, 8, 0] == 500.0


def test_a_token_store_without_room_is_an_error_inside_the_step():
    step, _keep = _window_step()
    step.set_tokens(_keep[4].data_ptr(), _keep[5].data_ptr(), 64, 60, 64)  # room for 4 tokens, not a page
    for _ in range(8):
        step.window_append(np.zeros((2, 1)), np.zeros((2, 1)))
    with pytest.raises(RuntimeError, match="must grow between decode steps"):
        step.window_offload()


def test_a_step_without_its_buffers_keeps_its_error_for_the_sequence():
    step, (sequence, *_) = _window_step()
    step.run_step()  # as the C entry runs it: no exception crosses, the sequence keeps it
    assert "layer 0: the decode buffers are not set" in sequence.error()
    function, state = step.step_entry()
    assert function != 0 and state != 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_host_dtype_rounds_as_torch_rounds(dtype):
    """The new token's float32 key is rounded into the window's host copy as torch's cast rounds it (ties,
    subnormals and overflow included; not NaN, whose bfloat16 bits torch's own paths do not agree on, and which
    an insert refuses anyway)."""
    values = torch.tensor([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, 6e-8, 3e-8, 1e-6, 65520.0,
                           7e4, -2.5e-5, float("inf"), 3.4e38, 1e-40, -0.0])
    values = torch.cat([values, torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 10 ** torch.randint(
        -9, 6, (4096,), generator=torch.Generator().manual_seed(1))])
    n = values.numel()
    sequence, group = _dci.NativeSequence(), _dci.ReuseGroup(1, 1)
    step = _dci.DecodeStep(sequence, group, layer=0, n_heads=1, n_kv_heads=1, head_dim=n, page_size=16,
                           n_sink_pages=0, n_selected=1, n_window_pages=1, first_window_slot=1, owner=False,
                           keys_in_index=False, host_dtype={torch.bfloat16: 1, torch.float16: 2}[dtype],
                           query_field_of_view=-1, query_prop_to_retrieve=0.8, insert_field_of_view=20,
                           insert_prop_to_retrieve=0.6, lookahead_min_cosine=0.9)
    host_k, host_v = torch.zeros(1, 16, n, dtype=dtype), torch.zeros(1, 16, n, dtype=dtype)
    step.set_window(host_k.data_ptr(), host_v.data_ptr(), 0, 0)
    step.window_append(values.view(1, n).numpy(), values.view(1, n).numpy())
    expected = values.to(dtype)
    assert torch.equal(host_k[0, 0].view(torch.int16), expected.view(torch.int16))


def test_merge_diff_and_cosines_match_their_numpy_forms():
    from icecache.method import diff_selection, merge_group_pages
    from icecache.method.lookahead import head_cosines

    rng = np.random.default_rng(3)
    for _ in range(50):
        group, k = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        pages = rng.integers(-1, 12, size=(3 * group, k)).astype(np.int32)
        assert np.array_equal(merge_group_pages(pages, group, k), reference.merge_group_pages(pages, group, k))
        resident = rng.integers(-1, 12, size=(3, k)).astype(np.int64)
        stale = rng.random((3, int(rng.integers(0, 14)))) < 0.3
        selection = merge_group_pages(rng.integers(-1, 12, size=(3 * group, k)).astype(np.int32), group, k)
        mine, theirs = resident.copy(), resident.copy()
        got = diff_selection(mine, stale, selection)
        want = reference.diff_selection(theirs, stale, selection)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)) and np.array_equal(mine, theirs)
    speculative, exact = rng.standard_normal((8, 32)).astype(np.float32), rng.standard_normal((8, 32)).astype(
        np.float32)
    speculative[3] = exact[3] = 0
    np.testing.assert_allclose(head_cosines(speculative, exact), reference.head_cosines(speculative, exact),
                               rtol=1e-13, atol=1e-15)


def test_run_native_on_cpu_calls_the_entry_at_once():
    """Off CUDA ``HostExchange.run_native`` calls the C entry directly: a step without its buffers records its
    error in the sequence, as it would inside a host function."""
    from icecache.core.cuda_driver import HostFunctions
    from icecache.core.host_step import HostExchange

    step, (sequence, *_) = _window_step()
    exchange = HostExchange({"x": ((1,), torch.float32)}, {}, "cpu", HostFunctions())
    exchange.run_native(*step.step_entry())
    assert "the decode buffers are not set" in sequence.error()
