"""The task contract: a task turns its data into tokenised samples and scores predictions.

Tasks never import torch kernels or methods; what they need of the model is a ``PromptContext``.
"""

from __future__ import annotations

import json
import statistics
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator

from icecache.errors import ConfigError, dataclass_from_dict
from icecache.registry import Registry


@dataclass
class PromptContext:
    """What prompt building needs of the model: its tokenizer and its family's conventions."""

    tokenizer: Any
    model_name: str = "model"
    chat_template: str = "none"  # llama3 | mistral | qwen | plain | none
    max_length: int = 8192  # prompt budget in tokens (LongBench middle truncation)


@dataclass
class Sample:
    """One prompt ready for generation, plus what scoring needs."""

    sample_id: str
    input_ids: list[int]
    max_new_tokens: int
    answers: list[str]
    eos_token_ids: list[int] | None = None  # None: the tokenizer's EOS
    min_new_tokens: int = 0
    stop_strings: list[str] = field(default_factory=list)
    suffix_ids: list[int] = field(default_factory=list)  # fed as decode steps before generating
    meta: dict[str, Any] = field(default_factory=dict)  # dataset, length, depth, classes, ...


@dataclass
class TaskConfig:
    """Settings every task has; each task extends this."""

    name: str = "passkey"
    limit: int | None = None  # at most this many samples (per dataset where a task has several)
    seed: int = 42

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "TaskConfig":
        return dataclass_from_dict(cls, values, "task")


class Task(ABC):
    """A task: its settings class, what the runner and the report need to know of it (declared here, on the class),
    its samples and its scoring."""

    config_class: ClassVar[type[TaskConfig]] = TaskConfig
    #: Whether every sample has a context length (``Sample.meta["length"]``): a run's latency and selection
    #: summaries then come per length as well as pooled, since a median over 10k and 30k prompts describes neither.
    has_lengths: ClassVar[bool] = False
    #: The task settings a table spreads over and a sweep may split into jobs (LongBench's ``datasets``, RULER's
    #: ``tasks`` and ``lengths``): runs that differ only in these share a table row; any other setting that differs
    #: makes a row of its own.
    coordinates: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def table_name(cls, settings: dict[str, Any]) -> str:
        """The name results of a run of these settings are tabled under: the task's own, unless a setting makes
        its scores another table's (LongBench-E's buckets are never LongBench v1 cells)."""
        return str(settings.get("name"))

    def __init__(self, config: TaskConfig):
        self.config = config

    def check(self) -> None:  # noqa: B027  optional: a task without data to check keeps it
        """Raise ``ConfigError`` for missing data or bad settings, before any model is loaded."""

    def check_max_length(self, max_length: int) -> None:  # noqa: B027  optional: tasks without lengths skip it
        """Raise ``ConfigError`` if the task asks for prompts longer than the model takes (``model.max_length``);
        called before the model's config or tokenizer is read. Tasks that truncate (LongBench) accept any."""

    @abstractmethod
    def samples(self, context: PromptContext) -> Iterator[Sample]:
        """Samples in a fixed order with stable ids (the runner skips ids already written)."""

    @abstractmethod
    def score(self, sample: Sample, prediction: str, output_ids: list[int]) -> dict[str, float]:
        """Per-sample metrics; must contain ``score`` in [0, 1]."""

    def data_record(self) -> dict[str, Any] | None:
        """What the run's result records about the data the samples came from (a file's path and sha256), so that
        two results say whether they read the same data; None for a task whose settings alone make its samples."""
        return None

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Task metrics from the per-sample records (each has ``score`` and ``meta``). Default: mean x 100."""
        if not records:
            return {"score": None, "n": 0}
        return {"score": round(100 * statistics.fmean(r["score"] for r in records), 2), "n": len(records)}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file (blank lines skipped); a file that cannot be read (no permission, not UTF-8
    text) or a line that is not a JSON object is a ``ConfigError`` that names the file (and the line)."""
    rows = []
    try:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                rows.append(_jsonl_row(path, number, line))
    except PermissionError:
        raise ConfigError(f"{path} cannot be read by this user (permission denied): make it readable "
                          f"(chmod a+r {path}) or point the task at a copy you can read") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text (line {_first_undecodable_line(path)} is not): give a "
                          f"JSON-lines file of UTF-8 text, one JSON object per line") from None
    return rows


def _first_undecodable_line(path: Path) -> int:
    """The number of the first line of ``path`` that is not UTF-8 (read again only to say where)."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 1  # a sequence cut by a line break: the decoder saw it, the lines alone do not


def _jsonl_row(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        reason = f"{error.msg.removesuffix(' at')} at column {error.colno}"
        raise ConfigError(f"{path} line {number} is not valid JSON ({reason}); fix or remove the line") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{path} line {number} is not a JSON object ({{...}}); fix or remove the line")
    return row


TASKS: Registry[type[Task]] = Registry("task")


def task_class(name: str | None) -> type[Task]:
    """The registered class of a task name (``eval.plugins`` imports every task module, which registers them)."""
    return TASKS.get(name)


def build_task(values: dict[str, Any], check: bool = True) -> Task:
    """The task ``values`` name, checked (``Task.check``) unless ``check=False``: scoring finished runs' records
    needs the task's aggregate, not its data."""
    import eval.tasks as _all_tasks  # noqa: F401  registers every task

    task_cls = task_class(values.get("name"))
    task = task_cls(task_cls.config_class.from_dict(dict(values)))
    if check:
        task.check()
    return task
