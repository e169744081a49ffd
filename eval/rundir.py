"""The run-directory format: what a run writes, under which names, and how it is read back.

A run's directory (``RunConfig.output_dir``) holds ``config.yaml`` (the run's identity), ``env.json`` (the machine
it started on), its predictions and, once every sample is in, ``metrics.json``: written last and atomically, the
file's presence marks the run done. Predictions are JSON lines, one per sample, appended and flushed as each sample
finishes; a restarted run skips the ids already written and drops a torn last line (a kill mid-write). A run may be
shared by several processes (``n_shards``), each appending to a file of its own
(``predictions.shard-<i>-of-<n>.jsonl``); the one that completes the run merges them into ``predictions.jsonl``.
Locks beside the files keep two processes from writing one file.

The runner writes this format and the report reads it; both go through this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from icecache.errors import ConfigError

PREDICTIONS = "predictions.jsonl"
METRICS = "metrics.json"
CONFIG = "config.yaml"
ENV = "env.json"
SHARD_PATTERN = "predictions.shard-*-of-*.jsonl"
RUN_LOCK = ".lock"
FINISH_LOCK = ".finish.lock"


def predictions_name(shard: int, n_shards: int) -> str:
    """The predictions file one process writes: the run's own, or its shard's."""
    return PREDICTIONS if n_shards == 1 else f"predictions.shard-{shard}-of-{n_shards}.jsonl"


def lock_name(predictions: str) -> str:
    """The lock that guards one predictions file: ``.lock`` for the run's own, ``.lock.<file>`` for a shard's."""
    return RUN_LOCK if predictions == PREDICTIONS else f"{RUN_LOCK}.{predictions}"


def read_records(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines of a predictions file, each sample once; a torn last line (killed mid-write) is dropped."""
    if not path.exists():
        return []
    records, seen = [], set()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record["sample_id"] not in seen:
                seen.add(record["sample_id"])
                records.append(record)
    return records


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file of this process's own (shards of one run write the same
    files at once), renamed into place: a reader sees the old file or the new one, never part of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: Path, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True, default=str))


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    """A whole predictions file at once (the merged shards), atomically."""
    write_text_atomic(path, "".join(json.dumps(record, default=str) + "\n" for record in records))


def append_record(sink, record: dict[str, Any]) -> None:
    """One sample's line, on disk before the next sample starts (a kill loses at most the sample in progress)."""
    sink.write(json.dumps(record, default=str) + "\n")
    sink.flush()
    os.fsync(sink.fileno())


def truncate_torn_tail(path: Path) -> None:
    """Drop a partial last line so the next append starts on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as handle:
            handle.truncate(cut)


class RunLock:
    """Exclusive lock next to the predictions, so two jobs never write one predictions file (duplicate sweep points,
    one shard started twice): ``.lock`` for the run's own file, ``.lock.<shard file>`` for a shard's, and
    ``.finish.lock``, waited for (``blocking``), around merging the files and writing the metrics."""

    def __init__(self, directory: Path, name: str = RUN_LOCK, blocking: bool = False):
        self.path = directory / name
        self.blocking = blocking

    def __enter__(self):
        import fcntl

        self.handle = open(self.path, "w")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | (0 if self.blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            self.handle.close()
            raise ConfigError(f"another process is writing {self.path.parent}; wait for it or kill it") from None
        return self

    def __exit__(self, *exc):
        self.handle.close()


def predictions_files(directory: Path) -> list[Path]:
    """A run's predictions files: its own first, then its shards' in name order."""
    shards = sorted(directory.glob(SHARD_PATTERN))
    own = directory / PREDICTIONS
    return ([own] if own.exists() else []) + shards


def shard_files(directory: Path) -> list[Path]:
    """The shards' predictions files of a run (merged into its own file when the run completes)."""
    return sorted(directory.glob(SHARD_PATTERN))


def run_records(directory: Path) -> dict[str, dict[str, Any]]:
    """Every finished sample of a run across its predictions files, once each (the first file that holds it wins:
    two shardings of one run may have overlapped)."""
    records: dict[str, dict[str, Any]] = {}
    for path in predictions_files(directory):
        for record in read_records(path):
            records.setdefault(record["sample_id"], record)
    return records


def done_metrics(directory: Path) -> dict[str, Any] | None:
    """The run's ``metrics.json`` if the run is done, else None."""
    path = directory / METRICS
    return json.loads(path.read_text()) if path.exists() else None


def check_writable(root: Path) -> None:
    """Refuse an ``output_root`` that cannot hold directories, without creating anything: a probe directory is made
    and removed in the nearest existing ancestor (permission bits do not tell for root, nor for /proc or /sys)."""
    import tempfile

    ancestor = Path(root).expanduser().absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"output_root={root}: {ancestor} is a file, not a folder; choose another output_root")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".icecache-probe-", dir=ancestor))
    except OSError as error:
        raise ConfigError(f"output_root={root}: cannot create folders under {ancestor} ({error.strerror or error}); "
                          f"choose another output_root") from None
