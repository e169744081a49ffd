"""Reading a run's model before its weights: one ``ConfigError`` line for a model path that is not there, a hub
model without network, or a config or tokenizer that cannot be read."""

from __future__ import annotations

from pathlib import Path

from icecache.core.models import ModelSpec
from icecache.errors import ConfigError


def looks_like_path(path: str) -> bool:
    """``/models/x``, ``./x``, ``~/x``, ``a/b/c``: a folder, not a hub id (``org/name``)."""
    return path.startswith(("/", "./", "../", "~")) or path.count("/") > 1


def check_model_path(spec: ModelSpec) -> None:
    """A hub model whose ``model.path`` is a folder that is not there: said before transformers is asked."""
    path = spec.path or ""
    if spec.source == "hub" and looks_like_path(path) and not Path(path).expanduser().exists():
        raise model_error(spec, FileNotFoundError(path))


def model_error(spec: ModelSpec, error: BaseException) -> ConfigError:
    """One line for a model whose config or tokenizer cannot be read (a path that is not there, no network)."""
    detail = " ".join(str(error).split()) or type(error).__name__
    detail = detail if len(detail) <= 200 else detail[:197] + "..."
    path = spec.path or ""
    if spec.source == "hub" and looks_like_path(path) and not Path(path).expanduser().exists():
        return ConfigError(
            f"model.path={path} does not exist: set model.path to a local folder with the model's config.json, "
            f"tokenizer and safetensors weights, or to a hub id"
        )
    if spec.source == "hub" and not Path(path).expanduser().exists():
        return ConfigError(
            f"could not load model {spec.name} ({path}) from the hub: {detail} -- without network, download it and "
            f"set model.path=<local folder>"
        )
    return ConfigError(f"could not read model {spec.name} ({path or spec.source}): {type(error).__name__}: {detail}")


_MODEL_READ_ERRORS = (OSError, ValueError, KeyError, ImportError, RuntimeError)


def read_model_part(spec: ModelSpec, read):
    """``read()`` (the model's config, its tokenizer), with what goes wrong reading it as one ``ConfigError``."""
    try:
        return read()
    except _MODEL_READ_ERRORS as error:
        if isinstance(error, ConfigError):
            raise
        raise model_error(spec, error) from None
