"""Read finished runs, latency benchmarks and the paper's reference numbers from disk into tidy tables.

Collect never depends on how the runs were launched (local, Slurm, by hand): a run is done when its
``metrics.json`` exists, and its directory is a pure function of its config, so globbing is enough. Scores become
long-form rows ``(task, model, method, budget, variant, dataset, length, score, n)``; a LongBench table split
over one job per dataset is put back together here.

A cell never mixes runs of different settings. A run's ``variant`` is a hash of its recorded settings less the
coordinates a table spreads over (the budget, and what each task declares, ``Task.coordinates``: LongBench's
datasets, RULER's tasks and lengths, which a sweep splits into jobs): runs of one method that differ in anything
else (``task.limit``, a method knob, the device, the prefill chunk) are separate rows, labelled with the settings
that differ (``variant_labels``). A run's scores go to the table its task names (``Task.table_name``): LongBench-E
runs are ``longbench_e``, never LongBench v1 cells. Method names and their order come from the registered methods
(``report.methods``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from eval.rundir import METRICS, PREDICTIONS
from eval.tasks.base import TASKS

from .methods import canonical_method, sort_key, uses_budget
from .variants import rename_rows

LONGBENCH_16 = [
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
    "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
]

# The paper's RULER columns as means over RULER subtasks.
RULER_CATEGORIES = {
    "single_niah": ("niah_single_1", "niah_single_2", "niah_single_3"),
    "multikey_niah": ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3"),
    "qa": ("qa_1", "qa_2"),
}
RULER_CATEGORY_NAMES = {"single_niah": "Single-NIAH", "multikey_niah": "Multi-keys NIAH", "qa": "QA"}

SCORE_COLUMNS = ["task", "model", "method", "budget", "variant", "dataset", "length", "score", "n", "run_dir",
                 "finished"]


def table_coordinates(task: str) -> tuple[str, ...]:
    """The settings a table of ``task`` spreads over (its rows and columns), so not part of a run's variant: the
    budget and what the task declares (``Task.coordinates``); for a task not registered, what any task declares."""
    if task in TASKS:
        declared = TASKS.get(task).coordinates
    else:
        declared = tuple(sorted({key for name in TASKS.names() for key in TASKS.get(name).coordinates}))
    return ("method.budget", *(f"task.{key}" for key in declared))
REFERENCE_DIR = Path(__file__).resolve().parents[2] / "results" / "paper"  # the paper's numbers, in the repo


def canonical_model(name: str) -> str:
    """Model names compare case-insensitively: the runs say llama-3.1-8b-instruct, the paper Llama-3.1-8B-Instruct."""
    return str(name).strip().lower()


def normalise_budget(method: str, budget: Any) -> int | None:
    if not uses_budget(method) or budget is None or budget == "" or _isnan(budget):
        return None
    return int(budget)


def _isnan(value: Any) -> bool:
    return value is pd.NA or (isinstance(value, float) and math.isnan(value))


def row_sort_key(method: str, budget: Any) -> tuple:
    """By method (``methods.sort_key``), then budget, the full cache's ``None`` first."""
    return (*sort_key(method), -1 if budget is None or _isnan(budget) else int(budget))


# ---------------------------------------------------------------------------------------------------------------
# Runs


@dataclass
class RunResult:
    """One finished run: its ``metrics.json`` and where it lies."""

    run_dir: Path
    task: str
    model: str
    method: str
    budget: int | None
    n_samples: int
    metrics: dict[str, Any]
    latency: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    config_hash: str | None = None
    finished: float = 0.0  # mtime of metrics.json: the newer of two runs of the same settings wins a tie
    payload: dict[str, Any] = field(default_factory=dict, repr=False)  # the whole metrics.json

    @classmethod
    def from_file(cls, path: Path) -> "RunResult":
        return cls.from_payload(json.loads(path.read_text(encoding="utf-8")), path.parent, path.stat().st_mtime)

    @classmethod
    def from_payload(cls, payload: dict[str, Any], run_dir: Path, finished: float) -> "RunResult":
        method = str(payload["method"])
        settings = payload.get("settings") or {}
        task = str(payload["task"])
        if task in TASKS:  # the table the task puts these settings' scores in (LongBench-E: longbench_e)
            task = TASKS.get(task).table_name(settings.get("task") or {"name": task})
        return cls(
            run_dir=run_dir,
            task=task,
            model=str(payload["model"]),
            method=method,
            budget=normalise_budget(method, payload.get("budget")),
            n_samples=int(payload.get("n_samples") or 0),
            metrics=payload.get("metrics") or {},
            latency=payload.get("latency") or {},
            settings=settings,
            config_hash=payload.get("config_hash"),
            finished=finished,
            payload=payload,
        )

    @property
    def variant_settings(self) -> dict[str, Any]:
        """The recorded settings, flattened to dotted keys, less the table coordinates."""
        coordinates = table_coordinates(str((self.settings.get("task") or {}).get("name") or self.task))
        return {key: value for key, value in flatten(self.settings).items() if key not in coordinates}

    @property
    def variant(self) -> str:
        """Short hash of ``variant_settings``: runs with the same variant may share a table cell."""
        canonical = json.dumps(self.variant_settings, sort_keys=True, default=str)
        return hashlib.sha256(canonical.encode()).hexdigest()[:8]

    @property
    def context(self) -> Any:
        """The context length of a run of one length (passkey, RULER), else None."""
        lengths = (self.settings.get("task") or {}).get("lengths")
        return int(lengths[0]) if isinstance(lengths, list) and len(lengths) == 1 else None


def flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    """``{"task": {"limit": 5}}`` -> ``{"task.limit": 5}``; lists stay values."""
    if not isinstance(values, dict):
        return {prefix: values} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def variant_labels(runs: list["RunResult"]) -> dict[str, str]:
    """variant -> the settings that tell it apart from the other variants of the same task and model ("" when
    nothing differs). Method settings are compared within one method (each method has its own knobs), the
    others (task, model, prefill) across all methods, so two rows measured on different samples say so."""
    by_variant = {run.variant: run for run in runs}
    labels: dict[str, str] = {}
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for run in by_variant.values():
        groups.setdefault((run.task, canonical_model(run.model)), []).append(run)
    def part(run: RunResult, method_keys: bool) -> dict[str, Any]:
        return {k: v for k, v in run.variant_settings.items() if k.startswith("method.") == method_keys}

    for members in groups.values():
        shared_keys = _varying({r.variant: part(r, False) for r in members})
        per_method: dict[str, list[RunResult]] = {}
        for run in members:
            per_method.setdefault(run.method, []).append(run)
        for same in per_method.values():
            method_keys = _varying({r.variant: part(r, True) for r in same})
            for run in same:
                flat = run.variant_settings
                parts = [f"{key}={_short(flat.get(key))}" for key in sorted(shared_keys | method_keys)]
                labels[run.variant] = ", ".join(parts)
    return labels


def _varying(settings: dict[str, dict[str, Any]]) -> set[str]:
    keys = {key for flat in settings.values() for key in flat}
    return {key for key in keys if len({json.dumps(flat.get(key), default=str) for flat in settings.values()}) > 1}


def _short(value: Any) -> str:
    return "null" if value is None else str(value)


@dataclass
class PartialRun:
    """A run directory without ``metrics.json``: started, not finished (or still running)."""

    run_dir: Path
    n_written: int


def _as_roots(roots: str | Path | Iterable[str | Path]) -> list[Path]:
    if isinstance(roots, (str, Path)):
        roots = [roots]
    return [Path(r) for r in roots]


def load_runs(roots: str | Path | Iterable[str | Path]) -> list[RunResult]:
    """Every finished run under ``roots`` (unreadable metrics files are skipped with a warning). A root that is a
    file is a curated list of runs (``{"runs": [metrics.json, ...]}``, results/bench/accuracy_*.json): its runs."""
    runs = []
    for root in _as_roots(roots):
        if root.is_file():
            runs += load_run_list(root)
            continue
        for path in sorted(root.rglob(METRICS)):
            try:
                runs.append(RunResult.from_file(path))
            except (OSError, ValueError, KeyError, TypeError) as error:
                warnings.warn(f"skipping unreadable {path}: {error}", stacklevel=2)
    return runs


