"""OmniKV's definitions against direct computations: which layers filter, attend fully or are sparsified, the
tokens a filter layer chooses and that its layers attend, and the CPU path against the GPU's.

Layers are driven directly (no model) with random tensors, 4 query heads over 2 KV heads.
"""

from __future__ import annotations

import pytest
import torch

from baselines.omnikv import OmniKVFilterKV, OmniKVSparseKV, default_filter_layers
from eval.plugins import build_method
from icecache.core.method import ModelInfo, SequenceContext
from icecache.errors import ConfigError

INFO = ModelInfo(n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8)
GROUP = INFO.n_heads // INFO.n_kv_heads
SCALING = INFO.head_dim**-0.5


def test_layer_roles_follow_the_papers_llama_setting():
    info = ModelInfo(n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128)
    method = build_method({"name": "omnikv", "budget": 256}, info)
    roles = [method.layer_role(layer) for layer in range(32)]
    filters = [layer for layer, (role, _) in enumerate(roles) if role == "filter"]
    dense = [layer for layer, (role, _) in enumerate(roles) if role == "dense"]
    assert filters == [2, 8, 18]
    assert dense == [0, 1, 3, 9, 19]  # before the first filter layer, and one wait layer after each
    # Every sparsified layer attends the selection of the last filter layer below it.
    for layer, (role, source) in enumerate(roles):
        if role == "sparse":
            assert source == max(f for f in filters if f < layer)
    assert sum(role == "sparse" for role, _ in roles) == 24
    # Other depths: the same relative positions.
    assert default_filter_layers(30) == [2, 8, 17]
    assert default_filter_layers(36) == [2, 9, 20]
    two_waits = build_method({"name": "omnikv", "budget": 256, "n_wait_layers": 2}, info)
    assert [layer for layer in range(32) if two_waits.layer_role(layer)[0] == "dense"] == [0, 1, 3, 4, 9, 10, 19, 20]


# Head dim 16: the paged kernel's tile product needs at least 16 (every real model has 64 or more).
HEAD_DIM = 16


def drive(config: dict, n_prompt: int, n_steps: int, seed: int, device: str = "cpu"):
    """A filter layer (1) and the sparsified layer after it (2) on one sequence, fed random tensors; yields, per
    step, the filter's query and keys and the sparse layer's keys, values, output and attended positions."""
    info = ModelInfo(n_layers=4, n_heads=4, n_kv_heads=2, head_dim=HEAD_DIM, device=torch.device(device))
    method = build_method({"name": "omnikv", "filter_layers": [1], "n_wait_layers": 0, "n_dense_layers": 1,
                           **config}, info)
    seq = SequenceContext(trace_selection=True)
    filter_layer, sparse = method.make_layer(1, seq), method.make_layer(2, seq)
    assert isinstance(filter_layer, OmniKVFilterKV) and isinstance(sparse, OmniKVSparseKV)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    filter_keys, keys, values = (randn(2, n_prompt, HEAD_DIM) for _ in range(3))
    filter_layer.forward(randn(1, 4, n_prompt, HEAD_DIM), filter_keys[None], randn(1, 2, n_prompt, HEAD_DIM), None,
                         SCALING)
    sparse.forward(randn(1, 4, n_prompt, HEAD_DIM), keys[None], values[None], None, SCALING)
    for _ in range(n_steps):
        filter_query, filter_key = randn(1, 4, 1, HEAD_DIM), randn(1, 2, 1, HEAD_DIM)
        filter_layer.forward(filter_query, filter_key, randn(1, 2, 1, HEAD_DIM), None, SCALING)
        filter_keys = torch.cat([filter_keys, filter_key[0]], dim=1)
        query, key, value = randn(1, 4, 1, HEAD_DIM), randn(1, 2, 1, HEAD_DIM), randn(1, 2, 1, HEAD_DIM)
        out = sparse.forward(query, key, value, None, SCALING)
        keys, values = torch.cat([keys, key[0]], dim=1), torch.cat([values, value[0]], dim=1)
        yield filter_query[0, :, 0], filter_keys, query[0, :, 0], keys, values, out[0, 0], sparse.last_attended, seq


