#!/usr/bin/env python
"""The TPOT breakdown figure of latency result files at one context, the paper's IceCache bars beside it.

    python scripts/diagnostics/plot_breakdown.py results/bench/latency_<host>_<date>.json --context 32768 \
        --out results/bench/tpot_breakdown_h200_32k

Several files (runs of one setup, each with its own full caches) give one bar per method; a method in more than
one file is taken from the last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.report.collect import load_paper_latency
from eval.report.plots import group_phases, paper_breakdown, tpot_breakdown

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="latency_*.json files of scripts/bench/latency.py")
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--out", required=True, help="output path without extension (.png and .pdf are written)")
    parser.add_argument("--reference", default=str(REPO / "results" / "paper"), help="paper numbers folder")
    args = parser.parse_args(argv)
    files = [json.loads(Path(result).read_text(encoding="utf-8")) for result in args.results]
    rows = [r for data in files for r in data["summary"] if r["context"] == args.context]
    if not rows:
        raise SystemExit(f"error: no row at context {args.context} in {' '.join(args.results)}")
    breakdowns = {r["method"]: group_phases(r["phases_s"], r["tpot_s_median"]) for r in rows}
    paper = None
    latency_csv = Path(args.reference) / "paper_latency.csv"
    if latency_csv.exists():
        paper = paper_breakdown(load_paper_latency(latency_csv))
    gpu = files[-1]["provenance"].get("gpu") or "CPU"
    title = f"TPOT breakdown at {args.context // 1024}k tokens, {rows[0]['model']}, {gpu}"
    for path in tpot_breakdown(breakdowns, paper, args.out, title=title):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
