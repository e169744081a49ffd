"""The full-cache path on the shared core equals plain transformers (sdpa + DynamicCache) on tiny random models."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from eval.plugins import build_method
from icecache.core.cache import HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate


def reference_generate(model, ids, n_new):
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="sdpa")
    reference.load_state_dict(model.state_dict())
    reference.eval()
    out = reference.generate(
        torch.tensor([ids]), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0,
    )
    return out.sequences[0, len(ids):].tolist(), [s[0] for s in out.logits]


def test_full_cache_matches_transformers(tiny):
    model, _, info = tiny
    ids = torch.randint(0, 500, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    method = build_method({"name": "full"}, info)
    ours = greedy_generate(model, HarnessCache(method), GenerationRequest(ids, 16), keep_logits=True)
    ref_tokens, ref_scores = reference_generate(model, ids, 16)
    assert ours.token_ids == ref_tokens
    for mine, theirs in zip(ours.logits, ref_scores):
        torch.testing.assert_close(mine, theirs.float(), rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_chunk(tiny):
    model, _, info = tiny
    ids = torch.randint(0, 500, (97,), generator=torch.Generator().manual_seed(1)).tolist()
    method = build_method({"name": "full"}, info)
    whole = greedy_generate(model, HarnessCache(method), GenerationRequest(ids, 8), keep_logits=True)
    chunked = greedy_generate(
        model, HarnessCache(method), GenerationRequest(ids, 8), prefill_chunk_size=32, keep_logits=True
    )
    assert whole.token_ids == chunked.token_ids
    torch.testing.assert_close(whole.logits[0], chunked.logits[0], rtol=1e-4, atol=1e-4)


def test_suffix_tokens_fed_as_decode_steps_equal_prefill(tiny):
    model, _, info = tiny
    ids = torch.randint(0, 500, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    method = build_method({"name": "full"}, info)
    whole = greedy_generate(model, HarnessCache(method), GenerationRequest(ids, 6))
    split = greedy_generate(model, HarnessCache(method), GenerationRequest(ids[:50], 6, suffix_ids=ids[50:]))
    assert whole.token_ids == split.token_ids
    assert split.prompt_tokens == 64


def test_generate_api_accepts_the_cache(tiny):
    """transformers' own generate() with our cache: honest logical length, same tokens as our loop."""
    model, _, info = tiny
    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    method = build_method({"name": "full"}, info)
    cache = HarnessCache(method)
    out = model.generate(torch.tensor([ids]), past_key_values=cache, max_new_tokens=5, min_new_tokens=5,
                         do_sample=False, pad_token_id=0)
    ours = greedy_generate(model, HarnessCache(method), GenerationRequest(ids, 5))
    assert out[0, 40:].tolist() == ours.token_ids
    assert cache.get_seq_length() == 40 + 4  # the last generated token is never fed back


