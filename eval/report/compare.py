"""Two sets of finished runs sample by sample: did they generate the same text?

A side is a run directory, a root of runs (a sweep's output root) or a curated file (``scripts/sweep.py
--curate``, whose payloads carry each sample's generation hash, ``paired.generated_sha256``). Runs are paired by
their directory below the output root, ``<task>/<model>/<method>/budget-<b>/<hash>``, when both sides hold it (the
same job run twice: a determinism check); the runs left are paired by ``<task>/<model>/<method>/budget-<b>``, with
the method's row and the task's lengths (``RunSide.variant``), where each side holds one run of it (a setting added
between two codes changes the hash, not the run; so does a smaller ``num_samples``, whose samples are the first of
the larger run's, compared where both have them). Two run
directories given directly are paired with each other. A sample differs when its text or token ids differ.

``by_method`` then says, per method (a variant as its own row, ``icecache+lookahead``), how many samples the
paired runs share and the share of them whose generation differs: the number to read after running one grid
twice on one host, or on two hosts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.rundir import CONFIG, ENV, METRICS, PREDICTIONS, read_records

from .paired import generated_sha256


@dataclass
class RunSide:
    """One run of a side: where it is, what generated each sample (a hash), its metrics and provenance."""

    path: str  # its directory below the output root (task/model/method/budget/hash), or the directory itself
    generated: dict[str, str]  # sample id -> generated_sha256
    metrics: dict[str, Any]
    provenance: dict[str, Any] | None = None
    label: str | None = None  # the method's row name (method_label), when the metrics say

    @property
    def cell(self) -> str:
        """``task/model/method/budget-b``: the run without its settings hash."""
        return "/".join(Path(self.path).parts[-5:-1])

    @property
    def variant(self) -> str:
        """The cell, told apart from the cell's other runs by what a grid varies in it: the method's row (the
        look-ahead shares IceCache's directory) and the task's lengths (one run per length)."""
        words = [self.cell]
        parts = Path(self.path).parts
        if self.label and len(parts) >= 3 and self.label != parts[-3]:
            words.append(self.label)
        lengths = ((self.metrics.get("settings") or {}).get("task") or {}).get("lengths")
        if lengths:
            words.append("lengths=" + ",".join(str(length) for length in lengths))
        return " ".join(words)

    @property
    def method(self) -> str:
        return self.label or self.metrics.get("method_label") or self.metrics.get("method") or (
            Path(self.path).parts[-3] if len(Path(self.path).parts) >= 3 else self.path)


@dataclass
class Side:
    runs: list[RunSide] = field(default_factory=list)
    single: bool = False  # a run directory given directly


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def run_in(run_dir: Path, name: str) -> RunSide:
    records = read_records(run_dir / PREDICTIONS)
    metrics = _read_json(run_dir / METRICS) or {}
    return RunSide(name, {r["sample_id"]: generated_sha256(r) for r in records}, metrics, _read_json(run_dir / ENV),
                   metrics.get("method_label"))


def load_side(path: Path) -> Side:
    """The finished runs of ``path``: a curated file, a run directory or a root of runs."""
    if path.is_file():
        payload = json.loads(path.read_text(encoding="utf-8"))
        runs = []
        for run in payload.get("runs") or []:
            samples = run.get("samples") or []
            metrics = {k: v for k, v in run.items() if k not in ("samples", "run_dir")}
            runs.append(RunSide("/".join(Path(str(run.get("run_dir"))).parts[-5:]),
                                {s["sample_id"]: s["generated_sha256"] for s in samples if "generated_sha256" in s},
                                metrics, run.get("provenance"), run.get("method_label")))
        return Side(runs)
    if (path / METRICS).exists() or (path / CONFIG).exists():
        return Side([run_in(path, path.name)], single=True)
    runs = [run_in(metrics.parent, "/".join(metrics.parent.relative_to(path).parts[-5:]))
            for metrics in sorted(path.rglob(METRICS)) if ".sweeps" not in metrics.parts]
    return Side(runs)


def pair_runs(before: Side, after: Side) -> tuple[list[tuple[str, RunSide, RunSide]], list[str]]:
    """(name, before, after) of every pair, and the names of the runs left unpaired (module docstring)."""
    if before.single or after.single:
        if len(before.runs) == 1 and len(after.runs) == 1:
            return [(before.runs[0].path, before.runs[0], after.runs[0])], []
    pairs, left_a, left_b = [], list(before.runs), list(after.runs)
    by_path = {run.path: run for run in left_b}
    for run in list(left_a):
        partner = by_path.get(run.path)
        if partner is not None:
            pairs.append((run.path, run, partner))
            left_a.remove(run)
            left_b.remove(partner)

    def unique(runs: list[RunSide]) -> dict[str, RunSide]:
        cells: dict[str, list[RunSide]] = {}
        for run in runs:
            cells.setdefault(run.variant, []).append(run)
        return {cell: members[0] for cell, members in cells.items() if len(members) == 1}

    cells_a, cells_b = unique(left_a), unique(left_b)
    for cell in sorted(set(cells_a) & set(cells_b)):
        pairs.append((cell, cells_a[cell], cells_b[cell]))
        left_a.remove(cells_a[cell])
        left_b.remove(cells_b[cell])
    return sorted(pairs, key=lambda p: p[0]), sorted(run.path for run in left_a + left_b)


def compare(before: Path, after: Path) -> dict[str, Any]:
    """Every pair's samples in common, how many generated the same, the ids of those that did not, both metrics
    and provenances; ``by_method`` the share of differing samples per method."""
    pairs, unpaired = pair_runs(load_side(Path(before)), load_side(Path(after)))
    out, by_method = [], {}
    for name, a, b in pairs:
        common = sorted(set(a.generated) & set(b.generated))
        differ = [s for s in common if a.generated[s] != b.generated[s]]
        out.append({
            "run": name, "method": a.method, "n_samples": len(common), "identical": len(common) - len(differ),
            "differ": differ, "only_before": sorted(set(a.generated) - set(b.generated)),
            "only_after": sorted(set(b.generated) - set(a.generated)), "metrics_before": a.metrics,
            "metrics_after": b.metrics, "provenance_before": a.provenance, "provenance_after": b.provenance,
        })
        tally = by_method.setdefault(a.method, {"runs": 0, "samples": 0, "differ": 0})
        tally["runs"] += 1
        tally["samples"] += len(common)
        tally["differ"] += len(differ)
    for tally in by_method.values():
        tally["share_differ"] = round(tally["differ"] / tally["samples"], 4) if tally["samples"] else None
    return {"kind": "runs_ab", "before": str(before), "after": str(after), "pairs": out, "unpaired": unpaired,
            "by_method": dict(sorted(by_method.items()))}


def render_by_method(result: dict[str, Any]) -> str:
    """One line per method: runs paired, samples compared, the share whose generation differs."""
    lines = [f"{'method':<24} {'runs':>5} {'samples':>8} {'differ':>7} {'share':>7}"]
    for method, tally in result["by_method"].items():
        share = "-" if tally["share_differ"] is None else f"{100 * tally['share_differ']:.1f}%"
        lines.append(f"{method:<24} {tally['runs']:>5} {tally['samples']:>8} {tally['differ']:>7} {share:>7}")
    return "\n".join(lines)
