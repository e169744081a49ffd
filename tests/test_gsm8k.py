"""GSM8K: answer extraction edge cases, the 8-shot prompt, data sources."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eval.tasks import gsm8k
from eval.tasks.base import PromptContext, build_task
from eval.tasks.gsm8k import build_prompt, exemplars, extract_answer, is_correct
from icecache.core.models import byte_tokenizer
from icecache.errors import ConfigError

FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k" / "test.jsonl"


# --- extraction --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So she makes 9 * 2 = 18 dollars. The answer is 18.", 18.0),  # last number; the final "." is not a decimal
        ("The total is 1,234 apples. The answer is 1,234.", 1234.0),  # commas removed before matching
        ("Each costs 3.50, so 7.5 in all. The answer is 7.5", 7.5),  # decimals
        ("The answer is .5", 0.5),  # \d*\.?\d+ accepts a bare fraction
        ("It drops by -5 degrees. The answer is -5.", 5.0),  # no sign in the pattern, as in the reference
        ("The answer is 18.\nQuestion: If 99 more eggs ...", 18.0),  # cut at the next "\nQuestion: "
        ("I cannot tell.", None),  # no number
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "gold, expected",
    [
        ("Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\nShe makes 9 * 2 = $<<9*2=18>>18.\n#### 18", 18.0),
        ("Total 1,000 + 250 = <<1000+250=1250>>1,250\n#### 1,250", 1250.0),
        ("#### 2.5", 2.5),
    ],
)
def test_extract_answer_reads_the_number_after_hashes(gold, expected):
    assert extract_answer(gold) == expected


def test_is_correct_compares_floats():
    gold = "3 * 4 = <<3*4=12>>12\n#### 12"
    assert is_correct("3 boxes of 4 make 12.0 apples. The answer is 12.0", gold)  # 12.0 == 12
    assert not is_correct("The answer is 13.", gold)
    assert not is_correct("No idea.", gold)  # no number -> wrong
    # the model's follow-up question does not count: the answer before it (11) is wrong.
    assert not is_correct("The answer is 11.\nQuestion: What is 6 + 6? The answer is 12.", gold)


# --- prompt ------------------------------------------------------------------------------------------------------


def test_exemplars_are_eight_chain_of_thought_blocks():
    head = exemplars()
    blocks = head.strip().split("\n\n")
    assert len(blocks) == 8
    # Wei et al. 2022's GSM8K exemplar answers, in order.
    assert [extract_answer(block) for block in blocks] == [6, 5, 39, 8, 9, 29, 33, 8]
    for block in blocks:
        lines = block.split("\n")
        assert lines[0].startswith("Question: ") and lines[1] == "Let's think step by step"
        assert re.fullmatch(r"The answer is \d+\.", lines[-1])


def test_prompt_is_exemplars_then_question():
    assert build_prompt("How many?") == exemplars() + "\nQuestion: How many?\n"
    assert exemplars().endswith("The answer is 8.\n")  # so a blank line separates the last exemplar and the question


# --- task --------------------------------------------------------------------------------------------------------


def test_samples_from_a_local_file_ignore_the_chat_template():
    tokenizer = byte_tokenizer()
    task = build_task({"name": "gsm8k", "path": str(FIXTURE)})
    samples = list(task.samples(PromptContext(tokenizer=tokenizer, chat_template="mistral")))
    assert [s.sample_id for s in samples] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    first = samples[0]
    question = "Tom has 3 boxes with 4 apples each. How many apples does he have?"
    assert tokenizer.decode(first.input_ids) == build_prompt(question)  # no [INST] wrapper
    assert first.max_new_tokens == 256
    assert first.stop_strings == ["\nQuestion: "]
    assert task.score(first, "3 * 4 = 12. The answer is 12.\nQuestion: next", [])["score"] == 1.0
    assert task.score(samples[1], "The answer is 1,000.", [])["score"] == 1.0  # gold "#### 1,000"
    assert task.score(samples[2], "The answer is 2.", [])["score"] == 0.0  # gold 2.5


def test_limit():
    task = build_task({"name": "gsm8k", "path": str(FIXTURE), "limit": 2})
    assert len(list(task.samples(PromptContext(tokenizer=byte_tokenizer())))) == 2


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="ICECACHE_GSM8K"):
        build_task({"name": "gsm8k", "path": str(tmp_path / "absent.jsonl")})


def test_path_resolution(monkeypatch):
    monkeypatch.delenv("ICECACHE_GSM8K", raising=False)
    assert gsm8k.resolve_path(None) == Path.home() / ".cache" / "icecache-harness" / "gsm8k" / "test.jsonl"
    monkeypatch.setenv("ICECACHE_GSM8K", str(FIXTURE))
    assert gsm8k.resolve_path(None) == FIXTURE
    assert gsm8k.resolve_path("tests/fixtures/gsm8k/test.jsonl") == FIXTURE.resolve()  # relative to the repo root


def test_hub_source(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(repo, config, split=None):
        calls.append((repo, config, split))
        return [{"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = build_task({"name": "gsm8k", "source": "hub"})
    (sample,) = task.samples(PromptContext(tokenizer=byte_tokenizer()))
    assert calls == [("openai/gsm8k", "main", "test")]
    assert sample.answers == ["2 + 2 = 4\n#### 4"]


# --- the data a result records ------------------------------------------------------------------------------------


def test_a_run_records_the_file_it_read_and_a_changed_file_gets_another_sha256(tmp_path):
    import hashlib
    import json

    from eval.runner import run
    from tests.test_runner import TINY_RUN

    data = tmp_path / "test.jsonl"
    data.write_bytes(FIXTURE.read_bytes())
    task = build_task({"name": "gsm8k", "path": str(data), "limit": 2})
    record = task.data_record()
    assert record["path"] == str(data) and record["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert record["n_problems"] == 2

    values = json.loads(json.dumps(TINY_RUN))
    values["model"]["config"]["max_position_embeddings"] = 8192  # the 8-shot head is ~4k bytes
    values["model"]["max_length"] = 8192
    values.update(output_root=str(tmp_path / "runs"), task={"name": "gsm8k", "path": str(data), "limit": 1})
    from eval.config import RunConfig

    metrics = run(RunConfig.from_dict(values))
    assert metrics["data"]["sha256"] == record["sha256"] and metrics["data"]["n_problems"] == 1
    written = json.loads((RunConfig.from_dict(values).output_dir() / "metrics.json").read_text())
    assert written["data"] == metrics["data"]

    # One more problem at the end: the file's hash changes, the first problem's (what limit=1 scored) does not.
    data.write_text(data.read_text() + json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"}) + "\n")
    changed = build_task({"name": "gsm8k", "path": str(data), "limit": 1}).data_record()
    assert changed["sha256"] != record["sha256"]
    assert changed["problems_sha256"] == metrics["data"]["problems_sha256"]
    assert build_task({"name": "gsm8k", "path": str(data)}).data_record()["n_problems"] == 4
