#!/usr/bin/env python
"""GPU host check of the shared core's kernels: correctness tests, then kernel and page-copy timings.

    PYTHONPATH=. python scripts/gpu_check.py [--skip-tests] [--commit SHA] [--out results/bench/kernels_<host>.json]

1. Runs the GPU kernel tests (``pytest -m gpu tests/test_paged_attention.py tests/test_selection_kernels.py``;
   without pytest, a built-in comparison of the Triton attention with the PyTorch reference stands in).
2. Times, for Llama-3.1-8B decode shapes (32 query heads, 8 KV heads, head_dim 128, bf16, pages of 16 tokens),
   the Triton paged decode attention, the PyTorch reference on the GPU, and dense SDPA over the same number of
   contiguous tokens, for selections of 16 pages (256 tokens) to 1024 pages (16k tokens).
3. Times the page copies the methods call, for IceCache's per-layer load (8 heads x 12 pages) and larger ones: the
   page scatter out of a device transit buffer (IceCache), the block copy from device memory and from a pinned
   host store read in place (ArkVale, ShadowKV, PQCache), against a raw host-to-device copy of the same bytes.

Prints a short table and writes a JSON file with provenance (git commit, GPU, CPU, torch/Triton/CUDA versions,
date). Needs only torch and Triton (no hydra, no DCI extension).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eval.provenance import cpu_model  # stdlib-only at import
from icecache.core.device_timing import graph_call_us, median_event_seconds
from icecache.core.kernels import triton_runtime
from icecache.core.kernels.block_copy import copy_blocks_triton
from icecache.core.kernels.page_scatter import PageScatterPlan, scatter_pages_triton
from icecache.core.kernels.paged_decode_attention import (
    DEFAULT_BLOCK_TOKENS,
    PagedAttentionPlan,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from icecache.core.paged import GpuPagePool, mapped_device_view

REPO = Path(__file__).resolve().parent.parent

N_HEADS, N_KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16  # Llama-3.1-8B attention geometry, IceCache pages
DTYPE = torch.bfloat16


# ------------------------------------------------------------------------------------------------- provenance


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if commit.returncode != 0:
        return "unknown"
    return commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def provenance(commit: str | None) -> dict:
    triton_version = None
    if triton_runtime.TRITON_IMPORT_ERROR is None:
        triton_version = triton_runtime.triton.__version__
    return {
        "git_commit": commit or os.environ.get("ICECACHE_GIT_COMMIT") or git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "gpu": torch.cuda.get_device_name(0),
        "gpu_count": torch.cuda.device_count(),
        "cpu": cpu_model(),
        "cpu_threads": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "driver_capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
    }


# ------------------------------------------------------------------------------------------------- correctness


def run_gpu_tests() -> dict:
    """``pytest -m gpu`` on the kernel tests, in a subprocess. ``--noconftest``: the shared fixtures load
    transformers models, which these tests do not need and the GPU host may not have."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"ran": False, "reason": "pytest is not installed"}
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "--noconftest", "-q", "-p", "no:cacheprovider",
               "tests/test_paged_attention.py", "tests/test_selection_kernels.py"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    print(result.stdout[-4000:], result.stderr[-2000:], sep="\n")
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return {"ran": True, "returncode": result.returncode, "summary": lines[-1] if lines else ""}


def selection(n_pages: int, gen: torch.Generator, n_pool_pages: int | None = None):
    """Per KV head, ``n_pages`` distinct pool pages in random order; about a quarter of them partly filled."""
    n_pool_pages = n_pool_pages or 2 * n_pages
    table = torch.stack([torch.randperm(n_pool_pages, generator=gen)[:n_pages] for _ in range(N_KV_HEADS)])
    counts = torch.full((N_KV_HEADS, n_pages), PAGE_SIZE)
    partial = torch.rand(N_KV_HEADS, n_pages, generator=gen) < 0.25
    counts[partial] = torch.randint(8, PAGE_SIZE + 1, (int(partial.sum()),), generator=gen)
    query = torch.randn(N_HEADS, HEAD_DIM, generator=gen)
    key_pages = torch.randn(n_pool_pages, N_KV_HEADS, PAGE_SIZE, HEAD_DIM, generator=gen)
    value_pages = torch.randn(n_pool_pages, N_KV_HEADS, PAGE_SIZE, HEAD_DIM, generator=gen)
    return (query.cuda().to(DTYPE), key_pages.cuda().to(DTYPE), value_pages.cuda().to(DTYPE),
            table.cuda().int(), counts.cuda().int())


