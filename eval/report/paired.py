"""Each run's score against the full cache's on the same samples: a paired bootstrap, attached when curating.

Two runs' own intervals overlapping says little about their difference: both carry the spread of the samples'
difficulty, which a difference over the same samples cancels. So at curating time (``scripts/sweep.py
--curate``), for every finished run whose predictions are on disk and whose reference run (``full``, the same task
settings and model) holds the same samples on disk, the payload gets ``paired``: the difference of every number
its task's aggregate reports, with the interval of ``bootstrap.paired_difference``. A payload that already has one
(put back from an earlier curated file, its predictions gone) keeps it; the table renders it as "Δ full".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from eval.report.accuracy import REFERENCE
from eval.report.bootstrap import paired_difference


def _pairing_key(payload: dict[str, Any]) -> str:
    settings = payload.get("settings") or {}
    return json.dumps([payload.get("task"), str(payload.get("model")).lower(), settings.get("task"),
                       settings.get("model")], sort_keys=True, default=str)


def attach_paired(payloads: list[dict[str, Any]], run_dir_of: Callable[[dict[str, Any]], Path]) -> int:
    """Add ``paired`` to every payload that can be paired with its reference run (module docstring); returns how
    many got one now."""
    from eval.rundir import run_records
    from eval.tasks.base import build_task

    references = {_pairing_key(p): p for p in payloads if p.get("method") == REFERENCE}
    loaded: dict[int, list[dict[str, Any]]] = {}

    def records(payload: dict[str, Any]) -> list[dict[str, Any]]:
        if id(payload) not in loaded:
            found = run_records(run_dir_of(payload))
            loaded[id(payload)] = list(found.values()) if len(found) == payload.get("n_samples") else []
        return loaded[id(payload)]

    attached = 0
    for payload in payloads:
        reference = references.get(_pairing_key(payload))
        if reference is None or reference is payload or not records(payload) or not records(reference):
            continue
        task = build_task((payload.get("settings") or {}).get("task") or {}, check=False)
        paired = paired_difference(records(payload), records(reference), task.aggregate)
        if paired is not None:
            payload["paired"] = {"reference": REFERENCE, "reference_run": reference.get("config_hash"), **paired}
            attached += 1
    return attached
