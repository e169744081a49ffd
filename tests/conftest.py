"""Shared fixtures: tiny random Llama, Mistral, Qwen2 and Qwen3 models (CPU, float32, byte tokenizer)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from icecache.core.cache import ATTENTION_NAME
from icecache.core.kernels import triton_runtime
from icecache.core.models import ModelSpec, load_model, model_info

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(relative: str):
    """``scripts/<relative>.py`` (``"bench/latency"``) as a module, registered in ``sys.modules`` (a dataclass of
    the script looks its module up there)."""
    name = "scripts_" + relative.replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{relative}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=8192,
)


def tiny_spec(architecture: str) -> ModelSpec:
    config = dict(TINY_CONFIG)
    if architecture == "mistral":
        config["sliding_window"] = None
    if architecture == "qwen3":
        config["head_dim"] = 16
    return ModelSpec(
        name=f"tiny-{architecture}", source="random", architecture=architecture, config=config,
        tokenizer="bytes", device="cpu", dtype="float32", seed=0,
    )


@functools.lru_cache(maxsize=None)
def tiny_model(architecture: str):
    """(model, tokenizer, ModelInfo) built once per test session and architecture."""
    spec = tiny_spec(architecture)
    model, tokenizer = load_model(spec, ATTENTION_NAME)
    return model, tokenizer, model_info(spec)


def tiny_model_on(architecture: str, device: str, dtype: torch.dtype = torch.float32):
    """A copy of ``tiny_model(architecture)`` on ``device`` in ``dtype``, and its ModelInfo (for GPU tests)."""
    model, _, info = tiny_model(architecture)
    return copy.deepcopy(model).to(device, dtype), dataclasses.replace(info, device=torch.device(device), dtype=dtype)


@pytest.fixture(params=ARCHITECTURES)
def tiny(request):
    return tiny_model(request.param)


@pytest.fixture
def rng():
    return torch.Generator().manual_seed(1234)


def count_triton_calls(monkeypatch, module, names) -> dict[str, int]:
    """Wrap ``module.<name>_triton`` for each name so that its calls are counted (the returned dict, updated in
    place): a test that forces a dispatch onto the kernels checks that they really ran."""
    calls = {name: 0 for name in names}
    for name in names:
        kernel = getattr(module, f"{name}_triton")

        def counted(*args, kernel=kernel, name=name):
            calls[name] += 1
            return kernel(*args)

        monkeypatch.setattr(module, f"{name}_triton", counted)
    return calls


def kernel_device() -> torch.device:
    """CUDA when the Triton kernels can run there, CPU under Triton's interpreter, otherwise skip."""
    if triton_runtime.available():
        return torch.device("cuda")
    if triton_runtime.interpreted():
        return torch.device("cpu")
    pytest.skip("needs CUDA and Triton (or TRITON_INTERPRET=1 with Triton installed)")
