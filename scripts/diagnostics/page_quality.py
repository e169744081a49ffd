#!/usr/bin/env python
"""How much attention a page layout can hold at all: the mass of its best pages, chosen by their true mass.

    python scripts/diagnostics/page_quality.py --model smollm2_135m --length 4096 --budget 256 --samples 2 --steps 16
    python scripts/diagnostics/page_quality.py --model smollm2_135m --task ruler --subtask niah_multikey_1 --length 8000

A page method attends whole pages, so what it can reach is bounded by its layout: how the prompt's tokens are
grouped into pages. For real prompts and the decode queries of the full cache (greedy, ``--steps`` steps past the
prompt, every sparsified layer, every query head), this computes the share of each step's exact attention (softmax
over every token seen) that ``budget / page_size`` pages of the prompt hold when chosen by their true mass, for

* ``positional``: consecutive pages of ``page_size`` tokens from position 0 (Quest's and ArkVale's layout);
* ``dci``: IceCache's layout: its sink pages, the leaves of the DCI index it builds over the rest of the prompt
  (with its own settings, ``IceCacheConfig``; 8 to 16 tokens a leaf) and its window pages;
* ``kmeans``: the same sink and window pages around a balanced k-means of the same middle keys (L2 on keys, at
  most ``page_size`` tokens a cluster, ``balanced_kmeans``): what a clustering of that page size can give;

and beside them ``token_topk`` (the best ``budget`` prompt tokens: no layout reaches more), ``dci_fixed`` (the sink
and window pages and the best ``K`` leaves: IceCache's structure with a perfect search) and ``dci_search`` (the
sink and window pages and the ``K`` leaves the index's own search returns for each query head, with IceCache's
query settings, without its GQA merge), so that the clustering's gain (``dci``, ``kmeans`` against ``positional``)
and what the search loses (``dci_search`` against ``dci_fixed``) read off one table. ``K`` is IceCache's number of
selected pages at that budget. Generated tokens belong to no page (every method keeps them in its window); their
mass counts in the denominator only.

Prints a table and writes results/bench/page_quality_<machine>_<date>.json (settings, per-layer means, provenance).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]

LAYOUTS = ("token_topk", "positional", "dci", "kmeans", "dci_fixed", "dci_search")


# --------------------------------------------------------------------------------------------------------------
# Layouts: a page id per prompt position and KV head, int64 [Hkv, n_prompt]


def positional_pages(n_kv_heads: int, n_tokens: int, page_size: int) -> torch.Tensor:
    return (torch.arange(n_tokens) // page_size).expand(n_kv_heads, n_tokens).clone()


def icecache_regions(n_tokens: int, cfg) -> tuple[int, int]:
    """(end of the sinks, start of the window) of an IceCache prompt of ``n_tokens``, as its layer splits it when
    it offloads the prompt: the first ``n_sink_pages`` pages are sinks; the window is the last partial page plus
    ``n_window_pages - 1`` full pages (``n_window_pages`` full pages when the length is a multiple of the page)."""
    ps = cfg.page_size
    sink_len = min(cfg.n_sink_pages * ps, n_tokens)
    tail = n_tokens % ps
    window_len = (cfg.n_window_pages - 1) * ps + tail if tail else cfg.n_window_pages * ps
    window_len = min(window_len, n_tokens - sink_len)
    return sink_len, n_tokens - window_len


def framed_pages(middle: torch.Tensor, sink_len: int, middle_end: int, n_tokens: int, page_size: int) -> torch.Tensor:
    """IceCache's frame around a layout of the middle ``[Hkv, middle_end - sink_len]`` (page ids from 0): sink
    pages first, then the middle's pages, then window pages of ``page_size`` from the window's start."""
    n_kv_heads = middle.shape[0]
    sinks = torch.arange(sink_len) // page_size
    n_sink_pages = -(-sink_len // page_size)
    first_window = n_sink_pages + (int(middle.max()) + 1 if middle.numel() else 0)
    window = first_window + torch.arange(n_tokens - middle_end) // page_size
    return torch.cat([sinks.expand(n_kv_heads, -1), middle + n_sink_pages, window.expand(n_kv_heads, -1)], dim=1)


def dci_leaves(middle_keys: torch.Tensor, cfg, threads: int | None = None):
    """(page id of every middle token ``[Hkv, n]``, the index): the DCI index IceCache builds over the middle keys
    ``[Hkv, n, D]`` (float32 of the host copy), with its settings; a leaf is a page."""
    from icecache.dci import DCIIndex

    n_kv_heads, n, head_dim = middle_keys.shape
    index = DCIIndex(head_dim, n_kv_heads, promotion_prob=cfg.promotion_prob,
                     promotion_prob_subseq=cfg.promotion_prob_subseq, transform=True, deterministic_levels=True,
                     seed=cfg.seed, num_threads=threads, score_precision=cfg.dci_score_precision)
    index.build(middle_keys.float().contiguous().numpy(), field_of_view=cfg.build_field_of_view,
                prop_to_retrieve=cfg.build_prop_to_retrieve, anchor_interval=cfg.anchor_interval,
                anchor_neighbours=cfg.anchor_neighbours, anchor_threshold=cfg.anchor_threshold)
    labels = torch.empty(n_kv_heads, n, dtype=torch.long)
    for head in range(n_kv_heads):
        page, _slot = index.token_to_page(head)
        labels[head] = torch.from_numpy(page.astype(np.int64))
    return labels, index


def balanced_kmeans(points: torch.Tensor, size: int, iterations: int = 20, seed: int = 0) -> torch.Tensor:
    """Cluster ids ``[N]`` of ``points [N, D]`` into ``ceil(N / size)`` clusters of at most ``size`` points each:
    Lloyd's iterations from ``ceil(N / size)`` distinct points drawn with ``seed``, each assignment made under the
    capacity (``capacity_assignment``); stops early when an assignment repeats."""
    n = points.shape[0]
    k = max(1, -(-n // size))
    points = points.float()
    generator = torch.Generator().manual_seed(seed)
    centroids = points[torch.randperm(n, generator=generator)[:k].to(points.device)].clone()
    labels = None
    for _ in range(iterations):
        assigned = capacity_assignment(torch.cdist(points, centroids), size)
        if labels is not None and torch.equal(assigned, labels):
            break
        labels = assigned
        sums = torch.zeros_like(centroids).index_add_(0, labels, points)
        counts = torch.bincount(labels, minlength=k)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None]
    return labels


def capacity_assignment(distances: torch.Tensor, size: int) -> torch.Tensor:
    """Each point to a cluster, at most ``size`` per cluster, nearest first: in rounds, every unplaced point asks
    for its nearest cluster with room and each cluster takes the closest of those who asked, up to its room; a
    full cluster is out of later rounds. Needs ``size * clusters >= points``."""
    n, k = distances.shape
    if size * k < n:
        raise ValueError(f"{k} clusters of {size} cannot hold {n} points")
    labels = torch.full((n,), -1, dtype=torch.long, device=distances.device)
    room = torch.full((k,), size, dtype=torch.long, device=distances.device)
    open_distances = distances.clone()
    while True:
        unplaced = (labels < 0).nonzero()[:, 0]
        if unplaced.numel() == 0:
            return labels
        nearest, choice = open_distances[unplaced].min(dim=1)
        by_distance = torch.argsort(nearest, stable=True)
        by_cluster = by_distance[torch.argsort(choice[by_distance], stable=True)]
        chosen = choice[by_cluster]
        asked = torch.bincount(chosen, minlength=k)
        first = torch.cumsum(asked, 0) - asked
        rank = torch.arange(chosen.numel(), device=distances.device) - first[chosen]
        taken = rank < room[chosen]
        labels[unplaced[by_cluster[taken]]] = chosen[taken]
        room -= torch.bincount(chosen[taken], minlength=k)
        open_distances[:, room == 0] = math.inf


# --------------------------------------------------------------------------------------------------------------
# Mass of a layout's best pages


def page_mass(probs: torch.Tensor, labels: torch.Tensor, group: int) -> torch.Tensor:
    """Mass of every page ``[Hq, pages]`` from ``probs [Hq, n]`` over the paged positions and ``labels [Hkv, n]``;
    query head ``h`` reads KV head ``h // group``."""
    per_head = labels.repeat_interleave(group, dim=0)
    n_pages = int(labels.max()) + 1
    return torch.zeros(probs.shape[0], n_pages, dtype=probs.dtype, device=probs.device).scatter_add_(
        1, per_head.to(probs.device), probs)


