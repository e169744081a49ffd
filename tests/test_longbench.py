"""LongBench task: prompts, truncation, chat rules, data sources, samsum's special case, aggregation.

Fixtures are hand-written rows in the official JSONL layout (tests/fixtures/longbench/); the tokenizer is the
offline byte tokenizer (one token per byte), optionally with a BOS post-processor.
"""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from tokenizers.processors import TemplateProcessing

from eval.tasks import longbench
from eval.tasks.base import PromptContext, build_task
from eval.tasks.chat import LLAMA3_SYSTEM_PROMPT, encode_prompt, wrap_chat
from eval.tasks.longbench import (
    LONGBENCH_DATASETS,
    LONGBENCH_E_DATASETS,
    aggregate_longbench,
    build_input_ids,
    length_bucket,
    official_prompt,
    truncate_middle,
)
from icecache.core.models import byte_tokenizer
from icecache.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
# A tiny chat template that shows every part it was given (system, user, the thinking switch, generation prompt).
TEST_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def bos_tokenizer():
    """The byte tokenizer, but adding BOS like Llama tokenizers do, with a chat template."""
    tokenizer = byte_tokenizer()
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = TEST_CHAT_TEMPLATE
    return tokenizer


def local_task(**settings):
    values = {"name": "longbench", "source": "local", "data_dir": str(FIXTURES), **settings}
    return build_task(values)


def decoded(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


# --- truncation ----------------------------------------------------------------------------------------------------


def test_truncation_keeps_first_and_last_halves():
    tokenizer = byte_tokenizer()  # no BOS: token i is character i
    prompt = string.ascii_letters * 2  # 104 characters = 104 tokens
    # max_length 20 -> half 10: the first 10 and the last 10 characters.
    assert truncate_middle(prompt, tokenizer, 20) == prompt[:10] + prompt[-10:]
    # odd budgets round down: int(21 / 2) = 10.
    assert truncate_middle(prompt, tokenizer, 21) == prompt[:10] + prompt[-10:]


def test_truncation_counts_bos_in_the_first_half_and_drops_it():
    tokenizer = bos_tokenizer()  # BOS + 104 characters = 105 tokens
    prompt = string.ascii_letters * 2
    # first 10 ids = BOS + 9 characters, decoded without special tokens -> prompt[:9]; last 10 -> prompt[-10:].
    assert truncate_middle(prompt, tokenizer, 20) == prompt[:9] + prompt[-10:]


def test_no_truncation_within_budget():
    tokenizer = bos_tokenizer()
    assert truncate_middle("short prompt", tokenizer, 13) == "short prompt"  # 1 + 12 tokens fit in 13


# --- prompts per dataset ------------------------------------------------------------------------------------------

EXPECTED_PROMPTS = {
    # Appendix A templates filled in by hand with the fixture rows.
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "Question: Who wrote Hamlet?\nType: Human\nQuestion: How far is the Moon?\nType: Numeric value\n"
        "Question: Where is the Louvre?\nType:"
    ),
    "lcc": "Please complete the code given below. \ndef add(a, b):\n    total = a + b\nNext line of code:\n",
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n悬崖上的旧灯塔属于玛拉。\n\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：灯塔属于谁？\n回答："
    ),
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Story: The old lighthouse on the cliff belonged to Mara, who repaired its lamp every winter.\n\n"
        "Now, answer the question based on the story asconcisely as you can, using a single phrase if possible. "
        "Do not provide any explanation.\n\nQuestion: Who owns the lighthouse?\n\nAnswer:"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n"
        "Paragraph 1: Rivers flow.\n\nParagraph 2: Rivers flow.\n\nParagraph 3: Hills rise.\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format should "
        "only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
}


@pytest.mark.parametrize("dataset", sorted(EXPECTED_PROMPTS))
def test_prompt_of_each_fixture_dataset(dataset):
    tokenizer = byte_tokenizer()
    task = local_task(datasets=[dataset], limit=1)
    (sample,) = task.samples(PromptContext(tokenizer=tokenizer, chat_template="none", max_length=100_000))
    assert decoded(tokenizer, sample.input_ids) == EXPECTED_PROMPTS[dataset]


