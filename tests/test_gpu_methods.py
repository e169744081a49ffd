"""On a CUDA host: every method gives the same greedy tokens on the GPU as on its CPU path (tiny model, float32).

Run with `pytest -m gpu tests/test_gpu_methods.py` (make test-gpu); skipped without CUDA.
"""

import copy

import pytest
import torch

from icecache.core.cache import HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate
from icecache.core.method import METHODS, ModelInfo, build_method

pytestmark = pytest.mark.gpu

SETTINGS = {"icecache": {"budget": 96}, "icecache_reuse": {"budget": 96, "n_reuse_layers": 2}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["icecache", "icecache_reuse"])
def test_gpu_path_gives_the_cpu_tokens(name):
    from tests.conftest import tiny_model

    model, _, info = tiny_model("llama")
    gpu_model = copy.deepcopy(model).to("cuda")
    gpu_info = ModelInfo(info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim, torch.device("cuda"),
                         torch.float32)
    ids = torch.randint(0, 500, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    values = {"name": name, **SETTINGS[name]}
    on_cpu = greedy_generate(model, HarnessCache(build_method(values, info)), GenerationRequest(ids, 48))
    on_gpu = greedy_generate(gpu_model, HarnessCache(build_method(values, gpu_info)), GenerationRequest(ids, 48))
    assert name in METHODS
    assert on_gpu.token_ids == on_cpu.token_ids
    assert on_gpu.counters["pages_loaded"] == on_cpu.counters["pages_loaded"] > 0
