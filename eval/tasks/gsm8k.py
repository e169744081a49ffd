r"""GSM8K (Cobbe et al. 2021) with 8-shot chain-of-thought, as IceCache's ``benchmark/gsm8k_pred.py`` runs it.

Prompt: the exemplars + ``"\nQuestion: " + question + "\n"``, no chat template, greedy, 256 new tokens, stopping at
the next ``"\nQuestion: "`` the model starts. The exemplars are the eight classic ones of the chain-of-thought paper
(Wei et al. 2022; ``eval/tasks/data/gsm8k/cot_8shot.txt``: "Question: ... / Let's think step by step / ... / The
answer is N.") because IceCache's own prompt file, ``gsm8k_prompt_formal.txt``, was never made public (see
``eval/tasks/data/gsm8k/SOURCE.md``); absolute accuracy may differ slightly from the paper's, method-against-method
comparisons do not.

Answer extraction: cut the generation at the first ``"\nQuestion: "``, remove commas, and read the last match of
``\d*\.?\d+`` as a float; the gold answer is read the same way (its last number is the one after "####"). Equal
floats are correct; a generation without a number is wrong. The regex has no sign, so "-5" and "5" compare equal,
as in the reference.

Data: ``source: local`` reads a JSONL with fields ``question`` and ``answer`` from ``path`` (default
``$ICECACHE_GSM8K``, else ``~/.cache/icecache-harness/gsm8k/test.jsonl``; a relative path is from the repository
root); ``source: hub`` reads ``openai/gsm8k`` (``main``, ``test``). A line that is not JSON, a row without a
``question`` or ``answer`` string, or a file without rows stops the run before the model loads, file and row named.
``limit: N`` takes the first N problems. The run's result records the data it read (``data``: the file's path and
sha256, or the hub's repository, config and split, and the sha256 of the problems used), so that a result says
which copy of the test set it scored, and a changed file is told apart from the same one at another path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from icecache.core.models import file_sha256
from icecache.errors import ConfigError

from .base import TASKS, PromptContext, Sample, Task, TaskConfig, read_jsonl
from .chat import encode_prompt

REPO_ROOT = Path(__file__).resolve().parents[2]
EXEMPLARS_FILE = Path(__file__).resolve().parent / "data" / "gsm8k" / "cot_8shot.txt"
DEFAULT_PATH = "~/.cache/icecache-harness/gsm8k/test.jsonl"  # where $ICECACHE_GSM8K is unset
QUESTION_MARKER = "\nQuestion: "
NUMBER = re.compile(r"\d*\.?\d+")
MAX_NEW_TOKENS = 256


@lru_cache(maxsize=None)
def exemplars() -> str:
    """The 8-shot chain-of-thought prompt head."""
    return EXEMPLARS_FILE.read_text(encoding="utf-8")


def build_prompt(question: str) -> str:
    return exemplars() + QUESTION_MARKER + question + "\n"


def extract_answer(text: str) -> float | None:
    """The last number of ``text`` before any follow-up question, commas removed; None without a number."""
    text = text.split(QUESTION_MARKER)[0].replace(",", "")
    numbers = NUMBER.findall(text)
    return float(numbers[-1]) if numbers else None


def is_correct(prediction: str, gold_answer: str) -> bool:
    predicted = extract_answer(prediction)
    return predicted is not None and predicted == extract_answer(gold_answer)


@dataclass
class GSM8KConfig(TaskConfig):
    """GSM8K settings; see configs/task/gsm8k.yaml."""

    name: str = "gsm8k"
    source: str = "local"  # local | hub
    path: str | None = None  # local JSONL (fields question, answer); None: $ICECACHE_GSM8K or DEFAULT_PATH
    hub_repo: str = "openai/gsm8k"
    hub_config: str = "main"
    split: str = "test"


def resolve_path(path: str | None) -> Path:
    """``path``, else ``$ICECACHE_GSM8K``, else ``DEFAULT_PATH``; a relative path is from the repository root."""
    chosen = Path(path or os.environ.get("ICECACHE_GSM8K") or DEFAULT_PATH).expanduser()
    return chosen if chosen.is_absolute() else (REPO_ROOT / chosen).resolve()


@TASKS.register("gsm8k")
class GSM8K(Task):
    """8-shot chain-of-thought GSM8K test accuracy."""

    config_class = GSM8KConfig
    config: GSM8KConfig

    def __init__(self, config: GSM8KConfig):
        super().__init__(config)
        self._rows: list[dict[str, Any]] | None = None

    def check(self) -> None:
        if self.config.source not in ("local", "hub"):
            raise ConfigError(f"gsm8k source must be 'local' or 'hub', not {self.config.source!r}")
        if self.config.limit is not None and self.config.limit < 1:
            raise ConfigError(f"task.limit must be at least 1, not {self.config.limit}")
        rows = self.rows()
        where = resolve_path(self.config.path) if self.config.source == "local" else self.config.hub_repo
        if not rows:
            raise ConfigError(f"GSM8K data {where} has no problems: a run of 0 samples would look finished")
        for index, row in enumerate(rows):
            missing = [key for key in ("question", "answer") if not isinstance(row.get(key), str)]
            if missing:
                raise ConfigError(f"GSM8K row {index + 1} of {where} has no {' or '.join(missing)} (a string); each "
                                  f"row needs question and answer")

    def data_record(self) -> dict[str, Any]:
        rows = self.rows()
        # the problems scored, whatever file or hub copy they came from
        used = hashlib.sha256("".join(json.dumps([row["question"], row["answer"]]) + "\n" for row in rows).encode())
        if self.config.source == "local":
            path = resolve_path(self.config.path)
            where = {"path": str(path), "sha256": file_sha256(path)}
        else:
            where = {"hub_repo": self.config.hub_repo, "hub_config": self.config.hub_config, "split": self.config.split}
        return {**where, "n_problems": len(rows), "problems_sha256": used.hexdigest()}

    def rows(self) -> list[dict[str, Any]]:
        if self._rows is None:
            rows = self._load()
            self._rows = rows[: self.config.limit] if self.config.limit is not None else rows
        return self._rows

    def _load(self) -> list[dict[str, Any]]:
        if self.config.source == "local":
            path = resolve_path(self.config.path)
            if not path.is_file():
                raise ConfigError(
                    f"GSM8K file {path} {'is a folder' if path.is_dir() else 'not found'}; set task.path (or "
                    f"$ICECACHE_GSM8K) to a JSONL with fields "
                    f"question and answer (the GSM8K test set), or use task.source=hub"
                )
            return read_jsonl(path)
        try:
            from datasets import load_dataset

            table = load_dataset(self.config.hub_repo, self.config.hub_config, split=self.config.split)
        except Exception as error:
            raise ConfigError(
                f"could not load {self.config.hub_repo} ({self.config.hub_config}, {self.config.split}) from the hub: "
                f"{type(error).__name__}: {error}. Use task.source=local task.path=<GSM8K test.jsonl>"
            ) from None
        return [dict(row) for row in table]

    def samples(self, context: PromptContext) -> Iterator[Sample]:
        for index, row in enumerate(self.rows()):
            yield Sample(
                sample_id=f"gsm8k/{index}",
                input_ids=encode_prompt(build_prompt(row["question"]), context.tokenizer),
                max_new_tokens=MAX_NEW_TOKENS,
                answers=[row["answer"]],
                stop_strings=[QUESTION_MARKER],
                meta={"index": index},
            )

    def score(self, sample: Sample, prediction: str, output_ids: list[int]) -> dict[str, float]:
        return {"score": 1.0 if is_correct(prediction, sample.answers[0]) else 0.0}
