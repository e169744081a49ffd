"""95% confidence intervals of a run's scores: a percentile bootstrap over its samples.

Each resample draws, with replacement, as many samples as there are from every cell of the run (its context
length and, where the task has them, its subtask or dataset: RULER's 13 tasks, LongBench's datasets), so every
resample has the run's design, and recomputes the task's own aggregate from them. The interval of a number the
aggregate reports (the headline ``score``, a length's score, a subtask's) is the 2.5th and 97.5th percentile of
that number over the resamples. Deterministic for a given seed. Nothing here imports torch or pandas.
"""

from __future__ import annotations

from typing import Any, Callable

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


def bootstrap_intervals(records: list[dict[str, Any]], aggregate: Callable[[list[dict[str, Any]]], dict[str, Any]],
                        resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0) -> dict[str, Any] | None:
    """``{"level", "resamples", "seed", "method", "intervals": {dotted key: [low, high]}}`` for every number of
    ``aggregate(records)``; None without records."""
    if not records:
        return None
    point = numeric_leaves(aggregate(records))
    cells: dict[tuple, list[int]] = {}
    for index, record in enumerate(records):
        cells.setdefault(cell_of(record), []).append(index)
    members = [np.asarray(indices) for indices in cells.values()]
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {key: [] for key in point}
    for _ in range(resamples):
        chosen = np.concatenate([rng.choice(indices, size=len(indices)) for indices in members])
        values = numeric_leaves(aggregate([records[i] for i in chosen]))
        for key, series in draws.items():
            if key in values:
                series.append(values[key])
    tail = 100 * (1 - level) / 2
    intervals = {key: [round(float(np.percentile(series, tail)), 2), round(float(np.percentile(series, 100 - tail)), 2)]
                 for key, series in draws.items() if series}
    return {"method": "percentile bootstrap, samples resampled within each (length, subtask) cell", "level": level,
            "resamples": resamples, "seed": seed, "intervals": intervals}
