"""The accuracy table: per task, model, context length, method and budget, the score with its 95% bootstrap
interval, its share of the full cache's score, the tokens attended and the attention mass they hold.

Every number is read from finished runs' ``metrics.json`` payloads (the runner's ``confidence`` and, with
``measure_selection``, ``selection``; curating adds ``paired``, the difference with the full cache on the same
samples: report/paired.py), whether they come from a results tree (``scripts/collect.py``) or from a
curated list of them in ``results/bench/accuracy_*.json`` (``scripts/sweep.py --curate``, rendered by
``eval.report.benchmarks``). TPOT for the trade-off figure comes from the latency benchmark files
(``latency_*.json``), matched by method and budget (``tpot_for``), since a measured run decodes eagerly and
measures as it goes. A budget-free method is one whose runs record budget null (the runner's rule); rows are in the
methods' display order (``report.methods``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from .methods import sort_key
from .names import method_text

REFERENCE = "full"  # the share of full is taken against this method's score of the same task, model and length


@dataclass
class AccuracyRow:
    """One (task, model, length, method, budget) cell of finished runs."""

    task: str
    model: str
    length: int | None
    method: str
    budget: int | None
    score: float | None
    interval: tuple[float, float] | None
    n: int | None
    attended: float | None = None  # mean tokens attended per query head (the runs' counters)
    mass: float | None = None  # selection diagnostic: mean mass of the attended set
    oracle_mass: float | None = None  # ... of the best set of the same size
    layers: list[int] = field(default_factory=list)
    mass_by_layer: list[float] = field(default_factory=list)
    oracle_by_layer: list[float] = field(default_factory=list)
    share_of_full: float | None = None  # filled by ``with_share_of_full``
    difference: float | None = None  # score minus the full cache's on the same samples (report/paired.py)
    difference_interval: tuple[float, float] | None = None  # ... its paired bootstrap interval
    commit: str | None = None
    date: str | None = None
    gpu: str | None = None

    @property
    def key(self) -> tuple:
        return (self.task, self.model.lower(), self.length, self.method, self.budget)


def _length(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _interval(confidence: dict[str, Any] | None, key: str) -> tuple[float, float] | None:
    found = ((confidence or {}).get("intervals") or {}).get(key)
    return (float(found[0]), float(found[1])) if found else None


def _at_length(summary: dict[str, Any], length: Any, n_lengths: int) -> dict[str, Any]:
    """A run's summary (latency, selection) at one of its lengths: its ``by_length`` entry, or the whole summary
    for a run of one length."""
    found = (summary.get("by_length") or {}).get(str(length))
    return found if found is not None else (summary if n_lengths == 1 else {})


def rows_of_run(payload: dict[str, Any]) -> list[AccuracyRow]:
    """The cells of one run: one per context length its aggregate reports (passkey ``by_length``, RULER
    ``lengths``), else one for its headline score."""
    metrics = payload.get("metrics") or {}
    confidence = payload.get("confidence")
    method = str(payload.get("method_label") or payload["method"])  # a variant's rows are its own
    budget = payload.get("budget")
    latency = payload.get("latency") or {}
    selection = payload.get("selection") or {}
    provenance = payload.get("provenance") or {}
    paired = payload.get("paired") or {}
    if isinstance(metrics.get("by_length"), dict):
        per_length, prefix = metrics["by_length"], "by_length"
        counts = metrics.get("n_by_length") or {}
    elif isinstance(metrics.get("lengths"), dict):
        per_length, prefix = metrics["lengths"], "lengths"
        counts = {}
        for per_task in (metrics.get("n_per_task") or {}).values():
            for length, n in per_task.items():
                counts[str(length)] = counts.get(str(length), 0) + n
    else:
        per_length, prefix, counts = {None: metrics.get("score")}, None, {None: payload.get("n_samples")}
    rows = []
    for length, score in per_length.items():
        key = "score" if prefix is None else f"{prefix}.{length}"
        at_latency, at_selection = (_at_length(summary, length, len(per_length)) for summary in (latency, selection))
        rows.append(AccuracyRow(
            task=str(payload["task"]), model=str(payload["model"]), length=_length(length), method=method,
            budget=None if budget is None else int(budget), score=None if score is None else float(score),
            interval=_interval(confidence, key), n=counts.get(str(length), counts.get(length)),
            attended=at_latency.get("mean_attended_tokens"), mass=at_selection.get("mean_mass"),
            oracle_mass=at_selection.get("mean_oracle_mass"), layers=list(at_selection.get("layers") or []),
            mass_by_layer=list(at_selection.get("mass") or []),
            oracle_by_layer=list(at_selection.get("oracle_mass") or []),
            difference=(paired.get("difference") or {}).get(key), difference_interval=_interval(paired, key),
            commit=provenance.get("git_commit"), date=provenance.get("date"), gpu=provenance.get("gpu"),
        ))
    return rows


def accuracy_rows(payloads: Iterable[dict[str, Any]]) -> list[AccuracyRow]:
    """Every cell of the runs, one row per key: where two runs give the same cell the one with more samples wins,
    then the newer; shares of full filled; sorted by task, model, length, method and budget."""
    best: dict[tuple, AccuracyRow] = {}
    for payload in payloads:
        for row in rows_of_run(payload):
            held = best.get(row.key)
            if held is None or (row.n or 0, row.date or "") > (held.n or 0, held.date or ""):
                best[row.key] = row
    rows = with_share_of_full(list(best.values()))
    return sorted(rows, key=lambda r: (r.task, r.model.lower(), r.length or 0, sort_key(r.method), r.budget or 0))


def with_share_of_full(rows: list[AccuracyRow]) -> list[AccuracyRow]:
    reference = {(r.task, r.model.lower(), r.length): r.score for r in rows if r.method == REFERENCE}
    for row in rows:
        full = reference.get((row.task, row.model.lower(), row.length))
        row.share_of_full = (100.0 * row.score / full) if full and row.score is not None else None
    return rows


# --------------------------------------------------------------------------------------------------------------
# TPOT from the latency benchmark files


def tpot_for(row: AccuracyRow, bench: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The latency file row that times ``row``'s method: the same method and (for a method that uses it) the same
    budget, preferring the same model, then the context nearest the row's length by ratio (16k is as near 8k as
    32k: contexts are measured on a doubling grid), then the newest file, then the longer context. None when no file
    timed that method at that budget, or when the row has no length (GSM8K's prompts are the problems' own): no
    context's decode time stands for it."""
    if not row.length:
        return None
    # a declared variant's row (``<name>+<variant>``) is timed by the latency rows of that label, whatever inline
    # settings named them there (``icecache:lookahead=true``)
    candidates = [b for b in bench if (b.get("method") == row.method
                                       or ("+" in row.method and b.get("method_label") == row.method))
                  and (row.budget is None or _length(b.get("budget")) == row.budget)
                  and b.get("tpot_s_median") is not None]
    if not candidates:
        return None

    def rank(b: dict[str, Any]) -> tuple:
        same_model = str(b.get("model") or "").lower() == row.model.lower()
        context = _length(b.get("context")) or 0
        distance = abs(math.log(context / row.length)) if context > 0 and row.length else math.inf
        return (not same_model, round(distance, 9), _negated(str(b.get("date") or "")), -context)

    return min(candidates, key=rank)


