"""The paper's tables from collected scores, next to the paper's numbers, as Markdown, CSV and LaTeX.

Layout of Table 2 (LongBench): rows are (method, budget, settings), columns the 16 datasets, then Avg and the
accuracy relative to the full cache. For every row there is an ``ours`` line (each cell with its delta to the
paper in brackets), an ``n`` line (the samples behind each of our cells) and, where the paper has the row, a
``paper`` line. Runs of one method and budget with different settings are different rows, labelled with what
differs (``task.limit=5``); the paper's line goes with each. A cell nobody measured is shown as missing (an em
dash in Markdown, ``--`` in LaTeX, an empty field in CSV), never as zero. Our Avg is the plain mean over the 16
datasets (the paper's Avg), so it is missing until all 16 are there; ``n_columns_ours`` says how many are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from .accuracy import length_label
from .collect import LONGBENCH_16, RULER_CATEGORIES, RULER_CATEGORY_NAMES, canonical_model, row_sort_key
from .methods import display_name, is_registered

MISSING_MD = "—"
MISSING_TEX = "--"


def row_id(method: str, budget: Any, settings: str = "") -> str:
    """The index label of a table row: ``icecache@256``, ``full@-`` (pandas indexes dislike None), with the
    settings that tell a variant apart in brackets: ``icecache@256[task.limit=5]``."""
    return f"{method}@{'-' if _missing(budget) else int(budget)}" + (f"[{settings}]" if settings else "")


def budget_text(budget: Any) -> str:
    """256 -> '256', a missing budget -> '' (never '256.0')."""
    return "" if _missing(budget) or budget == "" else str(int(budget))


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _fmt(value: Any, digits: int = 1, signed: bool = False) -> str | None:
    if _missing(value):
        return None
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


@dataclass
class ComparisonTable:
    """Ours, the paper's and their difference on the same rows and columns.

    ``keys`` are the rows, (method, budget, settings) with budget ``None`` for the full cache and settings the
    label of a variant ("" when one variant has the row), in the paper's order; ``ours``, ``paper``, ``delta``
    and ``n`` are DataFrames indexed by ``row_id(method, budget, settings)`` with the value columns ``columns``
    (plus ``Avg``, except in ``n``, the samples behind each of our cells); ``rel_full`` holds each side's Avg as a
    percentage of its own full-cache Avg. ``n_ours`` counts the value columns we have per row.
    """

    title: str
    columns: list[str]
    keys: list[tuple[str, Any, str]]
    ours: pd.DataFrame
    paper: pd.DataFrame
    delta: pd.DataFrame
    rel_full: pd.DataFrame  # columns: ours, paper
    n_ours: pd.Series
    n: pd.DataFrame
    first_label: str = "Method"
    notes: tuple[str, ...] = ()  # printed under the Markdown table and as LaTeX comments

    @property
    def rows(self) -> list[tuple[str, Any, str]]:
        return list(self.keys)

    def value(self, source: str, method: str, budget: Any, column: str, settings: str = "") -> float | None:
        """One cell (``source``: ours | paper | delta | n); ``None`` when missing."""
        frame = {"ours": self.ours, "paper": self.paper, "delta": self.delta, "n": self.n}[source]
        key = row_id(method, budget, settings)
        if key not in frame.index or column not in frame.columns:
            return None
        value = frame.at[key, column]
        return None if _missing(value) else float(value)

    # -- renderers ------------------------------------------------------------------------------------------

    def _row_label(self, method: str, budget: Any, settings: str = "") -> tuple[str, str]:
        name = display_name(method)
        if not is_registered(method):
            name += " (paper only)"
        if settings:
            name += f" [{settings}]"
        return name, budget_text(budget)

    def to_frame(self) -> pd.DataFrame:
        """The CSV layout: one line per (method, budget, settings, source) with source in ours, n, paper, delta."""
        lines = []
        for method, budget, settings in self.rows:
            key = row_id(method, budget, settings)
            for source, frame in (("ours", self.ours), ("n", self.n), ("paper", self.paper), ("delta", self.delta)):
                values = frame.loc[key]
                value_columns = self.columns + (["Avg"] if "Avg" in frame.columns else [])
                if source not in ("ours",) and all(_missing(values[c]) for c in value_columns):
                    continue
                if source in ("ours", "n") and not is_registered(method):
                    continue
                line = {"method": method, "method_display": display_name(method),
                        "budget": None if _missing(budget) else int(budget), "settings": settings, "source": source}
                line.update({c: values[c] if c in values else None for c in self.columns + ["Avg"]})
                rel = self.rel_full.loc[key]
                line["pct_of_full"] = rel["ours"] if source == "ours" else rel["paper"] if source == "paper" else (
                    None if source == "n" or _missing(rel["ours"]) or _missing(rel["paper"])
                    else rel["ours"] - rel["paper"])
                line["n_columns_ours"] = int(self.n_ours[key]) if source == "ours" else None
                lines.append(line)
        columns = ["method", "method_display", "budget", "settings", "source", *self.columns, "Avg", "pct_of_full",
                   "n_columns_ours"]
        frame = pd.DataFrame(lines, columns=columns)
        frame["budget"] = frame["budget"].astype("Int64")
        frame["n_columns_ours"] = frame["n_columns_ours"].astype("Int64")
        return frame

    def to_csv(self, path: str | Path) -> Path:
        path = Path(path)
        self.to_frame().to_csv(path, index=False, na_rep="", float_format="%.2f")
        return path

    def _cells(self, method: str, budget: Any, settings: str, missing: str,
               delta_fmt) -> tuple[list[str], list[str], list[str] | None]:
        ours_cells, n_cells, paper_cells = [], [], []
        has_paper = False
        for column in self.columns + ["Avg"]:
            ours = self.value("ours", method, budget, column, settings)
            paper = self.value("paper", method, budget, column, settings)
            delta = self.value("delta", method, budget, column, settings)
            n = self.value("n", method, budget, column, settings)
            has_paper |= paper is not None
            text = _fmt(ours) or missing
            if delta is not None:
                text += delta_fmt(_fmt(delta, signed=True))
            ours_cells.append(text)
            n_cells.append("" if column == "Avg" else (str(int(n)) if n is not None else missing))
            paper_cells.append(_fmt(paper) or missing)
        rel = self.rel_full.loc[row_id(method, budget, settings)]
        ours_cells.append((_fmt(rel["ours"]) + "%") if not _missing(rel["ours"]) else missing)
        n_cells.append("")
        paper_cells.append((_fmt(rel["paper"]) + "%") if not _missing(rel["paper"]) else missing)
        return ours_cells, n_cells, paper_cells if has_paper else None

    def to_markdown(self) -> str:
        header = [self.first_label, "Budget", "Source", *self.columns, "Avg", "% of full"]
        lines = [f"**{self.title}**", "", "| " + " | ".join(header) + " |",
                 "|" + "|".join(["---"] * 3 + ["---:"] * (len(self.columns) + 2)) + "|"]
        for method, budget, settings in self.rows:
            name, budget_label = self._row_label(method, budget, settings)
            ours, n, paper = self._cells(method, budget, settings, MISSING_MD, lambda d: f" ({d})")
            if is_registered(method) or paper is None:
                lines.append("| " + " | ".join([name, budget_label, "ours", *ours]) + " |")
                if any(cell not in ("", MISSING_MD) for cell in n):
                    lines.append("| " + " | ".join([name, budget_label, "n", *n]) + " |")
            if paper is not None:
                lines.append("| " + " | ".join([name, budget_label, "paper", *paper]) + " |")
        lines += ["", "ours cells: our score (difference to the paper's); n: the samples behind it; " + MISSING_MD
                  + ": not measured. % of full: Avg relative to the same source's full-cache Avg. A row's "
                  "[settings] say what its runs did differently from the other rows' (never mixed in one cell)."]
        lines += [f"{note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def to_latex(self) -> str:
        def esc(text: str) -> str:
            return text.replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")

        spec = "lll" + "r" * (len(self.columns) + 2)
        header = [self.first_label, "Budget", "", *[esc(c) for c in self.columns], "Avg", r"\% full"]
        lines = [r"\begin{tabular}{" + spec + "}", r"\toprule", " & ".join(header) + r" \\", r"\midrule"]
        for method, budget, settings in self.rows:
            name, budget_label = self._row_label(method, budget, settings)
            ours, _, paper = self._cells(method, budget, settings, MISSING_TEX,
                                         lambda d: r"\,{\scriptsize(" + d + ")}")
            if is_registered(method) or paper is None:
                lines.append(" & ".join([esc(name), budget_label, "ours", *[esc(c) for c in ours]]) + r" \\")
            if paper is not None:
                lines.append(" & ".join([esc(name), budget_label, r"\textit{paper}",
                                         *[r"\textit{" + esc(c) + "}" for c in paper]]) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}"] + [f"% {note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def write(self, stem: str | Path) -> list[Path]:
        """``<stem>.md``, ``<stem>.csv`` and ``<stem>.tex``."""
        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        paths = [Path(f"{stem}.md"), self.to_csv(Path(f"{stem}.csv")), Path(f"{stem}.tex")]
        paths[0].write_text(self.to_markdown(), encoding="utf-8")
        paths[2].write_text(self.to_latex(), encoding="utf-8")
        return paths


def _comparison(title: str, columns: list[str], ours_cells: dict, paper_cells: dict, paper_avg: dict,
                first_label: str = "Method", ours_n: dict | None = None, contexts: dict | None = None
                ) -> ComparisonTable:
    """Assemble the frames. ``ours_cells`` map (method, budget, settings) -> {column: value}, ``paper_cells``
    (method, budget) -> {column: value}; ``ours_n`` is like ``ours_cells`` with sample counts. ``contexts`` maps
    a row of ours to the settings its runs share with other methods' rows: its % of full is taken against the full
    cache row of the same context (none: missing), so a relative accuracy never compares different samples."""
    ours_n, contexts = ours_n or {}, contexts or {}
    paper_keys = {(m, b, "") for m, b in paper_cells if not any(k[:2] == (m, b) for k in ours_cells)}
    keys = sorted(set(ours_cells) | paper_keys, key=lambda k: (*row_sort_key(k[0], k[1]), k[2]))
    index = pd.Index([row_id(*k) for k in keys], name="row", dtype=object)

    def frame(cells: dict, paper: bool = False) -> pd.DataFrame:
        data = [[cells.get(k[:2] if paper else k, {}).get(c, math.nan) for c in columns] for k in keys]
        return pd.DataFrame(data, index=index, columns=columns, dtype=float)

    ours, paper, n = frame(ours_cells), frame(paper_cells, paper=True), frame(ours_n)
    # Our Avg only over a complete row: a partial mean is not comparable with the paper's.
    ours["Avg"] = ours[columns].mean(axis=1).where(ours[columns].notna().all(axis=1))
    paper["Avg"] = [paper_avg.get(k[:2], math.nan) for k in keys] if keys else []
    paper["Avg"] = paper["Avg"].astype(float)
    delta = ours - paper
    rel = pd.DataFrame(index=index, columns=["ours", "paper"], dtype=float)
    full_rows = [k for k in keys if k[0] == "full"]
    paper_full = row_id("full", None) if ("full", None, "") in keys else (
        row_id(*full_rows[0]) if full_rows else None)
    for key in keys:
        rid = row_id(*key)
        same = [k for k in full_rows if k in ours_cells and contexts.get(k) == contexts.get(key)]
        full = ours.at[row_id(*same[0]), "Avg"] if len(same) == 1 else math.nan
        rel.at[rid, "ours"] = 100.0 * ours.at[rid, "Avg"] / full if not _missing(full) and full else math.nan
        full_paper = paper.at[paper_full, "Avg"] if paper_full else math.nan
        rel.at[rid, "paper"] = (100.0 * paper.at[rid, "Avg"] / full_paper
                                if not _missing(full_paper) and full_paper else math.nan)
    n_ours = ours[columns].notna().sum(axis=1)
    return ComparisonTable(title, columns, keys, ours, paper, delta, rel, n_ours, n, first_label)


def _ours(scores: pd.DataFrame, column_of) -> tuple[dict, dict, dict]:
    """(cells, n, contexts) of long-form score rows; ``column_of(row)`` names a row's column (None: skip it)."""
    cells: dict = {}
    counts: dict = {}
    contexts: dict = {}
    for row in scores.to_dict("records"):
        column = column_of(row)
        if column is None:
            continue
        key = (row["method"], None if _missing(row["budget"]) else int(row["budget"]), row.get("settings") or "")
        cells.setdefault(key, {})[column] = row["score"]
        if not _missing(row.get("n")):
            counts.setdefault(key, {})[column] = row["n"]
        contexts[key] = _context_of(row.get("settings") or "")
    return cells, counts, contexts