@pytest.mark.parametrize("dataset", LONGBENCH_DATASETS)
def test_chat_template_is_skipped_exactly_on_the_few_shot_and_code_sets(dataset):
    tokenizer = byte_tokenizer()
    row = {"context": "C", "input": "I"}
    context = PromptContext(tokenizer=tokenizer, chat_template="mistral", max_length=100_000)
    text = decoded(tokenizer, build_input_ids(official_prompt(dataset, row), dataset, context))
    skips = dataset in {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}  # pred.py's list
    assert text.startswith("[INST]") != skips
    assert text.endswith("[/INST]") != skips


def test_truncation_happens_before_the_chat_template():
    tokenizer = byte_tokenizer()
    context = PromptContext(tokenizer=tokenizer, chat_template="mistral", max_length=40)
    row = {"context": "x" * 500, "input": "What?"}
    text = decoded(tokenizer, build_input_ids(official_prompt("hotpotqa", row), "hotpotqa", context))
    prompt = official_prompt("hotpotqa", row)
    # the 40-token budget applies to the raw prompt (20 + 20 characters); the chat wrapper comes on top.
    assert text == "[INST]" + prompt[:20] + prompt[-20:] + "[/INST]"


# --- chat rules --------------------------------------------------------------------------------------------------


def test_chat_rules_per_family():
    tokenizer = bos_tokenizer()
    assert wrap_chat("P", tokenizer, "none") == "P"
    assert wrap_chat("P", tokenizer, "mistral") == "[INST]P[/INST]"
    assert wrap_chat("P", tokenizer, "llama3") == (
        f"<s><system>{LLAMA3_SYSTEM_PROMPT}</system><user>P</user><assistant>"
    )
    assert wrap_chat("P", tokenizer, "qwen") == "<s><user>P</user><no-think><assistant>"
    assert wrap_chat("P", tokenizer, "plain") == "<s><user>P</user><assistant>"
    with pytest.raises(ConfigError, match="unknown chat_template"):
        wrap_chat("P", tokenizer, "vicuna")


def test_chat_template_needs_a_tokenizer_template():
    with pytest.raises(ConfigError, match="chat template, and this one has none"):
        wrap_chat("P", byte_tokenizer(), "plain")


def test_encode_prompt_does_not_double_a_bos_written_by_the_template():
    tokenizer = bos_tokenizer()
    bos = tokenizer.bos_token_id
    assert encode_prompt("<s><user>P</user>", tokenizer).count(bos) == 1
    assert encode_prompt("[INST]P[/INST]", tokenizer)[0] == bos  # default special tokens otherwise


# --- samples from local files ------------------------------------------------------------------------------------


def test_samples_carry_meta_lengths_and_stable_ids():
    tokenizer = byte_tokenizer()
    task = local_task(datasets=["narrativeqa", "trec"])
    samples = list(task.samples(PromptContext(tokenizer=tokenizer, max_length=100_000)))
    assert [s.sample_id for s in samples] == ["narrativeqa/0", "narrativeqa/1", "narrativeqa/2", "trec/0", "trec/1"]
    assert [s.max_new_tokens for s in samples] == [128, 128, 128, 64, 64]  # dataset2maxlen
    first, trec = samples[0], samples[3]
    assert first.meta == {"dataset": "narrativeqa", "variant": "v1", "length": 15, "all_classes": None,
                          "_id": "nqa-fixture-0", "max_length": 100_000}  # fmt: skip
    assert first.answers == ["Mara", "Mara the keeper"]
    assert trec.meta["all_classes"][4] == "Location"
    assert first.eos_token_ids is None and first.min_new_tokens == 0


def test_prompt_budget_is_the_icecache_scripts_model2maxlen_for_the_models_they_list():
    import yaml

    configs = Path(__file__).parents[1] / "configs" / "model"
    names = {yaml.safe_load(path.read_text())["name"]: path.stem for path in configs.glob("*.yaml")}
    assert set(longbench.REFERENCE_MAX_LENGTH) <= set(names)  # the table names harness models
    model_max = {"llama-3.1-8b-instruct": 131072, "mistral-7b-instruct-v0.2": 32768, "qwen3-4b-instruct-2507": 262144}
    # model2maxlen.json of the IceCache scripts: llama-3.1 131072, mistral-7b-inst 32768, qwen3 32760
    budgets = {name: longbench.prompt_budget(PromptContext(tokenizer=None, model_name=name, max_length=maximum))
               for name, maximum in model_max.items()}
    assert budgets == {"llama-3.1-8b-instruct": 131072, "mistral-7b-instruct-v0.2": 32768,
                       "qwen3-4b-instruct-2507": 32760}  # fmt: skip
    unlisted = PromptContext(tokenizer=None, model_name="smollm2-135m", max_length=8000)
    assert longbench.prompt_budget(unlisted) == 8000
    capped = PromptContext(tokenizer=None, model_name="qwen3-4b-instruct-2507", max_length=16000)
    assert longbench.prompt_budget(capped) == 16000 and longbench.prompt_budget(capped, 900) == 900


