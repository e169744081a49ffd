"""IceCache's opt-in look-ahead search (icecache/method/lookahead.py) and the core hook it rests on
(icecache/core/layer_inputs.py): the projection equals the query the attention receives, a held speculation uses
exactly the pages its speculative query finds, a missed one selects as the exact search, and the hooks go with
the generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eval.plugins import build_method
from icecache.core.cache import HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate
from icecache.core.layer_inputs import previous_layer_inputs, project_query
from icecache.errors import ConfigError
from icecache.method import lookahead as lookahead_module
from icecache.method import merge_group_pages

NEW_TOKENS = 24


def prompt(n, seed=11):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decoder_layers(model):
    return list(model.model.layers)


def record_layer_inputs(model):
    """Pre-hooks recording every decoder layer's (hidden states, position embeddings) per forward; the handles."""
    seen = {i: [] for i in range(len(decoder_layers(model)))}
    handles = []
    for index, layer in enumerate(decoder_layers(model)):
        def hook(module, args, kwargs, index=index):
            hidden = args[0] if args else kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            seen[index].append((hidden.clone(), (cos.clone(), sin.clone())))
        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def icecache(info, name="icecache", **settings):
    return build_method({"name": name, "budget": 96, "lookahead": True, **settings}, info)


def test_the_projection_of_a_layers_own_input_is_the_query_its_attention_receives(tiny):
    model, _, info = tiny
    cache = HarnessCache(build_method({"name": "full"}, info))
    queries = {i: [] for i in range(info.n_layers)}
    for index, kv in enumerate(cache.layer_kvs):
        def recording(query, key, value, mask, scaling, index=index, forward=kv.forward):
            queries[index].append(query.clone())
            return forward(query, key, value, mask, scaling)
        kv.forward = recording
    seen, handles = record_layer_inputs(model)
    try:
        greedy_generate(model, cache, GenerationRequest(prompt(40), 3))
    finally:
        for handle in handles:
            handle.remove()
    for index, layer in enumerate(decoder_layers(model)):
        assert len(seen[index]) == len(queries[index]) == 3  # the prompt and two decode steps
        for (hidden, position_embeddings), query in zip(seen[index], queries[index]):
            with torch.inference_mode():
                assert torch.equal(project_query(layer, position_embeddings, hidden), query)


def test_hooks_go_on_the_layers_before_the_owners_that_look_ahead_and_come_off_after(tiny):
    model, _, info = tiny
    layers = decoder_layers(model)
    for name, owners in (("icecache", [2, 3]), ("icecache_reuse", [2])):  # reuse groups of 3 from layer 2
        cache = HarnessCache(icecache(info, name))
        wanting = [i for i, kv in enumerate(cache.layer_kvs) if kv.wants_previous_layer_input]
        assert wanting == owners
        with previous_layer_inputs(model, cache.layer_kvs) as n_hooks:
            assert n_hooks == len(owners)
            assert [len(layer._forward_pre_hooks) for layer in layers] == \
                [int(i + 1 in owners) for i in range(len(layers))]
        assert all(not layer._forward_pre_hooks for layer in layers)
        cache.close()
    plain = HarnessCache(build_method({"name": "icecache", "budget": 96}, info))
    assert not any(kv.wants_previous_layer_input for kv in plain.layer_kvs)


@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
def test_a_missed_speculation_selects_as_the_exact_search(tiny, name):
    """A speculation that never holds (a bar no cosine reaches) is corrected at every step by the exact search:
    the run computes what the exact run computes, and every look-ahead counts as a miss."""
    model, _, info = tiny
    ids = prompt(400)
    exact = greedy_generate(model, HarnessCache(build_method({"name": name, "budget": 96}, info)),
                            GenerationRequest(ids, NEW_TOKENS))
    method = icecache(info, name)
    method.config.lookahead_min_cosine = 2.0  # above any cosine; the config's check allows [-1, 1]
    with HarnessCache(method) as cache:
        missed = greedy_generate(model, cache, GenerationRequest(ids, NEW_TOKENS))
        owners = sum(kv.wants_previous_layer_input for kv in cache.layer_kvs)
    assert missed.token_ids == exact.token_ids
    counters = dict(missed.counters)
    assert counters.pop("lookahead_searches") == counters.pop("lookahead_misses") == owners * (NEW_TOKENS - 1)
    assert counters == exact.counters  # the same loads, and the same search work (the exact searches')


def test_a_held_speculation_uses_the_pages_its_speculative_query_finds(tiny):
    """With a bar every cosine reaches, each owner attends the pages its index gives the speculative query, which
    is the owner's own projection of the previous layer's input at the step's position."""
    model, _, info = tiny
    method = icecache(info, lookahead_min_cosine=-1.0)
    seen, handles = record_layer_inputs(model)
    try:
        with HarnessCache(method) as cache:
            result = greedy_generate(model, cache, GenerationRequest(prompt(400), NEW_TOKENS))
            layers = decoder_layers(model)
            cfg = method.config
            for kv in cache.layer_kvs:
                if not kv.wants_previous_layer_input:
                    continue
                hidden, position_embeddings = seen[kv.layer_idx - 1][-1]  # the last step's input of the layer before
                with torch.inference_mode():
                    expected_query = project_query(layers[kv.layer_idx], position_embeddings, hidden)[0, :, 0, :]
                speculative = kv._speculative.read()
                assert np.array_equal(speculative, expected_query.numpy())
                # the index has not changed since that search: the same query finds the same pages again
                pages, _ = kv.group.index.query(speculative, cfg.n_selected_pages,
                                                field_of_view=cfg.query_field_of_view,
                                                prop_to_retrieve=cfg.query_prop_to_retrieve, ratio=info.group_size)
                assert np.array_equal(kv.group.selection, merge_group_pages(pages, info.group_size,
                                                                            cfg.n_selected_pages))
    finally:
        for handle in handles:
            handle.remove()
    assert result.counters["lookahead_searches"] == 2 * (NEW_TOKENS - 1)
    assert "lookahead_misses" not in result.counters
    assert result.counters["pages_loaded"] > 0