def builtin_correctness() -> list[dict]:
    """Max abs difference of the Triton attention from the reference on the benchmark shapes (bf16 and fp32)."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    plan = PagedAttentionPlan()
    for n_pages in (1, 16, 300, 1024):
        query, keys, values, table, counts = selection(n_pages, gen)
        table[:, ::7] = -1  # padding entries
        table[:, 0] = 0
        for dtype in (torch.bfloat16, torch.float32):
            args = (query.to(dtype), keys.to(dtype), values.to(dtype), table, counts, HEAD_DIM**-0.5)
            error = (paged_decode_attention_triton(*args, plan).float()
                     - paged_decode_attention_reference(*args).float()).abs().max().item()
            rows.append({"n_pages": n_pages, "dtype": str(dtype).replace("torch.", ""), "max_abs_error": error})
    return rows


# ------------------------------------------------------------------------------------------------- timing


def cuda_time_us(fn, reps: int = 200, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time per call of ``reps`` back-to-back calls (launch cost included)."""
    def calls() -> None:
        for _ in range(reps):
            fn()

    device = torch.device("cuda", torch.cuda.current_device())
    return median_event_seconds(calls, device, repeats, warmup=1) * 1e6 / reps


def _time_per_call_us(fn, reps: int, repeats: int, sync_every_call: bool) -> float:
    """Median over ``repeats`` of the mean host wall time per call of ``reps`` calls, after a warm-up."""
    for _ in range(max(reps, 5)):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
            if sync_every_call:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / reps)
    return statistics.median(times)


def host_time_us(fn, reps: int = 20, repeats: int = 20) -> float:
    """``reps`` calls, then one device sync (what a decode step that syncs once per token sees when the host, not
    the GPU, is the bottleneck)."""
    return _time_per_call_us(fn, reps, repeats, sync_every_call=False)


def bench_attention() -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(1)
    scaling = HEAD_DIM**-0.5
    for n_pages in (16, 64, 256, 1024):
        query, key_pages, value_pages, table, counts = selection(n_pages, gen)
        n_tokens = n_pages * PAGE_SIZE
        dense_keys = torch.randn(1, N_KV_HEADS, n_tokens, HEAD_DIM, device="cuda", dtype=DTYPE)
        dense_values = torch.randn_like(dense_keys)
        dense_query = query.view(1, N_HEADS, 1, HEAD_DIM)
        args = (query, key_pages, value_pages, table, counts, scaling)
        kv_bytes = 2 * N_KV_HEADS * n_tokens * HEAD_DIM * 2
        row = {"n_pages": n_pages, "n_tokens": n_tokens, "kv_bytes": kv_bytes}
        for block_tokens in (32, 64, 128):
            plan = PagedAttentionPlan(block_tokens=block_tokens)
            row[f"triton_us_block{block_tokens}"] = cuda_time_us(lambda: paged_decode_attention_triton(*args, plan))
        row["triton_us"] = row[f"triton_us_block{DEFAULT_BLOCK_TOKENS}"]
        eight_warps = PagedAttentionPlan(num_warps=8)
        row["triton_us_8warps"] = cuda_time_us(lambda: paged_decode_attention_triton(*args, eight_warps))
        # Per-call host cost: direct launches (default), Triton's own launch path, one split, out=.
        plan, one_split, jit_launch = PagedAttentionPlan(), PagedAttentionPlan(n_splits=1), \
            PagedAttentionPlan(direct_launch=False)
        row["n_splits"] = plan.splits(query, key_pages, table)[0]
        row["triton_host_us"] = host_time_us(lambda: paged_decode_attention_triton(*args, plan))
        out = torch.empty_like(query)
        row["triton_host_out_us"] = host_time_us(lambda: paged_decode_attention_triton(*args, plan, out=out))
        row["triton_host_1split_us"] = host_time_us(lambda: paged_decode_attention_triton(*args, one_split))
        row["triton_us_1split"] = cuda_time_us(lambda: paged_decode_attention_triton(*args, one_split))
        row["triton_host_jit_launch_us"] = host_time_us(lambda: paged_decode_attention_triton(*args, jit_launch))
        try:  # device time alone: the calls replayed from a CUDA graph carry no host cost
            row["triton_graph_us"] = graph_call_us(lambda: paged_decode_attention_triton(*args, plan, out=out))
        except Exception as error:  # noqa: BLE001 - a report line, not a failure
            row["triton_graph_us"] = float("nan")
            print(f"graph capture failed: {error!r}")
        row["reference_us"] = cuda_time_us(lambda: paged_decode_attention_reference(*args), reps=50)
        row["sdpa_dense_us"] = cuda_time_us(lambda: F.scaled_dot_product_attention(
            dense_query, dense_keys, dense_values, scale=scaling, enable_gqa=True))
        row["triton_gb_s"] = kv_bytes / row["triton_us"] / 1e3
        rows.append(row)
    return rows