def local_task_with_rows(row, **settings):
    task = local_task(datasets=["narrativeqa"], **settings)
    task._rows["narrativeqa"] = [row]
    return task


def test_samples_are_truncated_to_the_references_budget_and_record_it():
    row = {"context": "x" * 40_000, "input": "Who?", "answers": ["a"], "length": 1, "all_classes": None}
    context = PromptContext(tokenizer=byte_tokenizer(), model_name="qwen3-4b-instruct-2507", max_length=262_144)
    (sample,) = local_task_with_rows(row).samples(context)
    assert len(sample.input_ids) == 32760 and sample.meta["max_length"] == 32760  # one byte a token, no template
    (sample,) = local_task_with_rows(row, max_length=1000).samples(context)
    assert len(sample.input_ids) == 1000 and sample.meta["max_length"] == 1000
    with pytest.raises(ConfigError, match="task.max_length 300000 exceeds the model's max_length 262144"):
        local_task(datasets=["narrativeqa"], max_length=300_000).check_max_length(262_144)


def test_limit_applies_per_dataset():
    task = local_task(datasets=["narrativeqa", "trec"], limit=1)
    ids = [s.sample_id for s in task.samples(PromptContext(tokenizer=byte_tokenizer(), max_length=10_000))]
    assert ids == ["narrativeqa/0", "trec/0"]


def test_samsum_forces_one_token_and_stops_on_newline():
    tokenizer = byte_tokenizer()
    task = local_task(datasets=["samsum"])
    (sample,) = task.samples(PromptContext(tokenizer=tokenizer, max_length=10_000))
    newline_id = tokenizer.encode("\n", add_special_tokens=False)[-1]
    assert sample.min_new_tokens == 1
    assert sample.eos_token_ids == [tokenizer.eos_token_id, newline_id]
    assert sample.max_new_tokens == 128


def test_score_uses_the_dataset_metric_and_first_line_cut():
    task = local_task(datasets=["trec"], limit=1)
    (sample,) = task.samples(PromptContext(tokenizer=byte_tokenizer(), max_length=10_000))
    # first line "Location" names one class, the right one -> 1; without the cut "Human" would count too -> 1/2.
    assert task.score(sample, "Location\nQuestion: Who? Type: Human", [])["score"] == 1.0


def test_default_datasets_are_the_sixteen_icecache_sets():
    task = longbench.LongBench(longbench.LongBenchConfig())
    assert len(task.datasets) == 16
    assert not set(task.datasets) & {"multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"}
    task_e = longbench.LongBench(longbench.LongBenchConfig(variant="e"))
    assert task_e.datasets == list(LONGBENCH_E_DATASETS) and len(task_e.datasets) == 13


def test_missing_local_file_says_where_to_put_it(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.zip") as error:
        local_task(datasets=["qmsum"], data_dir=str(tmp_path))
    assert str(tmp_path / "qmsum.jsonl") in str(error.value)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"datasets": ["not_a_set"]}, "no dataset not_a_set"),
        ({"datasets": ["narrativeqa"], "variant": "e"}, "no dataset narrativeqa"),  # not a LongBench-E set
        ({"variant": "v3"}, "variant"),
        ({"source": "ftp"}, "source"),
        ({"datasets": []}, "empty"),
    ],
)
def test_bad_settings_are_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        local_task(**settings)


def test_unknown_setting_is_a_config_error():
    with pytest.raises(ConfigError, match="no setting"):
        local_task(dataset="trec")


# --- the hub mirror ------------------------------------------------------------------------------------------------

# Rows as the Xnhyacinth/LongBench mirror stores them (NVIDIA kvpress create_huggingface_dataset.py): the template
# head with the context filled in, the question part, and the answer prefix, written out by hand for three sets.
MIRROR_ROWS = {
    "trec": {
        "context": "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "Question: Who wrote Hamlet?\nType: Human\nQuestion: How far is the Moon?\nType: Numeric value\n",
        "question": "Question: Where is the Louvre?\n",  # input without its "Type:" suffix
        "answer_prefix": "Type:",
    },
    "lcc": {
        "context": "Please complete the code given below. \ndef add(a, b):\n    total = a + b\n",
        "question": "",
        "answer_prefix": "Next line of code:\n",
    },
    "narrativeqa": {
        "context": EXPECTED_PROMPTS["narrativeqa"].split("Question: ")[0],
        "question": "Question: Who owns the lighthouse?\n\n",
        "answer_prefix": "Answer:",
    },
}


