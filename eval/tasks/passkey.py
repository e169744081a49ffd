"""Passkey retrieval, as the ArkVale and IceCache benchmark scripts run it (``benchmark/passkey_pred.py`` of
pku-liang/ArkVale at 0c3b45e and of yuzhenmao/IceCache at 63db4c1, the same prompt code in both).

A pass key sentence, "The pass key is N. Remember it. N is the pass key.", is hidden at depth ``i / num_depths``
(``num_depths`` 20 samples per length) in repeated filler text ("The grass is green. The sky is blue. ..."); the
model must continue "What is the pass key? The pass key is" with the key. The prompt is the four lines task, filler
prefix, key sentence, filler suffix (both filler parts cut from the start of one long filler string), joined by
newlines, with the question appended straight onto the suffix, no newline between: the scripts' layout.

Length (``lengths``, default 4096): the scripts fix the filler in characters, 38000 / 76000 / 114000 for their
10k / 20k / 30k contexts, a ratio of 3.8 characters per token; ``calibration: reference`` uses that ratio,
``round(3.8 * length)`` filler characters (``task.lengths=[10000]`` is their 38000), so the prompt's token count is
whatever the model's tokenizer makes of it (recorded as ``meta.prompt_tokens``; a prompt over the model's
``max_length`` is refused before the weights load). ``calibration: tokens`` instead fits the filler so that the
prompt has at most ``length`` tokens of the run's tokenizer.

Keys come from ``numpy.random.RandomState(seed).randint(1, 50000)`` drawn in sample order, as the scripts do with the
global NumPy seed 42. Generation is greedy for ``len(answer_ids) + extra_new_tokens`` tokens (1, IceCache's setting;
ArkVale's is 0). A sample is correct iff the last ``len(answer_ids)`` generated ids equal the key's ids, its
tokenisation without special tokens (the scripts drop the first id, which is the BOS of their tokenizers);
A sample that stopped on a stop id (an EOS) before its ``max_new_tokens`` scores 0: the scripts compare
``output[-K:]``, the last K ids of the output with the EOS the model stopped on, so that window holds the EOS and
never equals the key (the generator drops the stop id, so this is decided from the number of ids). Such runs follow
``reference`` ``PASSKEY_REFERENCE``; runs before it kept the stop id out and recorded no ``reference``.
``first_integer``, whether the first number in the text is the key, is reported beside it. The score is the mean
in percent, also per length.

``decode_question`` is the scripts' question-as-decode mode (``--use-3-stages-gen``, Quest's protocol): the question
is tokenised on its own with the tokenizer's default special tokens (a BOS for Llama) and fed token by token as decode
steps after the prompt without it, so the selection sees the question's queries.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from icecache.errors import ConfigError

from .base import TASKS, PromptContext, Sample, Task, TaskConfig

TASK_LINE = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_LINE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
CHARS_PER_TOKEN = 3.8  # the scripts' filler characters per context token (38000 for 10k)
CALIBRATIONS = ("reference", "tokens")
# The scripts followed, and the scoring version: "+stop-id" since a stop id ends in the compared window, as there.
PASSKEY_REFERENCE = "yuzhenmao/IceCache@63db4c1+stop-id"


@dataclass
class PasskeyConfig(TaskConfig):
    name: str = "passkey"
    reference: str = PASSKEY_REFERENCE  # the scripts' protocol followed (recorded in every run's config)
    lengths: list[int] = field(default_factory=lambda: [4096])  # context length in tokens (see calibration)
    calibration: str = "reference"  # reference: round(3.8 * length) filler characters; tokens: at most length tokens
    num_depths: int = 20  # depths i / num_depths for i = 0 .. num_depths-1, one sample each per length
    extra_new_tokens: int = 1  # IceCache generates len(answer_ids) + 1 tokens; ArkVale uses 0
    decode_question: bool = False  # feed the question, tokenised alone, token by token as decode steps


def prompt_body(n_filler_chars: int, depth: float, key: int) -> str:
    """The four lines before the question: task, filler prefix, key sentence, filler suffix."""
    filler = " ".join([FILLER] * (n_filler_chars // len(FILLER) + 2))
    n_prefix = int(n_filler_chars * depth)
    lines = [TASK_LINE, filler[:n_prefix], KEY_LINE.format(key=key), filler[: n_filler_chars - n_prefix]]
    return "\n".join(lines)


def build_prompt(n_filler_chars: int, depth: float, key: int) -> str:
    return prompt_body(n_filler_chars, depth, key) + QUESTION


def tokenise(tokenizer, n_filler_chars: int, depth: float, key: int, decode_question: bool):
    """(prompt ids, decode-step ids): the whole prompt at once, or the body and the question tokenised apart."""
    if decode_question:
        body = tokenizer(prompt_body(n_filler_chars, depth, key))["input_ids"]
        return list(body), list(tokenizer(QUESTION)["input_ids"])
    return list(tokenizer(build_prompt(n_filler_chars, depth, key))["input_ids"]), []


def prompt_tokens(tokenizer, n_filler_chars: int, decode_question: bool) -> int:
    input_ids, suffix_ids = tokenise(tokenizer, n_filler_chars, 0.5, 12345, decode_question)
    return len(input_ids) + len(suffix_ids)


def filler_chars_for(tokenizer, n_tokens: int, decode_question: bool = False) -> int:
    """The largest filler size (in characters, to a few characters) whose prompt fits in ``n_tokens`` tokens."""

    def count(chars: int) -> int:
        return prompt_tokens(tokenizer, chars, decode_question)

    overhead = count(0)
    chars = (n_tokens - overhead) * 4
    for _ in range(4):  # fixed-point on the tokens-per-character ratio
        chars = max(1, int(chars * (n_tokens - overhead) / max(1, count(chars) - overhead)))
    while count(chars) > n_tokens:
        chars -= max(1, chars // 1000)
    return chars


@TASKS.register("passkey")
class Passkey(Task):
    config_class = PasskeyConfig
    has_lengths = True
    coordinates = ("lengths",)

    def check(self) -> None:
        if self.config.reference != PASSKEY_REFERENCE:
            raise ConfigError(f"passkey follows {PASSKEY_REFERENCE} only; task.reference={self.config.reference!r} "
                              f"asks for another version")
        if not self.config.lengths or min(self.config.lengths) <= 0:
            raise ConfigError("task.lengths must be a non-empty list of positive token counts")
        if self.config.calibration not in CALIBRATIONS:
            raise ConfigError(f"task.calibration must be one of {', '.join(CALIBRATIONS)}, not "
                              f"{self.config.calibration!r}")
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

    def filler_chars(self, tokenizer, length: int) -> int:
        overhead = prompt_tokens(tokenizer, 0, self.config.decode_question)
        if overhead >= length:
            raise ConfigError(f"passkey length {length} is shorter than the prompt's fixed text ({overhead} tokens "
                              f"with this tokenizer): raise task.lengths")
        if self.config.calibration == "tokens":
            return filler_chars_for(tokenizer, length, self.config.decode_question)
        return round(CHARS_PER_TOKEN * length)

    def samples(self, context: PromptContext) -> Iterator[Sample]:
        tokenizer, decode_question = context.tokenizer, self.config.decode_question
        rng = np.random.RandomState(self.config.seed)
        count = 0
        for length in self.config.lengths:
            chars = self.filler_chars(tokenizer, length)
            for i in range(self.config.num_depths):
                key = int(rng.randint(1, 50000))
                if self.config.limit is not None and count >= self.config.limit:
                    return
                count += 1
                depth = i / self.config.num_depths
                answer_ids = tokenizer.encode(str(key), add_special_tokens=False)
                input_ids, suffix_ids = tokenise(tokenizer, chars, depth, key, decode_question)
                max_new_tokens = len(answer_ids) + self.config.extra_new_tokens
                total = len(input_ids) + len(suffix_ids) + max_new_tokens
                if total > context.max_length:
                    raise ConfigError(
                        f"passkey length {length} makes a prompt of {len(input_ids) + len(suffix_ids)} tokens with "
                        f"this tokenizer ({chars} filler characters), over the model's max_length "
                        f"{context.max_length} with the answer: lower task.lengths or use task.calibration=tokens"
                    )
                yield Sample(
                    sample_id=f"len{length}-depth{i:02d}",
                    input_ids=input_ids,
                    suffix_ids=suffix_ids,
                    max_new_tokens=max_new_tokens,
                    answers=[str(key)],
                    meta={"length": length, "depth": depth, "answer_ids": answer_ids, "filler_chars": chars,
                          "prompt_tokens": len(input_ids) + len(suffix_ids)},
                )

    def score(self, sample: Sample, prediction: str, output_ids: list[int]) -> dict[str, float]:
        answer_ids = sample.meta["answer_ids"]
        stopped_on_stop_id = len(output_ids) < sample.max_new_tokens  # the scripts' window then holds the EOS
        exact = float(not stopped_on_stop_id and list(output_ids[-len(answer_ids) :]) == list(answer_ids))
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
