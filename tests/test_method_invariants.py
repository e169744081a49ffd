"""The invariants of docs/design.md (Budget semantics), for every registered method except the full cache, on the
four tiny models.

1. With a budget at least the sequence length, greedy tokens equal the full cache's and decode logits agree.
2. Prefill output (the first token's logits) never depends on the method.
3. With a small budget, the attended-token count never exceeds the budget, and sinks and the current window are
   always attended.
4. A sparse layer's output equals dense attention masked to exactly the positions it reports as attended.
Plus: a budget too small for a method's fixed parts stops at start-up with a ConfigError naming the numbers.

Every registered method joins automatically, with what it declares on its class: its small test settings
(``test_settings``), the positions it always attends (``forced_positions``) and its smallest budget
(``min_budget``). ``test_a_new_method_needs_one_file`` registers a throw-away method to show that nothing else is
needed.
"""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch

from eval.plugins import METHODS, build_method, method_class
from icecache.core.cache import HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate
from icecache.core.method import ModelInfo, SequenceContext
from icecache.errors import ConfigError
from tests.conftest import tiny_model, tiny_model_on

# Methods that ignore the budget are full caches; tests/test_core_full.py holds them to the full cache's tokens.
SPARSE_METHODS = [name for name in METHODS.names() if method_class(name).uses_budget]
# The sparse methods and their opt-in variants (``Method.variants``), as "name" or "name+variant".
SPARSE_CASES = SPARSE_METHODS + [f"{name}+{variant}" for name in SPARSE_METHODS
                                 for variant in method_class(name).variants]
ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]

SMALL_BUDGET = 64
PROMPT_TOKENS = 300
NEW_TOKENS = 8

def method_config(case: str, budget: int) -> dict:
    """The method's own test settings (``Method.test_settings``) at ``budget``; for a case "name+variant", with the
    variant's settings over them."""
    name, _, variant = case.partition("+")
    cls = method_class(name)
    return {"name": name, "budget": budget, **cls.test_settings, **(cls.variants[variant] if variant else {})}


def always_attended(name: str, config: dict, n_tokens: int) -> list[int]:
    """Positions a method must attend at a step with ``n_tokens`` tokens (new one included): what the method
    declares from its paper's definition (``Method.forced_positions``)."""
    return build_method(config, ModelInfo(n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16)).forced_positions(n_tokens)


def prompt_ids(n: int, vocab: int = 500) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(7)).tolist()


@functools.lru_cache(maxsize=None)
def full_run(arch: str, n_prompt: int, n_new: int, chunk: int | None):
    model, _, info = tiny_model(arch)
    cache = HarnessCache(build_method({"name": "full"}, info))
    return greedy_generate(
        model, cache, GenerationRequest(prompt_ids(n_prompt), n_new), keep_logits=True, prefill_chunk_size=chunk
    )


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("name", SPARSE_CASES)
def test_large_budget_matches_full_cache(name, arch):
    model, _, info = tiny_model(arch)
    n_prompt, n_new, chunk = 120, 6, 48  # chunked prefill exercises the methods' multi-chunk paths
    reference = full_run(arch, n_prompt, n_new, chunk)
    cache = HarnessCache(build_method(method_config(name, 256), info))  # 256 >= 126 tokens
    result = greedy_generate(
        model, cache, GenerationRequest(prompt_ids(n_prompt), n_new), keep_logits=True, prefill_chunk_size=chunk
    )
    assert result.token_ids == reference.token_ids
    for ours, theirs in zip(result.logits, reference.logits):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("name", SPARSE_CASES)
def test_small_budget_prefill_is_dense_and_budget_holds(name, arch):
    model, _, info = tiny_model(arch)
    config = method_config(name, SMALL_BUDGET)
    method = build_method(config, info)
    cache = HarnessCache(method, trace_selection=True)
    steps: list[tuple[int, torch.Tensor]] = []
    for kv in cache.layer_kvs[method.config.n_dense_layers :]:
        def recording(query, key, value, scaling, kv=kv, decode=kv.decode):
            out = decode(query, key, value, scaling)
            steps.append((kv.seq_len + 1, kv.last_attended.clone()))
            return out
        kv.decode = recording
    result = greedy_generate(model, cache, GenerationRequest(prompt_ids(PROMPT_TOKENS), NEW_TOKENS), keep_logits=True)

    # Invariant 2: the first token comes from the prompt's dense attention alone.
    reference = full_run(arch, PROMPT_TOKENS, NEW_TOKENS, None)
    torch.testing.assert_close(result.logits[0], reference.logits[0], atol=1e-5, rtol=1e-5)

    # Invariant 3, at every decode step of every sparse layer.
    n_sparse = info.n_layers - method.config.n_dense_layers
    assert len(steps) == n_sparse * (NEW_TOKENS - 1)
    # A trace is as wide as the sequence's announced length (LayerKV.trace_width), the same at every step, and
    # False past the tokens seen; one built from host state may be as wide as the tokens seen instead.
    widths = {PROMPT_TOKENS + NEW_TOKENS} if method_class(name.split("+")[0]).traces_in_graph else {
        PROMPT_TOKENS + NEW_TOKENS, *(n for n, _ in steps)}
    for n_tokens, attended in steps:
        assert attended.shape[0] == info.n_heads and attended.shape[1] in widths
        assert not attended[:, n_tokens:].any()
        attended = attended[:, :n_tokens]
        assert int(attended.sum(-1).max()) <= SMALL_BUDGET
        forced = always_attended(name, config, n_tokens)
        assert attended[:, forced].all(), f"{name} skipped a sink or window position at length {n_tokens}"
    assert result.counters["mean_attended_tokens"] <= SMALL_BUDGET


