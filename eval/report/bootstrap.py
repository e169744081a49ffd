"""95% confidence intervals of a run's scores: a percentile bootstrap over its samples.

Each resample draws, with replacement, as many samples as there are from every cell of the run (its context
length and, where the task has them, its subtask or dataset: RULER's 13 tasks, LongBench's datasets), so every
resample has the run's design, and recomputes the task's own aggregate from them. The interval of a number the
aggregate reports (the headline ``score``, a length's score, a subtask's) is the 2.5th and 97.5th percentile of
that number over the resamples. Deterministic for a given seed. ``paired_difference`` does the same for the
difference between two runs over the same samples (a method and the full cache). Nothing here imports torch or
pandas.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

RESAMPLES = 1000
LEVEL = 0.95


def numeric_leaves(values: Any, prefix: str = "") -> dict[str, float]:
    """``{"by_length": {"4096": 55.0}, "n": 20}`` -> ``{"by_length.4096": 55.0}``: the numbers an aggregate reports,
    less its sample counts (``n``, ``n_*``), which a stratified resample does not change."""
    out: dict[str, float] = {}
    if isinstance(values, dict):
        for key, value in values.items():
            if key == "n" or str(key).startswith("n_"):
                continue
            out.update(numeric_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(values, (int, float)) and not isinstance(values, bool) and prefix:
        out[prefix] = float(values)
    return out


def cell_of(record: dict[str, Any]) -> tuple:
    meta = record.get("meta") or {}
    return (str(meta.get("length")), str(meta.get("task") or meta.get("dataset") or ""))


def _resamples(records: list[dict[str, Any]], resamples: int, seed: int):
    """The index arrays of the stratified resamples: per cell of ``records``, as many draws with replacement as
    the cell has samples."""
    cells: dict[tuple, list[int]] = {}
    for index, record in enumerate(records):
        cells.setdefault(cell_of(record), []).append(index)
    members = [np.asarray(indices) for indices in cells.values()]
    rng = np.random.default_rng(seed)
    for _ in range(resamples):
        yield np.concatenate([rng.choice(indices, size=len(indices)) for indices in members])


def _intervals(point: dict[str, float], resampled: Iterable[dict[str, float]], level: float) -> dict[str, list[float]]:
    """The percentile interval of each number of ``point`` over the resamples' numbers (a number a resample lacks,
    a cell it happened to leave empty, is not drawn for it)."""
    draws: dict[str, list[float]] = {key: [] for key in point}
    for values in resampled:
        for key, series in draws.items():
            if key in values:
                series.append(values[key])
    tail = 100 * (1 - level) / 2
    return {key: [round(float(np.percentile(series, tail)), 2), round(float(np.percentile(series, 100 - tail)), 2)]
            for key, series in draws.items() if series}


def bootstrap_intervals(records: list[dict[str, Any]], aggregate: Callable[[list[dict[str, Any]]], dict[str, Any]],
                        resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0) -> dict[str, Any] | None:
    """``{"level", "resamples", "seed", "method", "intervals": {dotted key: [low, high]}}`` for every number of
    ``aggregate(records)``; None without records."""
    if not records:
        return None
    point = numeric_leaves(aggregate(records))
    resampled = (numeric_leaves(aggregate([records[i] for i in chosen]))
                 for chosen in _resamples(records, resamples, seed))
    return {"method": "percentile bootstrap, samples resampled within each (length, subtask) cell", "level": level,
            "resamples": resamples, "seed": seed, "intervals": _intervals(point, resampled, level)}


def paired_difference(records: list[dict[str, Any]], reference: list[dict[str, Any]],
                      aggregate: Callable[[list[dict[str, Any]]], dict[str, Any]], resamples: int = RESAMPLES,
                      level: float = LEVEL, seed: int = 0) -> dict[str, Any] | None:
    """Every number of ``aggregate(records)`` minus the same number of ``aggregate(reference)``, with the interval
    of a paired bootstrap: each resample draws the same samples (by ``sample_id``) from both runs, so what the two
    runs share, the difficulty of each sample, cancels, and the interval is that of the difference alone.
    ``{"difference": {key: value}, "intervals": {key: [low, high]}, "level", "resamples", "seed", "method"}``;
    None when the two runs do not hold the same samples (nothing to pair) or hold none."""
    by_id = {record["sample_id"]: record for record in reference}
    if not records or len(by_id) != len(reference) or sorted(by_id) != sorted(r["sample_id"] for r in records):
        return None
    partner = [by_id[record["sample_id"]] for record in records]

    def difference(indices) -> dict[str, float]:
        a = numeric_leaves(aggregate([records[i] for i in indices]))
        b = numeric_leaves(aggregate([partner[i] for i in indices]))
        return {key: a[key] - b[key] for key in a if key in b}

    point = difference(range(len(records)))
    resampled = (difference(chosen) for chosen in _resamples(records, resamples, seed))
    return {"method": "paired percentile bootstrap: the same samples of both runs, resampled within each (length, "
                      "subtask) cell", "level": level, "resamples": resamples, "seed": seed,
            "difference": {key: round(value, 2) for key, value in point.items()},
            "intervals": _intervals(point, resampled, level)}
