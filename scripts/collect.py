#!/usr/bin/env python
"""Collect finished runs and latency benchmarks into the paper's tables and figures.

    python scripts/collect.py results/runs --out results/summary
    python scripts/collect.py results/runs other/runs --bench results/bench --out results/summary --no-plots
    python scripts/collect.py results/bench/accuracy_smollm2-135m_<date>.json --bench results/bench --out summary

Reads only what is on disk (metrics.json marks a finished run), so it works after any launcher, after a sweep
that failed half-way, and while a sweep is still running. Writes Markdown, CSV and LaTeX tables next to the
paper's numbers (results/paper/ in the repository) and PNG + PDF plots under <out>/plots/, all from the runs
named on the command line (LongBench's Table 2 figures, and for every other task its score against the budget per
model: score_vs_budget_<task>_<model>); the latency table and figures only from the benchmark files of --bench
(e.g. results/bench, where scripts/bench/latency.py writes). Runs of different settings never share a cell
(docs/reproduce.md). A run root may be a sweep's output_root, one run folder, or a curated file of finished runs
(results/bench/accuracy_*.json, scripts/sweep.py --curate).
Runs with the selection diagnostic (measure_selection) also give accuracy.md / .csv (score with its 95% interval,
share of full, tokens attended, mass captured) and its figures: accuracy against the budget, against TPOT from the
--bench files, and the mass captured by layer, one line per method.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", default=[str(REPO / "results" / "runs")],
                        help="run roots to search, or curated files of runs")
    parser.add_argument("--out", default=str(REPO / "results" / "summary"), help="output folder")
    parser.add_argument("--bench", default=None,
                        help="latency_*.json folder for the latency figures, e.g. results/bench (default: none)")
    parser.add_argument("--reference", default=None, help="paper numbers folder (default: results/paper/)")
    parser.add_argument("--no-plots", action="store_true", help="tables only")
    parser.add_argument("--paper-only", action="store_true",
                        help="also write tables for models with the paper's numbers but no runs of ours")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    from eval.report.collect import REFERENCE_DIR
    from eval.report.summary import write_summary

    missing = [r for r in args.runs if not Path(r).exists()]
    if missing:
        print(f"note: no such run folder: {', '.join(missing)}", file=sys.stderr)
    if args.bench is not None and not Path(args.bench).exists():
        print(f"error: no such benchmark folder: {args.bench}", file=sys.stderr)
        return 2
    summary = write_summary([r for r in args.runs if Path(r).exists()], args.out, bench_root=args.bench,
                            reference_dir=args.reference or REFERENCE_DIR, plots=not args.no_plots,
                            paper_only_tables=args.paper_only)
    if args.bench is None:
        print("note: no --bench folder given: the latency figures from benchmark files are not drawn",
              file=sys.stderr)
    print(summary.describe())
    if len(summary.partial):
        print(f"{len(summary.partial)} run(s) started but unfinished (resubmit the sweep to resume them): "
              f"see {Path(args.out) / 'partial_runs.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