@pytest.mark.parametrize("selector", ["last", "softmax_last"])
def test_sparsified_layers_attend_the_window_and_the_filter_layers_top_tokens(selector):
    budget, n_recent = 24, 8  # 16 chosen tokens
    for filter_query, filter_keys, query, keys, values, out, attended, _ in drive(
            {"budget": budget, "n_recent": n_recent, "selector": selector}, 60, 6, seed=0):
        n_tokens = keys.shape[1]
        # Direct: every query head's scaled logits against its KV head's keys before the window, the maximum over
        # heads (of the logits, or of each head's softmax), the top 16 tokens for every head of the next layers.
        logits = torch.einsum("hd,htd->ht", filter_query, filter_keys.repeat_interleave(GROUP, 0))[:, :-n_recent]
        logits = logits * SCALING
        scores = logits.amax(0) if selector == "last" else torch.softmax(logits, dim=-1).amax(0)
        expected = torch.zeros(n_tokens, dtype=torch.bool)
        expected[scores.topk(budget - n_recent).indices] = True
        expected[n_tokens - n_recent :] = True
        assert torch.equal(attended, expected.expand(4, -1))
        # Exact attention over exactly those tokens of the sparsified layer's own keys and values.
        scores = torch.einsum("hd,htd->ht", query, keys.repeat_interleave(GROUP, 0)) * SCALING
        probs = torch.softmax(scores.masked_fill(~expected, float("-inf")), dim=-1)
        torch.testing.assert_close(out, torch.einsum("ht,htd->hd", probs, values.repeat_interleave(GROUP, 0)))


def test_a_short_sequence_is_attended_whole_and_transfers_count_the_chosen_tokens():
    steps = list(drive({"budget": 24, "n_recent": 8}, 10, 16, seed=1))
    for _, _, _, keys, _, _, attended, _ in steps:
        n_tokens = keys.shape[1]
        assert attended.sum(-1).tolist() == [min(n_tokens, 24)] * 4
    # Each step reads its chosen tokens (every KV head) from the host store: 11 - 8 = 3 at the first step ... 16.
    chosen = sum(min(max(0, 11 + step - 8), 16) for step in range(16))
    counters = steps[-1][-1].counters.as_dict()
    assert counters["pages_loaded"] == 2 * chosen
    assert counters["bytes_to_gpu"] == 2 * chosen * 2 * HEAD_DIM * 4  # keys and values, float32


def test_a_layer_with_no_filter_below_chooses_with_its_own_query():
    method = build_method({"name": "omnikv", "budget": 20, "n_recent": 4, "filter_layers": [2],
                           "n_dense_layers": 0}, INFO)
    assert method.layer_role(1) == ("sparse", None) and method.layer_role(3) == ("dense", 2)  # a wait layer
    layer = method.make_layer(0, SequenceContext(trace_selection=True))
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 40, 8, generator=gen)
    layer.forward(torch.randn(1, 4, 40, 8, generator=gen), keys[None], torch.randn(1, 2, 40, 8, generator=gen),
                  None, SCALING)
    for _ in range(4):
        query, key = torch.randn(1, 4, 1, 8, generator=gen), torch.randn(1, 2, 1, 8, generator=gen)
        layer.forward(query, key, torch.randn(1, 2, 1, 8, generator=gen), None, SCALING)
        keys = torch.cat([keys, key[0]], dim=1)
        logits = torch.einsum("hd,htd->ht", query[0, :, 0], keys.repeat_interleave(GROUP, 0))[:, :-4].amax(0)
        expected = torch.zeros(keys.shape[1], dtype=torch.bool)
        expected[logits.topk(16).indices] = True
        expected[-4:] = True
        assert torch.equal(layer.last_attended, expected.expand(4, -1))


@pytest.mark.parametrize("setting, message", [
    ({"filter_layers": [4]}, r"filter_layers=\[4\] must name at least one layer in \[0, 4\)"),
    ({"filter_layers": []}, "must name at least one layer"),
    ({"selector": "uniform"}, "selector='uniform' must be one of last, softmax_last"),
    ({"n_recent": 0}, "n_recent=0 must be >= 1"),
])
def test_settings_that_cannot_work_are_refused(setting, message):
    with pytest.raises(ConfigError, match=message):
        build_method({"name": "omnikv", "budget": 64, **setting}, INFO)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_layers_choose_and_attend_what_the_cpu_layers_do():
    """float32 on both: the filter's scores from the Triton kernel, the chosen rows read from pinned memory."""
    config = {"budget": 24, "n_recent": 8}
    cpu_steps = drive(config, 60, 12, seed=3)
    gpu_steps = drive(config, 60, 12, seed=3, device="cuda")
    for on_cpu, on_gpu in zip(cpu_steps, gpu_steps):
        assert torch.equal(on_gpu[6].cpu(), on_cpu[6])
        torch.testing.assert_close(on_gpu[5].cpu(), on_cpu[5], atol=1e-5, rtol=1e-5)
    assert on_gpu[-1].counters.as_dict() == on_cpu[-1].counters.as_dict()
