#!/usr/bin/env python
"""How close the paged decode attention comes to the GPU's memory bandwidth over a whole long context, per launch
setting: what `full_static` (and every method's dense layers) pays per layer and row.

    python scripts/diagnostics/attention_sweep.py                           # 32k and 128k tokens, the default grid
    python scripts/diagnostics/attention_sweep.py --lengths 131072 --programs-per-sm 2 8 --out results/bench

One decode query (32 query heads, 8 KV heads, head_dim 128, bf16: Llama-3.1-8B's shapes) over every 16-token page of
a static buffer laid out as full_static's (`[pages, Hkv, 16, D]`, the page table in order), per setting
(programs per SM, which sets the split count; token rows per loop step; warps; pipelining stages): the device time
of one call (CUDA-graph replays of 20 calls, median of 10) and the KV bytes it reads over that time. PyTorch's
dense SDPA on the same keys is timed for comparison. Every setting's output is checked against the default
setting's (float32 tolerance: the splits sum in another order). With --out, writes attention_sweep_<host>_<date>.json
with provenance there.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from icecache.core.device_timing import graph_call_us
from icecache.core.kernels.paged_decode_attention import PagedAttentionPlan, paged_decode_attention_triton

N_HEADS, N_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16


def sweep(length: int, settings: list[tuple[int, int, int, int]]) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(length)
    n_pages = length // PAGE_SIZE
    shape = (n_pages, N_KV_HEADS, PAGE_SIZE, HEAD_DIM)
    keys = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    query = torch.randn(N_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(n_pages, device="cuda", dtype=torch.int32).expand(N_KV_HEADS, n_pages).contiguous()
    counts = torch.full_like(table, PAGE_SIZE)
    scaling = HEAD_DIM ** -0.5
    kv_bytes = 2 * keys.numel() * keys.element_size()
    reference = paged_decode_attention_triton(query, keys, values, table, counts, scaling, PagedAttentionPlan())
    rows = []
    for programs_per_sm, block_tokens, num_warps, num_stages in settings:
        plan = PagedAttentionPlan(programs_per_sm=programs_per_sm, block_tokens=block_tokens, num_warps=num_warps,
                                  num_stages=num_stages)
        out = torch.empty_like(query)
        try:
            us = graph_call_us(lambda plan=plan, out=out: paged_decode_attention_triton(
                query, keys, values, table, counts, scaling, plan, out=out))
        except Exception as error:  # noqa: BLE001  a setting that does not compile (registers, shared memory)
            rows.append({"length": length, "programs_per_sm": programs_per_sm, "block_tokens": block_tokens,
                         "num_warps": num_warps, "num_stages": num_stages, "error": str(error).splitlines()[0][:200]})
            continue
        torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=2e-3)
        rows.append({"length": length, "programs_per_sm": programs_per_sm, "block_tokens": block_tokens,
                     "num_warps": num_warps, "num_stages": num_stages,
                     "n_splits": plan.splits(query, keys, table)[0], "us": us, "gb_s": kv_bytes / us / 1e3})
    dense_keys = keys.permute(1, 0, 2, 3).reshape(1, N_KV_HEADS, length, HEAD_DIM)
    dense_values = values.permute(1, 0, 2, 3).reshape(1, N_KV_HEADS, length, HEAD_DIM)
    dense_query = query.view(1, N_HEADS, 1, HEAD_DIM)
    us = graph_call_us(lambda: F.scaled_dot_product_attention(dense_query, dense_keys, dense_values, scale=scaling,
                                                          enable_gqa=True))
    rows.append({"length": length, "kernel": "sdpa_dense", "us": us, "gb_s": kv_bytes / us / 1e3})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--num-stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--out", help="folder for an attention_sweep_<host>_<date>.json result file")
    args = parser.parse_args(argv)
    if any(length % PAGE_SIZE for length in args.lengths):
        parser.error(f"every --lengths must be a multiple of the page size ({PAGE_SIZE})")
    if not torch.cuda.is_available():
        raise SystemExit("error: the attention sweep needs a CUDA device")
    settings = list(itertools.product(args.programs_per_sm, args.block_tokens, args.num_warps, args.num_stages))
    rows = [row for length in args.lengths for row in sweep(length, settings)]
    print(f"{'length':>7} {'setting':<34} {'splits':>6} {'us':>9} {'GB/s':>7}")
    for row in rows:
        setting = (row.get("kernel") or f"{row['programs_per_sm']}/SM, {row['block_tokens']} rows, "
                   f"{row['num_warps']}w, {row['num_stages']}st")
        if "error" in row:
            print(f"{row['length']:>7} {setting:<34} failed: {row['error']}")
            continue
        print(f"{row['length']:>7} {setting:<34} {row.get('n_splits', '-'):>6} {row['us']:9.1f} {row['gb_s']:7.0f}")
    if args.out:
        from eval import provenance

        provenance.write_result(args.out, "attention_sweep", {"rows": rows, "provenance": provenance.collect()})
    return rows


if __name__ == "__main__":
    main()
