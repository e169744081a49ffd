"""Passkey prompts: deterministic for a seed, the key at the requested depth, lengths within the token budget."""

from icecache.core.models import byte_tokenizer
from icecache.tasks.base import PromptContext, build_task
from icecache.tasks.passkey import FILLER, KEY_LINE, build_prompt


def make_samples(**changes):
    values = {"name": "passkey", "lengths": [600, 900], "num_depths": 4, "seed": 42}
    values.update(changes)
    task = build_task(values)
    return list(task.samples(PromptContext(tokenizer=byte_tokenizer())))


def test_same_seed_same_prompts_other_seed_other_keys():
    first, again, other = make_samples(), make_samples(), make_samples(seed=7)
    assert [s.input_ids for s in first] == [s.input_ids for s in again]
    assert [s.answers for s in first] != [s.answers for s in other]


def test_keys_follow_numpy_seed_42_sequence():
    import numpy as np

    rng = np.random.RandomState(42)
    expected = [str(rng.randint(1, 50000)) for _ in range(8)]
    assert [s.answers[0] for s in make_samples()] == expected


def test_key_sits_at_requested_depth_and_length_fits():
    tokenizer = byte_tokenizer()
    for sample in make_samples():
        text = tokenizer.decode(sample.input_ids)
        key_line = KEY_LINE.format(key=sample.answers[0])
        filler_before = text.index(key_line) - text.index("\n") - 2  # chars of filler before the key line
        total_filler = len(text) - len(key_line) - len(text.split("\n")[0]) - len(text.split("\n")[-1]) - 4
        assert abs(filler_before / total_filler - sample.meta["depth"]) < 0.01
        assert sample.meta["length"] * 0.97 <= len(sample.input_ids) <= sample.meta["length"]


def test_prompt_layout_is_five_lines():
    prompt = build_prompt(300, 0.5, 4242)
    lines = prompt.split("\n")
    assert len(lines) == 5 and lines[2] == KEY_LINE.format(key=4242)
    assert lines[-1] == "What is the pass key? The pass key is"
    assert lines[1] == " ".join([FILLER] * 5)[:150] and lines[3] == " ".join([FILLER] * 5)[:150]


def test_score_uses_the_tail_tokens():
    task = build_task({"name": "passkey", "lengths": [600], "num_depths": 1})
    sample = next(iter(task.samples(PromptContext(tokenizer=byte_tokenizer()))))
    answer_ids = sample.meta["answer_ids"]
    assert sample.max_new_tokens == len(answer_ids) + 1
    assert task.score(sample, " " + sample.answers[0], [32] + answer_ids)["score"] == 1.0
    assert task.score(sample, sample.answers[0] + "1", answer_ids + [49])["score"] == 0.0
    assert task.score(sample, "the key 9", [1, 2])["first_integer"] == 0.0


def test_decode_question_moves_the_question_into_decode_steps():
    plain = make_samples(lengths=[600], num_depths=2)
    split = make_samples(lengths=[600], num_depths=2, decode_question=True)
    tokenizer = byte_tokenizer()
    for whole, parts in zip(plain, split):
        assert parts.input_ids + parts.suffix_ids == whole.input_ids
        assert tokenizer.decode(parts.suffix_ids) == "\nWhat is the pass key? The pass key is"
