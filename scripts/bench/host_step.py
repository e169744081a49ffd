"""Time one IceCache layer's host work per decode step (what each layer's host function does in a captured step).

One sparsified layer with the Llama-3.1-8B geometry (32 query / 8 KV heads of 128 dimensions, budget 256) is
prefilled with ``--length`` random bf16 tokens on the CPU; its prompt index is built, then ``--steps`` decode steps
run with random queries (the worst case for loading: nearly every selected page changes at every step, as with
the random-weight model of the latency benchmark). The parts of the layer's host step are read from the phase
timer per step:

* ``search``: the DCI query and the merge of each GQA group's ranked pages (the step's ``query`` phase);
* ``stage``: the diff against the slots and the gather of the pages to load into the decode buffers (``load``);
* ``rest``: the window bookkeeping (and, every 16 steps, the offload of the oldest window page into the index),
  the valid counts and the counters: host work that the latency phases count as ``model``;
* ``host_step``: all of it (the timer's span ``host_step``).

``--variants`` times kernel settings of the DCI index (``ISA:PREFETCH_ROWS:CHUNK_ROWS[:PREFETCH_LEVEL]``, docs/dci.md)
against each other on the same layer: they take turns step by step, so that load from elsewhere hits them alike.

Writes ``host_step_<machine>_<date>.json`` with provenance to ``--out``.
Usage: python scripts/bench/host_step.py --length 32768 --steps 64 --threads 16 [--variants avx512:32:256:1 ...]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from eval.latency import llama8b_layer_method
from icecache.dci import KernelSettings

REPO = Path(__file__).resolve().parents[2]


def time_host_steps(length: int, steps: int, threads: int, team_spin_us: int,
                    variants: tuple[KernelSettings, ...]) -> dict[str, dict[str, list]]:
    """Per kernel setting (its label), the parts of each of its steps; the settings take turns, step by step."""
    import torch

    from icecache.core.method import SequenceContext
    from icecache.core.timing import PhaseTimer

    method = llama8b_layer_method(threads, team_spin_us)
    generator = torch.Generator().manual_seed(0)
    timer = PhaseTimer(enabled=True)
    seq = SequenceContext(timer=timer)
    layer = method.make_layer(0, seq)
    times = {v.label: {"search": [], "stage": [], "host_step": [], "pages_loaded": [], "phases_ns": []}
             for v in variants}
    try:
        with torch.inference_mode():
            layer.append(torch.randn(1, 8, length, 128, generator=generator).to(torch.bfloat16),
                         torch.randn(1, 8, length, 128, generator=generator).to(torch.bfloat16))
            layer.offload_prompt()
            layer.wait_until_indexed()
            layer.seq_len = length  # what the prefill's forward would have counted
            timer.take_step()
            timer.spans.clear()
            for step in range(steps * len(variants)):
                variant = variants[step % len(variants)]
                variant.apply()
                query = torch.randn(1, 32, 1, 128, generator=generator).to(torch.bfloat16)
                key = torch.randn(1, 8, 1, 128, generator=generator).to(torch.bfloat16)
                value = torch.randn(1, 8, 1, 128, generator=generator).to(torch.bfloat16)
                counters = layer.seq.counters
                loaded, extra = counters.pages_loaded, dict(counters.extra)
                spans = len(timer.spans.get("host_step", ()))
                layer.forward(query, key, value, None, 128 ** -0.5)
                phases = timer.take_step()
                mine = times[variant.label]
                mine["search"].append(phases.get("query", 0.0))
                mine["stage"].append(phases.get("load", 0.0))
                mine["host_step"].append(sum(timer.spans["host_step"][spans:]))
                mine["pages_loaded"].append(counters.pages_loaded - loaded)
                # the search's phases (QueryPhases) of this step
                mine["phases_ns"].append({name: value - extra.get(name, 0) for name, value in counters.extra.items()
                                          if name.endswith("_ns")})
    finally:
        seq.close()
        variants[0].apply()
    for mine in times.values():
        mine["rest"] = [total - search - stage for total, search, stage in
                        zip(mine["host_step"], mine["search"], mine["stage"])]
    return times


def summarize(mine: dict[str, list]) -> dict:
    """Medians of steps 2.. in ms, pages loaded per step, and the search's phases in ms per step (means)."""
    n = len(mine["search"])
    return {
        "median_ms": {name: statistics.median(mine[name][1:]) * 1e3
                      for name in ("search", "stage", "host_step", "rest")},
        "pages_loaded_per_step": sum(mine["pages_loaded"]) / n,
        "search_phases_ms": {name.removeprefix("search_").removesuffix("_ns"): sum(p.get(name, 0)
                             for p in mine["phases_ns"]) / n / 1e6 for name in mine["phases_ns"][0]},
        "seconds": {name: mine[name] for name in ("search", "stage", "host_step", "rest")},
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=64, help="steps per kernel setting")
    parser.add_argument("--threads", type=int, default=16, help="OpenMP threads of the index and torch")
    parser.add_argument("--team-spin-us", type=int, default=2000,
                        help="how long the search team spins between steps (2000: the decode step's on a GPU)")
    parser.add_argument("--variants", type=KernelSettings.argument, nargs="+",
                        help="ISA:PREFETCH_ROWS:CHUNK_ROWS[:PREFETCH_LEVEL] kernel settings taking turns step by step "
                             "on the same layer (default: the current ones)")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"))
    args = parser.parse_args(argv)
    if args.length < 1024 or args.steps < 2 or args.threads < 1 or args.team_spin_us < 0:
        parser.error("--length must be >= 1024 tokens, --steps >= 2, --threads >= 1 and --team-spin-us >= 0")
    import torch

    from eval import provenance

    torch.set_num_threads(args.threads)
    variants = tuple(dict.fromkeys(args.variants or [KernelSettings.current()]))
    times = time_host_steps(args.length, args.steps, args.threads, args.team_spin_us, variants)
    results = []
    for variant in variants:
        summary = summarize(times[variant.label])
        results.append({"kernel_settings": variant.label, **summary})
        print(f"{variant.label}: {args.length} tokens, {args.threads} threads, median of steps 2..{args.steps} "
              "(ms per layer step): " + "  ".join(f"{name} {value:.3f}" for name, value in summary["median_ms"].items())
              + f"  pages loaded per step {summary['pages_loaded_per_step']:.1f}")
        print("  search phases, mean ms per step: "
              + "  ".join(f"{name} {ms:.3f}" for name, ms in summary["search_phases_ms"].items()))
    first = results[0]
    payload = {"what": "one IceCache layer's host work per decode step, Llama-3.1-8B geometry, random bf16 keys "
                       "and queries; seconds per step", "length": args.length, "steps": args.steps,
               "threads": args.threads, "team_spin_us": args.team_spin_us,
               # the first setting's parts at the top (as files with one setting have them), every setting's below
               "kernel_settings": first["kernel_settings"], "median_ms": first["median_ms"],
               "search_phases_ms": first["search_phases_ms"],
               "seconds": {**first["seconds"], "pages_loaded_per_step": [first["pages_loaded_per_step"]]},
               "variants": results, "provenance": provenance.collect()}
    return provenance.write_result(args.out, "host_step", payload)


if __name__ == "__main__":
    main()
