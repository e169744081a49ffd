#!/usr/bin/env python
"""Markdown tables for BENCHMARKS.md from result files: results/bench/ (latency, DCI) and run metrics.json files.

    python scripts/bench_tables.py results/bench/latency_h200_*.json results/bench/dci_h200_*.json
    python scripts/bench_tables.py results/runs/passkey/*/*/*/*/metrics.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def latency(data: dict) -> str:
    lines = ["| context | method | TTFT s | TT2T s | TPOT ms (min-max) | x full | x full_static | phases ms | GPU KV MiB | "
             "CPU KV MiB | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in data["summary"]:
        phases = " ".join(f"{k}={1000 * v:.1f}" for k, v in sorted((row.get("phases_s") or {}).items()) if v)
        lines.append(
            f"| {row['context']} | {row['method']} | {row['ttft_s_median']:.3f} | {row['tt2t_s_median']:.3f} | "
            f"{1000 * row['tpot_s_median']:.1f} ({1000 * row['tpot_s_min']:.1f}-{1000 * row['tpot_s_max']:.1f}) | "
            f"{row['tpot_ratio_to_full']:.2f} | {ratio(row.get('tpot_ratio_to_full_static'))} | {phases} | {row['gpu_kv_bytes'] / 2**20:.0f} | "
            f"{row['cpu_kv_bytes'] / 2**20:.0f} | {(row['peak_gpu_bytes'] or 0) / 2**30:.1f} |"
        )
    return "\n".join(lines)


def dci(data: dict) -> str:
    lines = ["| keys | threads | build s / layer | query ms / layer | exact top-k ms (torch) | page recall | token recall | mass recall |",
             "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(
            f"| {row['n']} | {row['threads']} | {row['build_s']:.3f} | {row['query_ms']:.3f} | {row['exact_ms']:.2f} | "
            f"{row['page_recall']:.3f} | {row['token_recall']:.3f} | {row['mass_recall']:.3f} |"
        )
    return "\n".join(lines)


def runs(paths: list[str]) -> str:
    lines = ["| task | model | method | budget | protocol | samples | score | details | mean attended tokens | median TPOT s | commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        data = json.loads(Path(path).read_text())
        metrics = data["metrics"]
        details = {k: v for k, v in metrics.items() if k not in ("score", "n") and not isinstance(v, (list,))}
        attended = data["latency"].get("mean_attended_tokens")
        tpot = data["latency"].get("median_tpot_s")
        task = data["settings"]["task"]
        protocol = "question as decode steps" if task.get("decode_question") else ""
        if "lengths" in task:
            protocol = f"{task['lengths']} tokens {protocol}".strip()
        lines.append(
            f"| {data['task']} | {data['model']} | {data['method']} | {data['budget']} | {protocol} | {data['n_samples']} | "
            f"{metrics.get('score')} | {json.dumps(details)} | {'' if attended is None else f'{attended:.0f}'} | "
            f"{'' if tpot is None else f'{tpot:.3f}'} | {str(data['provenance'].get('git_commit'))[:7]} |"
        )
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    run_files = [p for p in paths if Path(p).name == "metrics.json"]
    if run_files:
        print(runs(run_files))
    for path in [p for p in paths if p not in run_files]:
        data = json.loads(Path(path).read_text())
        kind = data.get("kind") or data.get("benchmark")
        provenance = data.get("provenance", {})
        print(f"\n`{path}` (commit {str(provenance.get('git_commit'))[:10]}, {provenance.get('gpu')}, "
              f"torch {provenance.get('torch')}, {provenance.get('date')})\n")
        print(latency(data) if kind == "latency" else dci(data))


if __name__ == "__main__":
    main(sys.argv[1:])