def _context_of(settings: str) -> str:
    """The part of a variant label that is not a method setting (what rows of different methods must share)."""
    return ", ".join(part for part in settings.split(", ") if part and not part.startswith("method."))


def longbench_table(scores: pd.DataFrame, paper: pd.DataFrame | None, model: str,
                    datasets: list[str] | None = None) -> ComparisonTable:
    """The paper's Table 2 for one model from long-form scores (collect.collect_scores) and paper_longbench.csv.
    LongBench v1 runs only: LongBench-E runs are the task ``longbench_e``."""
    datasets = datasets or LONGBENCH_16
    wanted = canonical_model(model)
    ours_cells, ours_n, contexts = {}, {}, {}
    if not scores.empty:
        mine = scores[(scores["task"] == "longbench") & (scores["model"].map(canonical_model) == wanted)
                      & scores["length"].isna() & scores["dataset"].isin(datasets)]
        ours_cells, ours_n, contexts = _ours(mine, lambda row: row["dataset"])
    paper_cells, paper_avg = {}, {}
    if paper is not None:
        for row in paper[paper["model"].map(canonical_model) == wanted].to_dict("records"):
            key = (row["method"], None if _missing(row["budget"]) else int(row["budget"]))
            paper_cells[key] = {d: row[d] for d in datasets if d in row}
            paper_avg[key] = row.get("avg_reported", math.nan)
    table = _comparison(f"LongBench, {model}", datasets, ours_cells, paper_cells, paper_avg, ours_n=ours_n,
                        contexts=contexts)
    small = sorted({b for m, b, _ in table.rows if m in ("icecache", "icecache_reuse") and not _missing(b)
                    and b // 16 < 5})
    if small:
        table.notes = (ICECACHE_SMALL_BUDGETS.format(budgets=" and ".join(map(str, small))),)
    return table


# What IceCache attends at budgets its default fixed pages would fill (IceCacheConfig.fitted_to_budget).
ICECACHE_SMALL_BUDGETS = (
    "IceCache and IceCache(r) at budget {budgets}: the budget counts sink + selected + window pages of 16 tokens; "
    "where the default 2 sink + 2 window pages would leave no page to select, each is one page (at 64: 1 sink + 2 "
    "selected + 1 window page); docs/eval.md, IceCache at small budgets."
)


def ruler_table(categories: pd.DataFrame, paper: pd.DataFrame | None, model: str, length: int) -> ComparisonTable:
    """The paper's RULER table at one context length: rows (method, budget), columns the three categories."""
    columns = [RULER_CATEGORY_NAMES[c] for c in RULER_CATEGORIES]
    wanted = canonical_model(model)
    label = length_label(length)

    def at_length(frame: pd.DataFrame | None) -> pd.DataFrame:
        if frame is None or frame.empty:
            return pd.DataFrame(columns=["model", "method", "budget", "length", "category", "score"])
        return frame[(frame["model"].map(canonical_model) == wanted) & (frame["length"].map(length_label) == label)]

    paper_cells: dict = {}
    for row in at_length(paper).to_dict("records"):
        key = (row["method"], None if _missing(row["budget"]) else int(row["budget"]))
        paper_cells.setdefault(key, {})[RULER_CATEGORY_NAMES[row["category"]]] = row["score"]
    paper_avg = {k: sum(v.values()) / len(v) for k, v in paper_cells.items() if len(v) == len(columns)}
    ours_cells, ours_n, contexts = _ours(at_length(categories), lambda row: RULER_CATEGORY_NAMES[row["category"]])
    return _comparison(f"RULER {label}, {model}", columns, ours_cells, paper_cells, paper_avg, ours_n=ours_n,
                       contexts=contexts)


def task_table(scores: pd.DataFrame, task: str) -> pd.DataFrame:
    """Any task as rows (model, method, budget, settings) and columns (dataset, length) in order (lengths as
    numbers: 4k before 10k), each score followed by its ``n`` column; missing cells stay NaN."""
    frame = scores[scores["task"] == task].copy()
    if frame.empty:
        return pd.DataFrame()

    def column(dataset: str, length: Any) -> str:
        if _missing(length):
            return "score" if dataset == task else dataset
        return length_label(length) if dataset == task else f"{dataset}@{length_label(length)}"

    def order(dataset: str, length: Any) -> tuple:
        known = LONGBENCH_16.index(dataset) if dataset in LONGBENCH_16 else len(LONGBENCH_16)
        if _missing(length):
            return (known, dataset, -1, "")
        try:
            return (known, dataset, 0, float(length), "")
        except (TypeError, ValueError):
            return (known, dataset, 1, 0.0, str(length))  # LongBench-E buckets: 0-4k, 4-8k, 8k+ as written

    frame["column"] = [column(d, length) for d, length in zip(frame["dataset"], frame["length"])]
    frame["_order"] = [order(d, length) for d, length in zip(frame["dataset"], frame["length"])]
    frame["budget"] = frame["budget"].map(budget_text)
    frame["settings"] = frame["settings"].fillna("") if "settings" in frame else ""
    index = ["model", "method", "budget", "settings"]
    wide = frame.pivot_table(index=index, columns="column", values="score", aggfunc="first")
    counts = frame.pivot_table(index=index, columns="column", values="n", aggfunc="first")
    columns = [c for _, c in sorted({(o, c) for o, c in zip(frame["_order"], frame["column"])})]
    ordered = []
    for name in columns:
        ordered.append(wide[name].rename(name))
        if name in counts:
            ordered.append(counts[name].round().astype("Int64").rename(f"n {name}"))
    wide = pd.concat(ordered, axis=1)
    rows = sorted(wide.index, key=lambda k: (k[0], *row_sort_key(k[1], None if k[2] == "" else int(k[2])), k[3]))
    return wide.loc[rows]


def frame_to_markdown(frame: pd.DataFrame, digits: int = 1) -> str:
    """A small DataFrame as a Markdown table (no tabulate dependency); NaN -> em dash."""
    if frame.empty:
        return "(no results)\n"
    flat = frame.reset_index()
    header = [str(c) for c in flat.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for row in flat.itertuples(index=False):
        cells = []
        for value in row:
            if isinstance(value, float):
                cells.append(MISSING_MD if math.isnan(value) else f"{value:.{digits}f}")
            else:
                cells.append(MISSING_MD if value is None or value is pd.NA else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def latency_table(bench: pd.DataFrame) -> pd.DataFrame:
    """Benchmark summary as rows (model, method, budget) and, per context, TPOT in ms and its ratios to full and
    full_static."""
    if bench.empty or "tpot_s_median" not in bench:
        return pd.DataFrame()
    frame = bench.copy()
    frame["ctx"] = frame["context"].map(length_label)
    frame["tpot_ms"] = 1000 * frame["tpot_s_median"]
    frame["budget"] = frame["budget"].map(budget_text)
    optional = ("tt2t_s_median", "tpot_ratio_to_full", "tpot_ratio_to_full_static")
    values = ["tpot_ms"] + [c for c in optional if c in frame]
    wide = frame.pivot_table(index=["model", "method", "budget"], columns="ctx", values=values, aggfunc="first")
    tokens = dict(zip(frame["ctx"], frame["context"]))
    wide = wide[sorted(wide.columns, key=lambda c: (values.index(c[0]), float(tokens.get(c[1], 0))))]
    wide.columns = [f"{value}@{ctx}" for value, ctx in wide.columns]
    return wide
