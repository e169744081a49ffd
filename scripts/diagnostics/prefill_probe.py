#!/usr/bin/env python
"""TTFT and TT2T of method variants at one context, interleaved, to find what the prompt phase waits for.

    python scripts/diagnostics/prefill_probe.py --length 32768 --variants full icecache icecache:build_threads=15 \
        icecache:dci_score_precision=float32 --repeats 2

A variant is a method config name with optional ``key=value`` overrides after a colon (comma-separated). Each run
generates two tokens (TTFT = prompt to first token, TT2T = + the first decode step, which waits for the index
builds), and the next run starts only once the previous one's background index jobs are done. Prints a table and
writes results/bench/prefill_probe_<host>_<date>.json with provenance.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from eval.latency import method_values, model_spec

REPO = Path(__file__).resolve().parents[2]


def parse_variant(text: str, budget: int) -> tuple[str, dict]:
    return text, method_values(text, budget, [])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama31_8b")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--variants", nargs="+", required=True)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(REPO / "results" / "bench"))
    args = parser.parse_args(argv)

    import torch

    from eval import provenance
    from eval.plugins import build_method
    from icecache.core.cache import ATTENTION_NAME, HarnessCache
    from icecache.core.generation import GenerationRequest, greedy_generate
    from icecache.core.models import load_model, model_info

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = model_spec(args.model, "random", "auto", "auto")
    info = model_info(spec)
    variants = dict(parse_variant(v, args.budget) for v in args.variants)
    methods = {label: build_method(values, info) for label, values in variants.items()}
    model, _ = load_model(spec, ATTENTION_NAME)
    prompt = torch.randint(0, model.config.vocab_size, (args.length,), generator=torch.Generator().manual_seed(0))
    request = GenerationRequest(input_ids=prompt.tolist(), max_new_tokens=2)
    rows: dict[str, list[tuple[float, float]]] = {label: [] for label in methods}
    for round_index in range(args.repeats + 1):  # the first round warms up
        for label, method in methods.items():
            cache = HarnessCache(method)
            result = greedy_generate(model, cache, request)
            cache.close()  # waits for prompt jobs still running, so that they do not overlap the next round
            if round_index:
                rows[label].append((result.ttft_s, result.tt2t_s))
            del cache
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    summary = [{"variant": label, "context": args.length, "ttft_s": statistics.median(r[0] for r in runs),
                "tt2t_s": statistics.median(r[1] for r in runs), "runs": runs} for label, runs in rows.items()]
    print(f"{'variant':<48} {'TTFT s':>8} {'TT2T s':>8}")
    for row in summary:
        print(f"{row['variant']:<48} {row['ttft_s']:>8.3f} {row['tt2t_s']:>8.3f}")
    provenance.write_result(args.out, "prefill_probe", {"kind": "prefill_probe", "settings": vars(args),
                                                          "provenance": provenance.collect(), "summary": summary})


if __name__ == "__main__":
    main()
