"""Compare two sets of finished runs sample by sample: did code B (or a second run of the same jobs) generate what
code A did? (eval/report/compare.py)

Each side is a run directory, a root of runs (a sweep's output root) or a curated file (results/bench/accuracy_*.json,
whose runs carry each sample's generation hash). Runs are paired by their directory below the output root when both
sides hold it (the same jobs run twice), else by ``<task>/<model>/<method>/budget-<b>`` with the method's row and
the task's lengths (a setting added between two codes, or fewer samples, changes the config hash). For every
pair: both metrics, the samples in common, how many generated the same text and token ids, the ids of those that
differ, both provenances; per method, the share of samples that differ.
This is how a change meant to be exact is checked, and how a grid's determinism is measured.

    python scripts/compare_runs.py /tmp/runs_before /tmp/runs_after --out results/bench/ab_<name>.json
    python scripts/compare_runs.py results/runs results/runs_again          # the same sweep run twice
    python scripts/compare_runs.py results/bench/accuracy_<model>_<a>.json results/bench/accuracy_<model>_<b>.json

Exit status: 0 every paired sample generated the same, 1 some differ, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eval.report.compare import compare, render_by_method

__all__ = ["compare", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path, help="a run directory, a root of runs or a curated file")
    parser.add_argument("after", type=Path, help="the same for the other side")
    parser.add_argument("--out", type=Path, help="write the comparison here (JSON)")
    parser.add_argument("--note", default="", help="what the two codes are")
    args = parser.parse_args(argv)
    for side in (args.before, args.after):
        if not side.exists():
            parser.error(f"{side} is neither a directory of runs nor a curated file")
    result = compare(args.before, args.after)
    result["note"] = args.note
    for pair in result["pairs"]:
        def score(metrics: dict):  # a run's metrics.json holds the task's scores under "metrics"
            return (metrics.get("metrics") or metrics).get("score")

        print(f"{pair['run']:<55} {pair['identical']:>3}/{pair['n_samples']:<3} identical   score "
              f"{score(pair['metrics_before'])} -> {score(pair['metrics_after'])}")
    if result["unpaired"]:
        print("unpaired:", ", ".join(result["unpaired"]))
    print(render_by_method(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.out}")
    return 0 if all(not p["differ"] for p in result["pairs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
