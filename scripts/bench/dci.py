"""Benchmark the DCI index at IceCache's settings: build time, one decode step's query time, and recall.

One layer: 8 KV heads (trees) x n keys x 128 dims, 32 query heads (GQA ratio 4). Settings as IceCache uses them
(configs/method/icecache.yaml): 1 x 1 indices, transform, deterministic levels, promotion 0.01 / 0.2, build fov 30 and
prop_to_retrieve 1.0 with anchors (60, 60, 1.02), query fov max(int(1.5e-3 n), 30) and prop_to_retrieve 0.8,
K = 12 pages. Exact brute force (torch matmul on CPU) runs in the same process as the reference.

Recall, per query head, averaged:
  page recall   |selected pages & exact top-K pages| / K, where exact pages are ranked by their best token q.k
  token recall  |returned tokens & exact top-K tokens| / K
  mass recall   softmax(q.k / sqrt(d)) mass on the tokens of the selected pages / total mass
  oracle mass   the same mass for the exact top-K pages (the ceiling of any best-token page selection)

Data: per head, a mixture of Gaussian clusters with log-normal norm scales and a few large-norm outliers; each
query is aimed at a few keys of one cluster, so attention is concentrated as in real decoding.

Score precision (--score-precision float32 half): one index per precision over the same keys and queries. Their
queries are timed in alternation (one call each, round robin), so that load from elsewhere hits both alike.
`same` is the fraction of query heads whose pages, tokens and scores equal the float32 index's bit for bit, `pages`
the fraction whose set of selected pages equals it (the selection alone).

Key dtype (--key-dtype): the index holds float32 keys, or bfloat16 keys as a KV cache does (the keys rounded to
bfloat16 first; the exact reference scores the same rounded values); --query-dtype bfloat16 rounds the queries too,
as a bf16 model's are. Kernels (--variants): each variant ISA:PREFETCH_ROWS:CHUNK_ROWS[:PREFETCH_LEVEL] sets the
scoring kernels' instruction set (icecache.dci.set_isa) and the scan's speed settings (icecache.dci.set_scan_tuning);
the variants are timed in alternation on the same indexes, like the precisions, and `same` and `pages` then compare
every row with the first variant's float32 result (default: one variant, the current ISA and settings).

Read rate: for each thread count the host's read rate is measured first (icecache.dci.measure_read_rate, the same
OpenMP threads summing a fresh --read-probe-gib buffer), and each row reports the search's own rate (the bytes
``last_query_stats`` says one query read, over its median time) and its share of the host's. Each query is also
timed without a token list (``rank_tokens=False``, the search IceCache's decode step makes; the same rows read), in
turn with the ranked one: ``pages_only_query_ms``, its ``pages_only_read_share``, and whether its pages and their
scores are the ranked query's (``pages_only_same_pages``).

    python scripts/bench/dci.py --sizes 8192 32768 131072 --threads 1 4 16 [--shared-aim] \
        [--score-precision float32 half] [--key-dtype bfloat16] [--query-dtype bfloat16] \
        [--variants avx512:32:256:1 avx512bf16:32:256:2] [--out DIR_OR_FILE.json]
writes results/bench/dci_<hostname>_<date>.json (or into/at --out) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eval.provenance import machine_label
from icecache.dci import (
    DCIIndex,
    KernelSettings,
    default_query_field_of_view,
    measure_read_rate,
    search_read_share,
)
from icecache.dci.index import SCORE_PRECISIONS

REPO = Path(__file__).resolve().parents[2]

N_KV_HEADS, N_Q_HEADS, HEAD_DIM, K_PAGES = 8, 32, 128, 12


def make_keys(rng: np.random.Generator, n: int, n_heads: int = N_KV_HEADS, dim: int = HEAD_DIM,
              n_clusters: int = 64, outlier_frac: float = 0.002) -> np.ndarray:
    """Clustered keys with skewed norms: cluster centre + noise, times a log-normal scale; a few 4x-norm outliers."""
    keys = np.empty((n_heads, n, dim), dtype=np.float32)
    for h in range(n_heads):
        centres = rng.standard_normal((n_clusters, dim)).astype(np.float32) * 1.5
        sizes = rng.dirichlet(np.full(n_clusters, 0.7))
        assign = rng.choice(n_clusters, size=n, p=sizes)
        x = centres[assign] + rng.standard_normal((n, dim)).astype(np.float32)
        x *= rng.lognormal(0.0, 0.35, size=(n, 1)).astype(np.float32)
        outliers = rng.random(n) < outlier_frac
        x[outliers] *= 4.0
        keys[h] = x
    return keys


def make_queries(rng: np.random.Generator, keys: np.ndarray, ratio: int, shared_aim: bool = False) -> np.ndarray:
    """Each query head aims at 3 random keys of its KV head (their normalised mean) plus noise, scaled so the best
    logits stand out by several units, as in a real decode step. With shared_aim, the heads of one GQA group aim at
    the same 3 keys (each with its own noise), so they expand mostly the same parents."""
    n_heads, n, dim = keys.shape
    q = np.empty((n_heads * ratio, dim), dtype=np.float32)
    group_picks = [rng.integers(0, n, size=3) for _ in range(n_heads)] if shared_aim else None
    for h in range(n_heads * ratio):
        idx = group_picks[h // ratio] if shared_aim else rng.integers(0, n, size=3)
        picks = keys[h // ratio, idx]
        direction = picks.mean(0)
        direction /= np.linalg.norm(direction)
        noise = rng.standard_normal(dim).astype(np.float32)
        noise /= np.linalg.norm(noise)
        v = direction + 0.3 * noise
        q[h] = v / np.linalg.norm(v) * 3.0 * math.sqrt(dim) / 4.0
    return q


def exact_reference(keys_t: torch.Tensor, q_t: torch.Tensor, ratio: int, k: int):
    """Exact scores q.k (torch matmul) and top-k tokens for every query head."""
    n_kv, n, d = keys_t.shape
    grouped = q_t.view(n_kv, ratio, d).transpose(1, 2)              # [kv, d, ratio]: query head h -> kv h // ratio
    scores = torch.bmm(keys_t, grouped).permute(0, 2, 1).reshape(n_kv * ratio, n)
    top = torch.topk(scores, k, dim=1).indices
    return scores, top


def recall_metrics(index: DCIIndex, scores: torch.Tensor, pages: np.ndarray, tokens: np.ndarray, ratio: int,
                   exact_tokens: torch.Tensor) -> dict[str, float]:
    nq, n = scores.shape
    probs = torch.softmax(scores / math.sqrt(HEAD_DIM), dim=1).numpy()
    s_np = scores.numpy()
    page_rec, tok_rec, mass, oracle = [], [], [], []
    for h in range(nq):
        inst = h // ratio
        page_of, _ = index.token_to_page(inst)
        n_pages = int(index.num_pages()[inst])
        best = np.full(n_pages, -np.inf, dtype=np.float32)
        np.maximum.at(best, page_of, s_np[h])
        exact_pages = np.argsort(-best, kind="stable")[:K_PAGES]
        chosen = pages[h][pages[h] >= 0]
        page_rec.append(len(set(chosen.tolist()) & set(exact_pages.tolist())) / K_PAGES)
        tok_rec.append(len(set(tokens[h].tolist()) & set(exact_tokens[h].tolist())) / K_PAGES)
        mass.append(float(probs[h][np.isin(page_of, chosen)].sum()))
        oracle.append(float(probs[h][np.isin(page_of, exact_pages)].sum()))
    return {
        "page_recall": float(np.mean(page_rec)),
        "token_recall": float(np.mean(tok_rec)),
        "mass_recall": float(np.mean(mass)),
        "oracle_mass": float(np.mean(oracle)),
    }


def bench_size(n: int, threads: list[int], repeats: int, seed: int, shared_aim: bool = False,
               precisions: tuple[str, ...] = ("float32",), key_dtype: str = "float32",
               read_rates: dict[int, float] | None = None,
               variants: tuple[KernelSettings, ...] | None = None, query_dtype: str = "float32") -> list[dict]:
    variants = variants or (KernelSettings.current(),)
    rng = np.random.default_rng(seed)
    keys = make_keys(rng, n)
    if key_dtype == "bfloat16":  # the values a bfloat16 KV cache holds; the reference scores the same values
        keys = torch.from_numpy(keys).to(torch.bfloat16).float().numpy()
    index_keys = torch.from_numpy(keys).to(torch.bfloat16) if key_dtype == "bfloat16" else keys
    ratio = N_Q_HEADS // N_KV_HEADS
    queries = make_queries(rng, keys, ratio, shared_aim)
    if query_dtype == "bfloat16":  # a bf16 model's queries: bf16 values, handed to the index as float32
        queries = torch.from_numpy(queries).to(torch.bfloat16).float().numpy()
    keys_t, q_t = torch.from_numpy(keys), torch.from_numpy(queries)
    fov = default_query_field_of_view(n)

    def query(index: DCIIndex, rank_tokens: bool = True):
        return index.query(queries, K_PAGES, field_of_view=fov, prop_to_retrieve=0.8, ratio=ratio, return_scores=True,
                           rank_tokens=rank_tokens)

    rows = []
    for t in threads:
        indexes, build_times = {}, {}
        for precision in precisions:
            index = DCIIndex(HEAD_DIM, N_KV_HEADS, promotion_prob=0.01, promotion_prob_subseq=0.2, transform=True,
                             deterministic_levels=True, seed=seed, num_threads=t, score_precision=precision,
                             key_dtype=key_dtype)
            times = []
            for _ in range(max(1, repeats // 10)):
                t0 = time.perf_counter()
                index.build(index_keys, field_of_view=30, prop_to_retrieve=1.0, anchor_interval=60,
                            anchor_neighbours=60, anchor_threshold=1.02)
                times.append(time.perf_counter() - t0)
            indexes[precision], build_times[precision] = index, times
            query(index)  # warm-up
        timed = [(precision, variant) for variant in variants for precision in precisions]
        query_times: dict[tuple[str, KernelSettings], list[float]] = {key: [] for key in timed}
        # the search IceCache's decode step makes: the same pages, no token list (docs/dci.md)
        pages_only_times: dict[tuple[str, KernelSettings], list[float]] = {key: [] for key in timed}
        results, pages_only, bytes_read = {}, {}, {}
        phase_ns: dict[tuple[str, KernelSettings], list[dict[str, int]]] = {key: [] for key in timed}
        for _ in range(repeats):
            for precision, variant in timed:
                variant.apply()
                index = indexes[precision]
                t0 = time.perf_counter()
                results[precision, variant] = query(index)
                query_times[precision, variant].append(time.perf_counter() - t0)
                bytes_read[precision, variant] = index.last_query_stats()["bytes_read"]
                phase_ns[precision, variant].append(index.last_query_phases())
                t0 = time.perf_counter()
                pages_only[precision, variant] = query(index, rank_tokens=False)
                pages_only_times[precision, variant].append(time.perf_counter() - t0)
        variants[0].apply()
        torch.set_num_threads(t)
        exact_times = []
        for _ in range(max(3, repeats // 10)):
            t0 = time.perf_counter()
            scores, exact_tokens = exact_reference(keys_t, q_t, ratio, K_PAGES)
            exact_times.append(time.perf_counter() - t0)
        reference = results.get(("float32", variants[0]))
        for precision, variant in timed:
            index = indexes[precision]
            key = precision, variant
            pages, tokens = results[key][:2]
            query_s = statistics.median(query_times[key])
            pages_only_s = statistics.median(pages_only_times[key])
            read_rate = (read_rates or {}).get(t)
            row = {
                "n": n, "threads": t, "shared_aim": shared_aim, "score_precision": precision,
                "key_dtype": key_dtype, "query_dtype": query_dtype, "variant": variant.label, "isa": variant.isa,
                "prefetch_rows": variant.prefetch_rows, "chunk_rows": variant.chunk_rows,
                "prefetch_level": variant.prefetch_level,
                "bytes_read": bytes_read[key], "search_gbps": bytes_read[key] / query_s / 1e9,
                "host_read_gbps": read_rate / 1e9 if read_rate else None,
                "read_share": search_read_share(bytes_read[key], query_s, read_rate or 0.0),
                "levels": index.num_levels(0), "pages_per_head": float(index.num_pages().mean()),
                "query_fov": fov,
                "build_s": statistics.median(build_times[precision]),
                "query_ms": 1e3 * query_s,
                "query_ms_p90": 1e3 * float(np.percentile(query_times[key], 90)),
                "query_ms_min": 1e3 * min(query_times[key]),
                "pages_only_query_ms": 1e3 * pages_only_s,
                "pages_only_read_share": search_read_share(bytes_read[key], pages_only_s, read_rate or 0.0),
                # the pages (and their scores) of the search without a token list, against the ranked search's
                "pages_only_same_pages": bool(np.array_equal(pages_only[key][0], pages) and np.array_equal(
                    pages_only[key][2], results[key][2], equal_nan=True)),
                "exact_ms": 1e3 * statistics.median(exact_times),
                # the median query's phases (QueryPhases): where a search's time goes at this thread count
                "phases_ms": {name: 1e-6 * statistics.median(p[name] for p in phase_ns[key])
                              for name in phase_ns[key][0]},
            }
            row.update(recall_metrics(index, scores, pages, tokens, ratio, exact_tokens))
            if reference is not None:
                same = np.ones(len(queries), dtype=bool)
                for mine, ref in zip(results[key], reference):
                    same &= np.array([np.array_equal(a, b, equal_nan=True) for a, b in zip(mine, ref)])
                row["same_as_float32"] = float(same.mean())
                # the selection alone: the same set of pages (another order of the sums can swap near-ties)
                row["same_pages"] = float(np.mean([set(a[a >= 0].tolist()) == set(b[b >= 0].tolist())
                                                   for a, b in zip(pages, reference[0])]))
            rows.append(row)
            share = "-" if row["read_share"] is None else f"{row['read_share']:.2f}"
            print(f"  n={n:>7} threads={t:>2} {precision:>7} {variant.label}: build {row['build_s']:.3f} s, "
                  f"query {row['query_ms']:.3f} ms, {row['search_gbps']:.1f} GB/s ({share} of the host's), "
                  f"without tokens {row['pages_only_query_ms']:.3f} ms"
                  f"{'' if row['pages_only_same_pages'] else ' (OTHER PAGES)'}, "
                  f"mass {row['mass_recall']:.3f}; " + phase_summary(row["phases_ms"], t), flush=True)
    return rows


def phase_summary(phases_ms: dict[str, float], threads: int) -> str:
    """A query's phases in ms, and how busy the threads were while scanning."""
    text = " ".join(f"{name} {ms:.3f}" for name, ms in phases_ms.items() if name != "scan_busy")
    scan = phases_ms.get("scan", 0.0)
    return text + (f", scan busy {phases_ms['scan_busy'] / (threads * scan):.0%}" if scan else "")


