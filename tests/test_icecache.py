"""IceCache on the core: exactness when every page can be selected, page bookkeeping, attended set, reuse."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eval.plugins import build_method
from icecache.core.cache import HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate
from icecache.errors import ConfigError
from icecache.method import diff_selection, merge_group_pages
from tests.conftest import load_script


def prompt(n, seed=0):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
def test_offloaded_path_equals_full_when_every_page_is_selectable(tiny, name):
    """Force offload at prefill with room for every DCI page: attention covers all tokens, so tokens and logits
    must equal the full cache's (this exercises index, diff, bulk load, paged attention and window offload)."""
    model, _, info = tiny
    ids = prompt(300)
    full = greedy_generate(model, HarnessCache(build_method({"name": "full"}, info)), GenerationRequest(ids, 40),
                           keep_logits=True)
    method = build_method({"name": name, "budget": 1024, "offload_short_prompts": True,
                           "query_prop_to_retrieve": 1.0, "query_field_of_view": 400}, info)
    ours = greedy_generate(model, HarnessCache(method), GenerationRequest(ids, 40), keep_logits=True)
    assert ours.token_ids == full.token_ids
    for mine, theirs in zip(ours.logits, full.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    assert ours.counters["pages_loaded"] > 0


def test_attended_set_is_sinks_selected_pages_and_window(tiny):
    model, _, info = tiny
    method = build_method({"name": "icecache", "budget": 96}, info)
    cache = HarnessCache(method, trace_selection=True)
    greedy_generate(model, cache, GenerationRequest(prompt(300, 1), 30))
    for layer in cache.layer_kvs[method.config.n_dense_layers:]:
        attended = layer.last_attended
        total = layer.seq_len  # the forward that traced counted the new token already
        # As wide as the announced 330 tokens (written by the host step into its transit buffer), False past them.
        assert attended.shape == (info.n_heads, 330) and not attended[:, total:].any()
        attended = attended[:, :total]
        expected = torch.zeros(info.n_kv_heads, total, dtype=torch.bool)
        expected[:, : layer.state.sink_len] = True
        expected[:, layer.state.window.start:] = True
        index = layer.group.index
        for head in range(info.n_kv_heads):
            for page in layer.state.resident[head][layer.state.resident[head] >= 0]:
                tokens = index.page_tokens(head)[page]
                expected[head, layer.state.positions[tokens[tokens >= 0]]] = True
        assert torch.equal(attended, expected.repeat_interleave(info.group_size, 0))
        assert attended.sum(1).max() <= 96
        assert attended[:, :32].all() and attended[:, -1].all()  # sinks and the newest token


def test_reused_layers_share_the_owner_selection(tiny):
    model, _, info = tiny
    method = build_method({"name": "icecache_reuse", "budget": 96, "n_reuse_layers": 2}, info)
    cache = HarnessCache(method)
    greedy_generate(model, cache, GenerationRequest(prompt(300, 2), 20))
    owner, reused = cache.layer_kvs[2], cache.layer_kvs[3]
    assert owner.is_owner and not reused.is_owner
    assert np.array_equal(owner.state.resident, reused.state.resident)


def test_the_index_threads_are_the_process_s_share_unless_set():
    """A sweep's worker sets torch's threads to its share of the host; the index must not take every core."""
    from icecache.method.config import IceCacheConfig

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert IceCacheConfig().index_threads == 1 and IceCacheConfig(lookahead=True).search_threads == 1
        torch.set_num_threads(2)
        assert IceCacheConfig().index_threads == 2 and IceCacheConfig(cpu_threads=3).index_threads == 3
    finally:
        torch.set_num_threads(before)


def test_budget_too_small_is_refused_with_the_numbers():
    from tests.conftest import tiny_model

    _, _, info = tiny_model("llama")
    # One minimum: the sink and window pages shrink to one each at small budgets, so 48 whatever they are set to.
    least = r"icecache needs at least 48 = \(1 sink \+ 1 selected \+ 1 window page\) x page_size=16: use budget=48"
    with pytest.raises(ConfigError, match=r"^budget 47 gives 2 pages of 16 tokens; " + least + "[^0-9]*$"):
        build_method({"name": "icecache", "budget": 47}, info)
    with pytest.raises(ConfigError, match=r"^budget 32 gives 2 pages of 16 tokens; " + least):
        build_method({"name": "icecache", "budget": 32, "n_sink_pages": 1, "n_window_pages": 1}, info)


@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
@pytest.mark.parametrize(
    "budget, configured, effective",
    [
        (64, (2, 2), (1, 1)),  # 4 pages: the default 2 + 2 would leave none selected -> 1 + 2 selected + 1
        (48, (2, 2), (1, 1)),  # 3 pages -> 1 + 1 selected + 1
        (80, (2, 2), (2, 2)),  # 5 pages: 2 + 1 selected + 2, as configured
        (256, (2, 2), (2, 2)),  # the default budget is untouched
        (64, (0, 4), (0, 1)),  # each fixed part is capped at one page, never raised
        (64, (0, 3), (0, 3)),  # 1 page left to select: as configured
        (64, (1, 1), (1, 1)),
    ],
)
def test_fixed_pages_shrink_to_one_each_only_where_they_leave_no_selected_page(name, budget, configured, effective):
    """docs/eval.md, IceCache at small budgets: the budget counts sink + selected + window pages."""
    from tests.conftest import tiny_model

    _, _, info = tiny_model("llama")
    method = build_method({"name": name, "budget": budget, "n_sink_pages": configured[0],
                           "n_window_pages": configured[1]}, info)
    assert (method.config.n_sink_pages, method.config.n_window_pages) == effective
    assert method.n_selected_pages == budget // 16 - sum(effective) >= 1


def test_merge_interleaves_ranks_and_keeps_first_distinct():
    pages = np.array([[5, 7, 9], [7, 3, -1], [1, 2, 3], [1, 2, 3]])  # 2 KV heads x 2 query heads
    merged = merge_group_pages(pages, group_size=2, k=3)
    # KV head 0: rank 1 gives 5, 7; rank 2 gives 7 (dup), 3 -> [5, 7, 3]
    assert merged[0].tolist() == [5, 7, 3]
    assert merged[1].tolist() == [1, 2, 3]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_diff_never_loses_or_duplicates_a_page(data):
    n_heads, k = 3, data.draw(st.integers(1, 6))
    resident = np.full((n_heads, k), -1, dtype=np.int64)
    stale = np.zeros((n_heads, 20), dtype=bool)
    for _ in range(data.draw(st.integers(1, 6))):
        selection = np.full((n_heads, k), -1, dtype=np.int64)
        for head in range(n_heads):
            chosen = data.draw(st.lists(st.integers(0, 19), max_size=k, unique=True))
            selection[head, : len(chosen)] = chosen
        stale = np.array(data.draw(st.lists(st.booleans(), min_size=n_heads * 20, max_size=n_heads * 20))).reshape(
            n_heads, 20)
        before = resident.copy()
        slots, pages, heads = diff_selection(resident, stale, selection)
        for head in range(n_heads):
            held = resident[head][resident[head] >= 0]
            assert sorted(held) == sorted(p for p in selection[head] if p >= 0)  # exactly the selection
            assert len(set(held)) == len(held)  # no duplicates
            loaded = {p for p, h in zip(pages, heads) if h == head}
            for slot, page in enumerate(before[head]):
                # a kept page stays in its slot and is not reloaded unless stale
                if page >= 0 and page in held and not stale[head, page]:
                    assert resident[head, slot] == page and page not in loaded
            assert {p for p in held if p not in before[head] or stale[head, p]} <= loaded
        assert len(set(zip(slots, heads))) == len(slots)  # one load per slot


def merge_group_pages_loop(pages, group_size, k):
    """The per-head loop that ``merge_group_pages`` replaces, kept as its reference."""
    n_kv_heads = pages.shape[0] // group_size
    merged = np.full((n_kv_heads, k), -1, dtype=np.int64)
    for head in range(n_kv_heads):
        ranked = pages[head * group_size : (head + 1) * group_size].T.reshape(-1)
        ranked = ranked[ranked >= 0]
        _, first_seen = np.unique(ranked, return_index=True)
        distinct = ranked[np.sort(first_seen)][:k]
        merged[head, : distinct.size] = distinct
    return merged


def diff_selection_loop(resident, stale, selection):
    """The per-head loop with sets that ``diff_selection`` replaces, kept as its reference."""
    slots_out, pages_out, heads_out = [], [], []
    for head in range(resident.shape[0]):
        wanted = [int(p) for p in selection[head] if p >= 0]
        wanted_set = set(wanted)
        keep = {
            int(p) for p in resident[head]
            if p >= 0 and p in wanted_set and not (p < stale.shape[1] and stale[head, p])
        }
        free = [s for s, p in enumerate(resident[head]) if p < 0 or int(p) not in keep]
        to_load = [p for p in wanted if p not in keep]
        for slot in free:
            resident[head, slot] = -1
        for slot, page in zip(free, to_load):
            resident[head, slot] = page
            slots_out.append(slot)
            pages_out.append(page)
            heads_out.append(head)
    return slots_out, pages_out, heads_out


@pytest.mark.parametrize("seed", range(5))
def test_merge_matches_the_per_head_loop(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        group, n_kv, ranks = rng.integers(1, 5), rng.integers(1, 5), rng.integers(1, 8)
        # Few distinct pages, so that query heads of a group often rank the same page; -1 anywhere.
        pages = rng.integers(-1, rng.integers(1, 3 * ranks + 2), size=(group * n_kv, ranks)).astype(np.int32)
        k = int(rng.integers(1, ranks + 3))
        expected = merge_group_pages_loop(pages, group, k)
        merged = merge_group_pages(pages, group, k)
        assert merged.dtype == expected.dtype and np.array_equal(merged, expected)


@pytest.mark.parametrize("seed", range(5))
def test_diff_matches_the_per_head_loop(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        n_heads, k, n_pages = rng.integers(1, 9), rng.integers(1, 13), rng.integers(1, 40)
        resident = np.full((n_heads, k), -1, dtype=np.int64)
        reference = resident.copy()
        for _ in range(8):
            selection = np.full((n_heads, k), -1, dtype=np.int64)
            for head in range(n_heads):
                chosen = rng.permutation(n_pages)[: rng.integers(0, k + 1)]
                selection[head, : chosen.size] = chosen
            # A stale map narrower than the page ids at times, as before the index first grows it.
            stale = rng.random((n_heads, rng.integers(0, n_pages + 1))) < 0.3
            expected = diff_selection_loop(reference, stale, selection)
            slots, pages, heads = diff_selection(resident, stale, selection)
            assert (slots.tolist(), pages.tolist(), heads.tolist()) == expected
            assert np.array_equal(resident, reference)


@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
def test_valid_counts_cover_exactly_the_attended_positions(tiny, name):
    """The per-slot counts the attention reads (kept on the device, index counts cached between inserts) give,
    per KV head, as many tokens as the traced attended set, and the counter records their mean."""
    model, _, info = tiny
    method = build_method({"name": name, "budget": 96, "n_reuse_layers": 2}, info)
    cache = HarnessCache(method, trace_selection=True)
    per_step = []
    for layer in cache.layer_kvs[method.config.n_dense_layers:]:
        def recording(query, key, value, scaling, layer=layer, decode=layer.decode):
            out = decode(query, key, value, scaling)
            if layer.offloaded:
                attended = layer.last_attended[:: info.group_size].sum(1)  # one query head per KV head
                assert torch.equal(layer.buffers.exchange.device_out["counts"].sum(1).long(), attended)
            per_step.append(layer.last_attended[:: info.group_size].sum(1).float().mean().item())
            return out
        layer.decode = recording
    result = greedy_generate(model, cache, GenerationRequest(prompt(300, 3), 40))  # 40 steps: window offloads
    assert len(per_step) == cache.seq.counters.decode_layer_steps
    assert result.counters["mean_attended_tokens"] == pytest.approx(sum(per_step) / len(per_step), rel=1e-12)


def test_token_store_appends_like_concatenation_with_bounded_spare_room():
    from icecache.method import TokenStore

    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 100, 4, generator=generator), torch.randn(2, 100, 4, generator=generator)
    store, reference_k, reference_v = TokenStore(keys, values), keys, values
    storage_ids = set()
    for _ in range(40):
        page_k, page_v = torch.randn(2, 16, 4, generator=generator), torch.randn(2, 16, 4, generator=generator)
        store.append(page_k, page_v)
        reference_k, reference_v = torch.cat([reference_k, page_k], 1), torch.cat([reference_v, page_v], 1)
        storage_ids.add(store._keys.data_ptr())
        assert torch.equal(store.keys, reference_k) and torch.equal(store.values, reference_v)
        # an eighth of spare room (or the 256-token minimum step), not a doubling
        assert store.nbytes() <= (reference_k.nbytes + reference_v.nbytes) * 9 / 8 + 2 * (256 * 2 * 4 * 4)
    assert len(storage_ids) < 10  # grown a few times, not once per page


def test_token_store_grows_between_steps_and_refuses_to_inside_a_host_function():
    """A captured step appends window pages from a host function, where growing the store hung the H200: the
    layer reserves room between steps, and a growth that would still happen inside a host function is an error."""
    from icecache.core import cuda_driver
    from icecache.method import TokenStore

    store = TokenStore(torch.zeros(2, 10, 4), torch.zeros(2, 10, 4))
    store.reserve(40)
    room = store._keys.shape[1]
    assert room >= 40 and torch.equal(store.keys, torch.zeros(2, 10, 4))
    cuda_driver._HOST_FUNCTION_THREAD.active = True
    try:
        store.append(torch.ones(2, room - 10, 4), torch.ones(2, room - 10, 4))  # fits: no growth
        with pytest.raises(RuntimeError, match="between decode steps"):
            store.append(torch.ones(2, 1, 4), torch.ones(2, 1, 4))
    finally:
        cuda_driver._HOST_FUNCTION_THREAD.active = False
    assert store.n_tokens == room


def test_an_offloaded_layer_keeps_token_room_for_the_next_steps(tiny):
    model, _, info = tiny
    cache = HarnessCache(build_method({"name": "icecache", "budget": 96}, info))
    ids = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    greedy_generate(model, cache, GenerationRequest(ids, 3))
    offloaded = [layer for layer in cache.layer_kvs if getattr(layer, "offloaded", False)]
    assert offloaded
    for layer in offloaded:
        layer.between_steps()  # the store already holds every token up to the announced length, and no more
        assert layer.state.tokens.capacity == cache.seq.max_total_tokens - layer.state.sink_len
    cache.seq.max_total_tokens = None  # a sequence that runs past what it announced
    for layer in offloaded:
        layer.between_steps()
        spare_tokens = layer.state.tokens.capacity - layer.state.tokens.n_tokens
        assert spare_tokens >= 64 * layer.cfg.page_size  # many window offloads ahead (one per page_size steps)


@pytest.mark.parametrize("first_pass", ["half", "int8"])
def test_half_precision_search_selects_the_float32_pages(tiny, first_pass):
    """IceCache's approximate first pass (half, or int8) changes nothing a run computes: same tokens, same loads."""
    model, _, info = tiny
    ids = torch.randint(0, 500, (400,), generator=torch.Generator().manual_seed(11)).tolist()
    runs = {}
    for precision in ("float32", first_pass):
        values = {"name": "icecache", "budget": 96, "dci_score_precision": precision}
        cache = HarnessCache(build_method(values, info))
        runs[precision] = greedy_generate(model, cache, GenerationRequest(ids, 40))
        assert cache.layer_kvs[-1].group.index.score_precision == precision
    runs["half"] = runs[first_pass]
    assert runs["half"].token_ids == runs["float32"].token_ids
    def computed(counters):  # what the run computed; the search_* counters say how much each search read
        return {k: v for k, v in counters.items() if not k.startswith("search_")}

    assert computed(runs["half"].counters) == computed(runs["float32"].counters)
    assert runs["half"].counters["pages_loaded"] > 0
    # the first pass re-scores exactly only what its bounds cannot rule out
    assert runs["half"].counters["search_scores"] < runs["float32"].counters["search_scores"]


@pytest.mark.parametrize("n_window_pages", [2, 3])
def test_window_ring_turns_and_every_step_attends_exactly_its_selection(n_window_pages):
    """Over 120 decode steps the window's oldest page is offloaded 7 times (the ring of window slots turns, the
    page goes through its host copy into the index): at every step, in the owner and in a layer reusing its
    selection, the output equals exact attention over the true keys and values of the positions it attended,
    and the window positions are the most recent ones."""
    from icecache.core.method import ModelInfo, SequenceContext
    from tests.test_method_invariants import masked_dense_attention

    info = ModelInfo(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
    budget = (1 + 2 + n_window_pages) * 16  # 1 sink page, 2 selected, the window
    method = build_method({"name": "icecache_reuse", "budget": budget, "n_sink_pages": 1,
                           "n_window_pages": n_window_pages, "n_dense_layers": 0, "n_reuse_layers": 2}, info)
    seq = SequenceContext(trace_selection=True)
    layers = [method.make_layer(0, seq), method.make_layer(1, seq)]
    gen = torch.Generator().manual_seed(11)
    scaling = info.head_dim**-0.5
    n_prompt = 300
    keys = [torch.randn(1, 2, n_prompt, 16, generator=gen) for _ in layers]
    values = [torch.randn(1, 2, n_prompt, 16, generator=gen) for _ in layers]
    for layer, k, v in zip(layers, keys, values):
        layer.forward(torch.randn(1, 4, n_prompt, 16, generator=gen), k, v, None, scaling)
    for step in range(120):
        for i, layer in enumerate(layers):
            query = torch.randn(1, 4, 1, 16, generator=gen)
            key, value = torch.randn(1, 2, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen)
            keys[i], values[i] = torch.cat([keys[i], key], dim=2), torch.cat([values[i], value], dim=2)
            out = layer.forward(query, key, value, None, scaling)
            attended = layer.last_attended
            expected = masked_dense_attention(query[0, :, 0], keys[i][0], values[i][0], attended, scaling)
            torch.testing.assert_close(out[0, 0], expected, atol=1e-5, rtol=1e-5)
            n_tokens = n_prompt + step + 1
            window = layer.state.window
            assert attended[:, window.start : n_tokens].all()
            assert n_tokens - window.start == window.count <= n_window_pages * 16
        assert np.array_equal(layers[0].state.resident, layers[1].state.resident)  # the reuser holds the owner's pages
    assert layers[0].state.window.start > n_prompt + 100 - n_window_pages * 16  # the window moved with the tokens
    layers[0].between_steps()  # what a graphed step runs after each replay: room for several inserts ahead
    assert layers[0].state.tokens.capacity >= layers[0].state.tokens.n_tokens + 4 * 16


def test_token_store_rows_address_every_head_of_a_view_and_of_grown_storage():
    from icecache.method import TokenStore

    full, other = torch.randn(3, 10, 4), torch.randn(3, 10, 4)
    for store in (TokenStore(full[:, :6], other[:, :6]),  # views: heads 10 rows apart
                  TokenStore(full[:, :6], full[:, :6] * 2)):  # a view and a contiguous tensor
        _check_rows(store)


def _check_rows(store):
    for _ in range(2):
        keys, values, stride = store.rows()
        for head in range(3):
            for token in range(store.n_tokens):
                assert torch.equal(keys[head * stride + token], store.keys[head, token])
                assert torch.equal(values[head * stride + token], store.values[head, token])
        store.append(torch.randn(3, 300, 4), torch.randn(3, 300, 4))  # grows: new storage, new stride


def _index_workers() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name.startswith("icecache-index")]


@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
def test_closing_the_cache_ends_the_prompt_worker_and_its_progress_bar(tiny, name):
    from icecache.method import IceCacheSequence

    model, _, info = tiny
    method = build_method({"name": name, "budget": 96}, info)
    with HarnessCache(method) as cache:
        greedy_generate(model, cache, GenerationRequest(prompt(300, 3), 20))
        state = cache.seq.state(IceCacheSequence)
        # One group per owner layer; reusers share their owner's.
        owners = {method.owner_of(i) for i in range(method.config.n_dense_layers, info.n_layers)}
        assert set(state.groups) == owners
        assert all(group.index is not None for group in state.groups.values())
        # this sequence's own workers (other tests' unclosed caches may still hold theirs until collected)
        workers = list(state._worker._threads)
        assert 1 <= len(workers) <= method.config.prompt_workers
        assert all(t.name.startswith("icecache-index") and t.is_alive() for t in workers)
        assert state._progress is not None and state.n_layers_done == info.n_layers - method.config.n_dense_layers
    assert not any(t.is_alive() for t in workers)
    assert not set(workers) & set(_index_workers())
    assert state._worker is None and state._progress is None


def test_the_phase_timer_exposes_the_host_step_and_the_prompt_job(tiny):
    """The parts a benchmark times come from the timer, one span per layer step and per prompt build, and the
    host step's phases fit inside its span."""
    from icecache.core.timing import PhaseTimer

    model, _, info = tiny
    method = build_method({"name": "icecache", "budget": 96}, info)
    n_sparse = info.n_layers - method.config.n_dense_layers
    timer = PhaseTimer(enabled=True)
    with HarnessCache(method, timer) as cache:
        result = greedy_generate(model, cache, GenerationRequest(prompt(300, 4), 12))
    n_steps = len(result.step_times_s)
    assert len(timer.spans["index_build"]) == len(timer.spans["token_store"]) == n_sparse
    assert len(timer.spans["host_step"]) == n_sparse * n_steps
    host = sum(timer.spans["host_step"])
    phases = sum(p.get("query", 0.0) + p.get("load", 0.0) for p in result.step_phases)
    assert 0 < phases <= host


def test_a_disabled_timer_records_no_span():
    from icecache.core.timing import PhaseTimer

    timer = PhaseTimer(enabled=False)
    with timer.span("x"):
        pass
    assert timer.spans == {}


def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``) from /proc/cpuinfo, or the platform's processor."""
    import platform

    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def test_selections_equal_the_recorded_digests():
    """Every page IceCache and IceCache(r) select over 64 decode steps, on the four architectures in float32 and
    bfloat16, equals what the harness selected before the index held the bf16 keys itself and the page-ordered
    copies were dropped (tests/fixtures/selection_digests.json, ``scripts/diagnostics/selection_hash.py``), on a host
    of the same CPU capability and, where recorded, vendor (the tiny models' arithmetic follows them)."""
    import json
    from pathlib import Path

    from tests.conftest import tiny_model_on

    repo = Path(__file__).resolve().parents[1]
    module = load_script("diagnostics/selection_hash")
    fixture = json.loads((repo / "tests" / "fixtures" / "selection_digests.json").read_text())
    capability = torch.backends.cpu.get_cpu_capability()
    host = f"{capability}/{cpu_vendor()}"  # a vendor's own set first: the same capability can round otherwise
    sets = fixture["digests_by_cpu_capability"]
    recorded = sets.get(host, sets.get(capability))
    assert recorded is not None, (
        f"no digests recorded for CPU capability {capability} ({host}): make them with "
        f"scripts/diagnostics/selection_hash.py on the code of commit c8d6c58 (a git worktree) on such a host, and add "
        f"them to tests/fixtures/selection_digests.json")
    for key, digest in recorded.items():
        arch, dtype, name = key.split("/")
        model, info = tiny_model_on(arch, "cpu", getattr(torch, dtype))
        assert module.selection_digest(model, info, name) == digest, key


@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
def test_host_memory_is_one_copy_of_the_offloaded_tokens(name):
    """With bf16 KV at head_dim 128 a layer's host memory (token store, index keys and structure) is at most 1.3x
    the bf16 bytes of the keys and values it offloaded, through window inserts: an owner keeps no key copy beside
    its index, a reusing layer keeps its own keys and no index, and nothing grows past the announced length."""
    from icecache.core.method import ModelInfo, SequenceContext

    info = ModelInfo(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    method = build_method({"name": name, "budget": 96, "n_sink_pages": 1, "n_window_pages": 2,
                           "n_dense_layers": 0, "n_reuse_layers": 2 if name == "icecache_reuse" else 1}, info)
    n_prompt, n_steps = 6000, 40
    seq = SequenceContext()
    seq.max_total_tokens = n_prompt + n_steps
    layers = [method.make_layer(i, seq) for i in range(2)]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for layer in layers:
            k, v = (torch.randn(1, 2, n_prompt, 128, generator=gen).to(torch.bfloat16) for _ in range(2))
            layer.forward(torch.randn(1, 4, n_prompt, 128, generator=gen).to(torch.bfloat16), k, v, None, 0.1)
        for _ in range(n_steps):
            for layer in layers:
                layer.between_steps()
                q, k, v = (torch.randn(1, h, 1, 128, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
                layer.forward(q, k, v, None, 0.1)
        stores = [layer.state.tokens.capacity for layer in layers]
        for layer in layers:
            layer.between_steps()
            offloaded_kv = 2 * layer.state.tokens.n_tokens * 2 * 128 * 2  # keys and values, 2 heads, bf16
            assert layer.state.tokens.has_keys == (not layer.is_owner)
            assert layer.cpu_kv_bytes() <= 1.3 * offloaded_kv
        assert [layer.state.tokens.capacity for layer in layers] == stores == [n_prompt + n_steps - 16] * 2
    seq.close()


def test_a_keyless_token_store_takes_values_only_and_points_its_step_at_grown_storage():
    """A store without keys appends values in place within its capacity; once bound to its layer's C++ step, the
    step's count is the store's, and a growth points the step at the new storage (the step's gather from it is
    tested against the NumPy gather in tests/test_decode_step.py)."""
    from icecache.dci import _dci
    from icecache.method import TokenStore

    gen = torch.Generator().manual_seed(1)
    values = torch.randn(2, 40, 8, generator=gen)
    store = TokenStore(None, values, capacity=72)
    address = store.values.data_ptr()
    store.append(None, torch.randn(2, 32, 8, generator=gen))
    assert store.values.data_ptr() == address and store.keys is None and store.n_tokens == 72
    with pytest.raises(ValueError, match="keys exactly when"):
        store.append(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))
    step = _dci.DecodeStep(_dci.NativeSequence(), _dci.ReuseGroup(2, 1), layer=0, n_heads=2, n_kv_heads=2,
                           head_dim=8, page_size=16, n_sink_pages=0, n_selected=1, n_window_pages=1,
                           first_window_slot=1, owner=True, keys_in_index=True, host_dtype=0,
                           query_field_of_view=-1, query_prop_to_retrieve=0.8, insert_field_of_view=20,
                           insert_prop_to_retrieve=0.6, lookahead_min_cosine=0.9)
    store.bind(step)
    assert (step.n_tokens, step.capacity) == (72, 72)
    kept = store.values.clone()
    store.reserve(100)
    assert store.n_tokens == 72 and step.capacity == store.capacity >= 100 and torch.equal(store.values, kept)
    with pytest.raises(RuntimeError, match="appended to by the step"):
        store.append(None, torch.zeros(2, 1, 8))


def test_decode_buffers_on_cpu_are_the_host_memory_and_stage_inputs_as_float32():
    """Off CUDA a layer's decode buffers have no device copy: what the host step writes is what the device views
    read; the inputs arrive as float32 whatever the model's dtype, and no slot is loaded until the host says so."""
    from icecache.core.cuda_driver import HostFunctions
    from icecache.method.buffers import DecodeBuffers

    buffers = DecodeBuffers.make(n_heads=4, n_kv_heads=2, n_slots=5, max_blocks=3, page_size=4, head_dim=8,
                                 block_dtype=torch.bfloat16, device=torch.device("cpu"),
                                 host_functions=HostFunctions())
    assert (buffers.slots == -1).all() and buffers.attended is None
    buffers.counts[1, 4] = 7
    buffers.window_rows[:] = [11, 12]
    buffers.slots[0], buffers.heads[0] = 2, 1
    block = torch.randn(4, 8).to(torch.bfloat16)
    buffers.keys[0] = block.view(torch.uint8).reshape(-1).numpy()
    device_views = buffers.exchange.receive()  # nothing to copy on CPU
    assert device_views["counts"][1, 4] == 7 and device_views["window_rows"].tolist() == [11, 12]
    assert device_views["slots"].tolist() == [2, -1, -1] and device_views["heads"][0] == 1
    assert torch.equal(device_views["keys"][0], block)
    query, key, value = torch.randn(4, 8).to(torch.bfloat16), torch.randn(2, 8), torch.randn(2, 8)
    buffers.exchange.send(query=query, key=key, value=value)
    ran = []
    buffers.exchange.run(lambda: ran.append(buffers.query.copy()))  # on CPU: at once
    assert np.array_equal(ran[0], query.float().numpy()) and buffers.query.dtype == np.float32
    assert torch.equal(buffers.key, key) and torch.equal(buffers.value, value)
    assert buffers.exchange.nbytes()[1] == 0
    traced = DecodeBuffers.make(4, 2, 5, 3, 4, 8, torch.float32, torch.device("cpu"), HostFunctions(), trace_width=9)
    assert traced.attended.shape == (2, 9) and traced.attended.dtype == np.uint8
