"""ShadowKV's rules against direct computations: the inverse RoPE that recovers pre-RoPE keys, the SVD rebuild,
landmark scores, outlier chunks and the chunks a decode step chooses and loads; on a CUDA host the GPU path
against the CPU path."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from baselines.shadowkv import (
    BASIS_SOLVERS,
    ShadowKVConfig,
    chunk_landmarks,
    chunk_split,
    key_basis,
    outlier_chunks,
)
from eval.plugins import build_method
from icecache.core.cache import HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate
from icecache.core.kernels.shadowkv_step import key_coefficients, landmark_scores, rebuild_keys
from icecache.core.method import ModelInfo, SequenceContext
from icecache.core.rope import Rotary
from icecache.errors import ConfigError
from tests.conftest import ARCHITECTURES, load_script, tiny_model

CS = 8  # chunk size
ROTARY = Rotary(inv_freq=tuple(float(f) for f in 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))))
INFO = ModelInfo(n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, rotary=ROTARY)
SCALING = 16**-0.5


# ------------------------------------------------------------------------------------------------------------- RoPE
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_inverse_rope_recovers_the_keys_the_model_projected(arch):
    """The keys a layer receives are the model's k_proj (and Qwen3's k_norm) output after its RoPE; inverting RoPE
    with ModelInfo.rotary gives back that output, and applying it again gives the layer's keys."""
    model, _, info = tiny_model(arch)
    attention = model.model.layers[2].self_attn
    projected, received = [], []
    source = attention.k_norm if arch == "qwen3" else attention.k_proj
    hook = source.register_forward_hook(lambda module, args, out: projected.append(out))
    cache = HarnessCache(build_method({"name": "full"}, info))
    layer = cache.layer_kvs[2]
    forward = layer.forward
    layer.forward = lambda q, k, v, mask, scaling: (received.append(k), forward(q, k, v, mask, scaling))[1]
    try:
        ids = torch.randint(0, 500, (1, 40), generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=cache, use_cache=True)
    finally:
        hook.remove()
    n_kv_heads, head_dim = info.n_kv_heads, info.head_dim
    pre = projected[0].view(1, 40, n_kv_heads, head_dim).transpose(1, 2)[0]
    post = received[0][0]
    positions = torch.arange(40)
    torch.testing.assert_close(info.rotary.invert(post, positions), pre, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(info.rotary.apply(pre, positions), post, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(post, pre, atol=1e-3)  # RoPE did turn the keys


def test_scaled_llama3_rope_is_read_from_the_config_and_length_dependent_rope_is_refused():
    config = AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 64})
    rotary = Rotary.from_config(config)
    reference = LlamaRotaryEmbedding(config)
    assert rotary.rope_type == "llama3"
    assert torch.equal(rotary.frequencies("cpu"), reference.inv_freq.float())
    positions = torch.arange(300)[None]
    x = torch.randn(1, 2, 300, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = reference(x, positions)
    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(rotary.apply(x, positions[0]), expected, atol=1e-5, rtol=1e-5)

    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    dynamic = ModelInfo(n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, rotary=Rotary.from_config(config))
    assert not dynamic.rotary.supported
    with pytest.raises(ConfigError, match="dynamic"):
        build_method({"name": "shadowkv", "budget": 256}, dynamic)


# ------------------------------------------------------------------------------------------------ the definitions
def test_rebuild_is_the_best_rank_r_approximation_of_all_heads_keys_together():
    gen = torch.Generator().manual_seed(1)
    # Nearly low-rank keys, as pre-RoPE keys are: rank 6 plus noise, over 2 heads of 16 channels.
    keys = (torch.randn(200, 6, generator=gen) @ torch.randn(6, 32, generator=gen)).view(200, 2, 16).transpose(0, 1)
    keys = keys + 0.01 * torch.randn(keys.shape, generator=gen)
    basis = key_basis(keys, rank=6)
    rebuilt = rebuild_keys(key_coefficients(keys, basis), basis, n_kv_heads=2)
    u, s, vh = torch.linalg.svd(keys.transpose(0, 1).reshape(200, 32).double(), full_matrices=False)
    best = (u[:, :6] * s[:6] @ vh[:6]).view(200, 2, 16).transpose(0, 1)
    torch.testing.assert_close(rebuilt.double(), best, atol=1e-4, rtol=1e-4)
    assert (rebuilt - keys).norm() / keys.norm() < 0.01
    # A rank that covers every channel: the identity, the keys themselves.
    basis = key_basis(keys, rank=160)
    assert torch.equal(rebuild_keys(key_coefficients(keys, basis), basis, 2), keys)


@pytest.mark.parametrize("n_tokens, rank", [(200, 6), (300, 12), (10, 20)])
def test_the_gram_solver_finds_the_svds_subspace(n_tokens, rank):
    """The eigenvectors of the float64 Gram matrix span what the SVD's top right singular vectors span (the
    projectors agree to float32 rounding), also when the prompt has fewer tokens than the rank; both are
    orthonormal, and both are the identity when the rank covers every channel. Blocks of 64 rows sum the Gram."""
    gen = torch.Generator().manual_seed(n_tokens)
    spectrum = torch.logspace(1, -3, 32)  # distinct singular values: the top-r subspace is well defined
    mixing = torch.linalg.qr(torch.randn(32, 32, generator=gen)).Q
    matrix = (torch.randn(n_tokens, 32, generator=gen) * spectrum) @ mixing
    keys = matrix.view(n_tokens, 2, 16).transpose(0, 1)
    by_svd = key_basis(keys, rank, "svd")
    by_gram = BASIS_SOLVERS["gram"](matrix, min(rank, n_tokens), rows_per_block=64)
    assert by_svd.shape == by_gram.shape == (min(rank, n_tokens), 32)
    torch.testing.assert_close(key_basis(keys, rank, "gram"), by_gram)
    for basis in (by_svd, by_gram):
        torch.testing.assert_close(basis @ basis.T, torch.eye(basis.shape[0]), atol=1e-5, rtol=0)
    if n_tokens > rank:
        torch.testing.assert_close(by_gram.T @ by_gram, by_svd.T @ by_svd, atol=1e-4, rtol=0)
    for solver in BASIS_SOLVERS:
        assert torch.equal(key_basis(keys, 32, solver), torch.eye(32))


def test_an_unknown_basis_solver_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"basis_solver='qr' must be one of \['gram', 'svd'\]"):
        build_method({"name": "shadowkv", "budget": 64, "basis_solver": "qr"}, INFO)