@pytest.mark.parametrize("dataset", sorted(MIRROR_ROWS))
def test_mirror_rows_rebuild_the_official_prompt(dataset):
    # context + question + answer_prefix == the official template filled with the same fixture row
    assert official_prompt(dataset, MIRROR_ROWS[dataset]) == EXPECTED_PROMPTS[dataset]
    official_row = longbench.read_jsonl(FIXTURES / f"{dataset}.jsonl")[0]
    assert official_prompt(dataset, official_row) == EXPECTED_PROMPTS[dataset]


def test_hub_source_loads_the_dataset_folder(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(repo, data_dir=None, split=None):
        calls.append((repo, data_dir, split))
        row = dict(MIRROR_ROWS["trec"], answers=["Location"], length=20, all_classes=["Human", "Location"],
                   _id="x", dataset="trec", language="en")  # fmt: skip
        return [row]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = build_task({"name": "longbench", "datasets": ["trec"], "source": "hub"})
    (sample,) = task.samples(PromptContext(tokenizer=byte_tokenizer(), max_length=10_000))
    assert calls == [("Xnhyacinth/LongBench", "trec", "test")]
    assert byte_tokenizer().decode(sample.input_ids) == EXPECTED_PROMPTS["trec"]
    assert sample.meta["all_classes"] == ["Human", "Location"]

    calls.clear()
    build_task({"name": "longbench", "datasets": ["trec"], "variant": "e", "source": "hub"})
    assert calls == [("Xnhyacinth/LongBench", "trec_e", "test")]


def test_hub_failure_is_a_config_error_with_the_local_alternative(monkeypatch):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(ConfigError, match="task.source=local"):
        build_task({"name": "longbench", "datasets": ["qasper"], "source": "hub", "offline": True})


def test_offline_mode_switches_the_hub_libraries_offline_and_back(monkeypatch):
    import datasets
    import huggingface_hub.constants

    seen = []
    row = {"context": "c", "question": "q", "answer_prefix": "", "answers": ["a"], "length": 1}
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: seen.append(datasets.config.HF_HUB_OFFLINE) or [row])
    before = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    build_task({"name": "longbench", "datasets": ["qasper"], "source": "hub", "offline": True})
    assert seen == [True]
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == before


# --- aggregation -------------------------------------------------------------------------------------------------


def record(dataset, score, length=100):
    return {"score": score, "meta": {"dataset": dataset, "length": length}}


def test_dataset_category_and_average_scores():
    records = [record("narrativeqa", 1.0), record("narrativeqa", 0.0), record("qasper", 1.0), record("qasper", 1.0),
               record("trec", 0.5), record("lcc", 0.2)]  # fmt: skip
    result = aggregate_longbench(records)
    # per dataset: round(100 * mean, 2)
    assert result["datasets"] == {"narrativeqa": 50.0, "qasper": 100.0, "trec": 50.0, "lcc": 20.0}
    # categories: Single-Doc QA (50 + 100)/2 = 75, Few-shot 50, Code 20
    assert result["categories"] == {"Single-Doc QA": 75.0, "Few-shot Learning": 50.0, "Code": 20.0}
    # leaderboard Avg = mean of category means = 145/3 = 48.33; IceCache Avg = (50 + 100 + 50 + 20)/4 = 55
    assert result["official_average"] == 48.33
    assert result["paper_average"] == result["score"] == 55.0
    assert result["n"] == 6 and result["n_per_dataset"]["narrativeqa"] == 2
    assert "buckets" not in result


def test_length_buckets():
    assert [length_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 20000)] == [
        "0-4k", "0-4k", "4-8k", "4-8k", "8k+", "8k+"]  # fmt: skip