@pytest.mark.parametrize("name", SPARSE_METHODS)
def test_budget_too_small_is_a_config_error(name):
    _, _, info = tiny_model("llama")
    budget = build_method(method_config(name, 256), info).min_budget() - 1  # just below the method's fixed parts
    with pytest.raises(ConfigError, match=rf"budget(=| ){budget}\b|positive budget"):
        build_method(method_config(name, budget), info)
    build_method(method_config(name, budget + 1), info)  # one more token is enough


def masked_dense_attention(query, keys, values, attended, scaling, log_weights=None):
    """Reference for invariant 4: ``query [Hq, D]`` over ``keys [Hkv, T, D]`` masked to ``attended [Hq, T]``; a
    sampling estimator (MagicPIG) also reports the additive log-weight of each attended position."""
    group = query.shape[0] // keys.shape[0]
    k = keys.repeat_interleave(group, dim=0)
    v = values.repeat_interleave(group, dim=0)
    scores = torch.einsum("hd,htd->ht", query, k) * scaling
    if log_weights is not None:
        scores = scores + log_weights
    probs = torch.softmax(scores.masked_fill(~attended, float("-inf")), dim=-1)
    return torch.einsum("ht,htd->hd", probs, v)


ON_CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("name", SPARSE_METHODS)
def test_output_equals_dense_attention_masked_to_the_selection(name, device):
    # On CUDA this runs the Triton paged attention and the block copy from mapped pinned memory (ArkVale's recalls).
    info = ModelInfo(n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, device=torch.device(device))
    method = build_method({**method_config(name, SMALL_BUDGET), "n_dense_layers": 0}, info)
    layer = method.make_layer(0, SequenceContext(trace_selection=True))
    gen = torch.Generator().manual_seed(3)
    scaling = info.head_dim**-0.5

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    n_prompt = 150
    keys, values = randn(1, 2, n_prompt, 16), randn(1, 2, n_prompt, 16)
    layer.forward(randn(1, 4, n_prompt, 16), keys, values, None, scaling)
    for _ in range(20):
        query, key, value = randn(1, 4, 1, 16), randn(1, 2, 1, 16), randn(1, 2, 1, 16)
        keys, values = torch.cat([keys, key], dim=2), torch.cat([values, value], dim=2)
        out = layer.forward(query, key, value, None, scaling)
        expected = masked_dense_attention(query[0, :, 0], keys[0], values[0], layer.last_attended, scaling,
                                          getattr(layer, "last_log_weights", None))
        torch.testing.assert_close(out[0, 0], expected, atol=1e-5, rtol=1e-5)
        assert int(layer.last_attended.sum(-1).max()) <= SMALL_BUDGET


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("name", [name for name in METHODS.names() if name not in SPARSE_METHODS] + SPARSE_CASES)
def test_a_finished_cache_is_freed_without_the_garbage_collector(name, device):
    """A sequence's KV (tens of GB of host memory for IceCache at 128k) must go when the caller drops the cache,
    not at some later garbage collection: a reference cycle through it once kept a benchmark's previous method
    alive until the next one ran out of host memory. On CUDA this covers the captured decode step (its graph and
    host functions)."""
    model, info = tiny_model_on("llama", device)
    values = method_config(name, SMALL_BUDGET) if name in SPARSE_CASES else {"name": name}
    ids = torch.randint(0, 500, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(9)).tolist()
    gc.collect()
    gc.disable()
    try:
        cache = HarnessCache(build_method(values, info))
        result = greedy_generate(model, cache, GenerationRequest(ids, 24))
        layers = [weakref.ref(layer) for layer in cache.layer_kvs]
        del cache, result
        alive = [layer() is not None for layer in layers]
    finally:
        gc.enable()
    assert not any(alive), f"{name} on {device}: {sum(alive)} of {len(alive)} layers outlived their cache"


def test_a_new_method_needs_one_file():
    """CONTRIBUTING.md's recipe: a settings dataclass, a layer and a registered ``Method`` that declares its own
    metadata are all a method needs; the shared invariants above then hold it like every other method."""
    from dataclasses import dataclass

    import torch as _torch

    from icecache.core.method import Method, MethodConfig
    from icecache.core.token_slots import RingSlotsKV

    @dataclass
    class RecentOnlyConfig(MethodConfig):
        name: str = "recent_only_for_test"

    class RecentOnlyKV(RingSlotsKV):
        """The last ``budget`` tokens, nothing pinned."""

        def place_prompt(self, n_prompt):
            self.ring_size = self.budget
            kept = _torch.arange(max(0, n_prompt - self.budget), n_prompt).expand(self.model.n_kv_heads, -1)
            return kept, self.ring_slots(kept)

    class RecentOnly(Method):
        config_class = RecentOnlyConfig

        def min_budget(self):
            return 2

        def forced_positions(self, n_tokens):
            return list(range(max(0, n_tokens - self.config.budget), n_tokens))

        def make_sparse_layer(self, layer_idx, seq):
            return RecentOnlyKV(layer_idx, self.model, seq, self.config.budget)

    name = "recent_only_for_test"
    METHODS.register(name)(RecentOnly)
    try:
        test_large_budget_matches_full_cache(name, "llama")
        test_small_budget_prefill_is_dense_and_budget_holds(name, "qwen3")
        test_budget_too_small_is_a_config_error(name)
        test_output_equals_dense_attention_masked_to_the_selection(name, "cpu")
    finally:
        METHODS.unregister(name)