def test_misses_are_the_steps_where_a_head_falls_below_the_bar(tiny):
    """Each owner step's miss (read from the counters the step adds to) is exactly a step whose speculative and
    exact queries have a head with cosine below the bar (by the NumPy computation of the cosines)."""
    from tests.icecache_reference import head_cosines

    model, _, info = tiny
    decisions = []
    with HarnessCache(icecache(info, lookahead_min_cosine=0.9)) as cache:
        for kv in cache.layer_kvs:
            if not kv.wants_previous_layer_input:
                continue

            def recording(query, key, value, scaling, kv=kv, decode=kv.decode):
                before = cache.seq.counters.extra.get("lookahead_misses", 0)
                out = decode(query, key, value, scaling)
                if kv.offloaded and kv.state.native is not None and kv._speculative is not None:
                    low = head_cosines(kv._speculative.read(), query[0, :, 0].float().numpy()).min()
                    decisions.append((low, cache.seq.counters.extra.get("lookahead_misses", 0) == before))
                return out
            kv.decode = recording
        result = greedy_generate(model, cache, GenerationRequest(prompt(400), NEW_TOKENS))
    assert len(decisions) == result.counters["lookahead_searches"] == 2 * (NEW_TOKENS - 1)
    assert all(hit == (low >= 0.9) for low, hit in decisions)
    assert result.counters.get("lookahead_misses", 0) == sum(not hit for _, hit in decisions)


def test_head_cosines_are_the_direct_computation():
    rng = np.random.default_rng(0)
    speculative, exact = rng.standard_normal((6, 16)).astype(np.float32), rng.standard_normal((6, 16)).astype(
        np.float32)
    exact[1] = 3 * speculative[1]  # parallel: 1
    exact[2] = -speculative[2]  # opposite: -1
    speculative[4] = exact[4] = 0  # both zero: the same (no query at all)
    speculative[5] = 0  # one zero: nothing in common
    wide = speculative.astype(np.float64), exact.astype(np.float64)
    direct = [float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))) if np.linalg.norm(a) and
              np.linalg.norm(b) else None for a, b in zip(*wide)]
    cosines = lookahead_module.head_cosines(speculative, exact)
    np.testing.assert_allclose(cosines[[0, 1, 2, 3]], [direct[0], 1.0, -1.0, direct[3]], rtol=1e-12)
    assert cosines[4] == 1.0 and cosines[5] == 0.0
    assert lookahead_module.is_hit(speculative, exact, -1.0)
    assert not lookahead_module.is_hit(speculative, exact, -0.99)  # head 2 is below


def test_the_selection_meter_measures_a_run_that_looks_ahead(tiny):
    model, _, info = tiny
    with HarnessCache(icecache(info), measure_selection=True) as cache:
        result = greedy_generate(model, cache, GenerationRequest(prompt(400), 8))
    assert result.counters["lookahead_searches"] == 2 * 7
    summary = result.selection
    assert summary["layers"] == [2, 3] and summary["steps"] == 7
    assert all(0.0 < mass <= oracle + 1e-6 for mass, oracle in zip(summary["mass"], summary["oracle_mass"]))


@pytest.mark.parametrize("value", [1.5, -1.01])
def test_a_cosine_bar_outside_minus_one_to_one_is_one_config_error(tiny, value):
    _, _, info = tiny
    with pytest.raises(ConfigError, match=rf"lookahead_min_cosine={value} is a cosine: use a value in \[-1, 1\]"):
        icecache(info, lookahead_min_cosine=value)


def test_the_token_store_is_left_alone_while_a_look_ahead_may_write_it(tiny, monkeypatch):
    """Between a look-ahead's start and its step, the job offloads the due window page into the token store (and the
    index) on the search thread: the model's thread must not read or grow the store then. Every reservation of a
    layer that looks ahead comes while no job of it is pending, and the step still finds room for the job's page."""
    from icecache.method.stores import TokenStore

    model, _, info = tiny
    reserve = TokenStore.reserve
    calls = []

    def watched(store, n_tokens):
        native = getattr(store, "_native", None)
        calls.append(native is not None and native.lookahead_pending)
        return reserve(store, n_tokens)

    monkeypatch.setattr(TokenStore, "reserve", watched)
    with HarnessCache(icecache(info, lookahead_min_cosine=-1.0)) as cache:
        result = greedy_generate(model, cache, GenerationRequest(prompt(400), NEW_TOKENS))
    assert result.counters["lookahead_searches"] == 2 * (NEW_TOKENS - 1)
    assert len(calls) >= 2 * (NEW_TOKENS - 1)  # each owner reserves at each of its look-aheads' starts
    assert not any(calls)
