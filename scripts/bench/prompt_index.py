"""Time the parts of one IceCache layer's prompt job (what TT2T waits for, 30 times for Llama-3.1-8B).

After a layer's prefill, IceCache copies the prompt's middle keys and values to the CPU and a worker thread copies
the values into the layer's token store and builds its DCI index over the bf16 keys, which the index then holds
(``IceCacheLayer.offload_prompt``). This script runs that job for one layer of random bf16 keys (Llama-3.1-8B
geometry: 8 KV heads of 128 dimensions) and times its parts (the phase timer's spans ``index_build`` and
``token_store``):

* ``build``: the DCI build (all KV heads, ``--threads`` OpenMP threads);
* ``token_store``: the values copied into the token store, sized from the announced length;
* ``job_total``: the whole job (the copy to the CPU, the store, the build and the bookkeeping around them).

Writes ``prompt_index_<host>_<date>.json`` with provenance to ``--out``.
Usage: python scripts/bench/prompt_index.py --lengths 32768 131072 --threads 16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from eval.latency import llama8b_layer_method

REPO = Path(__file__).resolve().parents[2]


def time_layer(length: int, threads: int, repeats: int) -> dict[str, list[float]]:
    import torch

    from icecache.core.method import SequenceContext
    from icecache.core.timing import PhaseTimer

    method = llama8b_layer_method(threads)
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 8, length, 128, generator=generator).to(torch.bfloat16)
    values = torch.randn(1, 8, length, 128, generator=generator).to(torch.bfloat16)
    rows: dict[str, list[float]] = {}
    for _ in range(repeats):
        timer = PhaseTimer(enabled=True)
        seq = SequenceContext(timer=timer, max_total_tokens=length + 64)  # a decode run announces its length
        layer = method.make_layer(0, seq)
        try:
            with torch.inference_mode():
                start = time.perf_counter()
                layer.append(keys, values)
                layer.offload_prompt()
                layer.wait_until_indexed()
                rows.setdefault("job_total", []).append(time.perf_counter() - start)
                rows.setdefault("build", []).extend(timer.spans["index_build"])
                rows.setdefault("token_store", []).extend(timer.spans["token_store"])
        finally:
            seq.close()
    return rows


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768])
    parser.add_argument("--threads", type=int, default=16, help="OpenMP threads of the index and torch")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per length (all are recorded)")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"))
    args = parser.parse_args(argv)
    if any(length < 1024 for length in args.lengths) or args.threads < 1 or args.repeats < 1:
        parser.error("--lengths must be >= 1024 tokens, --threads and --repeats >= 1")
    import torch
    from tqdm.auto import tqdm

    from eval import provenance

    torch.set_num_threads(args.threads)
    results = []
    for length in tqdm(args.lengths, desc="lengths"):
        seconds = time_layer(length, args.threads, args.repeats)
        results.append({"length": length, "seconds": seconds})
        # A decode run builds each layer once, on fresh memory: the first round is the realistic one (page faults
        # of new allocations included); later rounds show the same work on warm memory.
        print(f"{length:>7} tokens, first / best round: " + "  ".join(
            f"{name} {times[0]:.3f} / {min(times):.3f} s" for name, times in seconds.items()))
    payload = {"what": "one IceCache layer's prompt job, Llama-3.1-8B geometry, bf16 keys; seconds per round",
               "threads": args.threads, "repeats": args.repeats, "results": results,
               "provenance": provenance.collect()}
    return provenance.write_result(args.out, "prompt_index", payload)


if __name__ == "__main__":
    main()
