"""RULER's aggregation family: common words extraction (``cwe``: the 10 words of a numbered list that appear most
often) and frequent words extraction (``fwe``: the three most frequent coded words, Zipf-distributed)."""

from __future__ import annotations

import math
import random
import string
from functools import lru_cache

import numpy as np

from icecache.errors import ConfigError

from .common import Prompt, Streams, Wrap, wonderwords_list

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
CWE_COMMON, FWE_ALPHA, FWE_WORD_LENGTH = 10, 2.0, 6


@lru_cache(maxsize=None)
def common_words(seed: int) -> list[str]:
    """CWE words: nouns, adjectives and verbs, deduplicated, sorted, then shuffled once with ``seed``."""
    lists = ("nounlist.txt", "adjectivelist.txt", "verblist.txt")
    words = sorted(set(word for name in lists for word in wonderwords_list(name)))
    random.Random(seed).shuffle(words)
    return words


# ---------------------------------------------------------------------------------------------------------------
# Sources


def _numbered(words: list[str]) -> str:
    return " ".join(f"{index + 1}. {word}" for index, word in enumerate(words))


def _word_list(streams: Streams, pool: list[str], num_words: int, common_repeats: int, uncommon_repeats: int):
    if num_words > len(pool):
        raise ConfigError(
            f"ruler cwe needs {num_words} distinct words at this length (in a probe of RULER's size search, which "
            f"tries up to twice the words that fill it), more than the {len(pool)} of the wonderwords lists (RULER "
            f"then draws from its english_words.json, which the harness does not have, and its draws go another "
            f"way from there); use a shorter length for cwe"
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