def bench_page_copies() -> list[dict]:
    """The page copies of IceCache's per-layer load (8 heads x 12 pages = 768 KiB), 4 and 32 layers' worth, and
    2048 pages per head (128 MiB): the scatter out of a device transit buffer, the block copy from device memory
    and from a pinned store read in place, and a raw pinned host-to-device copy of the same bytes."""
    rows = []
    gen = torch.Generator().manual_seed(2)
    n_store_pages = 4096
    store_shape = (n_store_pages, N_KV_HEADS, PAGE_SIZE, HEAD_DIM)
    host_store = [torch.randn(store_shape, generator=gen).to(DTYPE).pin_memory() for _ in range(2)]
    mapped_store = [mapped_device_view(pages, torch.device("cuda")) for pages in host_store]
    device_store = [pages.cuda() for pages in host_store]
    for pages_per_head, label in ((12, "1 layer, 12 pages/head"), (48, "4 layers"), (384, "32 layers"),
                                  (2048, "2048 pages/head")):
        n_blocks = N_KV_HEADS * pages_per_head
        pool = GpuPagePool(pages_per_head, N_KV_HEADS, PAGE_SIZE, HEAD_DIM, DTYPE, "cuda")
        page_ids = torch.randint(0, n_store_pages, (n_blocks,), generator=gen)
        heads = torch.arange(N_KV_HEADS).repeat(pages_per_head)
        slots = torch.arange(pages_per_head).repeat_interleave(N_KV_HEADS)
        n_bytes = 2 * n_blocks * PAGE_SIZE * HEAD_DIM * DTYPE.itemsize
        device_pages, device_slots, device_heads = page_ids.cuda(), slots.cuda(), heads.cuda()

        copy_blocks_triton(*mapped_store, device_pages, pool.key_pages, pool.value_pages, device_slots, device_heads)
        torch.cuda.synchronize()
        assert torch.equal(pool.key_pages[slots, heads].cpu(), host_store[0][page_ids, heads])
        copy_device_us = cuda_time_us(lambda: copy_blocks_triton(
            *device_store, device_pages, pool.key_pages, pool.value_pages, device_slots, device_heads), reps=50)
        copy_mapped_us = cuda_time_us(lambda: copy_blocks_triton(
            *mapped_store, device_pages, pool.key_pages, pool.value_pages, device_slots, device_heads), reps=20)
        copy_host_us = host_time_us(lambda: copy_blocks_triton(
            *mapped_store, device_pages, pool.key_pages, pool.value_pages, device_slots, device_heads))

        transit = [torch.randn(n_blocks, PAGE_SIZE, HEAD_DIM, generator=gen).to(DTYPE).cuda() for _ in range(2)]
        plan = PageScatterPlan()
        scatter_pages_triton(*transit, pool.key_pages, pool.value_pages, device_slots, device_heads, plan)
        torch.cuda.synchronize()
        assert torch.equal(pool.value_pages[slots, heads], transit[1])
        scatter_us = cuda_time_us(lambda: scatter_pages_triton(
            *transit, pool.key_pages, pool.value_pages, device_slots, device_heads, plan), reps=50)
        scatter_host_us = host_time_us(lambda: scatter_pages_triton(
            *transit, pool.key_pages, pool.value_pages, device_slots, device_heads, plan))

        pinned = torch.empty(2, n_blocks, PAGE_SIZE, HEAD_DIM, dtype=DTYPE, pin_memory=True)
        on_device = torch.empty_like(pinned, device="cuda")
        copy_us = cuda_time_us(lambda: on_device.copy_(pinned, non_blocking=True), reps=20)
        rows.append({
            "load": label, "blocks": n_blocks, "bytes": n_bytes, "scatter_us": scatter_us,
            "scatter_host_us": scatter_host_us, "copy_blocks_device_us": copy_device_us,
            "copy_blocks_mapped_us": copy_mapped_us, "copy_blocks_mapped_gb_s": n_bytes / copy_mapped_us / 1e3,
            "copy_blocks_host_us": copy_host_us, "h2d_copy_us": copy_us, "h2d_gb_s": n_bytes / copy_us / 1e3,
        })
    return rows


