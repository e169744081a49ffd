"""Each run's score against the full cache's on the same samples: a paired bootstrap, attached when curating.

Two runs' own intervals overlapping says little about their difference: both carry the spread of the samples'
difficulty, which a difference over the same samples cancels. So at curating time (``scripts/sweep.py
--curate``), for every finished run whose samples are known and whose reference run (``full``, the same task
settings and model) holds the same samples, the payload gets ``paired``: the difference of every number its task's
aggregate reports, with the interval of ``bootstrap.paired_difference``; the table renders it as "Δ full".

A run's samples are its predictions on disk or, where those are not on this disk, the ``samples`` its payload
carries: every curated payload holds each sample's scores and meta (``sample_summaries``), and ``--restore`` puts
them back with its metrics.json. A grid run over several hosts, each with a fresh disk, ends with the reference
runs (which run first) on an early host and the slow methods on the last: pairing on the disk alone left those
cells without a difference. A payload that already has ``paired`` and whose samples are nowhere (a file curated
before payloads carried them) keeps it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from eval.report.accuracy import REFERENCE
from eval.report.bootstrap import paired_difference


def _pairing_key(payload: dict[str, Any]) -> str:
    settings = payload.get("settings") or {}
    return json.dumps([payload.get("task"), str(payload.get("model")).lower(), settings.get("task"),
                       settings.get("model")], sort_keys=True, default=str)


# The fields of a predictions line that are not the task's per-sample scores.
_NOT_SCORES = ("sample_id", "prediction", "output_ids", "answers", "meta", "gen", "selection")


def generated_sha256(record: dict[str, Any]) -> str:
    """A short hash of what a sample generated (its text and token ids): two runs' samples with equal hashes
    generated the same, without the curated file holding every text."""
    text = json.dumps([record.get("prediction"), record.get("output_ids")], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sample_summaries(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a curated payload keeps of each sample: its id, its scores and meta (all a task's aggregate and the
    bootstrap read), the hash of what it generated and why its generation stopped (``eos``, ``stop_string`` or
    ``length``: a method whose answers run to the token cap shows it without the texts)."""
    out = []
    for record in records:
        scores = {key: value for key, value in record.items() if key not in _NOT_SCORES
                  and isinstance(value, (int, float)) and not isinstance(value, bool)}
        summary = {"sample_id": record["sample_id"], **scores, "meta": record.get("meta") or {},
                   "generated_sha256": generated_sha256(record)}
        stop_reason = (record.get("gen") or {}).get("stop_reason")
        if stop_reason is not None:
            summary["stop_reason"] = stop_reason
        out.append(summary)
    return out


def run_samples(payload: dict[str, Any], run_dir: Path | None) -> list[dict[str, Any]]:
    """The run's samples, all of them or none: its predictions on disk, else the ``samples`` of its payload."""
    from eval.rundir import run_records

    found = list(run_records(run_dir).values()) if run_dir is not None and run_dir.is_dir() else []
    if len(found) == payload.get("n_samples"):
        return found
    carried = payload.get("samples") or []
    return carried if len(carried) == payload.get("n_samples") else []


def attach_samples(payloads: list[dict[str, Any]], run_dir_of: Callable[[dict[str, Any]], Path]) -> int:
    """Give every payload its ``samples`` (``sample_summaries``) from its predictions on disk, keeping those it
    carries where its predictions are gone; returns how many payloads have them."""
    held = 0
    for payload in payloads:
        records = run_samples(payload, run_dir_of(payload))
        if records:
            payload["samples"] = sample_summaries(records) if "prediction" in records[0] else records
            held += 1
    return held


def attach_paired(payloads: list[dict[str, Any]], run_dir_of: Callable[[dict[str, Any]], Path]) -> int:
    """Add ``paired`` to every payload that can be paired with its reference run (module docstring); returns how
    many got one now."""
    from eval.tasks.base import build_task

    references = {_pairing_key(p): p for p in payloads if p.get("method") == REFERENCE}
    loaded: dict[int, list[dict[str, Any]]] = {}

    def records(payload: dict[str, Any]) -> list[dict[str, Any]]:
        if id(payload) not in loaded:
            loaded[id(payload)] = run_samples(payload, run_dir_of(payload))
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
