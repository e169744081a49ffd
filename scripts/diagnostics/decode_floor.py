#!/usr/bin/env python
"""The physical floor of one batch-1 decode step: bytes and FLOPs per token, and the time they need at the GPU's
peak rates (issue 8 asks for it next to every missed target).

    python scripts/diagnostics/decode_floor.py --model llama31_8b --lengths 32768 131072 --budget 256 --n-dense-layers 2

Counts, per generated token: every weight read once (the embedding: one row), the KV the attention reads (all of
it for the full cache; ``budget`` tokens per KV head in IceCache's sparsified layers, all of it in its dense
layers), 2 FLOPs per weight and 4 per attended key and head dimension per query head. Peak rates default to the
H200 SXM data sheet (4.8 TB/s HBM3e, 989 dense bf16 TFLOP/s); decode at batch 1 is far below the ridge point,
so the byte count is the bound.
"""

from __future__ import annotations

import argparse

from eval.latency import model_values


def step_cost(config: dict, context: int, attended_per_layer: list[int], bytes_per_value: int = 2) -> dict:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    n_layers, n_heads = config["num_hidden_layers"], config["num_attention_heads"]
    n_kv_heads = config.get("num_key_value_heads") or n_heads
    head_dim = config.get("head_dim") or hidden // n_heads
    vocab = config["vocab_size"]
    per_layer = (hidden * n_heads * head_dim * 2 + hidden * n_kv_heads * head_dim * 2 + 3 * hidden * inter
                 + 2 * hidden)
    weights = n_layers * per_layer + vocab * hidden + hidden  # the LM head and the final norm
    kv_bytes = sum(2 * n_kv_heads * head_dim * tokens * bytes_per_value for tokens in attended_per_layer)
    flops = 2 * weights + sum(4 * n_heads * head_dim * tokens for tokens in attended_per_layer)
    return {"weight_bytes": (weights + hidden) * bytes_per_value, "kv_bytes": kv_bytes, "flops": flops}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama31_8b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--n-dense-layers", type=int, default=2)
    parser.add_argument("--hbm-tb-s", type=float, default=4.8, help="device memory bandwidth, TB/s")
    parser.add_argument("--tflops", type=float, default=989.0, help="dense bf16 tensor throughput, TFLOP/s")
    args = parser.parse_args(argv)
    config = model_values(args.model)["config"]
    n_layers = config["num_hidden_layers"]
    print(f"{'context':>8} {'cache':<9} {'weights GB':>10} {'KV GB':>7} {'GFLOP':>7} {'HBM floor ms':>12} "
          f"{'FLOP floor ms':>13}")
    for context in args.lengths:
        layouts = {
            "full": [context] * n_layers,
            "icecache": [context] * args.n_dense_layers + [args.budget] * (n_layers - args.n_dense_layers),
        }
        for name, attended in layouts.items():
            cost = step_cost(config, context, attended)
            moved = cost["weight_bytes"] + cost["kv_bytes"]
            print(f"{context:>8} {name:<9} {cost['weight_bytes'] / 1e9:>10.2f} {cost['kv_bytes'] / 1e9:>7.2f} "
                  f"{cost['flops'] / 1e9:>7.1f} {1e3 * moved / (args.hbm_tb_s * 1e12):>12.2f} "
                  f"{1e3 * cost['flops'] / (args.tflops * 1e12):>13.3f}")


if __name__ == "__main__":
    main()
