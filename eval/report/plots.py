"""The paper's figures from collected results, ours filled, the paper's as hollow markers, PNG and PDF.

Figures are built with ``matplotlib.figure.Figure`` directly (no pyplot state, no backend switch), so the
functions work the same in a test, a script and a notebook. Every function returns the written paths (empty when
there is nothing to draw) and never draws a missing value as zero.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import NullLocator

from eval.plugins import method_class

from .accuracy import length_label
from .collect import canonical_model
from .methods import display_name, sort_key
from .methods import order as display_order
from .names import split_method
from .tables import ComparisonTable, budget_text, row_id

# One colour per method across every figure, given in display order (``methods.order``).
_PALETTE = [
    "#222222", "#555555", "#7f7f7f", "#1f77b4", "#ff7f0e", "#bcbd22", "#17becf", "#9467bd", "#8c564b", "#e377c2",
    "#2ca02c", "#aec7e8",
    "#d62728", "#ff9896",
]
COLORS = dict(zip(display_order(), _PALETTE))
# A declared variant (``<name>+<variant>``) is a series of its own: its own colour, none of the methods' (a shade of
# its method's could match another method's), and a dashed line that says it is a variant.
_VARIANT_PALETTE = ["#393b79", "#637939", "#8c6d31", "#7b4173", "#5254a3", "#b5cf6b", "#e7ba52", "#ce6dbd"]
VARIANT_COLORS = dict(zip((f"{name}+{variant}" for name in display_order() for variant in method_class(name).variants),
                          _VARIANT_PALETTE))
# The budgets of a trade-off figure, told apart by marker (the colour is the method's).
BUDGET_MARKERS = ["s", "v", "D", "^", "P", "X"]
# Our phases -> the paper's breakdown parts; the generation loop's remainder ("model") is the paper's "decoding".
PHASE_GROUPS = {
    "query": ("query", "select", "search", "index_query", "hash"),
    "load": ("load", "transfer", "copy", "gather", "scatter"),
    "compute": ("model", "attention", "compute", "decoding", "cpu_attention", "rebuild"),
}
PHASE_COLORS = {"query": "#1f77b4", "load": "#ff7f0e", "compute": "#2ca02c", "other": "#7f7f7f"}


# Any other series (a method with settings given inline or told apart by its settings, an unregistered name) takes
# the next colour of its own, none of the above: one shared fallback would draw two such series alike.
_OTHER_PALETTE = ["#a55194", "#6b6ecf", "#843c39", "#31a354", "#e6550d", "#3182bd", "#756bb1", "#636363",
                  "#bd9e39", "#ad494a"]
_OTHER_COLORS: dict[str, str] = {}


def color(method: str) -> str:
    """The method's colour, or its declared variant's (``<name>+<variant>``); any other label the next colour of
    ``_OTHER_PALETTE`` not yet given, the same one for that label from then on."""
    known = COLORS.get(method) or VARIANT_COLORS.get(method)
    if known:
        return known
    if method not in _OTHER_COLORS:
        _OTHER_COLORS[method] = _OTHER_PALETTE[len(_OTHER_COLORS) % len(_OTHER_PALETTE)]
    return _OTHER_COLORS[method]


def method_label(method: str) -> str:
    """The printed name of a method or a variant: ``IceCache``, ``IceCache (lookahead)`` (eval.report.names)."""
    base, settings = split_method(method)
    return display_name(base) + (f" ({settings})" if settings else "")


def _plain_log_ticks(ax, values: list[float], axis: str = "x") -> None:
    """Ticks at 1, 2, 5 x 10^k over the values' range on a log axis, written as plain numbers (10, 20, 50)."""
    values = [v for v in values if v and v > 0]
    if not values:
        return
    low, high = min(values), max(values)
    ticks = [m * 10.0 ** k for k in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
             for m in (1, 2, 5) if low / 1.5 <= m * 10.0 ** k <= high * 1.5]
    getattr(ax, f"set_{axis}ticks")(ticks, [f"{tick:g}" for tick in ticks])
    getattr(ax, f"{axis}axis").set_minor_locator(NullLocator())


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def save(fig: Figure, stem: str | Path) -> list[Path]:
    """``<stem>.png`` (150 dpi) and ``<stem>.pdf``."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [Path(f"{stem}.png"), Path(f"{stem}.pdf")]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    return paths


def _source_legend(ax, methods: list[str], loc: str = "best", sources: set[str] | None = None,
                   lines: list[Line2D] | None = None, outside: bool = False) -> None:
    """One entry per method drawn (ours or the paper's), the ours / paper convention only for the sources that
    have points in the figure, and ``lines`` (entries for variants or horizontal lines) as given."""
    sources = {"ours", "paper"} if sources is None else sources
    handles = [Line2D([], [], color=color(m), marker="s", linestyle="--" if "+" in m else "-", label=method_label(m))
               for m in sorted(set(methods), key=sort_key)]
    handles += list(lines or [])
    if "ours" in sources:
        handles.append(Line2D([], [], marker="o", color="k", linestyle="none", label="ours (filled)"))
    if "paper" in sources:
        handles.append(Line2D([], [], marker="o", markerfacecolor="none", color="k", linestyle="none",
                              label="paper (hollow)"))
    if outside:  # beside the axes: many lines over a wide range leave no empty corner inside
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
        return
    ax.legend(handles=handles, fontsize=7, loc=loc, framealpha=0.9, ncol=2 if len(handles) > 8 else 1)


OLDER_CODE_ALPHA = 0.3  # a latency point measured on older code than its method's newest

# Line styles and markers that tell apart the variants (settings) of one method, which share its colour.
VARIANT_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1)), "v"), ((0, (1, 1)), "P")]


# ---------------------------------------------------------------------------------------------------------------


def accuracy_vs_budget(table: ComparisonTable, stem: str | Path, ylabel: str = "LongBench average score") -> list[Path]:
    """Avg score against the token budget, one line per method and settings variant (a variant's own line style
    and marker, in its method's colour, named in the legend); the full cache as horizontal lines."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    points_drawn: list[str] = []
    entries: list[Line2D] = []
    sources: set[str] = set()
    methods = sorted({k[0] for k in table.rows}, key=sort_key)
    budgets = sorted({k[1] for k in table.rows if not _missing(k[1])})
    for method in methods:
        variants = sorted({k[2] for k in table.rows if k[0] == method})
        for number, settings in enumerate(variants):
            linestyle, marker = VARIANT_STYLES[number % len(VARIANT_STYLES)]
            label = method_label(method) + (f" ({settings})" if settings else "")
            rows = [k for k in table.rows if k[0] == method and k[2] == settings]
            for source, hollow in (("ours", False), ("paper", True)):
                if hollow and number:
                    continue  # the paper's points once per method
                points = [(b, table.value(source, method, b, "Avg", settings)) for _, b, _ in rows]
                if method == "full":
                    value = next((v for _, v in points if v is not None), None)
                    if value is not None:
                        style = ":" if hollow else linestyle
                        ax.axhline(value, color=color(method), linestyle=style, linewidth=1)
                        entries.append(Line2D([], [], color=color(method), linestyle=style,
                                              label=f"{label} ({source})"))
                    continue
                points = sorted((b, v) for b, v in points if v is not None and not _missing(b))
                if not points:
                    continue
                xs, ys = zip(*points)
                style = dict(color=color(method), marker=marker if not hollow else "o", markersize=6)
                if hollow:
                    ax.plot(xs, ys, linestyle="none", markerfacecolor="none", markeredgewidth=1.5, **style)
                else:
                    ax.plot(xs, ys, linestyle=linestyle, **style)
                    if len(variants) > 1:
                        entries.append(Line2D([], [], color=color(method), linestyle=linestyle, marker=marker,
                                              label=label))
                sources.add(source)
                if len(variants) == 1 or hollow:
                    points_drawn.append(method)
    if not points_drawn and not entries:
        return []
    ax.set_xscale("log", base=2)
    if budgets:
        ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("KV budget per query head (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(table.title + "\n(FULL: horizontal line, solid = ours, dotted = paper)", fontsize=10)
    ax.grid(alpha=0.3)
    _source_legend(ax, points_drawn, sources=sources, lines=entries)
    return save(fig, stem)


def accuracy_vs_tpot(points: pd.DataFrame, stem: str | Path, title: str = "Accuracy vs decode latency") -> list[Path]:
    """The paper's trade-off plot: accuracy relative to the full cache (%) against TPOT (s, log scale).

    ``points`` columns: method, budget, tpot_s, rel_accuracy_pct, source (ours | paper). A method's colour and a
    budget's marker tell the points apart (a legend for each, no labels on the points); the paper's are hollow.
    """
    points = points.dropna(subset=["tpot_s", "rel_accuracy_pct"])
    if points.empty:
        return []
    fig = Figure(figsize=(7.2, 4.4))
    ax = fig.add_subplot()
    settings = points["settings"] if "settings" in points else pd.Series([""] * len(points), index=points.index)
    labels = [row.method + (f"+{variant}" if variant else "") for row, variant in
              zip(points.itertuples(), settings.fillna(""))]
    budgets = sorted({int(b) for b in points["budget"] if not _missing(b)})
    for row, label in zip(points.itertuples(), labels):
        hollow = row.source == "paper"
        marker = "o" if _missing(row.budget) else BUDGET_MARKERS[budgets.index(int(row.budget)) % len(BUDGET_MARKERS)]
        ax.plot(row.tpot_s, row.rel_accuracy_pct, marker=marker, markersize=8 if hollow else 7, color=color(label),
                markerfacecolor="none" if hollow else color(label), markeredgewidth=1.5, linestyle="none")
    ax.set_xscale("log")
    _plain_log_ticks(ax, list(points["tpot_s"]))
    ax.set_xlabel("time per output token, TPOT (s, log scale)")
    ax.set_ylabel("accuracy relative to full cache (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    handles = [Line2D([], [], color=color(m), marker="s", linestyle="none", label=method_label(m))
               for m in sorted(set(labels), key=sort_key)]
    handles += [Line2D([], [], color="k", marker=BUDGET_MARKERS[i % len(BUDGET_MARKERS)], linestyle="none",
                       label=f"budget {b}") for i, b in enumerate(budgets)]
    if (points["source"] == "paper").any():
        handles.append(Line2D([], [], marker="o", markerfacecolor="none", color="k", linestyle="none",
                              label="paper (hollow)"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
    return save(fig, stem)


def latency_bars(ours: pd.DataFrame, paper: pd.DataFrame | None, stem: str | Path, *, value: str = "tt2t_s",
                 ylabel: str = "time to the second token, TT2T (s)", title: str = "TT2T") -> list[Path]:
    """One bar per method (ours, with min-max whiskers when known), the paper's value as a hollow marker.

    ``ours`` columns: method, ``value`` and optionally ``value_min`` / ``value_max``; ``paper``: method, value.
    """
    methods = sorted(set(ours["method"]) | (set(paper["method"]) if paper is not None else set()),
                     key=sort_key)
    if not methods:
        return []
    fig = Figure(figsize=(max(4.8, 0.8 * len(methods) + 1.5), 4.0))
    ax = fig.add_subplot()
    drew_ours = drew_paper = False
    for x, method in enumerate(methods):
        mine = ours[ours["method"] == method]
        if not mine.empty and not _missing(mine.iloc[0][value]):
            drew_ours = True
            height = float(mine.iloc[0][value])
            err = None
            if f"{value}_min" in mine and f"{value}_max" in mine and not _missing(mine.iloc[0][f"{value}_min"]):
                err = [[height - mine.iloc[0][f"{value}_min"]], [mine.iloc[0][f"{value}_max"] - height]]
            ax.bar(x, height, color=color(method), yerr=err, capsize=3, width=0.6)
        if paper is not None:
            theirs = paper[paper["method"] == method]
            if not theirs.empty:
                drew_paper = True
                ax.plot(x, float(theirs.iloc[0]["value"]), marker="D", markersize=8, markerfacecolor="none",
                        markeredgecolor="k", markeredgewidth=1.5, linestyle="none")
    ax.set_xticks(range(len(methods)), [method_label(m) for m in methods], rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color="#888888", label="ours (bar; whiskers: min-max)")] if drew_ours else []
    if drew_paper:
        handles.append(Line2D([], [], marker="D", markerfacecolor="none", color="k", linestyle="none",
                              label="paper (hollow)"))
    ax.legend(handles=handles, fontsize=7)
    return save(fig, stem)


def group_phases(phases: dict[str, float], total: float | None = None) -> dict[str, float]:
    """Our per-phase medians -> query / load / compute / other (other: everything unnamed, and the part of the
    measured TPOT the parts do not account for, when ``total`` is given)."""
    grouped = {name: 0.0 for name in PHASE_COLORS}
    for phase, seconds in phases.items():
        if _missing(seconds):
            continue
        group = next((g for g, names in PHASE_GROUPS.items() if phase in names), "other")
        grouped[group] += float(seconds)
    if total is not None and not _missing(total):
        grouped["other"] += max(0.0, float(total) - sum(grouped.values()))
    return grouped


def tpot_breakdown(breakdowns: dict[str, dict[str, float]], paper: dict[str, dict[str, float]] | None,
                   stem: str | Path, title: str = "TPOT breakdown") -> list[Path]:
    """Stacked bars of query / load / compute / other per method; the paper's breakdown as hollow stacked bars.

    ``breakdowns``: method -> grouped seconds (group_phases); ``paper``: method -> grouped seconds, and the context
    the paper measured them at (``context_tokens``), which the bar's label gives: it is not the figure's context.
    """
    bars = [(m, b, False) for m, b in breakdowns.items()]
    bars += [(m, b, True) for m, b in (paper or {}).items()]
    bars.sort(key=lambda item: (sort_key(item[0]), item[2]))
    if not bars:
        return []
    fig = Figure(figsize=(max(4.8, 0.9 * len(bars) + 1.5), 4.0))
    ax = fig.add_subplot()
    for x, (_method, parts, hollow) in enumerate(bars):
        bottom = 0.0
        for group, part_color in PHASE_COLORS.items():
            height = 1000 * parts.get(group, 0.0)
            if hollow:
                ax.bar(x, height, bottom=bottom, width=0.6, facecolor="none", edgecolor=part_color, linewidth=1.5,
                       hatch="//")
            else:
                ax.bar(x, height, bottom=bottom, width=0.6, color=part_color)
            bottom += height
    def label(method: str, parts: dict[str, float], hollow: bool) -> str:
        if not hollow:
            return method_label(method)  # a latency row's inline settings written as every other figure does
        context = parts.get("context_tokens")
        return method_label(method) + (f"\n(paper, {context / 1000:.0f}k)" if context else "\n(paper)")

    labels = [label(m, parts, hollow) for m, parts, hollow in bars]
    ax.set_xticks(range(len(bars)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("time per output token (ms)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    drawn = {g for _, parts, _ in bars for g in PHASE_COLORS if parts.get(g)}
    handles = [Patch(color=c, label=g) for g, c in PHASE_COLORS.items() if g in drawn]
    if any(hollow for _, _, hollow in bars):
        handles.append(Patch(facecolor="none", edgecolor="k", hatch="//", label="paper (hollow)"))
    ax.legend(handles=handles, fontsize=7)
    return save(fig, stem)


def latency_vs_context(ours: pd.DataFrame, paper: pd.DataFrame | None, stem: str | Path,
                       title: str = "Decode latency vs context length") -> list[Path]:
    """TPOT (ms) against context length, one line per method; the paper's points hollow; a point measured on older
    code than its method's newest point faded, so that a step between code versions does not read as the
    context's doing.

    ``ours`` columns: method, context, tpot_ms (and optionally tpot_ms_min / tpot_ms_max, and ``current``:
    False for a point of older code); ``paper``: method, context_tokens, tpot_ms.
    """
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    drawn: list[str] = []
    older = False
    for method, group in sorted(ours.groupby("method"), key=lambda item: sort_key(item[0])):
        group = group.dropna(subset=["tpot_ms"]).sort_values("context")
        if group.empty:
            continue
        # the line joins the points of the method's newest code only (a variant dashed, in a colour of its own)
        current = group["current"].astype(bool) if "current" in group else pd.Series(True, index=group.index)
        ax.plot(group["context"][current], group["tpot_ms"][current], marker="o", color=color(method),
                linestyle="--" if "+" in method else "-")
        if (~current).any():  # older points faded, and the whole curve faint and dotted beneath
            ax.plot(group["context"][~current], group["tpot_ms"][~current], marker="o", color=color(method),
                    linestyle="none", alpha=OLDER_CODE_ALPHA)
            ax.plot(group["context"], group["tpot_ms"], color=color(method), linestyle=":", linewidth=1,
                    alpha=OLDER_CODE_ALPHA)
            older = True
        spread = group[current]
        if "tpot_ms_min" in spread and len(spread) > 1 and spread["tpot_ms_min"].notna().all():
            ax.fill_between(spread["context"], spread["tpot_ms_min"], spread["tpot_ms_max"], color=color(method),
                            alpha=0.15, linewidth=0)
        drawn.append(method)
    sources = {"ours"} if drawn else set()
    if paper is not None:
        for row in paper.itertuples():
            ax.plot(row.context_tokens, row.tpot_ms, marker="o", markersize=8, markerfacecolor="none",
                    markeredgewidth=1.5, color=color(row.method), linestyle="none")
            drawn.append(row.method)
            sources.add("paper")
    if not drawn:
        return []
    ticks = sorted(set(ours["context"].dropna().astype(int)) | (
        set(paper["context_tokens"].astype(int)) if paper is not None else set()))
    ax.set_xscale("log", base=2)  # contexts double from one measurement to the next: evenly spaced on a log axis
    ax.set_xticks(ticks, [length_label(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("context length (tokens, log scale)")
    ax.set_ylabel("decode latency per token (ms, log scale)")
    ax.set_yscale("log")  # the methods span 8 to 200 ms: on a linear axis the fast ones merge into one line
    values = list(ours["tpot_ms"].dropna()) + (list(paper["tpot_ms"].dropna()) if paper is not None else [])
    _plain_log_ticks(ax, values, axis="y")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    lines = [Line2D([], [], marker="o", color="k", linestyle="none", alpha=OLDER_CODE_ALPHA,
                    label="faded, dotted: older code\nthan the solid line's points")] if older else None
    _source_legend(ax, drawn, sources=sources, lines=lines, outside=True)
    return save(fig, stem)


def throughput_vs_batch(rows: list[dict[str, Any]], limits: list[dict[str, Any]], stem: str | Path,
                        title: str = "Decode throughput vs batch size") -> list[Path]:
    """Decode tokens per second against batch size, one line per method, one panel per context; a cross where a
    method ran out of memory (its first batch that did not fit). ``rows`` and ``limits``: a throughput file's."""
    contexts = sorted({r["context"] for r in rows})
    if not contexts:
        return []
    fig = Figure(figsize=(5.2 * len(contexts) + 1.6, 4.0))
    axes = [fig.add_subplot(1, len(contexts), index + 1) for index in range(len(contexts))]
    drawn: list[str] = []
    for ax, context in zip(axes, contexts):
        at = [r for r in rows if r["context"] == context and r.get("tokens_per_s")]
        batches = sorted({r["batch_size"] for r in at} | {lim["batch_size"] for lim in limits
                                                          if lim["context"] == context})
        for method in sorted({r["method_label"] for r in at}, key=sort_key):
            points = sorted((r["batch_size"], r["tokens_per_s"]) for r in at if r["method_label"] == method)
            ax.plot(*zip(*points), marker="o", color=color(method), linestyle="--" if "+" in method else "-")
            failed = [lim for lim in limits if lim["context"] == context and lim["method_label"] == method]
            for lim in failed:  # at the height of the last batch that fit: where the line ends, and why
                ax.plot(lim["batch_size"], points[-1][1], marker="x", markersize=8, color=color(method),
                        linestyle="none")
            drawn.append(method)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_yscale("log")
        _plain_log_ticks(ax, [r["tokens_per_s"] for r in at], axis="y")
        ax.set_xlabel("batch size (sequences, log scale)")
        ax.set_ylabel("decode tokens per second (log scale)")
        ax.set_title(f"{length_label(context)} tokens", fontsize=10)
        ax.grid(alpha=0.3)
    oom = Line2D([], [], marker="x", color="k", linestyle="none", label="out of memory at this batch")
    _source_legend(axes[-1], drawn, sources=set(), lines=[oom], outside=True)
    fig.suptitle(title)
    return save(fig, stem)


# ---------------------------------------------------------------------------------------------------------------
# Adapters from collect's frames to the plot inputs


def tradeoff_points(table: ComparisonTable, latency: pd.DataFrame, paper_latency: pd.DataFrame | None,
                    model: str) -> pd.DataFrame:
    """Points for accuracy_vs_tpot: ours (rel. accuracy from the table, TPOT from the LongBench runs of the same
    method, budget and settings) and the paper's (paper_latency.csv's tpot and rel_accuracy rows)."""
    rows = []
    wanted = canonical_model(model)
    mine = latency[(latency["task"] == "longbench") & (latency["model"].map(canonical_model) == wanted)] \
        if not latency.empty else latency
    for method, budget, settings in table.rows:
        rel = table.rel_full.at[row_id(method, budget, settings), "ours"]
        match = mine[(mine["method"] == method) & (mine["budget"].map(budget_text) == budget_text(budget))
                     & (mine["settings"].fillna("") == settings)] if not mine.empty else mine
        tpot = match.iloc[0]["median_tpot_s"] if len(match) == 1 else None
        if not _missing(rel) and not _missing(tpot):
            rows.append({"method": method, "budget": budget, "settings": settings, "tpot_s": float(tpot),
                         "rel_accuracy_pct": float(rel), "source": "ours"})
    if paper_latency is not None:
        theirs = paper_latency[paper_latency["model"].map(canonical_model) == wanted]
        for method, group in theirs.groupby("method"):
            values = dict(zip(group["metric"], group["value"]))
            if "tpot" in values and "rel_accuracy" in values:
                rows.append({"method": method, "budget": None, "settings": "", "tpot_s": float(values["tpot"]),
                             "rel_accuracy_pct": float(values["rel_accuracy"]), "source": "paper"})
    return pd.DataFrame(rows, columns=["method", "budget", "settings", "tpot_s", "rel_accuracy_pct", "source"])


def paper_metric(paper_latency: pd.DataFrame | None, metric: str, model: str | None = None) -> pd.DataFrame | None:
    """The paper's rows of one metric as (method, value), optionally for one model."""
    if paper_latency is None:
        return None
    frame = paper_latency[paper_latency["metric"] == metric]
    if model is not None:
        frame = frame[frame["model"].map(canonical_model) == canonical_model(model)]
    return frame[["method", "value"]] if not frame.empty else None


def paper_breakdown(paper_latency: pd.DataFrame | None) -> dict[str, dict[str, float]]:
    if paper_latency is None:
        return {}
    out: dict[str, dict[str, float]] = {}
    for row in paper_latency[paper_latency["metric"].str.startswith("breakdown_")].itertuples():
        part = row.metric.removeprefix("breakdown_")
        if part != "total":
            out.setdefault(row.method, {})[part] = float(row.value)
            if pd.notna(row.context_tokens):
                out[row.method]["context_tokens"] = float(row.context_tokens)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The accuracy table's figures (report.accuracy rows): one panel per task and context length


def _panels(keys: list[tuple], width: float = 4.6, height: float = 3.4, columns: int = 2) -> tuple[Figure, list]:
    columns = min(columns, len(keys))
    rows = -(-len(keys) // columns)
    fig = Figure(figsize=(width * columns, height * rows + 0.8), layout="constrained")
    axes = [fig.add_subplot(rows, columns, i + 1) for i in range(len(keys))]
    return fig, axes


def _panel_title(task: str, length: Any) -> str:
    return f"{task}, {length_label(length)} tokens" if length is not None else task


def _error(row) -> list[list[float]] | None:
    if row.interval is None:
        return None
    return [[row.score - row.interval[0]], [row.interval[1] - row.score]]


def accuracy_vs_budget_panels(rows: list, stem: str | Path, title: str = "") -> list[Path]:
    """Score (with its 95% interval) against the budget, one line per method; budget-free methods (the full
    caches) as a horizontal line with their interval as a band. ``rows``: report.accuracy.AccuracyRow."""
    rows = [r for r in rows if r.score is not None]
    keys = sorted({(r.task, r.length) for r in rows}, key=lambda k: (k[0], k[1] or 0))
    if not keys:
        return []
    fig, axes = _panels(keys, width=5.6, height=4.0)
    drawn: set[str] = set()
    ends: list[tuple] = []  # per panel: (axes, the right edge of the lines, [(score at the line's end, method)])
    for ax, (task, length) in zip(axes, keys):
        here = [r for r in rows if (r.task, r.length) == (task, length)]
        budgets = sorted({r.budget for r in here if r.budget is not None})
        budgeted = sorted({r.method for r in here if r.budget is not None}, key=sort_key)
        # the x range: room on the right for each line's name at its end, where the full caches' lines stop too
        # (a name drawn across a line reads as struck through)
        x_range = (budgets[0] / 2 ** 0.4, budgets[-1] * 2 ** 1.9) if budgets else None
        line_end = (math.log2(budgets[-1] * 2 ** 0.45 / x_range[0]) / math.log2(x_range[1] / x_range[0])
                    if budgets else 1.0)
        ends.append((ax, budgets[-1] * 2 ** 0.45 if budgets else None,
                     [(max((r for r in here if r.method == m), key=lambda r: r.budget or 0).score, m)
                      for m in sorted({r.method for r in here}, key=sort_key)]))
        for method in sorted({r.method for r in here}, key=sort_key):
            points = sorted((r for r in here if r.method == method), key=lambda r: r.budget or 0)
            # each method a little to the side of the budget it ran at (a fraction of the step to the next
            # budget), so that points and intervals at one budget do not hide each other
            dodge = 2 ** (0.5 * ((budgeted.index(method) + 0.5) / len(budgeted) - 0.5)) if method in budgeted else 1
            if points[0].budget is None:
                row = points[0]
                ax.axhline(row.score, xmax=line_end, color=color(method), linestyle="--", linewidth=1)
                if row.interval is not None:
                    ax.axhspan(*row.interval, xmax=line_end, color=color(method), alpha=0.08, linewidth=0)
            else:
                errors = [_error(r) or [[0.0], [0.0]] for r in points]
                ax.errorbar([r.budget * dodge for r in points], [r.score for r in points], color=color(method),
                            marker="o",
                            markersize=4, capsize=2, linewidth=1.2,
                            yerr=[[e[0][0] for e in errors], [e[1][0] for e in errors]])
            drawn.add(method)
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlim(*x_range)
        ax.set_xlabel("KV budget per query head (tokens)")
        ax.set_ylabel("score (%)")
        ax.set_title(_panel_title(task, length), fontsize=9)
        ax.grid(alpha=0.3)
    _method_legend(fig, drawn, "dashed: budget-free (full caches); bars and band: 95% bootstrap interval")
    fig.suptitle(title or "Accuracy against the budget", fontsize=10)
    _laid_out(fig)
    for ax, right, members in ends:
        if right is not None:
            _label_line_ends(fig, ax, right, members)
    return save(fig, stem)


def _label_line_ends(fig: Figure, ax, right: float, ends: list[tuple[float, str]]) -> None:
    """Each line's name right of its last point, moved up or down only as far as keeps the names apart
    (``spread_vertically``), where it moved a thin leader back to the end it names: level from the name, then
    upright at the lines' end, so that leaders run beside the names and never across one."""
    size = 6.5
    box = ax.get_window_extent()
    ys = [ax.transData.transform((right, score))[1] for score, _ in ends]
    heights = [_text_size(fig, method_label(method), size)[1] + LABEL_GAP for _, method in ends]
    placed = spread_vertically(ys, heights, box.y0, box.y1)
    to_points = 72.0 / fig.dpi
    for (score, method), y, target in zip(ends, ys, placed):
        moved = abs(target - y) > 1.0
        ax.annotate(method_label(method), (right, score), xytext=(8 * to_points, (target - y) * to_points),
                    textcoords="offset points", ha="left", va="center", fontsize=size, color=ink(color(method)),
                    annotation_clip=False,
                    arrowprops=dict(arrowstyle="-", color=color(method), linewidth=0.5, shrinkA=0, shrinkB=0,
                                    connectionstyle="angle,angleA=0,angleB=90,rad=0")
                    if moved else None).set_in_layout(False)


# ---------------------------------------------------------------------------------------------------------------
# Labels beside points that overlap neither each other nor the points: a greedy, deterministic search


Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in display pixels

# Where a label may go around its point, in the order tried: right, then above-right, below-right, left, ...
_DIRECTIONS = [(1, 0), (1, 1), (1, -1), (-1, 0), (-1, 1), (-1, -1), (0, 1), (0, -1)]
_RADII = (6.0, 12.0, 20.0, 32.0, 48.0)  # pixels between a point and the nearest edge of its label
LABEL_GAP = 4.0  # pixels kept free between two labels


def _overlap(a: Box, b: Box) -> float:
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    return width * height if width > 0 and height > 0 else 0.0


def place_labels(anchors: list[tuple[float, float]], sizes: list[tuple[float, float]], obstacles: list[Box],
                 bounds: Box) -> list[tuple[float, float]]:
    """The centre of each label (display pixels): for each anchor in the order given, the first position around
    it (``_DIRECTIONS`` at each of ``_RADII``) whose box lies inside ``bounds`` and overlaps no label placed before
    it and no obstacle (the points, their interval bars); where none is free, the one overlapping least. The
    same input gives the same layout; no dependency beyond the boxes' arithmetic."""
    placed: list[Box] = []
    centres = []
    for (x, y), (width, height) in zip(anchors, sizes):
        best, best_cost = None, math.inf
        for radius in _RADII:
            for dx, dy in _DIRECTIONS:
                cx = x + dx * (radius + width / 2)
                cy = y + dy * (radius + height / 2)
                box = (cx - width / 2, cy - height / 2, cx + width / 2, cy + height / 2)
                outside = (max(0.0, bounds[0] - box[0]) + max(0.0, box[2] - bounds[2])
                           + max(0.0, bounds[1] - box[1]) + max(0.0, box[3] - bounds[3]))
                cost = sum(_overlap(box, other) for other in placed + obstacles) + 1e3 * outside
                if cost < best_cost:
                    best, best_cost = (cx, cy, box), cost
                if cost == 0:
                    break
            if best_cost == 0:
                break
        cx, cy, box = best
        placed.append(box)
        centres.append((cx, cy))
    return centres


def spread_vertically(ys: list[float], heights: list[float], low: float, high: float) -> list[float]:
    """Label centres (display pixels) as near ``ys`` as they can be without overlapping one another, within
    [low, high]: sorted, pushed up past the one below, then the stack pushed back down from the top."""
    order = sorted(range(len(ys)), key=lambda i: (ys[i], i))
    placed = [0.0] * len(ys)
    floor = low
    for i in order:
        placed[i] = max(ys[i], floor + heights[i] / 2)
        floor = placed[i] + heights[i] / 2
    ceiling = high
    for i in reversed(order):
        placed[i] = min(placed[i], ceiling - heights[i] / 2)
        ceiling = placed[i] - heights[i] / 2
    return placed


def _text_size(fig: Figure, text: str, size: float) -> tuple[float, float]:
    from matplotlib.font_manager import FontProperties

    width, height, _ = fig.canvas.get_renderer().get_text_width_height_descent(text, FontProperties(size=size),
                                                                                ismath=False)
    return width + 2.0, height + 2.0


def _laid_out(fig: Figure) -> None:
    """The figure's final layout (constrained), so that data coordinates map to the pixels it will be drawn at."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    fig.draw_without_rendering()
    fig.set_layout_engine("none")  # labels placed in these pixels must not move the axes again


def _short_label(method: str, budget: int | None, with_budget: bool = True) -> str:
    return method_label(method) + ("" if budget is None or not with_budget else f" {budget}")


def ink(colour: str) -> str:
    """A method's colour darkened for text: the light shades of the palette (ShadowKV's, IceCache(r)'s) are
    marks a reader sees, not small letters a reader can read."""
    from matplotlib.colors import to_hex, to_rgb

    return to_hex(tuple(0.62 * channel for channel in to_rgb(colour)))


def accuracy_vs_tpot_panels(points: list, stem: str | Path, title: str = "") -> list[Path]:
    """Each cell's score as a share of the full cache's (with its interval) against its TPOT as a multiple of
    full_static's (log axis), one panel per task and length, one point per method and budget: the method's colour,
    the budget's marker, and a label (name and budget) placed where it hides no other label or point.
    ``points``: report.accuracy.TradeoffPoint."""
    points = [p for p in points if p.share is not None and p.tpot_ratio]
    keys = sorted({(p.row.task, p.row.length) for p in points}, key=lambda k: (k[0], k[1] or 0))
    if not keys:
        return []
    budgets = sorted({p.row.budget for p in points if p.row.budget is not None})

    def marker(budget: int | None) -> str:
        return "o" if budget is None else BUDGET_MARKERS[budgets.index(budget) % len(BUDGET_MARKERS)]

    fig, axes = _panels(keys, width=6.0, height=4.6)
    drawn: set[str] = set()
    panels = []
    for ax, (task, length) in zip(axes, keys):
        here = sorted((p for p in points if (p.row.task, p.row.length) == (task, length)),
                      key=lambda p: (sort_key(p.row.method), p.row.budget or 0))
        ax.axhline(100, color="#888888", linestyle="--", linewidth=0.8)
        ax.axvline(1, color="#888888", linestyle=":", linewidth=0.8)
        for p in here:
            error = None if p.low is None else [[max(0.0, p.share - p.low)], [max(0.0, p.high - p.share)]]
            ax.errorbar([p.tpot_ratio], [p.share], yerr=error, color=color(p.row.method), marker=marker(p.row.budget),
                        markersize=5, capsize=2, linestyle="none", elinewidth=0.9 if p.paired else 0.6,
                        alpha=1.0 if p.paired or p.low is None else 0.55)
            drawn.add(p.row.method)
        ax.set_xscale("log")
        ratios = [p.tpot_ratio for p in here]
        ax.set_xlim(min(ratios) / 1.35, max(ratios) * 1.35)
        _plain_log_ticks(ax, ratios)
        shares = [v for p in here for v in (p.share, p.low, p.high) if v is not None]
        ax.set_ylim(min(0.0, min(shares)) - 4, max(105.0, max(shares)) + 6)
        ax.set_xlabel("TPOT relative to full_static (x, log scale)")
        ax.set_ylabel("score, % of the full cache's")
        ax.set_title(_panel_title(task, length), fontsize=9)
        ax.grid(alpha=0.3, which="major")
        panels.append((ax, here))
    extra = [Line2D([], [], color="k", marker=marker(b), linestyle="none", label=f"budget {b}") for b in budgets]
    extra += [Line2D([], [], color="k", marker="o", linestyle="none", label="full caches (no budget)")]
    _method_legend(fig, drawn, "bars: 95% paired bootstrap interval of the difference with the full cache (faded: "
                   "the run's own interval, where the two runs were not paired)", extra)
    fig.suptitle(title or "Accuracy against decode latency", fontsize=10)
    _laid_out(fig)
    for ax, here in panels:
        _label_points(fig, ax, [(p.tpot_ratio, p.share, p.low, p.high,
                                 _short_label(p.row.method, p.row.budget, len(budgets) > 1), ink(color(p.row.method)))
                                for p in here])
    return save(fig, stem)


def _label_points(fig: Figure, ax, points: list[tuple]) -> None:
    """Name each point (x, y, low, high, text, colour) beside it (``place_labels``), with a thin leader line when
    the label had to go further than the nearest ring."""
    size = 6.0
    anchors = [tuple(ax.transData.transform((x, y))) for x, y, *_ in points]
    obstacles: list[Box] = [(px - 5, py - 5, px + 5, py + 5) for px, py in anchors]  # the markers
    for (x, _, low, high, *_), (px, _) in zip(points, anchors):
        if low is not None:
            bottom, top = ax.transData.transform((x, low))[1], ax.transData.transform((x, high))[1]
            obstacles.append((px - 1.5, bottom, px + 1.5, top))
    # each label's box taken LABEL_GAP wider and taller, so that two placed side by side keep a gap between them
    # (names that touch read as one: "ArkValeQuest")
    sizes = [tuple(v + LABEL_GAP for v in _text_size(fig, text, size)) for *_, text, _ in points]
    box = ax.get_window_extent()
    # from the top right down: the crowded full-cache corner is labelled first, nearest its points
    order = sorted(range(len(points)), key=lambda i: (-anchors[i][1], -anchors[i][0], i))
    inset = 3.0  # a label that touches the frame reads as cut by it
    centres = place_labels([anchors[i] for i in order], [sizes[i] for i in order], obstacles,
                           (box.x0 + inset, box.y0 + inset, box.x1 - inset, box.y1 - inset))
    to_points = 72.0 / fig.dpi
    for i, (cx, cy) in zip(order, centres):
        x, y, _, _, text, tint = points[i]
        dx, dy = cx - anchors[i][0], cy - anchors[i][1]
        far = math.hypot(dx, dy) > sizes[i][0] / 2 + 12
        ax.annotate(text, (x, y), xytext=(dx * to_points, dy * to_points), textcoords="offset points",
                    ha="center", va="center", fontsize=size, color=tint, annotation_clip=False,
                    arrowprops=dict(arrowstyle="-", color=tint, linewidth=0.5, shrinkA=0, shrinkB=2) if far else None
                    ).set_in_layout(False)


def mass_by_layer_panels(rows: list, stem: str | Path, title: str = "") -> list[Path]:
    """Attention mass the attended tokens hold per sparsified layer, one line per method (dotted: the best set of
    the same size), one panel per task, length and budget."""
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in rows if r.mass_by_layer and r.budget is not None]
    keys = sorted({(r.task, r.length, r.budget) for r in rows}, key=lambda k: (k[0], k[1] or 0, k[2]))
    if not keys:
        return []
    # one row of panels per task and length, one column per budget
    fig, axes = _panels(keys, width=4.0, height=2.8, columns=len({k[2] for k in keys}))
    drawn: set[str] = set()
    for ax, (task, length, budget) in zip(axes, keys):
        for row in sorted((r for r in rows if (r.task, r.length, r.budget) == (task, length, budget)),
                          key=lambda r: sort_key(r.method)):
            ax.plot(row.layers, row.mass_by_layer, color=color(row.method), marker=".", linewidth=1.2)
            if row.oracle_by_layer:
                ax.plot(row.layers, row.oracle_by_layer, color=color(row.method), linestyle=":", linewidth=1)
            drawn.add(row.method)
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel("attention mass attended")
        ax.set_title(f"{_panel_title(task, length)}, budget {budget}", fontsize=9)
        ax.grid(alpha=0.3)
    _method_legend(fig, drawn, "dotted: the best tokens of the same number (oracle)")
    fig.suptitle(title or "Attention mass captured by layer", fontsize=10)
    return save(fig, stem)


def _method_legend(fig: Figure, methods: set[str], note: str, extra: list[Line2D] | None = None) -> None:
    handles = [Line2D([], [], color=color(m), marker="s", linestyle="-", label=method_label(m))
               for m in sorted(methods, key=sort_key)] + list(extra or [])
    fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncol=min(6, max(1, len(handles))),
               framealpha=0.9, title=note, title_fontsize=7)