@dataclass
class TradeoffPoint:
    """One point of the trade-off figure: a cell's score as a share of the full cache's with its interval, and its
    TPOT over full_static's measured beside it."""

    row: AccuracyRow
    tpot_ratio: float  # the method's TPOT / full_static's, same latency model and context
    share: float  # % of the full cache's score
    low: float | None
    high: float | None
    paired: bool  # the interval is the paired difference's (else the run's own, the full cache's spread ignored)
    timed_model: str | None = None
    timed_context: int | None = None  # the context the TPOT was measured at
    timed_gpu: str | None = None  # the GPU it was measured on


def share_interval(row: AccuracyRow, full_score: float | None) -> tuple[float | None, float | None, bool]:
    """The interval of ``row``'s share of the full cache's score: the paired difference's interval over the full
    score where the cell has one (the full cache's own spread cancels in it), else the run's own interval over it."""
    if not full_score:
        return None, None, False
    if row.difference_interval is not None:
        low, high = row.difference_interval
        return 100.0 * (full_score + low) / full_score, 100.0 * (full_score + high) / full_score, True
    if row.interval is not None:
        return 100.0 * row.interval[0] / full_score, 100.0 * row.interval[1] / full_score, False
    return None, None, False


STATIC = "full_static"  # the trade-off figure's TPOT is a multiple of this method's


def _static_tpot(timed: dict[str, Any], bench: list[dict[str, Any]]) -> float | None:
    """full_static's TPOT beside a latency row: the same model and context, the same file first, then newest."""
    beside = [b for b in bench if b.get("method") == STATIC and b.get("tpot_s_median") is not None
              and str(b.get("model") or "").lower() == str(timed.get("model") or "").lower()
              and _length(b.get("context")) == _length(timed.get("context"))]
    if not beside:
        return None
    best = min(beside, key=lambda b: (b.get("file") != timed.get("file"), _negated(str(b.get("date") or ""))))
    return float(best["tpot_s_median"])