def load_run_list(path: Path) -> list[RunResult]:
    """The runs of a curated file; each keeps the directory it was written in as its ``run_dir``."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["runs"]
        finished = path.stat().st_mtime
        return [RunResult.from_payload(entry, Path(entry.get("run_dir") or path), finished) for entry in entries]
    except (OSError, ValueError, KeyError, TypeError) as error:
        warnings.warn(f"skipping unreadable {path}: {error}", stacklevel=2)
        return []


def count_complete_lines(path: Path) -> int:
    """Complete, parseable JSON lines (distinct sample ids) of a predictions file; a torn tail does not count."""
    seen = set()
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                seen.add(json.loads(line)["sample_id"])
            except (ValueError, KeyError, TypeError):
                continue
    return len(seen)


def find_partial_runs(roots: str | Path | Iterable[str | Path]) -> list[PartialRun]:
    partial = []
    for root in _as_roots(roots):
        if root.is_file():
            continue  # a curated list holds finished runs only
        for path in sorted(root.rglob(PREDICTIONS)):
            if not (path.parent / METRICS).exists():
                partial.append(PartialRun(path.parent, count_complete_lines(path)))
    return partial


def runs_frame(runs: list[RunResult]) -> pd.DataFrame:
    """One row per finished run (what ran, where, how many samples, headline score and latency)."""
    rows = []
    labels = variant_labels(runs)
    for run in runs:
        rows.append({
            "task": run.task, "model": run.model, "method": run.method, "budget": run.budget,
            "variant": run.variant, "settings": labels.get(run.variant, ""),
            "n_samples": run.n_samples, "score": run.metrics.get("score"),
            **{k: run.latency.get(k) for k in ("median_ttft_s", "median_tt2t_s", "median_tpot_s",
                                                "mean_attended_tokens", "max_peak_gpu_bytes")},
            "config_hash": run.config_hash, "run_dir": str(run.run_dir),
        })
    columns = ["task", "model", "method", "budget", "variant", "settings", "n_samples", "score", "median_ttft_s",
               "median_tt2t_s", "median_tpot_s", "mean_attended_tokens", "max_peak_gpu_bytes", "config_hash",
               "run_dir"]
    frame = pd.DataFrame(rows, columns=columns)
    frame["budget"] = frame["budget"].astype("Int64")  # 256, not 256.0, beside the full cache's empty budget
    return frame


# ---------------------------------------------------------------------------------------------------------------
# Scores: long form, whatever the task's aggregate looks like


def _length_key(value: Any) -> int | str:
    try:
        return int(value)
    except (TypeError, ValueError):
        return str(value)


def score_rows(run: RunResult) -> list[dict[str, Any]]:
    """The per-(dataset, length) scores present in one run's aggregate, as long-form rows.

    Reads what is there: LongBench ``datasets`` (and LongBench-E ``buckets``), RULER ``tasks`` (task -> length ->
    score, or task -> score), passkey ``by_length``, else the task's headline ``score``.
    """
    metrics = run.metrics
    base = {"task": run.task, "model": run.model, "method": run.method, "budget": run.budget,
            "variant": run.variant, "run_dir": str(run.run_dir), "finished": run.finished}
    rows: list[dict[str, Any]] = []

    def add(dataset: str, length: Any, score: Any, n: Any) -> None:
        if score is None or _isnan(score):
            return  # an empty cell stays missing; it is never a zero
        rows.append({**base, "dataset": dataset, "length": length, "score": float(score),
                     "n": int(n) if n is not None else None})

    if isinstance(metrics.get("datasets"), dict):
        per_dataset_n = metrics.get("n_per_dataset") or {}
        for name, score in metrics["datasets"].items():
            add(name, None, score, per_dataset_n.get(name, run.n_samples if len(metrics["datasets"]) == 1 else None))
        per_bucket_n = metrics.get("n_per_bucket") or {}
        for name, buckets in (metrics.get("buckets") or {}).items():
            for bucket, score in (buckets or {}).items():
                add(name, str(bucket), score, (per_bucket_n.get(name) or {}).get(bucket))
    elif isinstance(metrics.get("tasks"), dict):
        n_per_task = metrics.get("n_per_task") or {}
        for name, per_length in metrics["tasks"].items():
            if isinstance(per_length, dict):
                counts = {str(k): v for k, v in (n_per_task.get(name) or {}).items()}
                for length, score in per_length.items():
                    add(name, _length_key(length), score, counts.get(str(length)))
            else:
                add(name, None, per_length, None)
    elif isinstance(metrics.get("by_length"), dict):
        n_by_length = metrics.get("n_by_length") or {}
        n_lengths = len(metrics["by_length"])
        for length, score in metrics["by_length"].items():
            n = n_by_length.get(str(length), run.n_samples if n_lengths == 1 else None)
            add(run.task, _length_key(length), score, n)
    else:
        add(run.task, None, metrics.get("score"), metrics.get("n", run.n_samples))
    return rows


def collect_scores(runs: list[RunResult]) -> pd.DataFrame:
    """Long-form scores of all runs. Runs of different settings (``variant``) never share a cell; where two runs
    of the same settings hold the same cell (two result trees, a rerun), the one with more samples wins, then the
    newer one. ``settings`` labels each variant with what tells it apart (``variant_labels``)."""
    rows = [row for run in runs for row in score_rows(run)]
    frame = pd.DataFrame(rows, columns=SCORE_COLUMNS)
    if frame.empty:
        frame["settings"] = pd.Series(dtype=object)
        return frame
    frame["_n"] = frame["n"].fillna(-1)
    frame["_length"] = frame["length"].astype(str)
    frame["_budget"] = frame["budget"].astype(str)
    frame = frame.sort_values(["_n", "finished"]).drop_duplicates(
        ["task", "model", "method", "_budget", "variant", "dataset", "_length"], keep="last"
    )
    frame = frame.drop(columns=["_n", "_length", "_budget"])
    labels = variant_labels(runs)
    frame["settings"] = frame["variant"].map(lambda v: labels.get(v, ""))
    return frame.reset_index(drop=True)


def collect_latency(runs: list[RunResult]) -> pd.DataFrame:
    """Per (task, model, method, budget, variant, context length): the median over runs of each run's median TTFT /
    TT2T / TPOT (a table split into one job per dataset has one median per dataset). Runs over several context
    lengths give one row per length from their ``latency.by_length``; latencies of different lengths or settings
    are never pooled."""
    groups: dict[tuple, list[tuple[RunResult, dict[str, Any]]]] = {}
    for run in runs:
        per_length = run.latency.get("by_length") or {}
        if per_length:
            pieces = [(_length_key(length), summary) for length, summary in per_length.items()]
        else:
            pieces = [(run.context, run.latency)]
        for length, summary in pieces:
            key = (run.task, canonical_model(run.model), run.method, run.budget, run.variant, length)
            groups.setdefault(key, []).append((run, summary))
    rows = []
    labels = variant_labels(runs)
    for (task, _, method, budget, variant, length), members in groups.items():
        row = {"task": task, "model": members[0][0].model, "method": method, "budget": budget, "variant": variant,
               "settings": labels.get(variant, ""), "length": length, "n_runs": len(members),
               "n_samples": sum(r.n_samples for r, _ in members)}
        for key in ("median_ttft_s", "median_tt2t_s", "median_tpot_s", "mean_attended_tokens"):
            values = [s.get(key) for _, s in members if s.get(key) is not None]
            row[key] = statistics.median(values) if values else None
        peaks = [s.get("max_peak_gpu_bytes") for _, s in members if s.get("max_peak_gpu_bytes")]
        row["max_peak_gpu_bytes"] = max(peaks) if peaks else None
        rows.append(row)
    columns = ["task", "model", "method", "budget", "variant", "settings", "length", "n_runs", "n_samples",
               "median_ttft_s", "median_tt2t_s", "median_tpot_s", "mean_attended_tokens", "max_peak_gpu_bytes"]
    frame = pd.DataFrame(rows, columns=columns)
    frame["budget"] = frame["budget"].astype("Int64")
    return frame


def ruler_categories(scores: pd.DataFrame) -> pd.DataFrame:
    """RULER subtask scores -> the paper's three columns (mean over the subtasks present) per context length."""
    ruler = scores[scores["task"] == "ruler"]
    rows = []
    keys = ["model", "method", "budget", "variant", "length"]
    for _key, group in ruler.groupby([ruler[k].astype(str) for k in keys], sort=False):
        first = group.iloc[0]
        for category, members in RULER_CATEGORIES.items():
            present = group[group["dataset"].isin(members)]
            if present.empty:
                continue
            n = present["n"].dropna()
            rows.append({"model": first["model"], "method": first["method"], "budget": first["budget"],
                         "variant": first["variant"], "settings": first.get("settings", ""),
                         "length": first["length"], "category": category, "score": float(present["score"].mean()),
                         "n_subtasks": len(present), "n": int(n.sum()) if len(n) == len(present) else None})
    return pd.DataFrame(rows, columns=["model", "method", "budget", "variant", "settings", "length", "category",
                                       "score", "n_subtasks", "n"])


