"""CONTRIBUTING.md's recipe for a task: one file in ``eval/tasks/`` (settings, a registered ``Task`` that declares
what the runner and the report need of it) and one YAML in ``configs/task/``, nothing else.

A throw-away task is registered here and run on a tiny model through the runner, then tabled by the report. Its
length setting is not called ``lengths`` and its table coordinate is a setting no other task has, so a runner that
looks for ``lengths`` in the task's settings, or a report that keeps its own list of each task's coordinates, fails
this test; what the task declares on its class is all they may use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from eval.config import RunConfig
from eval.rundir import run_records
from eval.runner import run
from eval.tasks.base import TASKS, Sample, Task, TaskConfig
from eval.tasks.chat import encode_prompt

ROOT = Path(__file__).resolve().parent.parent
NAME = "countdown_for_test"
TINY_MODEL = {"name": "tiny-llama", "source": "random", "architecture": "llama", "tokenizer": "bytes",
              "device": "cpu", "dtype": "float32",
              "config": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096}}


@dataclass
class CountdownConfig(TaskConfig):
    name: str = NAME
    sizes: list[int] = field(default_factory=lambda: [40])  # prompt lengths in tokens: a coordinate of the table
    per_size: int = 2


class Countdown(Task):
    """Counts down from the prompt's length; a sample scores 1 when the model answers anything."""

    config_class = CountdownConfig
    config: CountdownConfig
    has_lengths = True
    coordinates = ("sizes",)

    def samples(self, context):
        for size in self.config.sizes:
            for index in range(self.config.per_size):
                text = " ".join(str(n) for n in range(size + index, 0, -1))
                ids = encode_prompt(text, context.tokenizer)[:size]
                yield Sample(sample_id=f"{size}/{index}", input_ids=ids, max_new_tokens=2, answers=["0"],
                             meta={"length": size})

    def score(self, sample, prediction, output_ids):
        return {"score": float(bool(output_ids))}

    def aggregate(self, records):
        by_size: dict[int, list[float]] = {}
        for record in records:
            by_size.setdefault(record["meta"]["length"], []).append(record["score"])
        return {"score": 100 * sum(r["score"] for r in records) / len(records) if records else None,
                "n": len(records),
                "by_length": {str(size): 100 * sum(s) / len(s) for size, s in by_size.items()},
                "n_by_length": {str(size): len(s) for size, s in by_size.items()}}


@pytest.fixture
def countdown():
    TASKS.register(NAME)(Countdown)
    try:
        yield Countdown
    finally:
        TASKS.unregister(NAME)


def test_a_new_task_needs_one_file_and_one_yaml(countdown, tmp_path):
    runs = tmp_path / "runs"
    dirs = []
    for size in (40, 56):  # one job per coordinate, as a sweep splits it
        config = RunConfig.from_dict({"model": TINY_MODEL, "method": {"name": "full", "budget": None},
                                      "task": {"name": NAME, "sizes": [size], "per_size": 2},
                                      "output_root": str(runs)})
        metrics = run(config)
        dirs.append(config.output_dir())
        assert metrics["n_samples"] == 2 and len(run_records(config.output_dir())) == 2
        # has_lengths, not a setting called "lengths", gives the per-length summaries
        assert set(metrics["latency"]["by_length"]) == {str(size)}
    assert dirs[0].parent == dirs[1].parent and dirs[0] != dirs[1]

    from eval.report.collect import collect_scores, load_runs
    from eval.report.summary import write_summary
    from eval.report.tables import task_table

    loaded = [r for r in load_runs(runs) if r.task == NAME]
    assert len(loaded) == 2 and loaded[0].variant == loaded[1].variant  # the declared coordinate is no variant
    table = task_table(collect_scores(loaded), NAME)
    assert len(table) == 1  # one row (the full cache): a score and a sample count per size
    assert list(table.columns) == ["40", "n 40", "56", "n 56"] and table.iloc[0]["n 56"] == 2
    summary = write_summary(runs, tmp_path / "summary", reference_dir=None, plots=False)
    assert NAME in summary.tables and (tmp_path / "summary" / f"{NAME}.md").exists()


def test_every_task_yaml_names_a_registered_task_and_every_task_has_one():
    """The recipe's two files go together: configs/task/<name>.yaml composes ``task=<name>``."""
    import yaml

    import eval.plugins  # noqa: F401  registers every task

    named = {path.stem: yaml.safe_load(path.read_text())["name"] for path in (ROOT / "configs" / "task").glob("*.yaml")}
    assert set(named.values()) <= set(TASKS.names()), named
    missing = set(TASKS.names()) - set(named)
    assert not missing, f"tasks without configs/task/<name>.yaml: {missing}"


def test_a_task_declares_what_the_runner_and_the_report_read():
    import eval.plugins  # noqa: F401  registers every task

    for name in TASKS.names():
        task = TASKS.get(name)
        assert isinstance(task.has_lengths, bool) and isinstance(task.coordinates, tuple)
        fields = set(task.config_class.__dataclass_fields__)
        assert set(task.coordinates) <= fields, f"{name} declares a coordinate that is not one of its settings"
    assert json.dumps(TASKS.get("longbench").table_name({"name": "longbench", "variant": "e"})) == '"longbench_e"'
