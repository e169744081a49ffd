#!/usr/bin/env python
"""ShadowKV's chunk selection (the landmark scores, the ranking and the plan, `select_and_plan_triton`) per launch
setting of its scoring kernel, over a whole long context and a batch of rows: how close the scores come to reading
the landmarks at the GPU's memory bandwidth.

    python scripts/diagnostics/shadowkv_score_sweep.py                          # 128k tokens, 1 and 12 rows
    python scripts/diagnostics/shadowkv_score_sweep.py --rows 14 --out results/bench

Llama-3.1-8B's shapes (32 query heads, 8 KV heads, head_dim 128, bf16), ShadowKV's defaults (8-token chunks, 2
outlier chunks, 256 / 8 selected, a window of 4 chunks). With more than one row, one launch per kernel serves the
batch through row tables, as ShadowKV's batched step does. Per setting (`ScoreLaunch`: programs per row, chunks per
loop step, warps, pipelining stages, how the products run): the device time of one selection (CUDA-graph replays of 10,
median of 10) and the landmark bytes over it. Every setting's top chunks are checked against the default's. With
--out, writes shadowkv_score_sweep_<host>_<date>.json with provenance there.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from icecache.core.device_timing import graph_call_us
from icecache.core.kernels.row_table import row_table
from icecache.core.kernels.shadowkv_step import (
    PLAN_ROW_COLUMNS,
    RANK_ROW_COLUMNS,
    SCORE_PRODUCTS,
    SCORE_ROW_COLUMNS,
    ScoreLaunch,
    ShadowKVRowTables,
    ShadowKVSlots,
    ShadowKVStepPlan,
    select_and_plan_triton,
)

N_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
LAYOUT = ShadowKVSlots(chunk_size=8, n_outlier=2, n_selected=32, n_local=4)


def row_state(length: int, seed: int) -> dict[str, torch.Tensor]:
    """One row's selection inputs: landmarks, a query, a few outlier chunks, a slot table of other chunks."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_chunks = length // LAYOUT.chunk_size + 1
    state = {
        "landmarks": torch.randn(N_KV_HEADS, n_chunks, HEAD_DIM, generator=gen, device="cuda").bfloat16(),
        "query": torch.randn(N_HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16(),
        "is_outlier": torch.zeros(N_KV_HEADS, n_chunks, dtype=torch.bool, device="cuda"),
        "outlier_ids": torch.arange(LAYOUT.n_outlier, device="cuda").repeat(N_KV_HEADS, 1),
        "slot_chunk": torch.full((N_KV_HEADS, LAYOUT.n_selected + 1), -1, dtype=torch.long, device="cuda"),
        "position": torch.tensor([length - 1], device="cuda"),
    }
    state["is_outlier"][:, : LAYOUT.n_outlier] = True
    return state


def selection(states: list[dict], launch: ScoreLaunch):
    """A call that selects for every row (batched through row tables when more than one), and the rows' plans."""
    plans = [ShadowKVStepPlan(LAYOUT, N_KV_HEADS, N_HEADS // N_KV_HEADS, s["landmarks"].shape[1],
                              torch.device("cuda"), score_launch=launch) for s in states]
    rows = [{**s, **{name: getattr(plan, name) for name in ("scores", "block_max", "block_sum", "probabilities",
                                                              "block_keys", "top", "copy_pages", "copy_slots",
                                                              "counts", "loaded")}}
            for s, plan in zip(states, plans)]

    def table(columns):
        return row_table([{name: row[name] for name in columns} for row in rows], unaligned=("position",))

    tables = None
    if len(rows) > 1:
        score, rank, plan_table = table(SCORE_ROW_COLUMNS), table(RANK_ROW_COLUMNS), table(PLAN_ROW_COLUMNS)
        tables = ShadowKVRowTables(turn=score, score=score, rank=rank, plan=plan_table, finish=score)
    first = states[0]

    def call():
        select_and_plan_triton(LAYOUT, first["position"], first["query"], first["landmarks"], first["is_outlier"],
                               first["outlier_ids"], first["slot_chunk"], HEAD_DIM ** -0.5, plans[0], rows=tables)
    return call, plans


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=131072, help="context tokens (a multiple of 8)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 12], help="batch sizes")
    parser.add_argument("--programs", type=int, nargs="+", default=[256, 512, 1024, 2048],
                        help="about how many programs a row's scores run (fewer: more chunks each)")
    parser.add_argument("--tiles", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--num-stages", type=int, nargs="+", default=[0, 3], help="0: Triton's default")
    parser.add_argument("--products", nargs="+", default=list(SCORE_PRODUCTS), choices=SCORE_PRODUCTS)
    parser.add_argument("--out", help="folder for a shadowkv_score_sweep_<host>_<date>.json result file")
    args = parser.parse_args(argv)
    if args.length % LAYOUT.chunk_size or args.length < 64 * LAYOUT.chunk_size:
        parser.error(f"--length must be a multiple of {LAYOUT.chunk_size} of at least {64 * LAYOUT.chunk_size}")
    if min(args.rows) < 1:
        parser.error("--rows must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("error: the sweep needs a CUDA device")
    launches = [ScoreLaunch()] + [
        ScoreLaunch(programs=p, tile=t, num_warps=w, num_stages=st or None, products=products)
        for p, t, w, st, products in itertools.product(args.programs, args.tiles, args.num_warps, args.num_stages,
                                                       args.products)]
    results = []
    for n_rows in args.rows:
        states = [row_state(args.length, seed) for seed in range(n_rows)]
        landmark_bytes = sum(s["landmarks"].numel() * s["landmarks"].element_size() for s in states)
        reference_top = None
        for launch in launches:
            fresh = [{**s, "slot_chunk": s["slot_chunk"].clone()} for s in states]
            try:
                call, plans = selection(fresh, launch)
                us = graph_call_us(call, calls_per_graph=10)
            except Exception as error:  # noqa: BLE001  a setting that does not compile (registers, shared memory)
                results.append({"rows": n_rows, **launch.__dict__, "error": str(error).splitlines()[0][:200]})
                continue
            # The top chunks follow from the scores alone (the slot table the replays changed only shapes the copy
            # list), so the timed plans hold the setting's choice.
            top = [plan.top.sort(dim=1).values.cpu() for plan in plans]
            if reference_top is None:
                reference_top = top
            same = all(torch.equal(a, b) for a, b in zip(top, reference_top))
            results.append({"rows": n_rows, **launch.__dict__, "us": us, "landmark_gb_s": landmark_bytes / us / 1e3,
                            "same_top_as_default": same})
    print(f"{'rows':>4} {'programs':>8} {'tile':>4} {'warps':>5} {'stages':>6} {'products':>9} {'us':>8} "
          f"{'GB/s':>6} same")
    for r in results:
        head = (f"{r['rows']:>4} {r['programs']:>8} {r['tile']:>4} {r['num_warps']:>5} {str(r['num_stages']):>6} "
                f"{r['products']:>9}")
        if "error" in r:
            print(f"{head} failed: {r['error']}")
        else:
            print(f"{head} {r['us']:8.1f} {r['landmark_gb_s']:6.0f} {r['same_top_as_default']}")
    if args.out:
        from eval import provenance

        provenance.write_result(args.out, "shadowkv_score_sweep",
                                {"length": args.length, "rows": results, "provenance": provenance.collect()})
    return results


if __name__ == "__main__":
    main()
