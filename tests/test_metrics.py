"""Golden cases for the LongBench and RULER metrics; every expected value is derived by hand in its comment from the
official definitions (THUDM/LongBench metrics.py and eval.py, rouge 1.0.1, fuzzywuzzy 0.18.0, RULER)."""

from __future__ import annotations

import difflib

import pytest

from eval.tasks import metrics
from eval.tasks.metrics import (
    DATASET_TO_METRIC,
    classification_score,
    code_sim_score,
    count_score,
    first_line,
    longbench_sample_score,
    normalize_answer,
    normalize_zh_answer,
    official_round,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
    string_match_all,
    string_match_part,
)

# ROUGE's F is 2PR/(P+R+1e-8): with P = R = 1 it is 2/(2+1e-8), not exactly 1.
ROUGE_EPS = 1e-7


# --- qa_f1 -------------------------------------------------------------------------------------------------------


def test_normalize_answer_lowercases_strips_punctuation_and_articles():
    # "The theatre, an Apple." -> lower "the theatre, an apple." -> no punctuation "the theatre an apple"
    # -> articles (whole words only; "theatre" keeps its "the") -> " theatre   apple" -> collapse -> "theatre apple"
    assert normalize_answer("The theatre, an Apple.") == "theatre apple"
    # Punctuation inside a word is deleted, not replaced: "U.S.A." -> "usa".
    assert normalize_answer("U.S.A.") == "usa"


def test_qa_f1_exact_after_normalisation():
    # Both normalise to "eiffel tower".
    assert qa_f1_score("The Eiffel Tower!", "eiffel tower") == 1.0


def test_qa_f1_partial_overlap():
    # pred "a cat sat" -> [cat, sat]; gt "the cat sat on the mat" -> [cat, sat, on, mat]; overlap 2
    # P = 2/2, R = 2/4, F1 = 2 * 1 * 0.5 / 1.5 = 2/3.
    assert qa_f1_score("a cat sat", "the cat sat on the mat") == pytest.approx(2 / 3)


def test_qa_f1_counts_a_multiset_overlap():
    # pred [cat, cat, cat] vs gt [cat]: the multiset overlap is 1, P = 1/3, R = 1, F1 = (2/3)/(4/3) = 0.5.
    assert qa_f1_score("the cat cat cat", "cat") == pytest.approx(0.5)


def test_qa_f1_without_overlap_is_zero():
    assert qa_f1_score("London", "Paris") == 0


def test_qa_f1_zh_segments_with_jieba_and_drops_punctuation_tokens():
    # jieba: "北京。" -> [北京, 。]; "。" normalises to "" and is dropped -> [北京] vs [北京] -> 1.
    assert qa_f1_zh_score("北京。", "北京") == 1.0
    # jieba: "我爱北京" -> [我, 爱, 北京] vs [北京]: overlap 1, P = 1/3, R = 1, F1 = 0.5.
    assert qa_f1_zh_score("我爱北京", "北京") == pytest.approx(0.5)


def test_normalize_zh_answer_removes_chinese_and_ascii_punctuation_and_spaces():
    # "「玛拉」 ." : the corner brackets, the space and the ASCII dot all go; "ABC" is lower-cased.
    assert normalize_zh_answer("「玛拉」 .ABC") == "玛拉abc"


# --- ROUGE-L (rouge 1.0.1) -----------------------------------------------------------------------------------------


