#!/usr/bin/env python
"""Time one prefill chunk's attention (``core.attention.dense_attention``: ``chunk`` queries after ``kv - chunk``
earlier keys, bottom-right causal) at several key lengths, with PyTorch's SDPA choosing its kernel and with each
fused kernel forced, to see which kernel a long prompt's chunks get and at what rate.

    python scripts/diagnostics/attention_probe.py --kv 150000 300000 524288 --chunk 8192 --heads 32 --kv-heads 8

Prints effective TFLOP/s (4 * chunk * attended keys * heads * head_dim, the causal triangle counted once) per
kernel and length, and writes results/bench/attention_probe_<host>_<date>.json with provenance.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def time_attention(query, key, value, backend, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``dense_attention`` (after one untimed), with SDPA free to choose
    its kernel (``backend`` None) or held to ``backend``."""
    import contextlib

    import torch
    from torch.nn.attention import sdpa_kernel

    from icecache.core.attention import dense_attention

    def run():
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            return dense_attention(query, key, value, query.shape[-1] ** -0.5)

    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv", type=int, nargs="+", required=True, help="key lengths (the chunk's own included)")
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "results" / "bench"))
    args = parser.parse_args(argv)

    import torch
    from torch.nn.attention import SDPBackend

    from eval import provenance

    if not torch.cuda.is_available():
        raise SystemExit("error: attention_probe.py times CUDA kernels: run it on a GPU host")
    device = torch.device("cuda")
    kernels = {"auto": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    for kv in args.kv:
        query = torch.randn(1, args.heads, args.chunk, args.head_dim, device=device, dtype=torch.bfloat16)
        key = torch.randn(1, args.kv_heads, kv, args.head_dim, device=device, dtype=torch.bfloat16)
        value = torch.randn_like(key)
        attended = args.chunk * (kv - args.chunk) + args.chunk * (args.chunk + 1) / 2
        flops = 4 * attended * args.heads * args.head_dim
        for name, backend in kernels.items():
            try:
                seconds = time_attention(query, key, value, backend, args.repeats)
                row = {"kv": kv, "kernel": name, "seconds": seconds, "tflops": flops / seconds / 1e12}
            except RuntimeError as error:  # a forced kernel that does not take these inputs
                row = {"kv": kv, "kernel": name, "error": str(error).splitlines()[0][:200]}
            rows.append(row)
            print(row, flush=True)
        del query, key, value
        torch.cuda.empty_cache()
    payload = {"kind": "attention_probe", "settings": vars(args), "provenance": provenance.collect(), "rows": rows}
    provenance.write_result(args.out, "attention_probe", payload)


if __name__ == "__main__":
    main()