def test_unknown_score_products_are_refused_with_the_known_ones_and_a_known_one_reaches_the_step_plan():
    with pytest.raises(ConfigError, match=r"score_products='wmma' must be one of \['dot', 'dot_16bit', 'fma'\]"):
        build_method({"name": "shadowkv", "budget": 64, "score_products": "wmma"}, INFO)
    values = {"name": "shadowkv", "budget": 64, "rank": 4, "n_local_chunks": 2, "n_dense_layers": 0,
              "score_products": "fma"}
    layer = build_method(values, INFO).make_layer(0, SequenceContext())
    gen = torch.Generator().manual_seed(3)
    layer.forward(torch.randn(1, 4, 100, 16, generator=gen), torch.randn(1, 2, 100, 16, generator=gen),
                  torch.randn(1, 2, 100, 16, generator=gen), None, SCALING)
    assert layer._step_plan.score_launch.products == "fma"


def test_a_layer_built_with_the_gram_solver_chooses_what_the_svd_one_does():
    """Rank 4 of 32 over random keys: the two solvers' bases differ by rounding and by each vector's sign, which
    the rebuilt keys do not see: the same chunks resident and attended, outputs within float tolerance."""
    runs = {}
    for solver in BASIS_SOLVERS:
        gen = torch.Generator().manual_seed(11)
        values = {"name": "shadowkv", "budget": 64, "rank": 4, "n_local_chunks": 2, "n_dense_layers": 0,
                  "basis_solver": solver}
        layer = build_method(values, INFO).make_layer(0, SequenceContext(trace_selection=True))
        layer.forward(torch.randn(1, 4, 300, 16, generator=gen), torch.randn(1, 2, 300, 16, generator=gen),
                      torch.randn(1, 2, 300, 16, generator=gen), None, SCALING)
        steps = []
        for _ in range(12):
            q, k, v = (torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen),
                       torch.randn(1, 2, 1, 16, generator=gen))
            steps.append((layer.forward(q, k, v, None, SCALING), layer.last_attended.clone()))
        runs[solver] = steps
    for (out_svd, att_svd), (out_gram, att_gram) in zip(runs["svd"], runs["gram"]):
        assert torch.equal(att_svd, att_gram)
        torch.testing.assert_close(out_gram, out_svd, atol=1e-5, rtol=1e-5)


