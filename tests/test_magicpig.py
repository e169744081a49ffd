"""MagicPIG's rules against direct computations: SimHash codes, the collision counts of the hash tables, the
sampling rule (two collisions), the estimator's weights, the thinning to the budget and the exact mode; on a CUDA
host the GPU path against the CPU path."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from baselines.magicpig import (
    WEIGHT_FLOOR,
    HashTables,
    collision_counts_reference,
    hash_projections,
    sampling_probability,
    simhash_codes,
)
from eval.plugins import build_method
from icecache.core.kernels import _magicpig_host
from icecache.core.method import ModelInfo, SequenceContext
from icecache.errors import ConfigError
from tests.magicpig_reference import ReferenceHostStep, thinning_draws

INFO = ModelInfo(n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16)
SCALING = 16**-0.5


def test_simhash_codes_are_the_signs_of_each_tables_projections():
    projections = hash_projections(16, K=5, L=7, seed=3)
    vectors = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    codes = simhash_codes(vectors, projections, K=5)
    for i in range(6):
        for table in range(7):
            bits = [(vectors[i] @ projections[:, table * 5 + j]).item() > 0 for j in range(5)]
            assert codes[i, table] == sum(1 << j for j, bit in enumerate(bits) if bit)
    torch.testing.assert_close(simhash_codes(3.0 * vectors, projections, K=5), codes)  # a direction's bucket


@pytest.mark.parametrize("n_positions", [64, 40, 0, 70])
@pytest.mark.parametrize("K", [3, 8])  # 8 buckets for 60 keys (none empty), 256 (most empty)
def test_hash_tables_count_what_a_direct_comparison_counts(n_positions, K):
    gen = torch.Generator().manual_seed(1)
    key_codes = torch.randint(0, 2**K, (2, 60, 9), generator=gen, dtype=torch.int32)  # L=9 tables
    query_codes = torch.randint(0, 2**K, (4, 9), generator=gen, dtype=torch.int32)
    tables = HashTables(key_codes, first_position=4, K=K)  # positions 4..63
    counts = tables.counts(query_codes, group=2, n_positions=n_positions)
    expected = torch.zeros(4, 70, dtype=torch.int64)
    expected[:, 4:64] = collision_counts_reference(query_codes, key_codes, group=2)
    assert counts.dtype == torch.int64 and torch.equal(counts, expected[:, :n_positions])


def test_hash_tables_count_nothing_for_a_query_in_empty_buckets():
    key_codes = torch.zeros(1, 10, 4, dtype=torch.int32)  # every key in bucket 0 of every table
    tables = HashTables(key_codes, first_position=0, K=2)
    query_codes = torch.tensor([[1, 2, 3, 1], [0, 0, 1, 1]], dtype=torch.int32)
    counts = tables.counts(query_codes, group=2, n_positions=10)
    assert torch.equal(counts, torch.stack([torch.zeros(10), torch.full((10,), 2.0)]).long())


def test_sampling_probability_is_the_chance_of_two_collisions_in_L_tables():
    cos_angle = torch.tensor([0.9, 0.5, 0.0, -0.3])
    for K, L in ((10, 150), (11, 300), (3, 6)):
        p = (1 - torch.arccos(cos_angle) / math.pi) ** K
        at_least_two = [sum(math.comb(L, j) * pj**j * (1 - pj) ** (L - j) for j in range(2, L + 1))
                        for pj in p.double().tolist()]
        torch.testing.assert_close(sampling_probability(cos_angle, K, L).double(), torch.tensor(at_least_two,
                                   dtype=torch.float64), atol=1e-6, rtol=1e-4)


def test_sampling_probability_matches_the_frequency_over_random_hash_functions():
    """Draw 3000 sets of hash functions (K=3, L=6): a key at angle theta to the query collides in >= 2 tables as
    often as the formula says (within 4 standard deviations)."""
    gen = torch.Generator().manual_seed(2)
    query, other = torch.randn(2, 16, generator=gen)
    key = 0.7 * query / query.norm() + 0.5 * other / other.norm()
    cos_angle = (query @ key) / (query.norm() * key.norm())
    trials, hits = 3000, 0
    for seed in range(trials):
        projections = hash_projections(16, K=3, L=6, seed=seed)
        same = simhash_codes(query[None], projections, 3) == simhash_codes(key[None], projections, 3)
        hits += int(same.sum() >= 2)
    expected = float(sampling_probability(cos_angle, 3, 6))
    assert abs(hits / trials - expected) < 4 * math.sqrt(expected * (1 - expected) / trials)


def layer_after_prompt(gen, n_prompt=200, budget=64, device="cpu", announced=None, trace_width=None,
                       dtype=torch.float32, **settings):
    values = {"name": "magicpig", "budget": budget, "n_local_tokens": 16, "n_dense_layers": 0, **settings}
    info = dataclasses.replace(INFO, device=torch.device(device))
    seq = SequenceContext(trace_selection=True, max_total_tokens=announced, trace_width=trace_width)
    layer = build_method(values, info).make_layer(0, seq)
    keys = torch.randn(1, 2, n_prompt, 16, generator=gen).to(dtype)
    values_ = torch.randn(1, 2, n_prompt, 16, generator=gen).to(dtype)
    layer.forward(torch.randn(1, 4, n_prompt, 16, generator=gen).to(device, dtype), keys.to(device),
                  values_.to(device), None, SCALING)
    return layer, keys[0], values_[0]


def step(layer, gen, device="cpu", dtype=torch.float32):
    query, key, value = (torch.randn(1, 4, 1, 16, generator=gen).to(dtype),
                         torch.randn(1, 2, 1, 16, generator=gen).to(dtype),
                         torch.randn(1, 2, 1, 16, generator=gen).to(dtype))
    out = layer.forward(query.to(device), key.to(device), value.to(device), None, SCALING)
    return query[0, :, 0], key[0, :, 0], value[0, :, 0], out[0, 0]


def test_a_step_samples_the_two_collision_keys_with_importance_weights():
    """Uncapped: the sampled middle tokens are exactly those sharing the query's bucket in >= 2 of the L tables
    (codes of keys centred by the mean middle key), each with log-weight -log(u + 1e-4)."""
    gen = torch.Generator().manual_seed(3)
    layer, keys, _ = layer_after_prompt(gen, capped=False, K=6, L=20)
    query, key, _, _ = step(layer, gen)
    mean_key = keys[:, 4:184].mean(dim=1)  # the middle after the prompt: after 4 sinks, before the 16-token window
    projections = hash_projections(16, 6, 20, seed=0)
    all_keys = torch.cat([keys, key[:, None]], dim=1)
    key_codes = simhash_codes(all_keys - mean_key[:, None], projections, 6)
    counts = collision_counts_reference(simhash_codes(query, projections, 6), key_codes, group=2)
    positions, valid, log_weights = layer.last_sample()
    kv = torch.arange(4) // 2
    for head in range(4):
        sampled = positions[head][valid[head]]
        expected = [t for t in range(4, 185) if counts[head, t] >= 2]  # the middle at position 200: [4, 185)
        assert sorted(sampled.tolist()) == expected
        centred = all_keys[kv[head], sampled] - mean_key[kv[head]]
        cos_angle = centred @ query[head] / (centred.norm(dim=-1) * query[head].norm())
        expected_weights = -torch.log(sampling_probability(cos_angle, 6, 20) + WEIGHT_FLOOR)
        torch.testing.assert_close(log_weights[head][valid[head]], expected_weights, atol=1e-5, rtol=1e-5)
    assert (layer.last_log_weights[layer.last_attended] != 0).any()


def test_a_head_sampling_more_than_the_budget_keeps_a_random_subset_with_reweighted_keys():
    """K=1: nearly every key collides in two tables, so every head samples far more than the 44 slots left by 4
    sinks and 16 window tokens at budget 64: it keeps 44 of its candidates, those of the smallest thinning draws
    (a hash of seed, layer, position and token), and their weights grow by candidates / 44."""
    gen = torch.Generator().manual_seed(4)
    layer, _, _ = layer_after_prompt(gen, K=1, L=8)
    reference = ReferenceHostStep(layer)
    query, _, _, _ = step(layer, gen)
    positions, valid, log_weights = layer.last_sample()
    assert valid.all() and positions.shape == (4, 44)
    assert int(layer.last_attended.sum(-1).max()) <= 64
    codes = simhash_codes(query, layer.projections, 1)
    reference.step({name: tensor.clone() for name, tensor in layer.exchange.host_in.items()}, SCALING)
    # The same step uncapped: every candidate and its own weight.
    all_positions, all_valid, all_weights = reference.sample(query, codes, 200, capped=False)
    draws = thinning_draws(0, 0, 200, 200)
    for head in range(4):
        candidates = dict(zip(all_positions[head][all_valid[head]].tolist(), all_weights[head][all_valid[head]]))
        assert len(candidates) > 44 and set(positions[head].tolist()) <= set(candidates)
        by_draw = sorted(candidates, key=lambda t: (float(draws[t]), t))
        assert sorted(positions[head].tolist()) == sorted(by_draw[:44])
        kept = torch.stack([candidates[t] for t in positions[head].tolist()])
        torch.testing.assert_close(log_weights[head], kept + math.log(len(candidates) / 44))
    # The thinning draw depends on (seed, layer, position) only: a second layer's step samples the same tokens.
    gen = torch.Generator().manual_seed(4)
    again, _, _ = layer_after_prompt(gen, K=1, L=8)
    step(again, gen)
    assert all(torch.equal(a, b) for a, b in zip(again.last_sample(), (positions, valid, log_weights)))


def test_the_thinning_draws_of_the_host_step_are_the_reference_hash():
    """The C++ draw (splitmix64 of seed, layer, position, token, the top 53 bits over 2^53) and its Python mirror
    agree to the bit, and look uniform."""
    for seed, layer, position in ((0, 0, 200), (7, 31, 131071), (-1, 2, 5)):
        native = torch.from_numpy(_magicpig_host.thinning_draws(seed, layer, position, 5000))
        assert torch.equal(native, thinning_draws(seed, layer, position, 5000))
        assert 0.0 <= float(native.min()) and float(native.max()) < 1.0 and abs(float(native.mean()) - 0.5) < 0.02
    assert not torch.equal(thinning_draws(0, 0, 200, 100), thinning_draws(0, 0, 201, 100))
    assert not torch.equal(thinning_draws(0, 0, 200, 100), thinning_draws(0, 1, 200, 100))


def test_while_the_middle_fits_the_budget_attention_is_exact():
    gen = torch.Generator().manual_seed(5)
    layer, keys, values = layer_after_prompt(gen, n_prompt=50, budget=128)  # middle 31 + 1 per step <= 108
    all_keys, all_values = keys, values
    for _ in range(4):
        query, key, value, out = step(layer, gen)
        all_keys = torch.cat([all_keys, key[:, None]], dim=1)
        all_values = torch.cat([all_values, value[:, None]], dim=1)
        q = query.view(2, 2, 16)
        probs = torch.softmax(torch.einsum("hgd,htd->hgt", q, all_keys) * SCALING, dim=-1)
        expected = torch.einsum("hgt,htd->hgd", probs, all_values).reshape(4, 16)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        assert layer.last_attended.all() and not layer.last_log_weights.any()


def test_a_store_grown_past_its_first_capacity_gives_what_a_store_sized_once_gives():
    runs = []
    for announced in (None, 280):  # unannounced: room for 256 tokens, grown at the sixth step
        gen = torch.Generator().manual_seed(7)
        layer, _, _ = layer_after_prompt(gen, n_prompt=250, announced=announced)
        runs.append([(step(layer, gen)[-1], layer.last_attended.clone()) for _ in range(20)])
        assert layer.store_keys.shape[1] >= 270
    for (out_grown, attended_grown), (out_sized, attended_sized) in zip(*runs):
        assert torch.equal(attended_grown, attended_sized)
        torch.testing.assert_close(out_grown, out_sized, atol=1e-6, rtol=1e-6)


def test_the_trace_the_host_step_writes_is_the_one_made_from_the_device_ring_and_the_sample():
    """With a fixed trace width (a generation's) the host step writes the trace and log-weights into the buffers
    it sends the device, so that a captured step carries each replay's own; they equal the trace made after the
    step from the device's ring and the host's sample (a width the sequence does not fix)."""
    runs = []
    for width in (None, 300):
        gen = torch.Generator().manual_seed(11)
        layer, _, _ = layer_after_prompt(gen, n_prompt=250, announced=300, trace_width=width)
        assert ("attended" in layer.exchange.device_out) == (width is not None)
        runs.append([(step(layer, gen)[-1], layer.last_attended.clone(), layer.last_log_weights.clone(),
                      layer.seq_len) for _ in range(20)])
    for (out_made, attended_made, weights_made, n), (out_host, attended_host, weights_host, _) in zip(*runs):
        assert attended_made.shape[1] == n and attended_host.shape[1] == 300
        assert not attended_host[:, n:].any() and not weights_host[:, n:].any()
        assert torch.equal(attended_host[:, :n], attended_made)
        assert torch.equal(weights_host[:, :n], weights_made)
        assert torch.equal(out_host, out_made)
    assert any(not attended.all() for _, attended, _, _ in runs[0])  # the sample left tokens out


# (name, prompt tokens, decode steps, settings): each runs the C++ host step beside the torch reference.
REFERENCE_CASES = [
    # the middle fits the cap for 28 steps (exact, weight 0), then the LSH sample takes over
    ("exact_then_sampled", 100, 40, {"budget": 128, "K": 4, "L": 12}),
    # K=2: most keys collide twice, every head samples more than the cap and keeps a random 44
    ("capped", 300, 30, {"K": 2, "L": 8}),
    ("uncapped", 300, 30, {"K": 5, "L": 20, "capped": False}),
    # a short prompt: the middle is empty for the first steps, then made of tokens generated after the prompt
    ("after_the_prompt", 30, 90, {"K": 3, "L": 10}),
    # a prompt shorter than the sinks: no hash tables, every middle token comes after the prompt
    ("no_tables", 3, 90, {"K": 3, "L": 10}),
    # a fixed trace width: the host step writes the trace and its log-weights
    ("trace_width", 250, 30, {"K": 4, "L": 12, "announced": 300, "trace_width": 300}),
    # stores of the model's dtype: rows widened per row where they are read
    ("bfloat16", 300, 30, {"K": 3, "L": 10, "dtype": torch.bfloat16}),
    ("float16", 300, 30, {"K": 3, "L": 10, "dtype": torch.float16}),
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=[case[0] for case in REFERENCE_CASES])
def test_the_native_host_step_computes_what_the_torch_reference_computes(case):
    """Step by step, the C++ host step (what the GPU path runs too) against the torch step it replaced
    (tests/magicpig_reference.py) on the same inputs: the same sampled tokens per head, log-weights, outputs and
    log-sum-exps within float32 tolerance (the two sum in different orders), the same store afterwards."""
    name, n_prompt, n_steps, settings = case
    settings = dict(settings)
    dtype = settings.pop("dtype", torch.float32)
    gen = torch.Generator().manual_seed(20)
    layer, _, _ = layer_after_prompt(gen, n_prompt=n_prompt, dtype=dtype, **settings)
    reference = ReferenceHostStep(layer)
    sampled_steps = capped_steps = 0
    for _ in range(n_steps):
        step(layer, gen, dtype=dtype)
        position = layer.seq_len - 1
        inputs = {key: tensor.clone() for key, tensor in layer.exchange.host_in.items()}
        expected = reference.step(inputs, SCALING)
        positions, valid, log_weights = layer.last_sample()
        assert [set(positions[h][valid[h]].tolist()) for h in range(4)] == expected.sampled_sets()
        for head in range(4):
            mine = dict(zip(positions[head][valid[head]].tolist(), log_weights[head][valid[head]].tolist()))
            theirs = dict(zip(expected.positions[head][expected.valid[head]].tolist(),
                              expected.log_weights[head][expected.valid[head]].tolist()))
            keys = sorted(theirs)
            torch.testing.assert_close(torch.tensor([mine[t] for t in keys]), torch.tensor([theirs[t] for t in keys]),
                                       atol=1e-5, rtol=1e-4)
        host = layer.exchange.host_out
        torch.testing.assert_close(host["out"], expected.out, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(host["lse"], expected.lse, atol=1e-5, rtol=1e-4)
        sampled_steps += position + 1 - 16 - 4 > layer.cap  # the middle outgrew the cap
        _, candidates, _ = reference.sample(inputs["query"], inputs["query_codes"], position, capped=False)
        capped_steps += int(candidates.sum(-1).max()) > layer.cap  # some head sampled more than the cap
        if "trace_width" in settings:
            width = settings["trace_width"]
            attended = torch.zeros(4, width, dtype=torch.bool)
            attended[:, :4] = True
            attended[:, max(4, position + 1 - 16) : position + 1] = True
            weights = torch.zeros(4, width)
            for head in range(4):
                picked = expected.positions[head][expected.valid[head]]
                attended[head, picked] = True
                weights[head, picked] = expected.log_weights[head][expected.valid[head]]
            assert torch.equal(host["attended"], attended)
            torch.testing.assert_close(host["log_weights"], weights, atol=1e-5, rtol=1e-4)
    end = layer.seq_len
    assert torch.equal(layer.store_keys[:, :end], reference.store_keys[:, :end])
    assert torch.equal(layer.store_values[:, :end], reference.store_values[:, :end])
    assert torch.equal(layer.tail_codes[:, : end - layer.prompt_len], reference.tail_codes[:, : end - layer.prompt_len])
    torch.testing.assert_close(layer.store_norms[:, :end], reference.store_norms[:, :end], atol=1e-6, rtol=1e-6)
    assert sampled_steps > 0
    if name == "capped":
        assert capped_steps == n_steps
    if name in ("uncapped", "trace_width", "bfloat16"):
        assert capped_steps > 0  # uncapped: every candidate attended; capped: thinned
    if name == "exact_then_sampled":
        assert 0 < sampled_steps < n_steps


def test_the_host_step_gives_the_same_bits_with_any_thread_count():
    """Each query head is computed by one thread in a fixed order, so the step's results do not depend on how many
    threads share the heads (the H200 host runs 16, the tests' machine fewer)."""
    runs = []
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 3):
            torch.set_num_threads(n_threads)
            gen = torch.Generator().manual_seed(9)
            layer, _, _ = layer_after_prompt(gen, n_prompt=300, K=3, L=10)
            assert layer.native.threads == n_threads
            runs.append([(step(layer, gen)[-1], layer.last_attended.clone(), layer.last_log_weights.clone())
                         for _ in range(10)])
    finally:
        torch.set_num_threads(threads)
    for one, several in zip(*runs):
        assert all(torch.equal(a, b) for a, b in zip(one, several))


def test_a_host_step_past_the_store_keeps_its_error_and_the_layer_raises_it():
    """The C++ step never throws through the hand-off: a position past the store (which only Python grows, between
    steps) is kept as the step's error, later steps do nothing, and the layer raises it after the step."""
    gen = torch.Generator().manual_seed(8)
    layer, _, _ = layer_after_prompt(gen, n_prompt=250, announced=260)
    step(layer, gen)
    layer.exchange.host_in["position"].fill_(layer.store_keys.shape[1])
    layer.exchange.run_native(*layer.native.step_entry())
    with pytest.raises(RuntimeError, match="must grow between decode steps"):
        layer._after_native_step()
    with pytest.raises(RuntimeError, match="layer 0"):
        step(layer, gen)


def test_settings_that_cannot_work_are_refused_and_a_small_budget_shrinks_the_window():
    for values, message in (({"K": 0}, "K=0"), ({"L": 1}, "L=1"), ({"n_local_tokens": 0}, "n_local_tokens=0"),
                            ({"budget": 5}, "budget=5")):
        with pytest.raises(ConfigError, match=message):
            build_method({"name": "magicpig", "budget": 256, **values}, INFO)
    windows = {budget: build_method({"name": "magicpig", "budget": budget}, INFO).config.n_local_tokens
               for budget in (6, 64, 68, 69, 128, 256)}
    # The public code's 64 where it leaves a slot to sample; else a quarter of what the 4 sinks leave.
    assert windows == {6: 1, 64: 15, 68: 16, 69: 64, 128: 64, 256: 64}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("slow_hashing", [False, True])
def test_gpu_path_samples_and_computes_what_the_cpu_path_does(monkeypatch, slow_hashing):
    """float32 on both: the device hashes the query and the new key, the host samples and attends; the same
    samples and weights as the CPU path, outputs within float tolerance, while the window turns. The prompt is
    hashed on a side stream, not the model's; held there by a long kernel, its tables still reach the host before
    the first step reads them."""
    import baselines.magicpig as magicpig

    hashed_on = []

    def hashing(vectors, projections, K):
        if vectors.is_cuda and vectors.dim() == 3:  # a block of the prompt, not a step's query or key
            hashed_on.append(torch.cuda.current_stream(vectors.device))
            if slow_hashing:
                torch.cuda._sleep(500_000_000)
        return simhash_codes(vectors, projections, K)

    monkeypatch.setattr(magicpig, "simhash_codes", hashing)
    runs = {}
    for device in ("cpu", "cuda"):
        gen = torch.Generator().manual_seed(6)
        layer, _, _ = layer_after_prompt(gen, n_prompt=300, device=device)
        runs[device] = []
        for _ in range(20):
            *_, out = step(layer, gen, device)
            runs[device].append((out.cpu(), layer.last_attended.cpu(), layer.last_log_weights.cpu()))
    assert hashed_on and all(stream != torch.cuda.default_stream() for stream in hashed_on)
    for (out_cpu, att_cpu, w_cpu), (out_gpu, att_gpu, w_gpu) in zip(runs["cpu"], runs["cuda"]):
        assert torch.equal(att_cpu, att_gpu)
        torch.testing.assert_close(w_gpu, w_cpu, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out_gpu, out_cpu, atol=1e-4, rtol=1e-4)
