"""Passkey prompts as the ArkVale / IceCache scripts build them: layout, filler length in characters, keys, the
question tokenised apart for the decode-question mode; the token calibration option; scoring."""

import pytest

from eval.tasks.base import PromptContext, build_task
from eval.tasks.passkey import FILLER, KEY_LINE, QUESTION, TASK_LINE, build_prompt
from icecache.core.models import byte_tokenizer
from icecache.errors import ConfigError


def make_samples(tokenizer=None, max_length=100_000, **changes):
    values = {"name": "passkey", "lengths": [600, 900], "num_depths": 4, "seed": 42}
    values.update(changes)
    task = build_task(values)
    return list(task.samples(PromptContext(tokenizer=tokenizer or byte_tokenizer(), max_length=max_length)))


def bos_byte_tokenizer():
    """The byte tokenizer with a BOS before every encoding, as Llama's tokenizers add one."""
    from tokenizers import processors

    tokenizer = byte_tokenizer()
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    return tokenizer


def reference_prompt(n_garbage, depth, key):
    """The scripts' generate_prompt_landmark, rewritten: four lines, then the question with no newline before it."""
    garbage = " ".join([FILLER] * 5000)
    n_prefix = int(n_garbage * depth)
    lines = [TASK_LINE, garbage[:n_prefix], KEY_LINE.format(key=key), garbage[: n_garbage - n_prefix]]
    return "\n".join(lines) + QUESTION


def test_same_seed_same_prompts_other_seed_other_keys():
    first, again, other = make_samples(), make_samples(), make_samples(seed=7)
    assert [s.input_ids for s in first] == [s.input_ids for s in again]
    assert [s.answers for s in first] != [s.answers for s in other]


def test_keys_follow_numpy_seed_42_sequence():
    import numpy as np

    rng = np.random.RandomState(42)
    expected = [str(rng.randint(1, 50000)) for _ in range(8)]
    assert [s.answers[0] for s in make_samples()] == expected


def test_prompt_is_the_scripts_with_3_8_filler_characters_per_token():
    tokenizer = byte_tokenizer()
    samples = make_samples(lengths=[10000], num_depths=3)
    for sample in samples:
        assert sample.meta["filler_chars"] == 38000  # the scripts' n_garbage for their 10k context
        expected = reference_prompt(38000, sample.meta["depth"], int(sample.answers[0]))
        assert sample.input_ids == tokenizer(expected)["input_ids"] and sample.suffix_ids == []
        assert sample.meta["prompt_tokens"] == len(expected)  # one byte a token
    # depth 1/3: 25334 suffix characters, 281 fillers and 44 characters, the question glued to the cut word
    ending = ". The sky is blue. The sunWhat is the pass key? The pass key is"
    assert tokenizer.decode(samples[1].input_ids).endswith(ending)


def test_prompt_layout_appends_the_question_to_the_filler():
    prompt = build_prompt(300, 0.5, 4242)
    lines = prompt.split("\n")
    assert len(lines) == 4 and lines[0] == TASK_LINE and lines[2] == KEY_LINE.format(key=4242)
    assert lines[1] == " ".join([FILLER] * 5)[:150]
    assert lines[3] == " ".join([FILLER] * 5)[:150] + QUESTION


def test_decode_question_tokenises_the_question_apart_with_its_bos():
    tokenizer = bos_byte_tokenizer()
    plain = make_samples(tokenizer, lengths=[600], num_depths=2)
    split = make_samples(tokenizer, lengths=[600], num_depths=2, decode_question=True)
    for whole, parts in zip(plain, split):
        body = reference_prompt(round(3.8 * 600), parts.meta["depth"], int(parts.answers[0]))[: -len(QUESTION)]
        assert parts.input_ids == tokenizer(body)["input_ids"]
        assert parts.suffix_ids == [tokenizer.bos_token_id] + tokenizer.encode(QUESTION, add_special_tokens=False)
        assert whole.input_ids[0] == tokenizer.bos_token_id and whole.suffix_ids == []
        assert len(parts.input_ids) + len(parts.suffix_ids) == len(whole.input_ids) + 1  # the question's BOS


def test_token_calibration_fits_each_prompt_tightly_and_keeps_the_key_at_its_depth():
    tokenizer = byte_tokenizer()
    for sample in make_samples(calibration="tokens"):
        text = tokenizer.decode(sample.input_ids)
        key_line = KEY_LINE.format(key=sample.answers[0])
        prefix, suffix = text.split("\n")[1], text.split("\n")[3][: -len(QUESTION)]
        assert abs(len(prefix) / (len(prefix) + len(suffix)) - sample.meta["depth"]) < 0.01
        assert key_line in text
        assert sample.meta["length"] * 0.97 <= len(sample.input_ids) <= sample.meta["length"]


def test_score_uses_the_tail_tokens():
    task = build_task({"name": "passkey", "lengths": [600], "num_depths": 1})
    sample = next(iter(task.samples(PromptContext(tokenizer=byte_tokenizer()))))
    answer_ids = sample.meta["answer_ids"]
    assert sample.max_new_tokens == len(answer_ids) + 1
    assert task.score(sample, " " + sample.answers[0], [32] + answer_ids)["score"] == 1.0
    assert task.score(sample, sample.answers[0] + "1", answer_ids + [49])["score"] == 0.0
    assert task.score(sample, "the key 9", [1, 2])["first_integer"] == 0.0


def test_a_key_then_an_eos_scores_0_as_the_scripts_output_tail_holds_the_eos():
    # the scripts compare output[-K:] with the EOS the model stopped on; the generator drops the stop id, so the
    # key alone followed by an EOS comes back as K ids of K + 1 (and a short answer as fewer)
    task = build_task({"name": "passkey", "lengths": [600], "num_depths": 1})
    sample = next(iter(task.samples(PromptContext(tokenizer=byte_tokenizer()))))
    answer_ids = sample.meta["answer_ids"]
    assert task.score(sample, sample.answers[0], answer_ids) == {"score": 0.0, "first_integer": 1.0}
    assert task.score(sample, "", [])["score"] == 0.0
    extra0 = build_task({"name": "passkey", "lengths": [600], "num_depths": 1, "extra_new_tokens": 0})
    sample = next(iter(extra0.samples(PromptContext(tokenizer=byte_tokenizer()))))
    assert extra0.score(sample, sample.answers[0], answer_ids)["score"] == 1.0  # K of K: no EOS in the window


def test_the_scoring_version_is_a_setting_of_every_run():
    from pathlib import Path

    from eval.tasks.passkey import PASSKEY_REFERENCE

    assert build_task({"name": "passkey"}).config.reference == PASSKEY_REFERENCE
    config = Path(__file__).resolve().parents[1] / "configs/task/passkey.yaml"
    assert f"reference: {PASSKEY_REFERENCE}" in config.read_text()
    with pytest.raises(ConfigError, match="passkey follows"):
        build_task({"name": "passkey", "reference": "yuzhenmao/IceCache@63db4c1"})


def test_a_prompt_over_the_models_length_and_a_bad_calibration_are_refused():
    with pytest.raises(ConfigError, match="passkey length 900 makes a prompt of 3.* over the model's max_length 3000"):
        make_samples(max_length=3000)
    assert make_samples(max_length=3000, calibration="tokens")
    with pytest.raises(ConfigError, match="task.calibration must be one of reference, tokens"):
        make_samples(calibration="chars")
    with pytest.raises(ConfigError, match="passkey length 100 is shorter than the prompt's fixed text"):
        make_samples(lengths=[100])