def test_landmarks_outliers_and_scores_by_their_definitions():
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 10 * CS, 16, generator=gen)
    keys[1, 3 * CS] *= -4  # chunk 3 of head 1: one key against the others
    landmarks = chunk_landmarks(keys, CS)
    for head in range(2):
        for chunk in range(10):
            torch.testing.assert_close(landmarks[head, chunk], keys[head, chunk * CS : (chunk + 1) * CS].mean(0))
    worst = torch.tensor([[min(torch.nn.functional.cosine_similarity(landmarks[h, c], keys[h, c * CS + i], dim=0)
                               for i in range(CS)) for c in range(10)] for h in range(2)])
    outliers = outlier_chunks(keys, CS, 3)
    for head in range(2):
        assert set(outliers[head].tolist()) == set(worst[head].argsort()[:3].tolist())
    assert 3 in outliers[1].tolist()

    query = torch.randn(4, 16, generator=gen)
    candidates = torch.ones(2, 10, dtype=torch.bool)
    candidates[0, 7:] = False
    scores = landmark_scores(query, landmarks, candidates, SCALING)
    for head in range(2):
        best = torch.zeros(10)
        for q in query[2 * head : 2 * head + 2]:  # the KV head's query heads
            logits = torch.tensor([q @ landmarks[head, c] * SCALING if candidates[head, c] else -math.inf
                                   for c in range(10)])
            best = torch.maximum(best, torch.softmax(logits, 0))
        torch.testing.assert_close(scores[head], best)


def test_budget_split_follows_the_papers_llama31_setting():
    assert chunk_split(ShadowKVConfig(budget=8 * (4 + 48 + 256))) == (4, 48, 256)  # 2048-token sparse budget
    assert chunk_split(ShadowKVConfig(budget=256)) == (4, 4, 24)
    assert chunk_split(ShadowKVConfig(budget=256, n_outlier_chunks=0)) == (4, 0, 28)
    with pytest.raises(ConfigError, match="multiple of chunk_size"):
        build_method({"name": "shadowkv", "budget": 252}, INFO)


# ------------------------------------------------------------------------------------------------------ the layer
def sparse_layer(gen, n_prompt=160, budget=64, rank=4, device="cpu", info=INFO, announced=None, solver="svd"):
    values = {"name": "shadowkv", "budget": budget, "rank": rank, "n_local_chunks": 2, "n_dense_layers": 0,
              "basis_solver": solver}
    info = dataclasses.replace(info, device=torch.device(device))
    seq = SequenceContext(trace_selection=True, max_total_tokens=announced)
    layer = build_method(values, info).make_layer(0, seq)
    keys = torch.randn(1, 2, n_prompt, 16, generator=gen)
    values_ = torch.randn(1, 2, n_prompt, 16, generator=gen)
    layer.forward(torch.randn(1, 4, n_prompt, 16, generator=gen).to(device), keys.to(device), values_.to(device),
                  None, SCALING)
    return layer, keys[0], values_[0]


