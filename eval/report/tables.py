"""The paper's tables from collected scores, next to the paper's numbers, as Markdown, CSV and LaTeX.

Layout of Table 2 (LongBench): rows are (method, budget), columns the 16 datasets, then Avg and the accuracy
relative to the full cache. For every row there is an ``ours`` line (each cell with its delta to the paper in
brackets) and, where the paper has the row, a ``paper`` line. A cell nobody measured is shown as missing (an
em dash in Markdown, ``--`` in LaTeX, an empty field in CSV), never as zero. Our Avg is the plain mean over the
16 datasets (the paper's Avg), so it is missing until all 16 are there; ``n_datasets`` says how many are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from .collect import (
    LONGBENCH_16,
    NOT_IMPLEMENTED,
    RULER_CATEGORIES,
    RULER_CATEGORY_NAMES,
    canonical_model,
    display_name,
    length_label,
    row_sort_key,
)

MISSING_MD = "—"
MISSING_TEX = "--"


def row_id(method: str, budget: Any) -> str:
    """The index label of a table row: ``icecache@256``, ``full@-`` (pandas indexes dislike None)."""
    return f"{method}@{'-' if _missing(budget) else int(budget)}"


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _fmt(value: Any, digits: int = 1, signed: bool = False) -> str | None:
    if _missing(value):
        return None
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


@dataclass
class ComparisonTable:
    """Ours, the paper's and their difference on the same rows and columns.

    ``keys`` are the rows, (method, budget) with budget ``None`` for the full cache, in the paper's order;
    ``ours``, ``paper`` and ``delta`` are DataFrames indexed by ``row_id(method, budget)`` with the value columns
    ``columns`` plus ``Avg``; ``rel_full`` holds each side's Avg as a percentage of its own full-cache Avg.
    ``n_ours`` counts the value columns we have per row.
    """

    title: str
    columns: list[str]
    keys: list[tuple[str, Any]]
    ours: pd.DataFrame
    paper: pd.DataFrame
    delta: pd.DataFrame
    rel_full: pd.DataFrame  # columns: ours, paper
    n_ours: pd.Series
    first_label: str = "Method"

    @property
    def rows(self) -> list[tuple[str, Any]]:
        return list(self.keys)

    def value(self, source: str, method: str, budget: Any, column: str) -> float | None:
        """One cell (``source``: ours | paper | delta); ``None`` when missing."""
        frame = {"ours": self.ours, "paper": self.paper, "delta": self.delta}[source]
        key = row_id(method, budget)
        if key not in frame.index:
            return None
        value = frame.at[key, column]
        return None if _missing(value) else float(value)

    # -- renderers ------------------------------------------------------------------------------------------

    def _row_label(self, method: str, budget: Any) -> tuple[str, str]:
        name = display_name(method)
        if method in NOT_IMPLEMENTED:
            name += " (paper only)"
        return name, "" if _missing(budget) else str(int(budget))

    def to_frame(self) -> pd.DataFrame:
        """The CSV layout: one line per (method, budget, source) with source in ours, paper, delta."""
        lines = []
        for method, budget in self.rows:
            for source, frame in (("ours", self.ours), ("paper", self.paper), ("delta", self.delta)):
                values = frame.loc[row_id(method, budget)]
                if source != "ours" and all(_missing(values[c]) for c in self.columns + ["Avg"]):
                    continue
                if source == "ours" and method in NOT_IMPLEMENTED:
                    continue
                line = {"method": method, "method_display": display_name(method),
                        "budget": None if _missing(budget) else int(budget), "source": source}
                line.update({c: values[c] for c in self.columns + ["Avg"]})
                rel = self.rel_full.loc[row_id(method, budget)]
                line["pct_of_full"] = rel["ours"] if source == "ours" else rel["paper"] if source == "paper" else (
                    None if _missing(rel["ours"]) or _missing(rel["paper"]) else rel["ours"] - rel["paper"])
                line["n_columns_ours"] = int(self.n_ours[row_id(method, budget)]) if source == "ours" else None
                lines.append(line)
        columns = ["method", "method_display", "budget", "source", *self.columns, "Avg", "pct_of_full",
                   "n_columns_ours"]
        frame = pd.DataFrame(lines, columns=columns)
        frame["budget"] = frame["budget"].astype("Int64")
        frame["n_columns_ours"] = frame["n_columns_ours"].astype("Int64")
        return frame

    def to_csv(self, path: str | Path) -> Path:
        path = Path(path)
        self.to_frame().to_csv(path, index=False, na_rep="", float_format="%.2f")
        return path

    def _cells(self, method: str, budget: Any, missing: str, delta_fmt) -> tuple[list[str], list[str] | None]:
        ours_cells, paper_cells = [], []
        has_paper = False
        for column in self.columns + ["Avg"]:
            ours = self.value("ours", method, budget, column)
            paper = self.value("paper", method, budget, column)
            delta = self.value("delta", method, budget, column)
            has_paper |= paper is not None
            text = _fmt(ours) or missing
            if delta is not None:
                text += delta_fmt(_fmt(delta, signed=True))
            ours_cells.append(text)
            paper_cells.append(_fmt(paper) or missing)
        rel = self.rel_full.loc[row_id(method, budget)]
        ours_cells.append((_fmt(rel["ours"]) + "%") if not _missing(rel["ours"]) else missing)
        paper_cells.append((_fmt(rel["paper"]) + "%") if not _missing(rel["paper"]) else missing)
        return ours_cells, paper_cells if has_paper else None

    def to_markdown(self) -> str:
        header = [self.first_label, "Budget", "Source", *self.columns, "Avg", "% of full"]
        lines = [f"**{self.title}**", "", "| " + " | ".join(header) + " |",
                 "|" + "|".join(["---"] * 3 + ["---:"] * (len(self.columns) + 2)) + "|"]
        for method, budget in self.rows:
            name, budget_text = self._row_label(method, budget)
            ours, paper = self._cells(method, budget, MISSING_MD, lambda d: f" ({d})")
            if method not in NOT_IMPLEMENTED or paper is None:
                lines.append("| " + " | ".join([name, budget_text, "ours", *ours]) + " |")
            if paper is not None:
                lines.append("| " + " | ".join([name, budget_text, "paper", *paper]) + " |")
        lines += ["", "ours cells: our score (difference to the paper's); " + MISSING_MD + ": not measured. "
                  "% of full: Avg relative to the same source's full-cache Avg."]
        return "\n".join(lines) + "\n"

    def to_latex(self) -> str:
        def esc(text: str) -> str:
            return text.replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")

        spec = "lll" + "r" * (len(self.columns) + 2)
        header = [self.first_label, "Budget", "", *[esc(c) for c in self.columns], "Avg", r"\% full"]
        lines = [r"\begin{tabular}{" + spec + "}", r"\toprule", " & ".join(header) + r" \\", r"\midrule"]
        for method, budget in self.rows:
            name, budget_text = self._row_label(method, budget)
            ours, paper = self._cells(method, budget, MISSING_TEX, lambda d: r"\,{\scriptsize(" + d + ")}")
            if method not in NOT_IMPLEMENTED or paper is None:
                lines.append(" & ".join([esc(name), budget_text, "ours", *[esc(c) for c in ours]]) + r" \\")
            if paper is not None:
                lines.append(" & ".join([esc(name), budget_text, r"\textit{paper}",
                                         *[r"\textit{" + esc(c) + "}" for c in paper]]) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}"]
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
                full_key: tuple, first_label: str = "Method") -> ComparisonTable:
    """Assemble the frames; ``*_cells`` map (method, budget) -> {column: value}."""
    keys = sorted(set(ours_cells) | set(paper_cells), key=lambda k: row_sort_key(*k))
    index = pd.Index([row_id(*k) for k in keys], name="row", dtype=object)

    def frame(cells: dict) -> pd.DataFrame:
        data = [[cells.get(k, {}).get(c, math.nan) for c in columns] for k in keys]
        return pd.DataFrame(data, index=index, columns=columns, dtype=float)

    ours, paper = frame(ours_cells), frame(paper_cells)
    # Our Avg only over a complete row: a partial mean is not comparable with the paper's.
    ours["Avg"] = ours[columns].mean(axis=1).where(ours[columns].notna().all(axis=1))
    paper["Avg"] = [paper_avg.get(k, math.nan) for k in keys] if keys else []
    paper["Avg"] = paper["Avg"].astype(float)
    delta = ours - paper
    rel = pd.DataFrame(index=index, columns=["ours", "paper"], dtype=float)
    for side, source in (("ours", ours), ("paper", paper)):
        full = source.at[row_id(*full_key), "Avg"] if row_id(*full_key) in source.index else math.nan
        rel[side] = 100.0 * source["Avg"] / full if not _missing(full) and full else math.nan
    n_ours = ours[columns].notna().sum(axis=1)
    return ComparisonTable(title, columns, keys, ours, paper, delta, rel, n_ours, first_label)


def longbench_table(scores: pd.DataFrame, paper: pd.DataFrame | None, model: str,
                    datasets: list[str] | None = None) -> ComparisonTable:
    """The paper's Table 2 for one model from long-form scores (collect.collect_scores) and paper_longbench.csv."""
    datasets = datasets or LONGBENCH_16
    wanted = canonical_model(model)
    ours_cells: dict = {}
    if not scores.empty:
        mine = scores[(scores["task"] == "longbench") & (scores["model"].map(canonical_model) == wanted)
                      & scores["length"].isna() & scores["dataset"].isin(datasets)]
        for row in mine.itertuples():
            budget = None if _missing(row.budget) else int(row.budget)
            ours_cells.setdefault((row.method, budget), {})[row.dataset] = row.score
    paper_cells, paper_avg = {}, {}
    if paper is not None:
        for row in paper[paper["model"].map(canonical_model) == wanted].to_dict("records"):
            key = (row["method"], None if _missing(row["budget"]) else int(row["budget"]))
            paper_cells[key] = {d: row[d] for d in datasets if d in row}
            paper_avg[key] = row.get("avg_reported", math.nan)
    return _comparison(f"LongBench, {model}", datasets, ours_cells, paper_cells, paper_avg, ("full", None))