def tradeoff_points(rows: list[AccuracyRow], bench: list[dict[str, Any]]) -> list[TradeoffPoint]:
    """Every cell with a score, a full cache's score at its length and a latency row of its method (``tpot_for``)
    with full_static's beside it: its share of full with its interval against its TPOT as a multiple of
    full_static's."""
    full = {(r.task, r.model.lower(), r.length): r.score for r in rows if r.method == REFERENCE}
    points = []
    for row in rows:
        timed = tpot_for(row, bench)
        share = row.share_of_full if row.method != REFERENCE else (100.0 if row.score else None)
        if timed is None or share is None:
            continue
        static = _static_tpot(timed, bench)
        if not static:
            continue
        low, high, paired = share_interval(row, full.get((row.task, row.model.lower(), row.length)))
        if row.method == REFERENCE:
            low = high = None  # the reference against itself
        points.append(TradeoffPoint(row, float(timed["tpot_s_median"]) / static, share, low, high, paired,
                                    str(timed.get("model")) if timed.get("model") else None,
                                    _length(timed.get("context")),
                                    str(timed.get("gpu")) if timed.get("gpu") else None))
    return points


def _negated(text: str) -> tuple:
    return tuple(-ord(c) for c in text)


# --------------------------------------------------------------------------------------------------------------
# Markdown


def length_label(tokens: Any) -> str:
    """150000 -> '150k', 4096 -> '4k', 7500 -> '7.5k'; the paper labels context lengths in thousands. None: 'all'."""
    if tokens is None:
        return "all"
    try:
        value = int(tokens)
    except (TypeError, ValueError):
        return str(tokens)
    if value % 1024 == 0 and value >= 1024 and value % 1000 != 0:
        return f"{value // 1024}k"
    return f"{value / 1000:.1f}".removesuffix(".0") + "k" if value >= 1000 else str(value)


def _num(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}{suffix}"


def score_cell(row: AccuracyRow | None) -> str:
    if row is None or row.score is None:
        return "-"
    if row.interval is None:
        return _num(row.score)
    return f"{row.score:.1f} [{row.interval[0]:.1f}, {row.interval[1]:.1f}]"


def difference_cell(row: AccuracyRow | None) -> str:
    if row is None or row.difference is None:
        return "-"
    if row.difference_interval is None:
        return f"{row.difference:+.1f}"
    low, high = row.difference_interval
    return f"{row.difference:+.1f} [{low:+.1f}, {high:+.1f}]"


def mass_cell(row: AccuracyRow | None) -> str:
    if row is None or row.mass is None:
        return "-"
    return f"{row.mass:.3f} ({row.oracle_mass:.3f})" if row.oracle_mass is not None else f"{row.mass:.3f}"


def render_tables(rows: list[AccuracyRow]) -> str:
    """One Markdown table per (model, task): rows (method, budget), per context length the score [95% interval],
    n, % of full, the paired difference with the full cache (at the lengths where some row has one), tokens
    attended and mass (oracle's)."""
    blocks = []
    groups: dict[tuple[str, str], list[AccuracyRow]] = {}
    for row in rows:
        groups.setdefault((row.model, row.task), []).append(row)
    for (model, task), members in groups.items():
        lengths = sorted({r.length for r in members}, key=lambda x: (x is None, x or 0))
        cells = {(r.method, r.budget, r.length): r for r in members}
        keys = sorted({(r.method, r.budget) for r in members}, key=lambda k: (sort_key(k[0]), k[1] or 0))
        paired = {r.length for r in members if r.difference is not None}  # the lengths that get a Δ column
        header = ["method", "budget"]
        for length in lengths:
            label = length_label(length)
            header += [f"{label} score [95% CI]", f"{label} n", f"{label} % of full"]
            header += [f"{label} Δ full [95% CI]"] if length in paired else []
            header += [f"{label} attended", f"{label} mass (oracle)"]
        lines = [f"**{task}, {model}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for method, budget in keys:
            line = [f"`{method_text(method)}`", "-" if budget is None else str(budget)]
            for length in lengths:
                row = cells.get((method, budget, length))
                line += [score_cell(row), "-" if row is None or row.n is None else str(row.n),
                         _num(None if row is None else row.share_of_full, 0, "%")]
                line += [difference_cell(row)] if length in paired else []
                line += [_num(None if row is None else row.attended, 0), mass_cell(row)]
            lines.append("| " + " | ".join(line) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


DEFINITIONS = (
    "score: the task's score in percent (passkey: keys retrieved; RULER: the mean over its tasks of each task's "
    "string-match score), with the 2.5th-97.5th percentile of a bootstrap that resamples the samples within each "
    "(length, task) cell; % of full: the score over the full cache's at the same length; Δ full: the score minus "
    "the full cache's on the same samples, with the interval of a paired bootstrap (the same samples drawn for both "
    "runs; given where both runs' predictions were on disk when the file was curated); attended: the mean tokens "
    "a query head attended in a sparsified layer; mass: the share of each decode step's exact attention (over every "
    "token seen) that the attended tokens hold, averaged over query heads, steps, sparsified layers and samples, "
    "with in brackets the share the best tokens of the same number hold (docs/design.md, Selection quality)."
)