def test_a_step_chooses_each_kv_heads_top_candidate_chunks_and_attends_rebuilt_keys():
    """Budget 64 = 2 window + 1 outlier + 5 selected chunks of 8, rank 4 of 32: the chosen chunks are the top 5 by
    the landmark scores over the candidates (chunks before the window, outliers excluded); the output is the
    softmax over outliers and window (exact keys) and the chosen chunks (keys rebuilt from rank 4, rotated)."""
    gen = torch.Generator().manual_seed(3)
    layer, keys, values = sparse_layer(gen)
    assert layer.sparse and (layer.n_local, layer.n_outlier, layer.n_selected) == (2, 1, 5)
    positions = torch.arange(160)
    pre = ROTARY.invert(keys, positions)
    basis = key_basis(pre, 4)
    rebuilt = ROTARY.apply(rebuild_keys(key_coefficients(pre, basis), basis, 2), positions)
    # After the prompt the window is chunks 18 and 19 and the outlier is chosen among chunks 0..17; at position 160
    # chunk 20 starts and chunk 18 leaves the window: the candidates are chunks 0..18 less the outlier.
    candidates = torch.zeros(2, 20, dtype=torch.bool)
    candidates[:, :19] = True
    outliers = outlier_chunks(keys[:, : 18 * CS], CS, 1)
    candidates.scatter_(1, outliers, False)
    query, key, value = torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen), \
        torch.randn(1, 2, 1, 16, generator=gen)
    out = layer.forward(query, key, value, None, SCALING)

    scores = landmark_scores(query[0, :, 0], chunk_landmarks(keys[:, : 20 * CS], CS), candidates, SCALING)
    chosen = scores.topk(5, dim=-1).indices
    held = layer.slot_chunk[:, :5]
    for head in range(2):
        assert set(held[head].tolist()) == set(chosen[head].tolist())
    assert layer.seq.counters.as_dict()["pages_loaded"] == 10  # 5 chunks for each KV head, none resident before

    all_keys = torch.cat([keys, key[0, :, :, :]], dim=1)
    all_values = torch.cat([values, value[0]], dim=1)
    used = all_keys.clone()
    attended = torch.zeros(2, 161, dtype=torch.bool)
    attended[:, 19 * CS :] = True  # the window
    for head in range(2):
        for chunk in outliers[head].tolist():
            attended[head, chunk * CS : (chunk + 1) * CS] = True
        for chunk in chosen[head].tolist():
            span = slice(chunk * CS, (chunk + 1) * CS)
            attended[head, span] = True
            used[head, span] = rebuilt[head, span]
    assert torch.equal(layer.last_attended, attended.repeat_interleave(2, dim=0))
    q = query[0, :, 0].view(2, 2, 16)
    logits = torch.einsum("hgd,htd->hgt", q, used) * SCALING
    probs = torch.softmax(logits.masked_fill(~attended[:, None], -math.inf), dim=-1)
    expected = torch.einsum("hgt,htd->hgd", probs, all_values).reshape(4, 16)
    torch.testing.assert_close(out[0, 0], expected, atol=1e-5, rtol=1e-5)

    # The same query again: every chosen chunk is resident, nothing is copied.
    layer.forward(query, key, value, None, SCALING)
    assert layer.seq.counters.as_dict()["pages_loaded"] == 10


def test_a_chunk_leaving_the_window_becomes_a_candidate():
    gen = torch.Generator().manual_seed(4)
    layer, keys, values = sparse_layer(gen, n_prompt=160)  # window after the prompt: chunks 18 and 19
    steps = [(torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen),
              torch.randn(1, 2, 1, 16, generator=gen)) for _ in range(9)]
    for query, key, value in steps:  # positions 160..168: at 168 chunk 21 starts and chunk 19 leaves
        layer.forward(query, key, value, None, SCALING)
    chunk19 = keys[:, 19 * CS : 20 * CS]
    torch.testing.assert_close(layer.landmarks[:, 19], chunk19.mean(dim=1))
    torch.testing.assert_close(layer.store_values[19], values[:, 19 * CS : 20 * CS])
    pre = ROTARY.invert(chunk19, torch.arange(19 * CS, 20 * CS))
    torch.testing.assert_close(layer.coefficients[19 * CS : 20 * CS], key_coefficients(pre, layer.basis))
    assert not layer.is_outlier[:, 19].any()
    assert layer.last_attended[:, 20 * CS :].all()  # chunks 20 and 21 are the window now


def test_a_sequence_within_the_budget_is_attended_in_full_and_an_unannounced_one_goes_sparse_when_it_outgrows_it():
    gen = torch.Generator().manual_seed(5)
    layer, _, _ = sparse_layer(gen, n_prompt=40, budget=64)
    assert not layer.sparse
    for step in range(40):
        layer.forward(torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen),
                      torch.randn(1, 2, 1, 16, generator=gen), None, SCALING)
        n_tokens = 41 + step
        assert layer.sparse == (n_tokens > 64)
        if n_tokens <= 64:
            assert layer.last_attended.all() and layer.last_attended.shape == (4, n_tokens)
        else:
            assert int(layer.last_attended.sum(-1).max()) <= 64


def test_storage_grown_past_its_first_capacity_gives_what_storage_sized_once_gives():
    """Unannounced, a 250-token prompt gets room for 256 tokens and grows at the sixth step; the same steps on
    storage sized for the announced length give the same outputs and selections."""
    runs = []
    for announced in (None, 280):
        gen = torch.Generator().manual_seed(8)
        layer, _, _ = sparse_layer(gen, n_prompt=250, announced=announced)
        runs.append([(step_out, layer.last_attended.clone()) for step_out in
                     (layer.forward(torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen),
                                    torch.randn(1, 2, 1, 16, generator=gen), None, SCALING) for _ in range(20))])
        assert layer.n_chunks * CS >= 270
    for (out_grown, attended_grown), (out_sized, attended_sized) in zip(*runs):
        assert torch.equal(attended_grown, attended_sized)
        torch.testing.assert_close(out_grown, out_sized, atol=1e-6, rtol=1e-6)


