"""Everything results/ holds, turned into the paper's tables and figures in one directory.

``write_summary`` is what ``scripts/collect.py`` and the notebook call: it reads finished runs, latency
benchmarks and the paper's reference numbers, and writes

* ``runs.csv`` (one line per finished run, with its settings variant), ``partial_runs.csv`` (started, not
  finished), ``scores_long.csv``, ``run_latency.csv`` (per method, budget, settings and context length);
* ``table2_<model>.{md,csv,tex}`` for every model with LongBench v1 runs or paper numbers;
* ``ruler_<model>_<length>.{md,csv,tex}``, ``<task>.{md,csv}`` for passkey, GSM8K, LongBench-E (``longbench_e``,
  per length bucket) and any other task, each score with its ``n``;
* ``latency.{md,csv}`` from the benchmark files (the CSV one wide row per model, method and budget; the Markdown one
  short table per measure, a column per context);
* ``accuracy.{md,csv}`` from the runs with the selection diagnostic (``measure_selection``): per task, model,
  length, method and budget the score with its 95% bootstrap interval, its share of full, the tokens attended and
  the attention mass they hold (report.accuracy);
* ``plots/``: accuracy vs budget, accuracy vs TPOT, TT2T bars, TPOT breakdown, decode latency vs context, for
  every other task of the runs given (passkey, RULER, GSM8K, LongBench-E, ...) its score against the budget per
  model (``score_vs_budget_<task>_<model>``), and for the measured runs accuracy vs budget and vs TPOT with
  intervals and the mass captured by layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from . import accuracy as A
from . import plots as P
from .accuracy import length_label
from .collect import (
    REFERENCE_DIR,
    References,
    canonical_model,
    collect_latency,
    collect_scores,
    curve_method,
    find_partial_runs,
    latest_bench,
    load_bench,
    load_runs,
    ruler_categories,
    runs_frame,
    safe_name,
)
from .paired import attach_paired
from .tables import ComparisonTable, frame_to_markdown, latency_table, longbench_table, ruler_table, task_table


@dataclass
class Summary:
    """What was read and what was written."""

    runs: pd.DataFrame
    partial: pd.DataFrame
    scores: pd.DataFrame
    latency: pd.DataFrame
    bench: pd.DataFrame
    references: References
    tables: dict[str, ComparisonTable | pd.DataFrame] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"{len(self.runs)} finished run(s), {len(self.partial)} unfinished, "
                 f"{len(self.bench)} benchmark row(s); wrote {len(self.files)} file(s)"]
        lines += [f"  {path}" for path in self.files]
        return "\n".join(lines)


def _models_with_longbench(scores: pd.DataFrame, references: References) -> list[str]:
    names: dict[str, str] = {}
    if references.longbench is not None:
        for model in references.longbench["model"]:
            names.setdefault(canonical_model(model), model)
    if not scores.empty:
        for model in scores.loc[scores["task"] == "longbench", "model"]:
            names.setdefault(canonical_model(model), model)
    return list(names.values())


def _has_ours(table: ComparisonTable) -> bool:
    return bool((table.n_ours > 0).any())


def write_summary(runs_root: str | Path | list, out: str | Path, *, bench_root: str | Path | None = None,
                  reference_dir: str | Path | None = REFERENCE_DIR, plots: bool = True,
                  paper_only_tables: bool = False) -> Summary:
    """Read results, write tables and plots under ``out``; returns what was done.

    Every table and plot comes from the runs under ``runs_root`` and, for the latency figures, the benchmark files
    under ``bench_root`` (none unless given), next to the paper's numbers in ``reference_dir`` (the repository's
    results/paper/ unless given). Tables for models we have no runs of are written only with
    ``paper_only_tables`` (they would be the paper's numbers alone).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot_dir = out / "plots"
    runs = load_runs(runs_root)
    references = References.load(reference_dir) if reference_dir and Path(reference_dir).exists() else References()
    bench = latest_bench(load_bench(bench_root)) if bench_root and Path(bench_root).exists() else pd.DataFrame()
    summary = Summary(
        runs=runs_frame(runs),
        partial=pd.DataFrame([{"run_dir": str(p.run_dir), "n_written": p.n_written}
                              for p in find_partial_runs(runs_root)], columns=["run_dir", "n_written"]),
        scores=collect_scores(runs),
        latency=collect_latency(runs),
        bench=bench,
        references=references,
    )
    files = summary.files
    for name, frame in (("runs", summary.runs), ("partial_runs", summary.partial), ("scores_long", summary.scores),
                        ("run_latency", summary.latency)):
        path = out / f"{name}.csv"
        frame.to_csv(path, index=False, na_rep="")
        files.append(path)

    # Table 2 and its figures, per model
    for model in _models_with_longbench(summary.scores, references):
        table = longbench_table(summary.scores, references.longbench, model)
        if not _has_ours(table) and not paper_only_tables:
            continue
        stem = f"table2_{safe_name(canonical_model(model))}"
        summary.tables[stem] = table
        files += table.write(out / stem)
        if plots:
            files += P.accuracy_vs_budget(table, plot_dir / f"accuracy_vs_budget_{safe_name(canonical_model(model))}")
            points = P.tradeoff_points(table, summary.latency, references.latency, model)
            files += P.accuracy_vs_tpot(points, plot_dir / f"accuracy_vs_tpot_{safe_name(canonical_model(model))}",
                                        title=f"Accuracy vs TPOT, {model}")

    # RULER, per model and context length
    categories = ruler_categories(summary.scores) if not summary.scores.empty else pd.DataFrame()
    ruler_keys: set[tuple[str, str]] = set()
    for frame in (categories, references.ruler if paper_only_tables else None):
        if frame is not None and not frame.empty:
            ruler_keys |= {(m, length) for m, length in zip(frame["model"], frame["length"])}
    seen_labels: set[tuple[str, str]] = set()
    for model, length in sorted(ruler_keys, key=lambda k: (canonical_model(k[0]), int(k[1]))):
        label = (canonical_model(model), length_label(length))
        if label in seen_labels:
            continue
        seen_labels.add(label)
        table = ruler_table(categories, references.ruler, model, int(length))
        stem = f"ruler_{safe_name(label[0])}_{label[1]}"
        summary.tables[stem] = table
        files += table.write(out / stem)

    # Every other task as a plain wide table
    if not summary.scores.empty:
        for task in sorted(set(summary.scores["task"]) - {"longbench", "ruler"}):
            wide = task_table(summary.scores, task)
            summary.tables[task] = wide
            (out / f"{task}.md").write_text(f"**{task}**\n\n" + frame_to_markdown(wide), encoding="utf-8")
            wide.to_csv(out / f"{task}.csv", na_rep="")
            files += [out / f"{task}.md", out / f"{task}.csv"]

        if plots:
            files += task_figures(summary.scores, plot_dir)

    # The measured runs' accuracy table and figures
    measured_runs = [run for run in runs if (run.settings or {}).get("measure_selection")]
    measured = [run.payload for run in measured_runs]
    if measured:
        run_dirs = {id(run.payload): Path(run.run_dir) for run in measured_runs}
        attach_paired(measured, lambda payload: run_dirs[id(payload)])  # where the predictions are on disk
        rows = A.accuracy_rows(measured)
        summary.tables["accuracy"] = pd.DataFrame([accuracy_record(r) for r in rows])
        (out / "accuracy.md").write_text(A.render_tables(rows) + "\n\n" + A.DEFINITIONS + "\n", encoding="utf-8")
        summary.tables["accuracy"].to_csv(out / "accuracy.csv", index=False, na_rep="")
        files += [out / "accuracy.md", out / "accuracy.csv"]
        if plots:
            files += accuracy_figures(rows, bench.to_dict("records") if not bench.empty else [], plot_dir)

    # Latency benchmarks
    if not bench.empty:
        wide = latency_table(bench)
        summary.tables["latency"] = wide
        (out / "latency.md").write_text(latency_markdown(wide), encoding="utf-8")
        wide.to_csv(out / "latency.csv", na_rep="")
        files += [out / "latency.md", out / "latency.csv"]
        if plots:
            files += _latency_plots(bench, references, plot_dir)
    return summary


# The measures of latency_table's columns (``<measure>@<context>``), as latency.md titles them.
LATENCY_MEASURES = {
    "tpot_ms": "TPOT (ms)",
    "tt2t_s_median": "TT2T (s)",
    "tpot_ratio_to_full": "TPOT / full cache's",
    "tpot_ratio_to_full_static": "TPOT / static full cache's",
}


def latency_markdown(wide: pd.DataFrame) -> str:
    """latency_table's wide frame as one short table per measure (rows model, method, budget; a column per
    context), so that no table is wider than the contexts measured."""
    parts = ["**Latency (scripts/bench/latency.py)**"]
    for measure, title in LATENCY_MEASURES.items():
        columns = [c for c in wide.columns if str(c).partition("@")[0] == measure]
        if not columns or wide[columns].isna().all().all():
            continue
        table = wide[columns].dropna(how="all")
        table.columns = [str(c).partition("@")[2] for c in columns]
        parts.append(f"{title}, by context length (tokens)\n\n" + frame_to_markdown(table, 3))
    return "\n\n".join(parts) + "\n"


@dataclass
class ScorePoint:
    """One cell of a task's score figure: the fields accuracy_vs_budget_panels reads (no interval: the runs'
    aggregates carry none)."""

    task: str
    length: object
    method: str
    budget: int | None
    score: float
    interval: tuple[float, float] | None = None


def task_score_points(scores: pd.DataFrame, task: str, model: str) -> list[ScorePoint]:
    """Per context length and per method, budget and settings, the task's score: the mean over its datasets or
    subtasks, drawn only where a row has every one that any row of the same length has (a mean over fewer would not
    compare). LongBench-E's length buckets are its table's, not a panel each. A settings variant is its own series,
    ``<method>+<settings>``."""
    frame = scores[(scores["task"] == task) & (scores["model"].map(canonical_model) == canonical_model(model))]
    points: list[ScorePoint] = []
    lengths = [None if _missing_length(v) else int(float(v)) for v in frame["length"]]
    keep = [_missing_length(v) or _is_number(v) for v in frame["length"]]
    frame, lengths = frame[keep], [length for length, kept in zip(lengths, keep) if kept]
    for length in sorted(set(lengths), key=lambda v: -1 if v is None else v):
        here = frame[[value == length for value in lengths]]
        datasets = set(here["dataset"])
        keys = ["method", "budget", "settings"]
        for (method, budget, settings), group in here.groupby([here[k].astype(object).fillna("") for k in keys]):
            if set(group["dataset"]) != datasets:
                continue
            label = f"{method}+{settings}" if settings else method
            points.append(ScorePoint(task=task, length=length, method=label,
                                     budget=None if budget == "" else int(budget),
                                     score=float(group["score"].mean())))
    return points


def _missing_length(value) -> bool:
    return value is None or (isinstance(value, float) and pd.isna(value))


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def task_figures(scores: pd.DataFrame, folder: Path) -> list[Path]:
    """Score against the budget for every task but LongBench v1 (Table 2's figures), one figure per model with a
    panel per context length: the runs given on the command line, whatever their task."""
    files: list[Path] = []
    if scores.empty:
        return files
    others = scores[scores["task"] != "longbench"]
    for task, model in sorted({(t, m) for t, m in zip(others["task"], others["model"])}):
        points = task_score_points(scores, task, model)
        stem = folder / f"score_vs_budget_{safe_name(task)}_{safe_name(canonical_model(model))}"
        files += P.accuracy_vs_budget_panels(points, stem, title=f"{task}: score against the budget, {model}")
    return files


def accuracy_record(row: A.AccuracyRow) -> dict:
    """One accuracy row as a flat CSV record (the per-layer lists as space-separated numbers)."""
    record = {key: getattr(row, key) for key in ("task", "model", "length", "method", "budget", "score", "n",
                                                   "share_of_full", "difference", "attended", "mass", "oracle_mass",
                                                   "commit")}
    record["ci_low"], record["ci_high"] = row.interval or (None, None)
    record["difference_ci_low"], record["difference_ci_high"] = row.difference_interval or (None, None)
    for key in ("layers", "mass_by_layer", "oracle_by_layer"):
        record[key] = " ".join(str(v) for v in getattr(row, key))
    return record


ACCURACY_FIGURES = ("accuracy_vs_budget", "accuracy_vs_tpot", "mass_by_layer")


def accuracy_figures(rows: list[A.AccuracyRow], bench: list[dict], folder: Path, prefix: str = "",
                     only: tuple[str, ...] = ACCURACY_FIGURES) -> list[Path]:
    """Per model: accuracy vs budget, accuracy vs TPOT (TPOT from the latency benchmark rows ``bench``, matched
    by ``accuracy.tpot_for``; the title names the model timed) and the mass captured by layer; of those, the ones
    named in ``only`` (``ACCURACY_FIGURES``), so that another kind's file in ``folder`` is left as it is."""
    files: list[Path] = []
    for model in sorted({r.model for r in rows}):
        mine = [r for r in rows if r.model == model]
        name = prefix + safe_name(canonical_model(model))
        if "accuracy_vs_budget" in only:
            files += P.accuracy_vs_budget_panels(mine, folder / f"accuracy_vs_budget_{name}",
                                                 title=f"Accuracy against the budget, {model}")
        if "accuracy_vs_tpot" in only:
            points = A.tradeoff_points(mine, bench)
            # The title says whose decode time it is; the files it comes from are BENCHMARKS.md's (a list of them
            # would bury the title).
            timed = sorted({p.timed_model for p in points if p.timed_model})
            contexts = sorted({p.timed_context for p in points if p.timed_context})
            at = f" at {length_label(contexts[0])}" if len(contexts) == 1 else (
                f" at {length_label(contexts[0])}-{length_label(contexts[-1])}" if contexts else "")
            gpus = sorted({p.timed_gpu for p in points if p.timed_gpu})
            on = f", {' + '.join(gpus)}" if gpus else ""
            title = (f"{model}: score (% of the full cache's) against TPOT / full_static's "
                     f"({', '.join(timed)}{at}{on})" if timed else "")
            files += P.accuracy_vs_tpot_panels(points, folder / f"accuracy_vs_tpot_{name}", title=title)
        if "mass_by_layer" in only:
            files += P.mass_by_layer_panels(mine, folder / f"mass_by_layer_{name}",
                                            title=f"Attention mass captured by layer, {model}")
    return files


def current_code(methods: pd.Series, dates: pd.Series, commits: pd.Series | None) -> pd.Series:
    """Per latency row, whether it was measured on the commit of its method's newest row: a curve that joins
    points of older code to newer ones draws a change of code as a change with the context."""
    if commits is None:
        return pd.Series(True, index=methods.index)
    frame = pd.DataFrame({"method": methods, "date": dates, "commit": commits})
    newest = frame.sort_values("date").groupby("method")["commit"].last()
    return frame["commit"].isna() | (frame["commit"] == frame["method"].map(newest))


def _latency_plots(bench: pd.DataFrame, references: References, plot_dir: Path) -> list[Path]:
    files: list[Path] = []
    for model, frame in bench.groupby("model"):
        name = safe_name(canonical_model(model))
        contexts = sorted(frame["context"].dropna().astype(int).unique())
        # Bars at the context nearest the paper's breakdown (36k); the paper's LongBench TT2T is drawn alongside.
        context = min(contexts, key=lambda c: abs(c - 36000)) if contexts else None
        at = frame[frame["context"] == context]
        bars = pd.DataFrame({"method": at["method"], "tt2t_s": at.get("tt2t_s_median"),
                             "tt2t_s_min": at.get("tt2t_s_min"), "tt2t_s_max": at.get("tt2t_s_max")})
        files += P.latency_bars(bars, P.paper_metric(references.latency, "tt2t", model), plot_dir / f"tt2t_{name}",
                                title=f"TT2T at {length_label(context)} tokens, {model}")
        breakdowns = {}
        for row in at.to_dict("records"):
            phases = {k.removeprefix("phase_").removesuffix("_s"): v for k, v in row.items()
                      if k.startswith("phase_") and not pd.isna(v)}
            if phases:
                breakdowns[row["method"]] = P.group_phases(phases, row.get("tpot_s_median"))
        paper_parts = P.paper_breakdown(references.latency) if canonical_model(model).startswith("llama") else {}
        files += P.tpot_breakdown(breakdowns, paper_parts, plot_dir / f"tpot_breakdown_{name}",
                                  title=f"TPOT breakdown at {length_label(context)} tokens, {model}")
        labels = frame["method_label"] if "method_label" in frame else pd.Series(None, index=frame.index)
        curve = pd.DataFrame({
            "method": [curve_method(m, label) for m, label in zip(frame["method"], labels)],
            "context": frame["context"].astype(float),
            "tpot_ms": 1000 * frame["tpot_s_median"],
            "tpot_ms_min": 1000 * frame["tpot_s_min"] if "tpot_s_min" in frame else None,
            "tpot_ms_max": 1000 * frame["tpot_s_max"] if "tpot_s_max" in frame else None,
        })
        curve = curve.dropna(subset=["method"])
        curve["current"] = current_code(curve["method"], frame["date"], frame.get("commit"))
        paper_curve = None
        if references.scaling is not None:
            paper_curve = references.scaling[references.scaling["model"].map(canonical_model) == canonical_model(model)]
            paper_curve = paper_curve if not paper_curve.empty else None
        files += P.latency_vs_context(curve, paper_curve, plot_dir / f"latency_vs_context_{name}",
                                      title=f"Decode latency vs context, {model}")
    return files