def best_pages_mass(probs: torch.Tensor, labels: torch.Tensor, group: int, n_pages: int) -> torch.Tensor:
    """Per query head, the mass of the ``n_pages`` pages that hold most of it."""
    masses = page_mass(probs, labels, group)
    return masses.topk(min(n_pages, masses.shape[1]), dim=1).values.sum(1)


def step_probabilities(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Exact attention ``[Hq, T]`` (float64) of ``query [Hq, D]`` over ``keys [Hkv, T, D]``."""
    from icecache.core.selection_quality import attention_probabilities

    return attention_probabilities(query, keys, scaling)


@dataclasses.dataclass
class LayerLayouts:
    """The layouts of one layer's prompt, and what IceCache's frame needs."""

    positional: torch.Tensor
    dci: torch.Tensor
    kmeans: torch.Tensor
    leaves: torch.Tensor  # the DCI page of every middle token [Hkv, middle_end - sink_len]: the index's page ids
    sink_len: int
    middle_end: int
    index: Any  # the DCI index, for its search


def build_layouts(prompt_keys: torch.Tensor, cfg, kmeans_iterations: int = 20, threads: int | None = None
                  ) -> LayerLayouts:
    """The three layouts of ``prompt_keys [Hkv, n, D]`` (the model's dtype, any device)."""
    n_kv_heads, n_tokens, _ = prompt_keys.shape
    ps = cfg.page_size
    sink_len, middle_end = icecache_regions(n_tokens, cfg)
    middle = prompt_keys[:, sink_len:middle_end]
    leaves, index = dci_leaves(middle.cpu(), cfg, threads)
    clusters = torch.stack([balanced_kmeans(middle[h].float(), ps, kmeans_iterations, seed=cfg.seed + h).cpu()
                            for h in range(n_kv_heads)])
    return LayerLayouts(
        positional=positional_pages(n_kv_heads, n_tokens, ps),
        dci=framed_pages(leaves, sink_len, middle_end, n_tokens, ps),
        kmeans=framed_pages(clusters, sink_len, middle_end, n_tokens, ps),
        leaves=leaves, sink_len=sink_len, middle_end=middle_end, index=index,
    )


def layer_quality(layouts: LayerLayouts, queries: torch.Tensor, keys: torch.Tensor, n_prompt: int, scaling: float,
                  budget: int, cfg, n_selected: int) -> dict[str, float]:
    """Mean over query heads and steps of each layout's mass. ``queries [S, Hq, D]``: decode step ``s`` sees the
    ``n_prompt + s + 1`` first rows of ``keys [Hkv, T, D]``."""
    n_heads = queries.shape[1]
    group = n_heads // keys.shape[0]
    n_pages = budget // cfg.page_size
    frame = torch.zeros(n_prompt, dtype=torch.bool)
    frame[: layouts.sink_len] = True
    frame[layouts.middle_end:] = True
    totals = {name: 0.0 for name in LAYOUTS}
    for step, query in enumerate(queries):
        probs = step_probabilities(query, keys[:, : n_prompt + step + 1], scaling)[:, :n_prompt].cpu()
        totals["token_topk"] += float(probs.topk(min(budget, n_prompt), dim=1).values.sum())
        for name in ("positional", "dci", "kmeans"):
            totals[name] += float(best_pages_mass(probs, getattr(layouts, name), group, n_pages).sum())
        fixed = probs[:, frame].sum(1)
        middle = probs[:, layouts.sink_len: layouts.middle_end]
        leaf_mass = page_mass(middle, layouts.leaves, group)
        totals["dci_fixed"] += float((fixed + leaf_mass.topk(min(n_selected, leaf_mass.shape[1]), 1).values.sum(1))
                                     .sum())
        pages, _ = layouts.index.query(query.float().cpu().numpy(), n_selected,
                                       field_of_view=cfg.query_field_of_view,
                                       prop_to_retrieve=cfg.query_prop_to_retrieve, ratio=group)
        found = torch.from_numpy(pages.astype(np.int64))  # [Hq, K], -1 padded
        searched = torch.where(found >= 0, leaf_mass.gather(1, found.clamp(min=0)), 0.0).sum(1)
        totals["dci_search"] += float((fixed + searched).sum())
    count = queries.shape[0] * n_heads
    return {name: total / count for name, total in totals.items()}


# --------------------------------------------------------------------------------------------------------------
# Real prompts, keys and decode queries


def record_full_cache(model, info, prompt_ids: list[int], steps: int, n_dense_layers: int):
    """Greedy decoding of ``steps`` tokens past the prompt with the full cache: per sparsified layer, the decode
    queries ``[steps, Hq, D]``, every key ``[Hkv, T, D]`` and the attention scaling."""
    from eval.plugins import build_method
    from icecache.core.cache import HarnessCache
    from icecache.core.generation import GenerationRequest, greedy_generate

    cache = HarnessCache(build_method({"name": "full"}, info))
    queries: dict[int, list[torch.Tensor]] = {}
    scalings: dict[int, float] = {}
    for kv in cache.layer_kvs[n_dense_layers:]:
        def decode(query, key, value, scaling, kv=kv, original=kv.decode):
            queries.setdefault(kv.layer_idx, []).append(query[0, :, 0].detach().clone())
            scalings[kv.layer_idx] = scaling
            return original(query, key, value, scaling)
        kv.decode = decode
    greedy_generate(model, cache, GenerationRequest(prompt_ids, steps + 1, eos_token_ids=()))
    return {layer: (torch.stack(qs), cache.layer_kvs[layer].keys[0].detach(), scalings[layer])
            for layer, qs in queries.items()}


def prompts(args, spec, tokenizer) -> list[list[int]]:
    """The token ids of ``args.samples`` prompts of the task at ``args.length``."""
    from eval.tasks.base import PromptContext, build_task

    if args.task == "passkey":
        values = {"name": "passkey", "lengths": [args.length], "num_depths": args.samples}
    else:
        values = {"name": "ruler", "lengths": [args.length], "tasks": [args.subtask], "num_samples": args.samples}
        if args.data_dir:
            values["data_dir"] = args.data_dir
    task = build_task(values)
    context = PromptContext(tokenizer=tokenizer, model_name=spec.name, chat_template=spec.chat_template,
                            max_length=spec.max_length)
    return [list(sample.input_ids) for sample in task.samples(context)][: args.samples]


def measure(args) -> dict[str, Any]:
    from eval.latency import model_spec
    from icecache.core.cache import ATTENTION_NAME
    from icecache.core.models import load_model, load_tokenizer, model_info
    from icecache.method import IceCacheConfig

    cfg = IceCacheConfig(budget=args.budget)
    cfg = cfg.fitted_to_budget()
    cfg.check_pages()
    n_selected = args.budget // cfg.page_size - cfg.n_sink_pages - cfg.n_window_pages
    spec = model_spec(args.model, args.source, args.device, args.dtype)
    tokenizer = load_tokenizer(spec)
    info = model_info(spec)
    model, _ = load_model(spec, ATTENTION_NAME, tokenizer=tokenizer)
    per_layer: dict[int, dict[str, list[float]]] = {}
    lengths = []
    for ids in prompts(args, spec, tokenizer):
        if len(ids) <= args.budget:
            raise SystemExit(f"error: a prompt of {len(ids)} tokens fits in the budget {args.budget}: nothing to page")
        lengths.append(len(ids))
        recorded = record_full_cache(model, info, ids, args.steps, cfg.n_dense_layers)
        for layer, (queries, keys, scaling) in sorted(recorded.items()):
            layouts = build_layouts(keys[:, : len(ids)], cfg, args.kmeans_iterations, args.threads)
            result = layer_quality(layouts, queries, keys, len(ids), scaling, args.budget, cfg, n_selected)
            for name, value in result.items():
                per_layer.setdefault(layer, {}).setdefault(name, []).append(value)
            print(f"  {len(ids)} tokens, layer {layer}: " + " ".join(f"{k} {v:.3f}" for k, v in result.items()),
                  flush=True)
    layers = sorted(per_layer)
    by_layer = {name: [float(np.mean(per_layer[layer][name])) for layer in layers] for name in LAYOUTS}
    return {
        "layers": layers, "by_layer": by_layer, "mean": {name: float(np.mean(v)) for name, v in by_layer.items()},
        "prompt_tokens": lengths, "n_selected_pages": n_selected, "page_size": cfg.page_size,
        "icecache": {k: getattr(cfg, k) for k in ("n_sink_pages", "n_window_pages", "promotion_prob",
                                                  "promotion_prob_subseq", "build_field_of_view",
                                                  "build_prop_to_retrieve", "anchor_interval", "anchor_neighbours",
                                                  "anchor_threshold", "query_field_of_view",
                                                  "query_prop_to_retrieve", "seed")},
    }


def print_table(result: dict[str, Any]) -> None:
    mean = result["mean"]
    print(f"\n{'layout':<12} {'mass':>7} {'- dci':>7}   (mean over {len(result['layers'])} layers)")
    for name in LAYOUTS:
        print(f"{name:<12} {mean[name]:>7.3f} {mean[name] - mean['dci']:>+7.3f}")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m", help="model config name in configs/model")
    parser.add_argument("--source", default=None, help="model source (default: the config's)")
    parser.add_argument("--task", choices=["passkey", "ruler"], default="passkey")
    parser.add_argument("--subtask", default="niah_multikey_1", help="with --task ruler: which of its tasks")
    parser.add_argument("--data-dir", default=None, help="with --task ruler: RULER's source texts")
    parser.add_argument("--length", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--samples", type=int, default=2, help="prompts (passkey: depths i / samples)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps whose queries are measured")
    parser.add_argument("--budget", type=int, default=256, help="tokens per query head; pages = budget / page size")
    parser.add_argument("--kmeans-iterations", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="threads of the DCI build (default: all)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"), help="output folder")
    args = parser.parse_args(argv)

    from eval import provenance

    torch.manual_seed(0)
    with torch.inference_mode():
        result = measure(args)
    print_table(result)
    payload = {"kind": "page_quality", "settings": {k: v for k, v in vars(args).items() if k != "out"},
               "result": result, "provenance": provenance.collect()}
    return provenance.write_result(args.out, "page_quality", payload)


if __name__ == "__main__":
    main()
