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

Writes ``host_step_<machine>_<date>.json`` with provenance to ``--out``.
Usage: python scripts/bench/host_step.py --length 32768 --steps 64 --threads 16
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from eval.latency import llama8b_layer_method

REPO = Path(__file__).resolve().parents[2]


def time_host_steps(length: int, steps: int, threads: int, team_spin_us: int) -> dict[str, list[float]]:
    import torch

    from icecache.core.method import SequenceContext
    from icecache.core.timing import PhaseTimer

    method = llama8b_layer_method(threads, team_spin_us)
    generator = torch.Generator().manual_seed(0)
    timer = PhaseTimer(enabled=True)
    seq = SequenceContext(timer=timer)
    layer = method.make_layer(0, seq)
    times: dict[str, list[float]] = {"search": [], "stage": []}
    try:
        with torch.inference_mode():
            layer.append(torch.randn(1, 8, length, 128, generator=generator).to(torch.bfloat16),
                         torch.randn(1, 8, length, 128, generator=generator).to(torch.bfloat16))
            layer.offload_prompt()
            layer.wait_until_indexed()
            layer.seq_len = length  # what the prefill's forward would have counted
            timer.take_step()
            timer.spans.clear()
            for _ in range(steps):
                query = torch.randn(1, 32, 1, 128, generator=generator).to(torch.bfloat16)
                key = torch.randn(1, 8, 1, 128, generator=generator).to(torch.bfloat16)
                value = torch.randn(1, 8, 1, 128, generator=generator).to(torch.bfloat16)
                layer.forward(query, key, value, None, 128 ** -0.5)
                phases = timer.take_step()
                times["search"].append(phases.get("query", 0.0))
                times["stage"].append(phases.get("load", 0.0))
    finally:
        seq.close()
    times["host_step"] = list(timer.spans["host_step"])
    times["rest"] = [total - search - stage for total, search, stage in
                     zip(times["host_step"], times["search"], times["stage"])]
    times["pages_loaded_per_step"] = [layer.seq.counters.pages_loaded / steps]
    extra = layer.seq.counters.extra  # the searches' phases (QueryPhases), summed over the steps
    times["search_phases_ms_per_step"] = [{name.removeprefix("search_").removesuffix("_ns"): value / steps / 1e6
                                           for name, value in extra.items() if name.endswith("_ns")}]
    return times


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--threads", type=int, default=16, help="OpenMP threads of the index and torch")
    parser.add_argument("--team-spin-us", type=int, default=2000,
                        help="how long the search team spins between steps (2000: the decode step's on a GPU)")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"))
    args = parser.parse_args(argv)
    if args.length < 1024 or args.steps < 2 or args.threads < 1 or args.team_spin_us < 0:
        parser.error("--length must be >= 1024 tokens, --steps >= 2, --threads >= 1 and --team-spin-us >= 0")
    import torch

    from eval import provenance

    torch.set_num_threads(args.threads)
    times = time_host_steps(args.length, args.steps, args.threads, args.team_spin_us)
    summary = {name: statistics.median(values[1:]) * 1e3 for name, values in times.items()
               if name not in ("pages_loaded_per_step", "search_phases_ms_per_step")}
    phases = times["search_phases_ms_per_step"][0]
    print(f"{args.length} tokens, {args.threads} threads, median of steps 2..{args.steps} (ms per layer step): "
          + "  ".join(f"{name} {value:.3f}" for name, value in summary.items())
          + f"  pages loaded per step {times['pages_loaded_per_step'][0]:.1f}")
    print("search phases, mean ms per step: " + "  ".join(f"{name} {ms:.3f}" for name, ms in phases.items()))
    payload = {"what": "one IceCache layer's host work per decode step, Llama-3.1-8B geometry, random bf16 keys "
                       "and queries; seconds per step", "length": args.length, "steps": args.steps,
               "threads": args.threads, "team_spin_us": args.team_spin_us, "median_ms": summary,
               "search_phases_ms": phases, "seconds": times,
               "provenance": provenance.collect()}
    return provenance.write_result(args.out, "host_step", payload)


if __name__ == "__main__":
    main()
