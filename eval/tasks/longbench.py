r"""LongBench v1 and LongBench-E (Bai et al. 2023), as ``THUDM/LongBench``'s ``pred.py`` and ``eval.py`` run them.

``task=longbench`` (``variant: v1``; by default the 16 English and code sets of the IceCache table, any of the 21)
and ``task=longbench_e`` (``variant: e``: the 13 LongBench-E sets with the same prompts, truncation, generation and
metrics). Per sample:

1. ``prompt = dataset2prompt[dataset].format(**sample)``. The templates and generation lengths are byte-exact copies
   of the official ``config/dataset2prompt.json`` and ``dataset2maxlen.json`` in ``eval/tasks/data/longbench/``
   (licence and commit beside them); their typos ("asconcisely", trailing spaces) are part of the benchmark.
2. Middle truncation to the prompt budget ``L``: tokenised with default special tokens; if longer than ``L``, the
   first and the last ``int(L/2)`` tokens are decoded separately with special tokens skipped and the two strings
   joined. The string is re-tokenised later, so the length can drift by a token or two, as in the official script.
   ``L`` is the IceCache scripts' ``model2maxlen.json`` value for the models they list (``REFERENCE_MAX_LENGTH``:
   ``llama31_8b`` 131072, their ``llama-3.1``; ``mistral7b_v02`` 32768, their ``mistral-7b-inst``, which their
   ``model2path.json`` points at Mistral-7B-Instruct-v0.2; ``qwen3_4b_2507`` 32760, their ``qwen3``, the nearest
   checkpoint they list, not the model's 262144 context); THUDM's own file lists none of the harness models, so
   other models use their ``max_length``. ``task.max_length`` overrides both; ``meta.max_length`` records it.
3. The model family's chat template (``eval.tasks.chat``), except on trec, triviaqa, samsum, lsht, lcc and
   repobench-p (few-shot and code sets, where chat models do better on the raw continuation).
4. Greedy generation of ``dataset2maxlen[dataset]`` tokens. samsum also forces one new token and stops on the
   tokenizer's EOS and the newline id only (the last id of ``encode("\n")``), as ``pred.py`` passes its own
   ``eos_token_id`` list, which replaces the model's.

``Sample.meta`` carries ``dataset``, ``variant``, ``length``, ``all_classes`` and ``_id``; ids are
``<dataset>[_e]/<row index>``.

Scores: the official per-sample metric of each dataset (``eval.tasks.metrics``, quirks included; docs/eval.md,
Scoring quirks), the max over ground truths, ``round(100 * mean, 2)`` per dataset (``datasets``). ``score`` (also
``paper_average``) is the plain mean over datasets, the IceCache table's "Avg"; ``official_average`` is the
leaderboard's mean of the category means (``categories``), reported beside it; ``n_per_dataset``. LongBench-E adds
``buckets[dataset]`` for ``0-4k`` (``length`` < 4000), ``4-8k`` (4000-7999) and ``8k+`` (>= 8000; words for
English and code, characters for Chinese), ``null`` where a bucket is empty (the official script prints NaN),
``n_per_bucket`` and ``bucket_average`` over datasets per bucket. The report keeps LongBench-E runs as their own
task: a ``qasper_e`` score is never a LongBench v1 ``qasper`` cell.

Data:

* ``source: hub`` (default): ``datasets.load_dataset("Xnhyacinth/LongBench", data_dir="<dataset>[_e]",
  split="test")``, the parquet mirror (the script-based ``THUDM/LongBench`` no longer loads with ``datasets`` >= 4).
  The mirror stores each prompt pre-split as ``context`` (the template head with the context filled in) +
  ``question`` + ``answer_prefix``; their concatenation is the official prompt for every set (for trec, triviaqa
  and samsum the mirror moves the "Type:" / "Answer:" / "Summary:" suffix of ``input`` into ``answer_prefix``,
  which concatenation restores when ``input`` ends in the bare cue; one that ends in the cue and a space keeps it in
  ``question`` and so carries it twice). ``hub_repo`` may also name a local folder in the mirror's layout (one
  ``<dataset>[_e]/`` folder of parquet files per set, as ``push_to_hub`` writes them; rows with the mirror's columns
  or the official ones): the same ``load_dataset`` call reads it. ``tests/test_longbench.py`` builds such a folder
  from the official-layout fixtures and checks that both sources give the same samples. ``offline: true`` reads only
  the local Hugging Face cache.
* ``source: local``: the official ``data.zip`` unzipped (``<dir>/<dataset>.jsonl``, ``<dir>/<dataset>_e.jsonl``);
  ``data_dir`` defaults to ``$ICECACHE_LONGBENCH``, else ``~/.cache/icecache-harness/longbench``. A missing file, a
  line that is not JSON (file and line named), a row without prompt fields, ``answers`` or ``length``, or a set
  with no rows stops the run before the model loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from icecache.errors import ConfigError

from .base import TASKS, PromptContext, Sample, Task, TaskConfig, read_jsonl
from .chat import encode_prompt, newline_token_id, wrap_chat
from .metrics import longbench_sample_score, official_round

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_FILES = Path(__file__).resolve().parent / "data" / "longbench"
DEFAULT_LOCAL_DIR = Path("~/.cache/icecache-harness/longbench").expanduser()
DATA_ZIP_URL = "https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip"

# Leaderboard categories, in the README's column order; together they are the 21 LongBench v1 sets.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "Single-Doc QA": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "Multi-Doc QA": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "Summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "Few-shot Learning": ("trec", "triviaqa", "samsum", "lsht"),
    "Synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "Code": ("lcc", "repobench-p"),
}
DATASET_CATEGORY = {dataset: category for category, members in CATEGORIES.items() for dataset in members}
LONGBENCH_DATASETS = tuple(DATASET_CATEGORY)
CHINESE_DATASETS = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
# The 16 English and code sets of the IceCache LongBench table (its run_longbench.sh), in the table's order.
ICECACHE_DATASETS = tuple(dataset for dataset in LONGBENCH_DATASETS if dataset not in CHINESE_DATASETS)
LONGBENCH_E_DATASETS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
# The prompt budget (pred.py's max_length) of the IceCache scripts' longbench_config/model2maxlen.json
# (yuzhenmao/IceCache at 44346b0), for the harness models whose checkpoint their model2path.json names: harness model
# name -> (their model name, budget). THUDM's own model2maxlen.json lists none of these models.
REFERENCE_MAX_LENGTH: dict[str, tuple[str, int]] = {
    "llama-3.1-8b-instruct": ("llama-3.1", 131072),  # meta-llama/Llama-3.1-8B-Instruct
    "mistral-7b-instruct-v0.2": ("mistral-7b-inst", 32768),  # mistralai/Mistral-7B-Instruct-v0.2
    "qwen3-4b-instruct-2507": ("qwen3", 32760),  # their Qwen/Qwen3-4B, the nearest checkpoint they list
}
NO_CHAT_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
LENGTH_BUCKETS = ("0-4k", "4-8k", "8k+")


def length_bucket(length: int) -> str:
    """LongBench-E's interval for a sample's ``length`` field (words, or characters for Chinese)."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


