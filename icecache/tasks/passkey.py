"""Passkey retrieval, the ArkVale / IceCache protocol (docs/algorithms.md, Passkey).

A pass key sentence is hidden at a relative depth in repeated filler text; the model must continue
"The pass key is" with the key. Lengths are given in tokens: the filler's character count is calibrated with
the model's tokenizer so each prompt has at most ``length`` tokens. Keys come from
``numpy.random.RandomState(seed).randint(1, 50000)`` drawn in sample order, as the reference scripts do with the
global NumPy seed 42. A sample is correct iff the last ``len(answer_ids)`` generated ids equal the key's ids
(``max_new_tokens = len(answer_ids) + 1``, IceCache's setting). The prompt joins its five lines (task, filler
prefix, key sentence, filler suffix, question) with newlines, as the landmark-attention generator does.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from icecache.core.errors import ConfigError

from .base import TASKS, PromptContext, Sample, Task, TaskConfig

TASK_LINE = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeyConfig(TaskConfig):
    name: str = "passkey"
    lengths: list[int] = field(default_factory=lambda: [4096])  # prompt tokens, at most
    num_depths: int = 20  # depths i / num_depths for i = 0 .. num_depths-1, one sample each per length
    extra_new_tokens: int = 1  # IceCache generates len(answer_ids) + 1 tokens; ArkVale uses 0
    decode_question: bool = False  # feed the question line token by token as decode steps (Quest's protocol)


def build_prompt(n_filler_chars: int, depth: float, key: int) -> str:
    filler = " ".join([FILLER] * (n_filler_chars // len(FILLER) + 2))
    n_prefix = int(n_filler_chars * depth)
    lines = [TASK_LINE, filler[:n_prefix], KEY_LINE.format(key=key), filler[: n_filler_chars - n_prefix], QUESTION]
    return "\n".join(lines)


def filler_chars_for(tokenizer, n_tokens: int) -> int:
    """The largest filler size (in characters, to a few characters) whose prompt fits in ``n_tokens`` tokens."""

    def count(chars: int) -> int:
        return len(tokenizer(build_prompt(chars, 0.5, 12345))["input_ids"])

    overhead = count(0)
    if overhead >= n_tokens:
        raise ConfigError(f"passkey length {n_tokens} is shorter than the prompt's fixed text ({overhead} tokens with "
                          f"this tokenizer): raise task.lengths")
    chars = (n_tokens - overhead) * 4
    for _ in range(4):  # fixed-point on the tokens-per-character ratio
        chars = max(1, int(chars * (n_tokens - overhead) / max(1, count(chars) - overhead)))
    while count(chars) > n_tokens:
        chars -= max(1, chars // 1000)
    return chars


@TASKS.register("passkey")
class Passkey(Task):
    config_class = PasskeyConfig

    def check(self) -> None:
        if not self.config.lengths or min(self.config.lengths) <= 0:
            raise ConfigError("task.lengths must be a non-empty list of positive token counts")
        if self.config.num_depths <= 0:
            raise ConfigError("task.num_depths must be positive")
        if self.config.limit is not None and self.config.limit < 1:
            raise ConfigError(f"task.limit must be at least 1 (or null for every sample), not {self.config.limit}")
        if self.config.extra_new_tokens < 0:
            raise ConfigError(f"task.extra_new_tokens must be >= 0, not {self.config.extra_new_tokens}")

    def check_max_length(self, max_length: int) -> None:
        too_long = [length for length in self.config.lengths if length > max_length]
        if too_long:
            raise ConfigError(
                f"passkey length {max(too_long)} exceeds the model's max_length {max_length}: lower task.lengths "
                f"(or raise model.max_length if the model takes longer prompts)"
            )

    def samples(self, context: PromptContext) -> Iterator[Sample]:
        tokenizer = context.tokenizer
        rng = np.random.RandomState(self.config.seed)
        count = 0
        for length in self.config.lengths:
            chars = filler_chars_for(tokenizer, length)
            for i in range(self.config.num_depths):
                key = int(rng.randint(1, 50000))
                if self.config.limit is not None and count >= self.config.limit:
                    return
                count += 1
                depth = i / self.config.num_depths
                answer_ids = tokenizer.encode(str(key), add_special_tokens=False)
                input_ids = tokenizer(build_prompt(chars, depth, key))["input_ids"]
                suffix_ids: list[int] = []
                if self.config.decode_question:
                    n_question = len(tokenizer.encode("\n" + QUESTION, add_special_tokens=False))
                    input_ids, suffix_ids = input_ids[:-n_question], input_ids[-n_question:]
                yield Sample(
                    sample_id=f"len{length}-depth{i:02d}",
                    input_ids=input_ids,
                    suffix_ids=suffix_ids,
                    max_new_tokens=len(answer_ids) + self.config.extra_new_tokens,
                    answers=[str(key)],
                    meta={"length": length, "depth": depth, "answer_ids": answer_ids,
                          "prompt_tokens": len(input_ids) + len(suffix_ids)},
                )

    def score(self, sample: Sample, prediction: str, output_ids: list[int]) -> dict[str, float]:
        answer_ids = sample.meta["answer_ids"]
        exact = float(list(output_ids[-len(answer_ids) :]) == list(answer_ids))
        numbers = re.findall(r"\d+", prediction)
        first_integer = float(bool(numbers) and numbers[0] == sample.answers[0])
        return {"score": exact, "first_integer": first_integer}

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        out = super().aggregate(records)
        by_length: dict[int, list[float]] = {}
        for record in records:
            by_length.setdefault(record["meta"]["length"], []).append(record["score"])
        out["by_length"] = {str(k): round(100 * statistics.fmean(v), 2) for k, v in sorted(by_length.items())}
        out["n_by_length"] = {str(k): len(v) for k, v in sorted(by_length.items())}
        if records:
            out["first_integer"] = round(100 * statistics.fmean(r["first_integer"] for r in records), 2)
        return out