# ------------------------------------------------------------------------------------------------- main


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n{title}")
    print(" | ".join(f"{c:>14}" for c in columns))
    for row in rows:
        cells = []
        for c in columns:
            value = row[c]
            cells.append(f"{value:>14.1f}" if isinstance(value, float) else f"{value!s:>14}")
        print(" | ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-tests", action="store_true", help="skip pytest -m gpu")
    parser.add_argument("--commit", default=None, help="git commit to record when the tree has no .git")
    parser.add_argument("--out", default=None, help="JSON path (default results/bench/kernels_<host>.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on the GPU host")
        return 2
    if not triton_runtime.available():
        print(f"gpu_check: the Triton kernels cannot run here ({triton_runtime.TRITON_IMPORT_ERROR})")
        return 2

    report = {"provenance": provenance(args.commit)}
    print(json.dumps(report["provenance"], indent=1))
    report["tests"] = {"ran": False, "reason": "--skip-tests"} if args.skip_tests else run_gpu_tests()
    report["correctness"] = builtin_correctness()
    print_table("Triton vs reference (max abs error)", report["correctness"], ["n_pages", "dtype", "max_abs_error"])
    for row in report["correctness"]:
        row["max_abs_error"] = float(row["max_abs_error"])
    report["attention"] = bench_attention()
    print_table("Paged decode attention, Llama-3.1-8B shapes, bf16, microseconds per call",
                report["attention"], ["n_pages", "n_tokens", "triton_us", "triton_us_block32",
                                      "triton_us_block128", "triton_us_8warps", "reference_us", "sdpa_dense_us",
                                      "triton_gb_s"])
    print_table("Paged decode attention, host time per call (20 calls per sync), microseconds",
                report["attention"], ["n_pages", "n_splits", "triton_host_us", "triton_host_out_us",
                                      "triton_host_1split_us", "triton_us_1split", "triton_host_jit_launch_us",
                                      "triton_graph_us"])
    report["page_copies"] = bench_page_copies()
    print_table("Page copies (scatter, block copy from device or mapped host memory), bf16 pages of 16 x 128, "
                "microseconds", report["page_copies"], ["load", "bytes", "scatter_us", "copy_blocks_device_us",
                                                        "copy_blocks_mapped_us", "copy_blocks_mapped_gb_s",
                                                        "h2d_copy_us", "h2d_gb_s"])
    print_table("Page copies, host time per call (20 calls per sync), microseconds",
                report["page_copies"], ["load", "scatter_host_us", "copy_blocks_host_us"])

    host = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in socket.gethostname())
    out = Path(args.out) if args.out else REPO / "results" / "bench" / f"kernels_{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out)
    print(f"\nwrote {out}")
    failed = report["tests"].get("returncode", 0) != 0
    if failed:
        print("gpu_check: GPU TESTS FAILED (see above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