def ruler_table(categories: pd.DataFrame, paper: pd.DataFrame | None, model: str, length: int) -> ComparisonTable:
    """The paper's RULER table at one context length: rows (method, budget), columns the three categories."""
    columns = [RULER_CATEGORY_NAMES[c] for c in RULER_CATEGORIES]
    wanted = canonical_model(model)
    label = length_label(length)

    def cells(frame: pd.DataFrame | None) -> dict:
        out: dict = {}
        if frame is None or frame.empty:
            return out
        frame = frame[(frame["model"].map(canonical_model) == wanted)
                      & (frame["length"].map(length_label) == label)]
        for row in frame.to_dict("records"):
            key = (row["method"], None if _missing(row["budget"]) else int(row["budget"]))
            out.setdefault(key, {})[RULER_CATEGORY_NAMES[row["category"]]] = row["score"]
        return out

    paper_cells = cells(paper)
    paper_avg = {k: sum(v.values()) / len(v) for k, v in paper_cells.items() if len(v) == len(columns)}
    table = _comparison(f"RULER {label}, {model}", columns, cells(categories), paper_cells, paper_avg,
                        ("full", None))
    return table


def task_table(scores: pd.DataFrame, task: str) -> pd.DataFrame:
    """Any task as rows (model, method, budget) and columns (dataset, length); missing cells stay NaN."""
    frame = scores[scores["task"] == task].copy()
    if frame.empty:
        return pd.DataFrame()
    def column(dataset: str, length: Any) -> str:
        if _missing(length):
            return "score" if dataset == task else dataset
        return length_label(length) if dataset == task else f"{dataset}@{length_label(length)}"

    frame["column"] = [column(d, length) for d, length in zip(frame["dataset"], frame["length"])]
    frame["budget"] = frame["budget"].astype(object).where(frame["budget"].notna(), "")
    wide = frame.pivot_table(index=["model", "method", "budget"], columns="column", values="score", aggfunc="first")
    order = sorted(wide.index, key=lambda k: (k[0], *row_sort_key(k[1], None if k[2] == "" else k[2])))
    return wide.loc[order]


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
                cells.append(MISSING_MD if value is None else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def latency_table(bench: pd.DataFrame) -> pd.DataFrame:
    """Benchmark summary as rows (model, method, budget) and, per context, TPOT in ms and its ratios to full and full_static."""
    if bench.empty or "tpot_s_median" not in bench:
        return pd.DataFrame()
    frame = bench.copy()
    frame["ctx"] = frame["context"].map(length_label)
    frame["tpot_ms"] = 1000 * frame["tpot_s_median"]
    frame["budget"] = frame["budget"].astype(object).where(frame["budget"].notna(), "")
    values = ["tpot_ms"] + [c for c in ("tt2t_s_median", "tpot_ratio_to_full", "tpot_ratio_to_full_static") if c in frame]
    wide = frame.pivot_table(index=["model", "method", "budget"], columns="ctx", values=values, aggfunc="first")
    wide.columns = [f"{value}@{ctx}" for value, ctx in wide.columns]
    return wide