# ---------------------------------------------------------------------------------------------------------------
# Latency benchmarks (scripts/bench/latency.py)


def load_bench(roots: str | Path | Iterable[str | Path], recursive: bool = True) -> pd.DataFrame:
    """Summary rows of every ``latency_*.json`` under ``roots`` (``recursive=False``: in the folders themselves, not
    their subfolders): one row per (file, method, context)."""
    rows = []
    for root in _as_roots(roots):
        pattern = "latency_*.json"
        paths = [root] if root.is_file() else sorted(root.rglob(pattern) if recursive else root.glob(pattern))
        for path in paths:
            try:
                payload = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as error:
                warnings.warn(f"skipping unreadable {path}: {error}", stacklevel=2)
                continue
            rename_rows(payload)  # each row named by the settings it ran with (report/variants.py)
            settings = payload.get("settings", {})
            provenance = payload.get("provenance", {})
            for entry in payload.get("summary", []):
                row = {key: value for key, value in entry.items() if key != "phases_s"}
                for phase, seconds in (entry.get("phases_s") or {}).items():
                    row[f"phase_{phase}_s"] = seconds
                row.setdefault("model", settings.get("model_name"))
                row["host"] = provenance.get("host")
                row["gpu"] = provenance.get("gpu")
                row["date"] = provenance.get("date")
                row["commit"] = (provenance.get("git_commit") or "")[:7] or None
                row["file"] = str(path)
                rows.append(row)
    return pd.DataFrame(rows)


