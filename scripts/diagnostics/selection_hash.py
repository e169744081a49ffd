"""A digest of every page IceCache selects over a decode run, to prove that a change to its stores or its search
leaves the selections exactly as they were.

At every decode step each sparsified layer's selection (``group.selection``, the pages per KV head its owner's
search returned) and the token positions of those pages are fed to one SHA-256; the digest covers a run of
``--steps`` steps on a tiny random model. Equal digests mean equal pages at every step of every layer.

    python scripts/diagnostics/selection_hash.py        # every architecture, IceCache and IceCache(r), two dtypes
    python scripts/diagnostics/selection_hash.py --arch llama --dtype bfloat16 --steps 64
    python scripts/diagnostics/selection_hash.py --model smollm2_135m --prompt-tokens 4000 --budget 256   # a real model
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from eval.plugins import build_method
from icecache.core.cache import HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate

REPO = Path(__file__).resolve().parents[2]

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
METHODS = ("icecache", "icecache_reuse")
DTYPES = ("float32", "bfloat16")


def selection_digest(model, info, method_name: str, *, prompt_tokens: int = 1200, steps: int = 64,
                     budget: int = 96, seed: int = 0) -> str:
    """SHA-256 (hex) of every decode step's selected pages, and their token positions, of every sparsified layer."""
    ids = torch.randint(0, 500, (prompt_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    method = build_method({"name": method_name, "budget": budget, "n_reuse_layers": 2 if "reuse" in method_name
                           else 1}, info)
    digest = hashlib.sha256()
    with HarnessCache(method) as cache:
        layers = cache.layer_kvs[method.config.n_dense_layers:]
        for layer in layers:
            _record_selections(layer, digest)
        greedy_generate(model, cache, GenerationRequest(ids, steps, min_new_tokens=steps), cuda_graph=False)
    return digest.hexdigest()


def _record_selections(layer, digest) -> None:
    """Wrap the layer's decode step so that each step's pages (and the positions they hold) enter ``digest``: the
    reuse group's selection after the step, for every step that selected (once the layer is offloaded)."""
    decode = layer.decode

    def recorded(query, key, value, scaling):
        out = decode(query, key, value, scaling)
        if not layer.offloaded:
            return out
        pages = layer.group.selection
        digest.update(np.ascontiguousarray(pages, dtype=np.int64).tobytes())
        index = layer.group.index
        positions_of = layer.state.positions
        for head in range(pages.shape[0]):
            chosen = pages[head][pages[head] >= 0]
            tokens = index.page_tokens(head)[chosen].reshape(-1)
            positions = positions_of[tokens[tokens >= 0]]
            digest.update(np.ascontiguousarray(positions, dtype=np.int64).tobytes())
        return out

    layer.decode = recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHITECTURES, nargs="*", default=list(ARCHITECTURES))
    parser.add_argument("--method", choices=METHODS, nargs="*", default=list(METHODS))
    parser.add_argument("--dtype", choices=DTYPES, nargs="*", default=list(DTYPES))
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--model", help="a model config (configs/model/<name>.yaml) instead of the tiny models; "
                                        "one --dtype picks its dtype (default: the device's)")
    parser.add_argument("--prompt-tokens", type=int, default=1200)
    parser.add_argument("--budget", type=int, default=96)
    parser.add_argument("--out", help="also write the digests with their provenance to this folder "
                                      "(selection_digests_<machine>_<date>.json)")
    args = parser.parse_args()
    digests = {}
    if args.model:
        from eval.latency import model_spec
        from icecache.core.cache import ATTENTION_NAME
        from icecache.core.models import load_model, model_info

        spec = model_spec(args.model, None, "auto", args.dtype[0] if len(args.dtype) == 1 else "auto")
        model, _ = load_model(spec, ATTENTION_NAME)
        info = model_info(spec)
        for name in args.method:
            digests[f"{args.model}/{name}"] = selection_digest(model, info, name, prompt_tokens=args.prompt_tokens,
                                                               steps=args.steps, budget=args.budget)
            print(f"{args.model} {name:15s} {digests[f'{args.model}/{name}']}", flush=True)
        finish(args, digests)
        return
    from tests.conftest import tiny_model_on

    for arch in args.arch:
        for dtype in args.dtype:
            model, info = tiny_model_on(arch, "cpu", getattr(torch, dtype))
            for name in args.method:
                digests[f"{arch}/{dtype}/{name}"] = selection_digest(model, info, name, steps=args.steps,
                                                                     prompt_tokens=args.prompt_tokens,
                                                                     budget=args.budget)
                print(f"{arch:8s} {dtype:9s} {name:15s} {digests[f'{arch}/{dtype}/{name}']}", flush=True)
    finish(args, digests)


def finish(args, digests: dict[str, str]) -> None:
    print(json.dumps(digests, indent=1))
    if args.out:
        from eval import provenance

        settings = {k: v for k, v in vars(args).items() if k != "out"}
        provenance.write_result(args.out, "selection_digests", {"kind": "selection_digests", "settings": settings,
                                                                "digests": digests,
                                                                "provenance": provenance.collect()})


if __name__ == "__main__":
    main()