def provenance() -> dict:
    try:
        from eval.provenance import collect

        info = collect()
    except Exception as exc:  # noqa: BLE001  provenance must never stop a benchmark
        info = {"provenance_error": repr(exc), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
                "command": " ".join(sys.argv)}
    info["numpy"] = np.__version__
    info["omp_threads_env"] = os.environ.get("OMP_NUM_THREADS")
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=50, help="query repetitions (build: repeats // 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shared-aim", action="store_true",
                    help="the query heads of a GQA group aim at the same keys (default: every head aims on its own)")
    ap.add_argument("--score-precision", nargs="+", choices=list(SCORE_PRECISIONS), default=["float32"],
                    help="DCIIndex score_precision values to bench side by side on the same data")
    ap.add_argument("--key-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the dtype the index holds its keys in (bfloat16: as a KV cache holds them)")
    ap.add_argument("--query-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the queries' values (bfloat16: rounded, as a bf16 model's queries are)")
    ap.add_argument("--variants", type=KernelSettings.argument, nargs="+",
                    help="ISA:PREFETCH_ROWS:CHUNK_ROWS[:PREFETCH_LEVEL] kernel settings timed in alternation "
                         "(default: the current)")
    ap.add_argument("--read-probe-gib", type=float, default=1.0,
                    help="buffer size of the host read-rate probe, per thread count (0: no probe)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench",
                    help="a directory (gets dci_<host>_<date>.json) or a .json file path")
    args = ap.parse_args()

    variants = tuple(dict.fromkeys(args.variants or [KernelSettings.current()]))
    read_rates = {t: measure_read_rate(int(args.read_probe_gib * 2**30), t) for t in args.threads} \
        if args.read_probe_gib > 0 else {}
    for t, rate in read_rates.items():
        print(f"host read rate on {t} threads: {rate / 1e9:.1f} GB/s", flush=True)
    rows = []
    for n in args.sizes:
        rows.extend(bench_size(n, args.threads, args.repeats, args.seed, args.shared_aim,
                               tuple(dict.fromkeys(args.score_precision)), args.key_dtype, read_rates, variants,
                               args.query_dtype))
    info = provenance()
    info["threads"] = args.threads
    info["variants"] = [v.label for v in variants]
    info["host_read_gbps"] = {str(t): rate / 1e9 for t, rate in read_rates.items()}
    result = {
        "benchmark": "dci", "provenance": info,
        "settings": {"kv_heads": N_KV_HEADS, "query_heads": N_Q_HEADS, "head_dim": HEAD_DIM, "K_pages": K_PAGES,
                     "num_comp_indices": 1, "num_simp_indices": 1, "transform": True, "deterministic_levels": True,
                     "promotion_prob": [0.01, 0.2], "build": {"field_of_view": 30, "prop_to_retrieve": 1.0,
                     "anchors": [60, 60, 1.02]}, "query": {"field_of_view": "max(int(1.5e-3*n), 30)",
                     "prop_to_retrieve": 0.8, "prop_to_visit": 1.0}, "score_precision": args.score_precision,
                     "key_dtype": args.key_dtype, "query_dtype": args.query_dtype,
                     "variants": [v.label for v in variants]},
        "rows": rows,
    }
    date = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out if args.out.suffix == ".json" else args.out / f"dci_{machine_label()}_{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))

    head = (f"{'n':>7} {'thr':>3} {'scores':>7} {'variant':>20} {'lvls':>4} {'build s':>8} {'query ms':>9} "
            f"{'exact ms':>9} {'GB/s':>6} {'share':>5} {'page rec':>8} {'tok rec':>8} {'mass rec':>8} {'oracle':>7} "
            f"{'same':>5} {'pages':>5}")
    print(head)
    for r in rows:
        same = f"{r['same_as_float32']:>5.2f}" if "same_as_float32" in r else f"{'-':>5}"
        same += f" {r['same_pages']:>5.2f}" if "same_pages" in r else f" {'-':>5}"
        print(f"{r['n']:>7} {r['threads']:>3} {r['score_precision']:>7} {r['variant']:>20} {r['levels']:>4} "
              f"{r['build_s']:>8.3f} "
              f"{r['query_ms']:>9.3f} {r['exact_ms']:>9.2f} {r['search_gbps']:>6.1f} "
              f"{'-' if r['read_share'] is None else format(r['read_share'], '.2f'):>5} "
              f"{r['page_recall']:>8.3f} {r['token_recall']:>8.3f} "
              f"{r['mass_recall']:>8.3f} {r['oracle_mass']:>7.3f} {same}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