def curve_method(method: str, label: str | None) -> str | None:
    """The name a latency row is drawn under in a figure: its method, or a declared variant's label
    (``icecache:lookahead=true`` -> ``icecache+lookahead``); None for a one-off setting
    (``icecache:prompt_workers=1``), a diagnostic row the tables show but no curve draws."""
    if ":" not in method:
        return method
    return label if isinstance(label, str) and "+" in label else None


def reference_bench_rows(folder: str | Path) -> list[dict[str, Any]]:
    """The latency rows the accuracy figures take their TPOTs from: the newest of each (model, method, budget,
    context) among ``folder``'s own files, not its per-GPU subfolders (results/bench/<gpu>_<date>/), so that they
    are one GPU's, the GPU of BENCHMARKS.md's own tables. [] without any."""
    folder = Path(folder)
    frame = latest_bench(load_bench(folder, recursive=False)) if folder.exists() else pd.DataFrame()
    return frame.to_dict("records") if not frame.empty else []


def latest_bench(bench: pd.DataFrame) -> pd.DataFrame:
    """Of several benchmark files, keep the newest measurement of each (model, method, budget, context)."""
    if bench.empty:
        return bench
    ordered = bench.sort_values(["date", "file"])
    keys = [k for k in ("model", "method", "budget", "context") if k in bench]
    return ordered.drop_duplicates(keys, keep="last").reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------------
# The paper's numbers (REFERENCE_DIR: results/paper/ in the repository)


def load_paper_longbench(path: str | Path) -> pd.DataFrame:
    """paper_longbench.csv with a canonical ``method`` column (the paper's name kept as ``paper_method``)."""
    frame = pd.read_csv(path)
    frame["paper_method"] = frame["method"]
    frame["method"] = frame["method"].map(canonical_method)
    frame["budget"] = [normalise_budget(m, b) for m, b in zip(frame["method"], frame["budget"])]
    frame["budget"] = frame["budget"].astype(object)
    return frame


def _load_reference(path: str | Path) -> pd.DataFrame:
    frame = pd.read_csv(path)
    frame["paper_method"] = frame["method"]
    frame["method"] = frame["method"].map(canonical_method)
    return frame


load_paper_latency = _load_reference
load_paper_scaling = _load_reference


def load_paper_ruler(path: str | Path) -> pd.DataFrame:
    frame = _load_reference(path)
    frame = frame.rename(columns={"context_tokens": "length"})
    frame["budget"] = [normalise_budget(m, b) for m, b in zip(frame["method"], frame["budget"])]
    frame["budget"] = frame["budget"].astype(object)
    return frame


@dataclass
class References:
    """The paper's numbers, each ``None`` when its file is absent."""

    longbench: pd.DataFrame | None = None
    latency: pd.DataFrame | None = None
    scaling: pd.DataFrame | None = None
    ruler: pd.DataFrame | None = None

    @classmethod
    def load(cls, directory: str | Path) -> "References":
        directory = Path(directory)

        def maybe(name: str, loader):
            path = directory / name
            return loader(path) if path.exists() else None

        return cls(
            longbench=maybe("paper_longbench.csv", load_paper_longbench),
            latency=maybe("paper_latency.csv", load_paper_latency),
            scaling=maybe("paper_scaling.csv", load_paper_scaling),
            ruler=maybe("paper_ruler.csv", load_paper_ruler),
        )


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_")