def test_eos_min_new_tokens_and_stop_strings(tiny):
    model, tokenizer, info = tiny
    ids = torch.randint(0, 500, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    method = build_method({"name": "full"}, info)
    free = greedy_generate(model, HarnessCache(method), GenerationRequest(ids, 6))
    first = free.token_ids[0]
    stopped = greedy_generate(model, HarnessCache(method), GenerationRequest(ids, 6, eos_token_ids=[first]))
    assert stopped.token_ids == [] and stopped.stop_reason == "eos"
    forced = greedy_generate(
        model, HarnessCache(method), GenerationRequest(ids, 6, eos_token_ids=[first], min_new_tokens=1)
    )
    assert forced.token_ids and forced.token_ids[0] != first
    text = tokenizer.decode(free.token_ids[:3])
    if text:
        by_string = greedy_generate(
            model, HarnessCache(method), GenerationRequest(ids, 6, stop_strings=[text]), tokenizer=tokenizer
        )
        assert by_string.stop_reason == "stop_string" and len(by_string.token_ids) <= 3


@pytest.mark.parametrize("architecture", ["mistral"])
def test_sliding_window_models_are_refused(architecture):
    from icecache.core.models import ModelSpec, model_info
    from icecache.errors import ConfigError

    spec = ModelSpec(name="windowed", source="random", architecture=architecture,
                     config={"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 300,
                             "sliding_window": 4096})
    with pytest.raises(ConfigError, match="sliding_window=null"):
        model_info(spec)


@pytest.mark.parametrize("prefill_chunk_size", [None, 40])
def test_static_full_cache_equals_full_cache(tiny, prefill_chunk_size):
    """full_static (buffers sized once, positions read on the device, paged kernel) computes what full does."""
    model, _, info = tiny
    ids = torch.randint(0, 500, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    full = greedy_generate(model, HarnessCache(build_method({"name": "full"}, info)), GenerationRequest(ids, 24),
                           keep_logits=True)
    cache = HarnessCache(build_method({"name": "full_static"}, info))
    static = greedy_generate(model, cache, GenerationRequest(ids, 24), prefill_chunk_size=prefill_chunk_size,
                             keep_logits=True)
    assert static.token_ids == full.token_ids
    for mine, theirs in zip(static.logits, full.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    # Sized once for the announced sequence (rounded up to whole pages), never grown.
    assert {kv.capacity for kv in cache.layer_kvs} == {128}  # 90 + 24 tokens, in pages of 16
    assert all(kv.seq_len == 90 + 23 for kv in cache.layer_kvs)


def test_static_full_cache_grows_under_transformers_generate(tiny):
    """Without an announced length (transformers' generate) the buffers grow, and the tokens stay the full cache's."""
    model, _, info = tiny
    ids = torch.randint(0, 500, (250,), generator=torch.Generator().manual_seed(6)).tolist()
    ref_tokens, _ = reference_generate(model, ids, 12)
    cache = HarnessCache(build_method({"name": "full_static"}, info))
    out = model.generate(torch.tensor([ids]), past_key_values=cache, max_new_tokens=12, min_new_tokens=12,
                         do_sample=False, pad_token_id=0)
    assert out[0, len(ids):].tolist() == ref_tokens
    assert all(kv.capacity >= 250 + 11 for kv in cache.layer_kvs)


@pytest.mark.parametrize("residual_on_host", [False, True], ids=["residual-on-device", "residual-on-host"])
@pytest.mark.parametrize("name", ["full", "full_static", "icecache", "snapkv"])
def test_layer_by_layer_prefill_equals_the_model_forward(tiny, name, residual_on_host):
    """Prefill one layer at a time (chunks of 48) computes what the model's own forward does, for dense and
    offloading methods alike (IceCache's per-layer offload runs at each layer's last chunk), with the residual
    stream kept on the model's device or in host memory."""
    model, _, info = tiny
    ids = torch.randint(0, 500, (200,), generator=torch.Generator().manual_seed(7)).tolist()
    values = {"name": name, "budget": 64, **({"n_sink_pages": 1, "n_window_pages": 1} if name == "icecache" else {})}
    method = build_method(values, info)
    whole = greedy_generate(model, HarnessCache(method), GenerationRequest(ids, 12), keep_logits=True)
    layered = greedy_generate(model, HarnessCache(method), GenerationRequest(ids, 12), prefill_chunk_size=48,
                              layer_by_layer=True, residual_on_host=residual_on_host, keep_logits=True)
    assert layered.token_ids == whole.token_ids
    for mine, theirs in zip(layered.logits, whole.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_full_cache_storage_is_sized_once_for_the_announced_length(tiny):
    """No doubling at the first decode token: the storage holds prompt + new tokens from the first chunk on."""
    model, _, info = tiny
    ids = torch.randint(0, 500, (256,), generator=torch.Generator().manual_seed(8)).tolist()
    cache = HarnessCache(build_method({"name": "full"}, info))
    greedy_generate(model, cache, GenerationRequest(ids, 10), prefill_chunk_size=64)
    assert {kv._keys.shape[2] for kv in cache.layer_kvs} == {256 + 10}


def test_residual_on_host_without_layer_by_layer_is_refused_before_any_work(tiny):
    model, _, info = tiny
    with pytest.raises(ValueError, match="needs layer_by_layer"):
        greedy_generate(model, HarnessCache(build_method({"name": "full"}, info)), GenerationRequest([1, 2, 3], 2),
                        residual_on_host=True)


def test_a_sequence_state_is_made_once_per_kind_and_closed_with_the_sequence():
    from icecache.core.layer import SequenceContext

    class Worker:
        def __init__(self):
            self.closed = 0

        def close(self):
            self.closed += 1

    class Plain:  # no close(): nothing to end
        pass

    seq = SequenceContext()
    worker = seq.state(Worker)
    assert seq.state(Worker) is worker and isinstance(seq.state(Plain), Plain)
    assert SequenceContext().state(Worker) is not worker  # per sequence, not global
    seq.close()
    assert worker.closed == 1