def test_rouge_identical_sentence_scores_one():
    # One sentence each, 5 distinct words, LCS covers all of them: R = P = 1, F = 2/(2 + 1e-8).
    assert rouge_score("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0, abs=ROUGE_EPS)


def test_rouge_is_case_sensitive():
    # No lower-casing: {The, cat} vs {the, cat}; LCS = [cat] -> R = P = 1/2, F = 0.5 (1.0 if it lower-cased).
    assert rouge_score("The cat", "the cat") == pytest.approx(0.5, abs=ROUGE_EPS)


def test_rouge_uses_distinct_word_denominators():
    # m = |{a}| = 1 and n = |{a, a, a}| as a set = 1; LCS word set {a}: R = P = 1 (standard ROUGE-L: P = 1/3).
    assert rouge_score("a a a", "a") == pytest.approx(1.0, abs=ROUGE_EPS)


def test_rouge_union_set_is_shared_across_reference_sentences():
    # Reference "a b. a b" is two sentences; the union of LCS words is one set across them, so the second
    # sentence adds nothing: LCS sum = 2, m = |{a, b}| = 2, n = 2 -> F = 1 (not R = 2).
    assert rouge_score("a b", "a b. a b") == pytest.approx(1.0, abs=ROUGE_EPS)


def test_rouge_trailing_space_after_dot_adds_an_empty_word():
    # "a b. " splits on "." into ["a b", " "]; " " is kept (len > 0) and becomes "", whose split(" ") is [""],
    # so the hypothesis words are {a, b, ""}: n = 3, m = 2, LCS = 2 -> P = 2/3, R = 1, F = (4/3)/(5/3) = 0.8.
    assert rouge_score("a b. ", "a b") == pytest.approx(0.8, abs=ROUGE_EPS)


@pytest.mark.parametrize("prediction", ["", "...", "."])
def test_rouge_exception_scores_zero(prediction):
    # "" and "..." leave no sentence after splitting on "." -> rouge raises ValueError -> the scorer returns 0.
    assert rouge_score(prediction, "a reference summary") == 0.0


def test_rouge_zh_joins_jieba_words_and_keeps_punctuation_words():
    # "北京。" -> "北京 。" (2 distinct words; "。" is not an ASCII dot, so no sentence split), "北京" -> 1 word:
    # LCS 1 -> R = 1, P = 1/2, F = 2/3.
    assert rouge_zh_score("北京。", "北京") == pytest.approx(2 / 3, abs=ROUGE_EPS)


# --- classification -----------------------------------------------------------------------------------------------

TREC_CLASSES = ["Abbreviation", "Entity", "Description", "Human", "Location", "Numeric value"]


def test_classification_single_match():
    assert classification_score("Location", "Location", all_classes=TREC_CLASSES) == 1.0


def test_classification_two_classes_named_share_the_credit():
    # matches = [Human, Location]; neither is a strict substring of "Location" except itself -> 1/2.
    assert classification_score("Human or Location", "Location", all_classes=TREC_CLASSES) == 0.5


def test_classification_ground_truth_not_named_is_zero():
    assert classification_score("Entity", "Location", all_classes=TREC_CLASSES) == 0.0


def test_classification_list_mutation_skips_the_element_after_a_removed_one():
    # matches = [ab, bc, abc]. Iteration: index 0 "ab" is a strict substring of "abc" -> removed, list becomes
    # [bc, abc]; the iterator moves on to index 1 = "abc" (kept, equal to the truth); "bc" is never examined.
    # Final [bc, abc] -> 1/2. Removing every strict substring would give [abc] -> 1.
    assert classification_score("abc", "abc", all_classes=["ab", "bc", "abc"]) == 0.5


# --- retrieval and count ---------------------------------------------------------------------------------------------


def test_retrieval_share_of_numbers():
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    # numbers [12, 3]; one equals 12 -> 1/2.
    assert retrieval_score("Paragraph 12, not Paragraph 3", "Paragraph 12") == 0.5
    # whole-number match: "120" != "12".
    assert retrieval_score("Paragraph 120", "Paragraph 12") == 0.0
    assert retrieval_score("I do not know", "Paragraph 12") == 0.0


def test_retrieval_uses_the_first_paragraph_of_the_ground_truth():
    assert retrieval_score("5", "Paragraph 5 and Paragraph 7") == 1.0


def test_retrieval_zh_pattern():
    assert retrieval_zh_score("答案是段落3", "段落3") == 1.0


def test_count_score():
    # numbers [7, 10]; one equals "7" -> 1/2; "07" is not "7".
    assert count_score("There are 7 unique paragraphs out of 10", "7") == 0.5
    assert count_score("07", "7") == 0.0


# --- code similarity -------------------------------------------------------------------------------------------------


def test_fuzz_uses_difflib_not_python_levenshtein():
    from fuzzywuzzy import fuzz

    assert fuzz.SequenceMatcher is difflib.SequenceMatcher


def test_code_sim_skips_fence_and_comment_lines():
    # "```python" has a backtick and "# add" a hash; the first clean line equals the truth -> ratio 100.
    assert code_sim_score("```python\n# add\nx = foo(1)\n```", "x = foo(1)") == 1.0


def test_code_sim_strips_leading_newlines():
    assert code_sim_score("\n\nreturn a", "return a") == 1.0


def test_code_sim_without_a_clean_line_compares_the_empty_string():
    # every line has "//" -> "" -> fuzz.ratio("", x) = 0.
    assert code_sim_score("// only a comment", "return a") == 0.0


def test_code_sim_rounds_the_difflib_ratio():
    # "return a + b" vs "return a - b": matching blocks "return a " (9) and " b" (2) -> 2*11/24 = 0.91667
    # -> fuzz.ratio = int(round(91.667)) = 92 -> 0.92.
    assert code_sim_score("return a + b", "return a - b") == 0.92


# --- per-sample and per-dataset scoring ----------------------------------------------------------------------------


def test_every_longbench_dataset_has_its_official_metric():
    assert len(DATASET_TO_METRIC) == 21
    assert DATASET_TO_METRIC["samsum"] is rouge_score
    assert DATASET_TO_METRIC["dureader"] is rouge_zh_score
    assert DATASET_TO_METRIC["triviaqa"] is qa_f1_score
    assert DATASET_TO_METRIC["lsht"] is classification_score
    assert DATASET_TO_METRIC["repobench-p"] is code_sim_score


def test_first_line_cut():
    assert first_line("\n\nParis\nQuestion: next") == "Paris"


def test_first_line_cut_applies_to_few_shot_sets_only():
    prediction = "\nParis\nQuestion: What is the capital of Italy? Answer: Rome"
    # triviaqa: cut to "Paris" -> F1 1.
    assert longbench_sample_score("triviaqa", prediction, ["Paris"]) == 1.0
    # hotpotqa: no cut; normalised pred is "paris question what is capital of italy answer rome" ("the" removed),
    # 9 tokens, one of them "paris": P = 1/9, R = 1, F1 = (2/9)/(10/9) = 0.2.
    assert longbench_sample_score("hotpotqa", prediction, ["Paris"]) == pytest.approx(0.2)


def test_sample_score_is_max_over_ground_truths():
    # "paris" vs "Paris" -> 1; vs "City of Paris" -> [city, of, paris]: P = 1, R = 1/3, F1 = 0.5; max = 1.
    assert longbench_sample_score("narrativeqa", "paris", ["City of Paris", "Paris"]) == 1.0
    assert longbench_sample_score("narrativeqa", "paris", ["City of Paris"]) == pytest.approx(0.5)


def test_sample_score_passes_all_classes():
    assert longbench_sample_score("trec", "Location\nQuestion: x", ["Location"], TREC_CLASSES) == 1.0


def test_official_round():
    # mean of [1, 0, 0.5] = 0.5 -> 50.0; 1/3 -> 33.33.
    assert official_round(0.5) == 50.0
    assert official_round(1 / 3) == 33.33


# --- RULER -------------------------------------------------------------------------------------------------------


def test_string_match_all_is_the_share_of_references_found_case_insensitively():
    # "1234567" and "ABC-def" (as "abc-DEF") are found, "7654321" is not -> 2/3.
    assert string_match_all("Values: 1234567 and abc-DEF.", ["1234567", "ABC-def", "7654321"]) == pytest.approx(2 / 3)


def test_string_match_part_is_one_if_any_reference_is_found():
    assert string_match_part("It is in france.", ["Paris", "France"]) == 1.0
    assert string_match_part("It is in Spain.", ["Paris", "France"]) == 0.0


def test_module_has_official_names():
    for name in ("qa_f1_score", "qa_f1_zh_score", "rouge_score", "rouge_zh_score", "classification_score",
                 "retrieval_score", "retrieval_zh_score", "count_score", "code_sim_score"):  # fmt: skip
        assert callable(getattr(metrics, name))
