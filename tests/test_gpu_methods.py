"""On a CUDA host: every method gives the same greedy tokens on the GPU as on its CPU path (tiny model, float32),
and every method's captured decode step replays bitwise the logits of its eager step.

Run with `pytest -m gpu tests/test_gpu_methods.py` (make test-gpu); skipped without CUDA.
"""

import contextlib
import gc
import threading
import warnings

import pytest
import torch

from eval.plugins import METHODS, build_method, method_class
from icecache.core.cache import HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate
from tests.test_method_invariants import SMALL_BUDGET, method_config

pytestmark = pytest.mark.gpu

SETTINGS = {"icecache": {"budget": 96}, "icecache_reuse": {"budget": 96, "n_reuse_layers": 2}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
def test_gpu_path_gives_the_cpu_tokens(name, lookahead):
    from tests.conftest import tiny_model, tiny_model_on

    model, _, info = tiny_model("llama")
    gpu_model, gpu_info = tiny_model_on("llama", "cuda", torch.float32)
    ids = torch.randint(0, 500, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    values = {"name": name, **SETTINGS[name], "lookahead": lookahead}
    on_cpu = greedy_generate(model, HarnessCache(build_method(values, info)), GenerationRequest(ids, 48))
    on_gpu = greedy_generate(gpu_model, HarnessCache(build_method(values, gpu_info)), GenerationRequest(ids, 48))
    assert name in METHODS
    assert on_gpu.token_ids == on_cpu.token_ids
    assert on_gpu.counters["pages_loaded"] == on_cpu.counters["pages_loaded"] > 0
    for key in ("lookahead_searches", "lookahead_misses"):
        assert on_gpu.counters.get(key) == on_cpu.counters.get(key), key
    assert ("lookahead_searches" in on_gpu.counters) == lookahead


# Every budgeted method whose step is captured (IceCache has its own settings and test below).
CAPTURED_SPARSE = [name for name in METHODS.names() if method_class(name).supports_cuda_graph
                   and method_class(name).uses_budget and not name.startswith("icecache")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CAPTURED_SPARSE)
def test_every_method_gives_its_cpu_tokens_on_the_gpu(name):
    """float32 on both devices: the GPU's kernels and captured steps choose what the CPU reference chooses."""
    from tests.conftest import tiny_model, tiny_model_on

    model, _, info = tiny_model("llama")
    gpu_model, gpu_info = tiny_model_on("llama", "cuda", torch.float32)
    ids = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(11)).tolist()
    values = method_config(name, SMALL_BUDGET)
    on_cpu = greedy_generate(model, HarnessCache(build_method(values, info)), GenerationRequest(ids, 40))
    on_gpu = greedy_generate(gpu_model, HarnessCache(build_method(values, gpu_info)), GenerationRequest(ids, 40))
    assert on_gpu.counters["graph_replays"] == 38
    assert on_gpu.token_ids == on_cpu.token_ids
    assert on_gpu.counters["mean_attended_tokens"] == pytest.approx(on_cpu.counters["mean_attended_tokens"])
    assert on_gpu.counters["pages_loaded"] == on_cpu.counters["pages_loaded"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("name", CAPTURED_SPARSE)
def test_every_method_replays_its_eager_step(architecture, name):
    """64 decode steps of a budget that evicts or reselects at every step (pages of 8 tokens, so that pages fill,
    leave the window and are recalled): the graph's tokens, logits and counters are bitwise the eager step's."""
    from tests.conftest import tiny_model_on

    gpu_model, gpu_info = tiny_model_on(architecture, "cuda", torch.bfloat16)
    ids = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(12)).tolist()
    request = GenerationRequest(ids, 65)
    method = build_method(method_config(name, SMALL_BUDGET), gpu_info)
    assert method.captures_decode_step
    graphed = greedy_generate(gpu_model, HarnessCache(method), request, keep_logits=True)
    eager = greedy_generate(gpu_model, HarnessCache(method), request, keep_logits=True, cuda_graph=False)
    assert graphed.counters["graph_replays"] == 63  # every decode step after the first, eager one
    assert "graph_replays" not in eager.counters
    assert graphed.token_ids == eager.token_ids
    for key in ("mean_attended_tokens", "pages_loaded", "bytes_to_gpu"):
        assert graphed.counters[key] == eager.counters[key], key
    for mine, theirs in zip(graphed.logits, eager.logits):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decode_replays_the_eager_step(architecture, dtype):
    """full_static replays a captured decode step: the same kernels as its eager step, so bitwise the same logits;
    and in float32 the tokens of the eager full cache (SDPA) too."""
    from tests.conftest import tiny_model_on

    gpu_model, gpu_info = tiny_model_on(architecture, "cuda", dtype)
    ids = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    request = GenerationRequest(ids, 40)
    method = build_method({"name": "full_static"}, gpu_info)
    graphed = greedy_generate(gpu_model, HarnessCache(method), request, keep_logits=True)
    eager = greedy_generate(gpu_model, HarnessCache(method), request, keep_logits=True, cuda_graph=False)
    assert graphed.counters["graph_replays"] == 38  # every decode step after the first, eager one
    assert "graph_replays" not in eager.counters
    assert graphed.token_ids == eager.token_ids
    for mine, theirs in zip(graphed.logits, eager.logits):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    if dtype == torch.float32:
        full = greedy_generate(gpu_model, HarnessCache(build_method({"name": "full"}, gpu_info)), request,
                               keep_logits=True)
        assert graphed.token_ids == full.token_ids
        for mine, theirs in zip(graphed.logits, full.logits):
            torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
@pytest.mark.parametrize("lookahead", [False, True])
def test_icecache_graph_replays_the_eager_step(architecture, name, lookahead):
    """IceCache's captured decode step (each layer's host work a host function of the graph) gives bitwise the
    logits of its eager step, over enough steps for the window ring to turn several times and pages to be
    reloaded after inserts; with the look-ahead, whose speculative query and job launch are captured too, as
    well."""
    from tests.conftest import tiny_model_on

    gpu_model, gpu_info = tiny_model_on(architecture, "cuda", torch.bfloat16)
    ids = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    request = GenerationRequest(ids, 64)
    values = {"name": name, **SETTINGS[name], "cuda_graph": True, "lookahead": lookahead}
    graphed = greedy_generate(gpu_model, HarnessCache(build_method(values, gpu_info)), request, keep_logits=True)
    eager = greedy_generate(gpu_model, HarnessCache(build_method(values, gpu_info)), request, keep_logits=True,
                            cuda_graph=False)
    assert graphed.counters["graph_replays"] == 62  # every decode step after the first, eager one
    assert graphed.token_ids == eager.token_ids
    assert graphed.counters["pages_loaded"] == eager.counters["pages_loaded"] > 0
    assert graphed.counters["mean_attended_tokens"] == eager.counters["mean_attended_tokens"]
    for key in ("lookahead_searches", "lookahead_misses"):
        assert graphed.counters.get(key) == eager.counters.get(key), key
    for mine, theirs in zip(graphed.logits, eager.logits):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cpu_kv_dtype", ["auto", "float16", "float32"])
def test_icecache_captured_host_step_is_native_and_replays_the_eager_step(monkeypatch, cpu_kv_dtype):
    """The captured IceCache step enqueues its host work (the step and the look-ahead's start) as raw C functions
    through ``HostExchange.run_native``, never a Python host function, and replays bitwise its eager step, for
    every host dtype (float16 keeps the keys in the token store beside a float32 index)."""
    from icecache.core.cuda_driver import HostFunctions
    from tests.conftest import tiny_model_on

    launched = []
    launch = HostFunctions.launch_native

    def counting(self, function_address, state_address, device):
        launched.append(function_address)
        launch(self, function_address, state_address, device)

    def no_python(*args, **kwargs):
        raise AssertionError("IceCache's captured step launched a Python host function")

    monkeypatch.setattr(HostFunctions, "launch_native", counting)
    monkeypatch.setattr(HostFunctions, "launch", no_python)
    gpu_model, gpu_info = tiny_model_on("llama", "cuda", torch.bfloat16)
    ids = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    request = GenerationRequest(ids, 48)
    values = {"name": "icecache_reuse", **SETTINGS["icecache_reuse"], "lookahead": True, "cpu_kv_dtype": cpu_kv_dtype}
    graphed = greedy_generate(gpu_model, HarnessCache(build_method(values, gpu_info)), request, keep_logits=True)
    eager = greedy_generate(gpu_model, HarnessCache(build_method(values, gpu_info)), request, keep_logits=True,
                            cuda_graph=False)
    assert graphed.counters["graph_replays"] == 46
    assert len(set(launched)) == 2 and len(launched) == 3  # two sparsified layers' steps, one owner's look-ahead
    assert graphed.token_ids == eager.token_ids
    for key in ("pages_loaded", "bytes_to_gpu", "mean_attended_tokens", "lookahead_searches", "lookahead_misses",
                "search_rows_read"):
        assert graphed.counters.get(key) == eager.counters.get(key), key
    for mine, theirs in zip(graphed.logits, eager.logits):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_failed_capture_falls_back_to_eager_steps_with_the_same_tokens(monkeypatch):
    """A decode step that synchronises (illegal while capturing) makes the capture fail: the generation goes on
    eagerly, gives the eager tokens, and the result says why nothing was replayed."""
    from icecache.core.static_kv import StaticDenseKV
    from tests.conftest import tiny_model_on

    gpu_model, gpu_info = tiny_model_on("llama", "cuda", torch.float32)
    ids = torch.randint(0, 500, (200,), generator=torch.Generator().manual_seed(4)).tolist()
    request = GenerationRequest(ids, 12)
    method = build_method({"name": "full_static"}, gpu_info)
    eager = greedy_generate(gpu_model, HarnessCache(method), request, cuda_graph=False)
    decode = StaticDenseKV.decode

    def synchronising_decode(self, query, key, value, scaling):
        float(key.sum().item())  # a host read of a device value: a capture cannot record it
        return decode(self, query, key, value, scaling)

    monkeypatch.setattr(StaticDenseKV, "decode", synchronising_decode)
    with pytest.warns(RuntimeWarning, match="capture"):
        fallen_back = greedy_generate(gpu_model, HarnessCache(method), request)
    assert fallen_back.token_ids == eager.token_ids
    assert fallen_back.counters["graph_replays"] == 0 and fallen_back.counters["graph_capture_error"]
    torch.randn(8, device="cuda")  # the failed capture left the device's random generator usable


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_residual_on_host_gives_the_same_logits_with_less_device_memory():
    """Layer-by-layer prefill with the residual stream in pinned host memory: bitwise the logits of the same
    prefill with it on the device (the same kernels on the same chunks), and a lower peak."""
    from tests.conftest import tiny_model_on

    gpu_model, gpu_info = tiny_model_on("llama", "cuda", torch.bfloat16)
    ids = torch.randint(0, 500, (12000,), generator=torch.Generator().manual_seed(6)).tolist()
    request = GenerationRequest(ids, 4)
    values = {"name": "icecache", **SETTINGS["icecache"]}
    runs, peak_above_start = {}, {}
    for on_host in (False, True):
        # The peak is absolute: free what earlier runs (and tests) left, and count from what is held at the start.
        # Eager decode steps: a captured step's memory pool would dwarf the tiny model's prefill activations.
        gc.collect()
        torch.cuda.empty_cache()
        held_at_start = torch.cuda.memory_allocated()
        runs[on_host] = greedy_generate(gpu_model, HarnessCache(build_method(values, gpu_info)), request,
                                        prefill_chunk_size=1000, layer_by_layer=True, residual_on_host=on_host,
                                        keep_logits=True, cuda_graph=False)
        peak_above_start[on_host] = runs[on_host].peak_gpu_bytes - held_at_start
    assert runs[True].token_ids == runs[False].token_ids
    for mine, theirs in zip(runs[True].logits, runs[False].logits):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    # The device-resident residual is [12000, 64] bf16; on the host only a chunk of it is on the device at once.
    assert peak_above_start[True] < peak_above_start[False]


@contextlib.contextmanager
def synchronising_calls_of_this_thread():
    """The synchronising CUDA calls (torch's sync debug mode: a read of a device value, a copy from pageable host
    memory, a stream or device synchronisation) that this thread makes inside the block, each as "file:line:
    message" (worker threads may wait on the device: they hold up no launch)."""
    calls: list[str] = []
    thread = threading.get_ident()
    previous = torch.cuda.get_sync_debug_mode()

    def record(message, category, filename, lineno, file=None, line=None):
        if threading.get_ident() == thread and "called a synchronizing" in str(message):
            calls.append(f"{filename}:{lineno}: {message}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield calls
        finally:
            torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_synchronising_call_recorder_sees_a_pageable_copy_and_a_read():
    with synchronising_calls_of_this_thread() as calls:
        torch.arange(4).to("cuda")
        torch.ones(1, device="cuda").item()
    assert len(calls) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", METHODS.names())
def test_a_prefill_never_makes_the_model_thread_wait_for_the_device(name, monkeypatch):
    """A prefill queues its layers without waiting: a synchronising call on the model's thread at a layer leaves
    the GPU idle while the thread does the layer's host work, which TTFT then pays at every layer. The second
    sequence of a method is checked (the first may pin the host buffers it keeps for the next)."""
    from icecache.core import generation
    from tests.conftest import tiny_model_on

    gpu_model, gpu_info = tiny_model_on("llama", "cuda", torch.float32)
    method = build_method(method_config(name, SMALL_BUDGET), gpu_info)
    ids = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(12)).tolist()
    request = GenerationRequest(ids, 3)
    first = greedy_generate(gpu_model, HarnessCache(method), request)
    calls: list[str] = []
    prefill = generation.prefill_sequence

    def recorded_prefill(*args, **kwargs):
        with synchronising_calls_of_this_thread() as found:
            out = prefill(*args, **kwargs)
        calls.extend(found)
        return out

    monkeypatch.setattr(generation, "prefill_sequence", recorded_prefill)
    second = greedy_generate(gpu_model, HarnessCache(method), request)
    assert calls == []
    assert second.token_ids == first.token_ids