def test_generation_on_a_tiny_model_keeps_the_budget_with_a_low_rank():
    model, _, info = tiny_model("llama")
    ids = torch.randint(0, 500, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    method = build_method({"name": "shadowkv", "budget": 64, "rank": 8, "n_local_chunks": 2}, info)
    result = greedy_generate(model, HarnessCache(method), GenerationRequest(ids, 12))
    assert 40 < result.counters["mean_attended_tokens"] <= 64
    assert result.counters["pages_loaded"] > 0
    assert result.cpu_kv_bytes > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("solver", sorted(BASIS_SOLVERS))
def test_gpu_path_chooses_and_computes_what_the_cpu_path_does(solver):
    """float32 on both: the same chunks chosen and resident, the same attended positions, outputs within float
    tolerance (the basis solver and the kernels differ in rounding only), over steps that turn the window and
    reload. (The slot table is updated in place, so each step's is cloned: ``.cpu()`` of a CPU tensor is the tensor
    itself.)"""
    layers = {}
    for device in ("cpu", "cuda"):
        gen = torch.Generator().manual_seed(7)
        layers[device] = sparse_layer(gen, n_prompt=300, budget=64, rank=8, device=device, solver=solver)[0]
        outputs = []
        for _ in range(20):
            q, k, v = (torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen),
                       torch.randn(1, 2, 1, 16, generator=gen))
            outputs.append((layers[device].forward(q.to(device), k.to(device), v.to(device), None, SCALING).cpu(),
                            layers[device].last_attended.cpu(), layers[device].slot_chunk.cpu().clone()))
        layers[device] = outputs
    for step, ((out_cpu, att_cpu, held_cpu), (out_gpu, att_gpu, held_gpu)) in enumerate(
            zip(layers["cpu"], layers["cuda"])):
        where = f"step {step}: resident cpu {held_cpu.tolist()} gpu {held_gpu.tolist()}"
        assert torch.equal(att_cpu, att_gpu), f"{where}; attended differ at {(att_cpu != att_gpu).nonzero().tolist()}"
        # The same chunks resident; which slot holds which follows the top-k's order, which CUDA leaves unsorted.
        assert torch.equal(held_cpu.sort(dim=-1).values, held_gpu.sort(dim=-1).values), where
        torch.testing.assert_close(out_gpu, out_cpu, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_slow_value_copy_still_reads_the_chunks_it_was_given():
    """The value copy runs on a side stream while the main stream rebuilds keys. Each step here first puts a long
    sleep on the side stream, so the copy starts only after the main stream has allocated and written the rebuild's
    temporaries: the copy must still move exactly the chunks chosen (the GPU path against the CPU path)."""
    from baselines.shadowkv import ShadowKVSequence

    results = {}
    for device in ("cpu", "cuda"):
        gen = torch.Generator().manual_seed(11)
        layer = sparse_layer(gen, n_prompt=300, budget=64, rank=8, device=device)[0]
        steps = []
        for _ in range(12):
            q, k, v = (torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen),
                       torch.randn(1, 2, 1, 16, generator=gen))
            if device == "cuda":
                shared = layer.seq.state(ShadowKVSequence)
                if shared.copy_stream is None:
                    shared.copy_stream = torch.cuda.Stream()
                with torch.cuda.stream(shared.copy_stream):
                    torch.cuda._sleep(50_000_000)  # ~25 ms of one SM's clock before the copy can start
            out = layer.forward(q.to(device), k.to(device), v.to(device), None, SCALING)
            steps.append((out.cpu(), layer.pool_values.cpu().clone(), layer.slot_chunk.cpu().clone()))
        results[device] = steps
        n_outlier = layer.n_outlier
    for step, ((out_cpu, pool_cpu, held_cpu), (out_gpu, pool_gpu, held_gpu)) in enumerate(
            zip(results["cpu"], results["cuda"])):
        assert torch.equal(held_cpu.sort(dim=-1).values, held_gpu.sort(dim=-1).values), f"step {step}"
        for head in range(held_cpu.shape[0]):  # each resident chunk's values, wherever its slot is
            for chunk in held_cpu[head].tolist():
                if chunk < 0:
                    continue
                slot_cpu = held_cpu[head].tolist().index(chunk)
                slot_gpu = held_gpu[head].tolist().index(chunk)
                assert torch.equal(pool_cpu[n_outlier + slot_cpu, head], pool_gpu[n_outlier + slot_gpu, head]), \
                    f"step {step}: chunk {chunk} of KV head {head}"
        torch.testing.assert_close(out_gpu, out_cpu, atol=1e-4, rtol=1e-4)