def test_longbench_e_bucket_aggregation():
    records = [record("qasper", 1.0, 3999), record("qasper", 0.0, 4000), record("qasper", 1.0, 7999),
               record("qasper", 0.5, 8000), record("trec", 1.0, 100)]  # fmt: skip
    result = aggregate_longbench(records, with_buckets=True)
    # qasper: 0-4k [1] -> 100; 4-8k [0, 1] -> 50; 8k+ [0.5] -> 50. trec: only 0-4k; empty buckets are None.
    assert result["buckets"] == {
        "qasper": {"0-4k": 100.0, "4-8k": 50.0, "8k+": 50.0},
        "trec": {"0-4k": 100.0, "4-8k": None, "8k+": None},
    }
    # average over the datasets that have the bucket: 0-4k (100 + 100)/2; the others qasper's alone.
    assert result["bucket_average"] == {"0-4k": 100.0, "4-8k": 50.0, "8k+": 50.0}
    assert result["datasets"]["qasper"] == 62.5  # all lengths: mean(1, 0, 1, 0.5) = 0.625


def test_longbench_e_end_to_end_from_fixture_files():
    tokenizer = byte_tokenizer()
    task = local_task(datasets=["qasper"], variant="e")
    samples = list(task.samples(PromptContext(tokenizer=tokenizer, max_length=10_000)))
    assert [s.sample_id for s in samples] == ["qasper_e/0", "qasper_e/1", "qasper_e/2"]
    predictions = ["Penn Treebank", "no", "six"]  # right, wrong, right (second ground truth)
    records = [{"score": task.score(s, p, [])["score"], "meta": s.meta} for s, p in zip(samples, predictions)]
    result = task.aggregate(records)
    assert result["buckets"]["qasper"] == {"0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}


# --- the hub path on a local folder laid out as the hub mirror ------------------------------------------------------

# How the parquet mirror splits each official prompt (its build script: the template head with the context filled in
# becomes `context`, the question part `question`, the answer cue `answer_prefix`; for trec, triviaqa and samsum the
# cue is cut off the end of `input`). Per fixture set: (question part of the template, answer cue, cue cut off input).
MIRROR_SPLIT = {
    "narrativeqa": ("Question: {input}\n\n", "Answer:", False),
    "qasper": ("Question: {input}\n\n", "Answer:", False),
    "multifieldqa_zh": ("问题：{input}\n", "回答：", False),
    "passage_count": (
        "Please enter the final count of unique paragraphs after removing duplicates. The output format should only "
        "contain the number, such as 1, 2, 3, and so on.\n\n", "The final answer is: ", False,
    ),
    "trec": ("{input}", "Type:", True),
    "samsum": ("{input}", "Summary:", True),
    "lcc": ("", "Next line of code:\n", False),
}
FIXTURE_STEMS = sorted(path.stem for path in FIXTURES.glob("*.jsonl"))
# The samsum fixture's input ends in "Summary: " (a space after the cue): the mirror's recipe cuts only a bare
# "Summary:", so it keeps the cue in `question` and adds it again as `answer_prefix`.
SAMSUM_CUE_REPEATED = pytest.mark.xfail(
    strict=True, reason="the mirror's recipe repeats the samsum cue when a space follows it in input"
)


def mirror_row(dataset: str, row: dict) -> dict:
    """One official row as the mirror stores it: the official columns with ``input`` split into the three parts."""
    question_part, answer_cue, cue_in_input = MIRROR_SPLIT[dataset]
    template = longbench.prompt_templates()[dataset]
    tail = question_part if cue_in_input else question_part + answer_cue
    assert template.endswith(tail), f"the mirror's split does not match the {dataset} template"
    head = template[: len(template) - len(tail)]
    question_input = row["input"].removesuffix(answer_cue) if cue_in_input else row["input"]
    mirrored = {key: value for key, value in row.items() if key != "input"}
    mirrored.update(
        context=head.format(context=row["context"]),
        question=question_part.format(input=question_input) if cue_in_input else question_part.format(**row),
        answer_prefix=answer_cue,
        task=dataset,
        max_new_tokens=longbench.max_new_tokens_per_dataset()[dataset] + 20,
    )
    return mirrored


def write_hub_mirror(
    root: Path, stems: list[str], official_columns: bool = False, rows_of: dict[str, list[dict]] | None = None
) -> Path:
    """A folder laid out as the hub mirror after ``push_to_hub(config_name=<stem>, split="test")``: one parquet file
    per configuration under ``<stem>/``, and a README whose YAML lists the configurations. ``official_columns``
    keeps the rows as THUDM's files have them (input, context, answers, length, dataset, language, all_classes, _id).
    Rows come from the fixture file of each stem, or from ``rows_of[stem]``.
    """
    import pandas as pd

    card = ["---", "configs:"]
    for stem in stems:
        dataset = stem.removesuffix("_e")
        rows = (rows_of or {}).get(stem) or longbench.read_jsonl(FIXTURES / f"{stem}.jsonl")
        table = pd.DataFrame(rows if official_columns else [mirror_row(dataset, row) for row in rows])
        (root / stem).mkdir(parents=True)
        table.to_parquet(root / stem / "test-00000-of-00001.parquet", index=False)
        card += [f"- config_name: {stem}", "  data_files:", "  - split: test", f"    path: {stem}/test-*"]
    (root / "README.md").write_text("\n".join([*card, "---", ""]), encoding="utf-8")
    return root


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    """``datasets`` keeps its prepared Arrow copies under tmp_path instead of the user's cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def hub_and_local_samples(mirror: Path, stem: str, **settings) -> tuple[list, list]:
    dataset, variant = (stem.removesuffix("_e"), "e") if stem.endswith("_e") else (stem, "v1")
    values = {"name": "longbench", "datasets": [dataset], "variant": variant, **settings}
    context = PromptContext(tokenizer=bos_tokenizer(), max_length=100_000)
    hub = build_task({**values, "source": "hub", "hub_repo": str(mirror)})
    local = build_task({**values, "source": "local", "data_dir": str(FIXTURES)})
    return list(hub.samples(context)), list(local.samples(context))


@pytest.mark.parametrize(
    ("stem", "official_columns"),
    [pytest.param(stem, False, id=f"{stem}-mirror-columns", marks=[SAMSUM_CUE_REPEATED] if stem == "samsum" else [])
     for stem in FIXTURE_STEMS] + [pytest.param(stem, True, id=f"{stem}-official-columns") for stem in FIXTURE_STEMS],
)
def test_hub_path_on_a_mirror_folder_gives_the_local_paths_prompts(tmp_path, datasets_cache, stem, official_columns):
    # The same load_dataset(hub_repo, data_dir=<stem>, split="test") the hub path makes, on parquet files in the
    # mirror's layout, with the official JSONL fixtures beside it: the same ids, prompts, answers and meta per row.
    mirror = write_hub_mirror(tmp_path / "LongBench", [stem], official_columns)
    hub_samples, local_samples = hub_and_local_samples(mirror, stem, offline=True)
    assert len(hub_samples) == len(local_samples) >= 1
    for hub_sample, local_sample in zip(hub_samples, local_samples):
        assert hub_sample.sample_id == local_sample.sample_id
        assert hub_sample.input_ids == local_sample.input_ids
        assert (hub_sample.answers, hub_sample.meta) == (local_sample.answers, local_sample.meta)
        assert (hub_sample.max_new_tokens, hub_sample.eos_token_ids) == (
            local_sample.max_new_tokens, local_sample.eos_token_ids)  # fmt: skip


def test_hub_mirror_folder_serves_longbench_and_longbench_e_side_by_side(tmp_path, datasets_cache):
    # One mirror holds both `qasper` (v1) and `qasper_e`: the variant picks the folder, never the other one.
    v1_row = dict(longbench.read_jsonl(FIXTURES / "qasper_e.jsonl")[0], _id="qasper-v1-row")
    mirror = write_hub_mirror(tmp_path / "LongBench", ["qasper", "qasper_e"], rows_of={"qasper": [v1_row]})
    context = PromptContext(tokenizer=byte_tokenizer(), max_length=100_000)
    settings = {"name": "longbench", "datasets": ["qasper"], "source": "hub", "hub_repo": str(mirror)}
    v1 = list(build_task(settings).samples(context))
    e_task = build_task({**settings, "variant": "e"})
    e = list(e_task.samples(context))
    assert [s.meta["_id"] for s in v1] == ["qasper-v1-row"]
    assert [s.sample_id for s in e] == ["qasper_e/0", "qasper_e/1", "qasper_e/2"]
    records = [{"score": 1.0, "meta": s.meta} for s in e]
    assert e_task.aggregate(records)["n_per_bucket"]["qasper"] == {"0-4k": 1, "4-8k": 1, "8k+": 1}


def test_hub_mirror_folder_without_the_set_is_one_config_error(tmp_path, datasets_cache):
    mirror = write_hub_mirror(tmp_path / "LongBench", ["trec"])
    with pytest.raises(ConfigError, match="could not load LongBench 'lcc'.*task.source=local"):
        build_task({"name": "longbench", "datasets": ["lcc"], "source": "hub", "hub_repo": str(mirror)})