@lru_cache(maxsize=None)
def prompt_templates() -> dict[str, str]:
    """``dataset2prompt.json`` from THUDM/LongBench, byte-exact (MIT; LICENSE.txt beside it)."""
    return json.loads((DATA_FILES / "dataset2prompt.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def max_new_tokens_per_dataset() -> dict[str, int]:
    """``dataset2maxlen.json`` from THUDM/LongBench: generation length per dataset."""
    return json.loads((DATA_FILES / "dataset2maxlen.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------------------------------------------------------
# Prompt building


def official_prompt(dataset: str, row: dict[str, Any]) -> str:
    """The untruncated prompt of one row, from the official layout or from the hub mirror's pre-split fields."""
    if "input" in row and "context" in row:
        return prompt_templates()[dataset].format(**row)
    if {"context", "question", "answer_prefix"} <= set(row):
        return row["context"] + row["question"] + (row["answer_prefix"] or "")
    raise ConfigError(
        f"LongBench row of {dataset!r} has neither the official fields (context, input) nor the mirror's "
        f"(context, question, answer_prefix); it has: {', '.join(sorted(row))}"
    )


def truncate_middle(prompt: str, tokenizer: Any, max_length: int) -> str:
    """Keep the first and last ``int(max_length/2)`` tokens of ``prompt`` (pred.py's truncation), as a string.

    The prompt is tokenised with default special tokens, as in the official script, so a BOS counts towards the
    first half and is then dropped by ``skip_special_tokens``.
    """
    token_ids = tokenizer(prompt, truncation=False)["input_ids"]
    if len(token_ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return tokenizer.decode(token_ids[:half], skip_special_tokens=True) + tokenizer.decode(
        token_ids[-half:], skip_special_tokens=True
    )


def prompt_budget(context: PromptContext, max_length: int | None = None) -> int:
    """The truncation budget: ``max_length`` if given, else the reference's value for a model it lists (never over
    the model's ``max_length``), else the model's ``max_length``."""
    if max_length is not None:
        return max_length
    if context.model_name in REFERENCE_MAX_LENGTH:
        return min(REFERENCE_MAX_LENGTH[context.model_name][1], context.max_length)
    return context.max_length


def build_input_ids(prompt: str, dataset: str, context: PromptContext, max_length: int | None = None) -> list[int]:
    """Truncate, wrap in the chat template unless the dataset skips it, and tokenise."""
    prompt = truncate_middle(prompt, context.tokenizer, prompt_budget(context, max_length))
    if dataset not in NO_CHAT_DATASETS:
        prompt = wrap_chat(prompt, context.tokenizer, context.chat_template)
    return encode_prompt(prompt, context.tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# Data


@dataclass
class LongBenchConfig(TaskConfig):
    """LongBench settings; see configs/task/longbench.yaml for each field's meaning."""

    name: str = "longbench"
    datasets: list[str] | None = None  # None: the 16 IceCache sets (v1) or the 13 LongBench-E sets (e)
    variant: str = "v1"  # v1 | e
    source: str = "hub"  # hub | local
    data_dir: str | None = None  # local: folder with <dataset>.jsonl / <dataset>_e.jsonl (official data.zip)
    hub_repo: str = "Xnhyacinth/LongBench"  # hub: parquet mirror with one data folder per (dataset[_e])
    offline: bool = False  # hub: read only the local Hugging Face cache, never the network
    max_length: int | None = None  # truncation budget; None: the reference's for the model, else model.max_length


def _file_stem(dataset: str, variant: str) -> str:
    return f"{dataset}_e" if variant == "e" else dataset


def resolve_data_dir(data_dir: str | None) -> Path:
    """``data_dir``, else ``$ICECACHE_LONGBENCH``, else ``~/.cache/icecache-harness/longbench``; a relative path is
    from the repository root."""
    chosen = data_dir or os.environ.get("ICECACHE_LONGBENCH")
    if not chosen:
        return DEFAULT_LOCAL_DIR
    path = Path(chosen).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


@contextlib.contextmanager
def _hub_offline(enabled: bool) -> Iterator[None]:
    """Make ``datasets`` and ``huggingface_hub`` read only their caches for the duration (their flags are read at
    import, so setting the environment variables now would be too late)."""
    if not enabled:
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    saved = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def load_rows(config: LongBenchConfig, dataset: str) -> list[dict[str, Any]]:
    """All rows of one dataset in file order, from the configured source; ``ConfigError`` says how to get them."""
    stem = _file_stem(dataset, config.variant)
    if config.source == "local":
        folder = resolve_data_dir(config.data_dir)
        path = folder / f"{stem}.jsonl"
        if not path.is_file():
            raise ConfigError(
                f"LongBench file {path} not found. Download {DATA_ZIP_URL}, unzip it and point task.data_dir "
                f"(or $ICECACHE_LONGBENCH) at the folder holding <dataset>.jsonl and <dataset>_e.jsonl, "
                f"or use task.source=hub"
            )
        return read_jsonl(path)
    try:
        from datasets import load_dataset

        with _hub_offline(config.offline):
            table = load_dataset(config.hub_repo, data_dir=stem, split="test")
    except Exception as error:  # network, missing cache, missing folder: one actionable line
        mode = "from the local Hugging Face cache (offline)" if config.offline else "from the hub"
        raise ConfigError(
            f"could not load LongBench {stem!r} {mode} ({config.hub_repo}): {type(error).__name__}: {error}. "
            f"Without hub access, download {DATA_ZIP_URL}, unzip it and run with task.source=local "
            f"task.data_dir=<folder with {stem}.jsonl>"
        ) from None
    return [dict(row) for row in table]


def check_row(stem: str, index: int, row: dict[str, Any]) -> None:
    """A row has what prompting and scoring read (the prompt fields, answers, length), else one line says which."""
    has_prompt = {"input", "context"} <= set(row) or {"context", "question", "answer_prefix"} <= set(row)
    problems = [] if has_prompt else ["its prompt fields (context + input, or context + question + answer_prefix)"]
    if not isinstance(row.get("answers"), (list, tuple)):
        problems.append("answers (a list)")
    try:
        int(row.get("length"))
    except (TypeError, ValueError):
        problems.append("length (a number)")
    if problems:
        raise ConfigError(f"LongBench {stem!r} row {index + 1} lacks {' and '.join(problems)}")


@TASKS.register("longbench")
class LongBench(Task):
    """LongBench v1 (21 sets) or LongBench-E (13 sets), official prompts, truncation and metrics."""

    config_class = LongBenchConfig
    config: LongBenchConfig
    coordinates = ("datasets",)

    @classmethod
    def table_name(cls, settings: dict[str, Any]) -> str:
        """LongBench-E runs are the table ``longbench_e``: their scores are per length bucket of other files."""
        return "longbench_e" if settings.get("variant") == "e" else "longbench"

    def __init__(self, config: LongBenchConfig):
        super().__init__(config)
        self._rows: dict[str, list[dict[str, Any]]] = {}

    @property
    def datasets(self) -> list[str]:
        if self.config.datasets is not None:
            return list(self.config.datasets)
        return list(LONGBENCH_E_DATASETS if self.config.variant == "e" else ICECACHE_DATASETS)

    def check(self) -> None:
        config = self.config
        if config.variant not in ("v1", "e"):
            raise ConfigError(f"longbench variant must be 'v1' or 'e', not {config.variant!r}")
        if config.source not in ("hub", "local"):
            raise ConfigError(f"longbench source must be 'hub' or 'local', not {config.source!r}")
        known = LONGBENCH_E_DATASETS if config.variant == "e" else LONGBENCH_DATASETS
        unknown = [dataset for dataset in self.datasets if dataset not in known]
        if unknown or not self.datasets:
            raise ConfigError(
                f"longbench ({config.variant}) has no dataset {', '.join(unknown) or '(empty list)'}; "
                f"known: {', '.join(known)}"
            )
        if config.limit is not None and config.limit < 1:
            raise ConfigError(f"task.limit must be at least 1, not {config.limit}")
        if config.max_length is not None and config.max_length < 2:
            raise ConfigError(f"task.max_length must be at least 2 tokens (or null), not {config.max_length}")
        for dataset in self.datasets:  # load now: a missing file should stop the run before the model loads
            rows = self.rows(dataset)
            stem = _file_stem(dataset, config.variant)
            if not rows:
                raise ConfigError(f"LongBench {stem!r} has no samples: a run of 0 samples would look finished")
            for index, row in enumerate(rows):
                check_row(stem, index, row)

    def rows(self, dataset: str) -> list[dict[str, Any]]:
        """The dataset's rows (cached), cut to ``limit``."""
        if dataset not in self._rows:
            rows = load_rows(self.config, dataset)
            self._rows[dataset] = rows[: self.config.limit] if self.config.limit is not None else rows
        return self._rows[dataset]

    def check_max_length(self, max_length: int) -> None:
        if self.config.max_length is not None and self.config.max_length > max_length:
            raise ConfigError(f"task.max_length {self.config.max_length} exceeds the model's max_length {max_length}")

    def samples(self, context: PromptContext) -> Iterator[Sample]:
        max_new_tokens = max_new_tokens_per_dataset()
        budget = prompt_budget(context, self.config.max_length)
        for dataset in self.datasets:
            stem = _file_stem(dataset, self.config.variant)
            for index, row in enumerate(self.rows(dataset)):
                sample = Sample(
                    sample_id=f"{stem}/{index}",
                    input_ids=build_input_ids(official_prompt(dataset, row), dataset, context, budget),
                    max_new_tokens=max_new_tokens[dataset],
                    answers=list(row["answers"]),
                    meta={
                        "dataset": dataset,
                        "variant": self.config.variant,
                        "length": int(row["length"]),
                        "all_classes": list(row["all_classes"]) if row.get("all_classes") is not None else None,
                        "_id": row.get("_id"),
                        "max_length": budget,
                    },
                )
                if dataset == "samsum":
                    # pred.py: min_length = context + 1 and EOS = [eos, "\n"], against endless "\nDialogue" loops.
                    sample.min_new_tokens = 1
                    sample.eos_token_ids = [context.tokenizer.eos_token_id, newline_token_id(context.tokenizer)]
                yield sample

    def score(self, sample: Sample, prediction: str, output_ids: list[int]) -> dict[str, float]:
        meta = sample.meta
        return {"score": longbench_sample_score(meta["dataset"], prediction, sample.answers, meta["all_classes"])}

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        return aggregate_longbench(records, with_buckets=self.config.variant == "e")


# ---------------------------------------------------------------------------------------------------------------
# Aggregation (works from the per-sample records alone)


def _mean_or_none(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 2) if values else None


def aggregate_longbench(records: list[dict[str, Any]], with_buckets: bool = False) -> dict[str, Any]:
    """Per-dataset, per-category and average scores from records carrying ``score`` and ``meta``.

    * ``datasets``: ``round(100 * mean, 2)`` per dataset (eval.py's ``scorer``);
    * ``categories``: mean of the dataset scores in each leaderboard category present;
    * ``official_average``: mean of the category means (the leaderboard's "Avg");
    * ``paper_average`` (also ``score``): plain mean of the dataset scores (the IceCache table's "Avg");
    * with ``with_buckets`` (LongBench-E): ``buckets[dataset][interval]`` as eval.py's ``scorer_e`` (None where a
      bucket is empty, where the official script would print NaN) and ``bucket_average`` over datasets.
    """
    by_dataset: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_dataset.setdefault(record["meta"]["dataset"], []).append(record)
    ordered = sorted(by_dataset, key=lambda name: LONGBENCH_DATASETS.index(name) if name in DATASET_CATEGORY else 99)

    dataset_scores = {name: official_round(statistics.fmean(r["score"] for r in by_dataset[name])) for name in ordered}
    categories: dict[str, float] = {}
    for category, members in CATEGORIES.items():
        present = [dataset_scores[name] for name in members if name in dataset_scores]
        if present:
            categories[category] = round(statistics.fmean(present), 2)
    paper_average = _mean_or_none(list(dataset_scores.values()))
    result: dict[str, Any] = {
        "score": paper_average,
        "n": len(records),
        "datasets": dataset_scores,
        "n_per_dataset": {name: len(by_dataset[name]) for name in ordered},
        "categories": categories,
        "official_average": _mean_or_none(list(categories.values())),
        "paper_average": paper_average,
    }
    if with_buckets:
        buckets: dict[str, dict[str, float | None]] = {}
        for name in ordered:
            per_bucket: dict[str, list[float]] = {bucket: [] for bucket in LENGTH_BUCKETS}
            for record in by_dataset[name]:
                per_bucket[length_bucket(record["meta"]["length"])].append(record["score"])
            buckets[name] = {
                bucket: official_round(statistics.fmean(scores)) if scores else None
                for bucket, scores in per_bucket.items()
            }
        result["buckets"] = buckets
        result["n_per_bucket"] = {
            name: {bucket: sum(length_bucket(r["meta"]["length"]) == bucket for r in by_dataset[name])
                   for bucket in LENGTH_BUCKETS}
            for name in ordered
        }
        result["bucket_average"] = {
            bucket: _mean_or_none([b[bucket] for b in buckets.values() if b[bucket] is not None])
            for bucket in LENGTH_BUCKETS
        }
    return result
