"""Compare two sets of finished runs sample by sample: are the predictions of code B those of code A?

Runs are paired by ``<task>/<model>/<method>/budget-<b>`` under each output root (the config hash may differ when a
setting was added between the two codes). For every pair: both metrics, the number of samples, how many
predictions (decoded text and output ids) are identical, the ids of those that differ, and both runs' provenance
(``env.json``). This is how a change meant to be exact is checked for changed predictions.

    python scripts/compare_runs.py /tmp/runs_before /tmp/runs_after --out results/bench/ab_<name>.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def finished_runs(root: Path) -> dict[str, Path]:
    """``task/model/method/budget-b`` -> run directory, for runs with a metrics.json (one per key)."""
    runs: dict[str, Path] = {}
    for metrics in sorted(root.rglob("metrics.json")):
        run_dir = metrics.parent
        key = "/".join(run_dir.relative_to(root).parts[-5:-1])
        if key in runs:
            raise SystemExit(f"error: two finished runs for {key} under {root}; give a root with one run per key")
        runs[key] = run_dir
    return runs


def compare(before: Path, after: Path) -> dict:
    from eval.rundir import read_records

    runs_before, runs_after = finished_runs(before), finished_runs(after)
    pairs = []
    for key in sorted(set(runs_before) & set(runs_after)):
        a, b = runs_before[key], runs_after[key]
        records_a = {r["sample_id"]: r for r in read_records(a / "predictions.jsonl")}
        records_b = {r["sample_id"]: r for r in read_records(b / "predictions.jsonl")}
        common = sorted(set(records_a) & set(records_b))
        differ = [s for s in common if (records_a[s]["prediction"], records_a[s].get("output_ids"))
                  != (records_b[s]["prediction"], records_b[s].get("output_ids"))]
        pairs.append({
            "run": key, "n_samples": len(common), "identical": len(common) - len(differ), "differ": differ,
            "only_before": sorted(set(records_a) - set(records_b)),
            "only_after": sorted(set(records_b) - set(records_a)),
            "metrics_before": json.loads((a / "metrics.json").read_text()),
            "metrics_after": json.loads((b / "metrics.json").read_text()),
            "provenance_before": json.loads((a / "env.json").read_text()) if (a / "env.json").exists() else None,
            "provenance_after": json.loads((b / "env.json").read_text()) if (b / "env.json").exists() else None,
        })
    unpaired = sorted(set(runs_before) ^ set(runs_after))
    return {"kind": "runs_ab", "before": str(before), "after": str(after), "pairs": pairs, "unpaired": unpaired}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--out", type=Path, help="write the comparison here (JSON)")
    parser.add_argument("--note", default="", help="what the two codes are")
    args = parser.parse_args(argv)
    for root in (args.before, args.after):
        if not root.is_dir():
            parser.error(f"{root} is not a directory of runs")
    result = compare(args.before, args.after)
    result["note"] = args.note
    for pair in result["pairs"]:
        def score(metrics: dict):  # a run's metrics.json holds the task's scores under "metrics"
            return metrics.get("metrics", metrics).get("score")

        print(f"{pair['run']:<55} {pair['identical']:>3}/{pair['n_samples']:<3} identical   score "
              f"{score(pair['metrics_before'])} -> {score(pair['metrics_after'])}")
    if result["unpaired"]:
        print("unpaired:", ", ".join(result["unpaired"]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
        print(f"wrote {args.out}")
    return 0 if all(not p["differ"] for p in result["pairs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