def test_the_basis_probe_times_every_solver_and_finds_them_agreeing(tmp_path):
    """scripts/diagnostics/basis_probe.py on the CPU at a small size: one row per solver, the first its own
    reference, the others within float32 rounding of its subspace with the same rebuild error, and a result file;
    an unknown solver is refused in one line before any work."""
    import json

    probe = load_script("diagnostics/basis_probe")
    rows = probe.main(["--tokens", "600", "--kv-heads", "2", "--head-dim", "32", "--rank", "24", "--repeats", "1",
                       "--device", "cpu", "--out", str(tmp_path)])
    assert [row["solver"] for row in rows] == list(BASIS_SOLVERS)
    assert rows[0]["projector_diff_to_first"] == 0.0
    for row in rows[1:]:
        assert row["rank"] == 24 and row["projector_diff_to_first"] < 1e-3
        assert row["rebuild_error"] == pytest.approx(rows[0]["rebuild_error"], rel=1e-4)
    (written,) = tmp_path.glob("basis_probe_*.json")
    assert json.loads(written.read_text())["rows"] == rows
    with pytest.raises(SystemExit, match=r"--solvers qr: not a solver; the solvers are \['gram', 'svd'\]"):
        probe.main(["--tokens", "64", "--solvers", "qr", "--out", str(tmp_path)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_prompt_is_factorised_beside_the_prefill_and_waited_for_by_the_first_step(monkeypatch):
    """On CUDA the prompt's factorisation runs on a worker thread and a side stream: the prefill returns while it is
    still held back (here by the test), and the first decode step waits for it, so the steps are the CPU path's."""
    import threading

    import baselines.shadowkv as shadowkv

    release = threading.Event()
    ran_on = []

    def held_basis(pre_rope_keys, rank, solver="svd"):
        if pre_rope_keys.is_cuda:
            ran_on.append((threading.current_thread(), torch.cuda.current_stream(pre_rope_keys.device)))
            assert release.wait(timeout=30), "the prefill waited for the factorisation"
        return key_basis(pre_rope_keys, rank, solver)

    monkeypatch.setattr(shadowkv, "key_basis", held_basis)
    outputs = {}
    for device in ("cpu", "cuda"):
        gen = torch.Generator().manual_seed(21)
        layer = sparse_layer(gen, n_prompt=300, budget=64, rank=8, device=device)[0]
        if device == "cuda":
            assert not layer.sparse  # the prefill is back; the worker is still held
            release.set()
        steps = []
        for _ in range(6):
            q, k, v = (torch.randn(1, 4, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen),
                       torch.randn(1, 2, 1, 16, generator=gen))
            steps.append(layer.forward(q.to(device), k.to(device), v.to(device), None, SCALING).cpu())
        outputs[device] = steps
        layer.seq.close()
    (thread, stream), = ran_on
    assert thread is not threading.main_thread() and stream != torch.cuda.default_stream()
    for out_cpu, out_gpu in zip(outputs["cpu"], outputs["cuda"]):
        torch.testing.assert_close(out_gpu, out_cpu, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n_prompt, rank, rows", [(40, 20, 20), (12, 20, 12), (100, 32, 32), (100, 64, 32)])
def test_the_sparse_layout_is_sized_for_the_basis_the_prompt_gives(n_prompt, rank, rows):
    """The buffers are made before the factorisation (on CUDA it runs later, on a worker): their rank is the
    basis's, min(rank, prompt, width), or the whole width (32) when the rank covers it, also for a prompt shorter
    than the rank in a sequence announced past the budget."""
    gen = torch.Generator().manual_seed(5)
    layer = sparse_layer(gen, n_prompt=n_prompt, budget=32, rank=rank, announced=n_prompt + 64)[0]
    assert layer.sparse and layer.basis.shape == (rows, 32) and layer.coefficients.shape[1] == rows
