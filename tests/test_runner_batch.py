"""Batched runs (``batch_size`` > 1): a run's samples decoded together, each row with its own cache.

With the model's matrix products computed row by row (``row_by_row_linear``) a batched run must write what the
batch-1 run writes; without, a sample's tokens must not depend on the samples beside it in its batch (every batch
is filled to ``batch_size``), so that shards and resumed runs, which start their batches elsewhere, agree.
"""

import json

import pytest
import torch

from eval import rundir, runner
from icecache.core.generation import default_eos_token_ids
from icecache.errors import ConfigError
from tests.test_batch import row_by_row_linear  # noqa: F401 (a fixture)
from tests.test_method_invariants import method_config
from tests.test_runner import TINY_RUN, make_config

# Budget-free, an eviction method, a page-selection method on the GPU side, and one with host work in its step.
METHODS = ["full", "streaming_llm", "quest", "icecache"]


def method_settings(name: str) -> dict:
    return {"name": "full", "budget": None, "n_dense_layers": 2} if name == "full" else method_config(name, 64)


def outputs(config) -> list[tuple]:
    """What each sample computed (timings differ from run to run), in file order."""
    lines = (config.output_dir() / rundir.PREDICTIONS).read_text().splitlines()
    return [(r["sample_id"], r["output_ids"], r["score"], r["gen"]["stop_reason"]) for r in map(json.loads, lines)]


@pytest.mark.parametrize("name", METHODS)
def test_a_batched_run_writes_what_the_batch_1_run_writes(name, tmp_path, row_by_row_linear):  # noqa: F811
    single = make_config(tmp_path, method=method_settings(name))
    batched = make_config(tmp_path, method=method_settings(name), batch_size=4)
    assert batched.output_dir() != single.output_dir()  # its own run: products over a batch may round otherwise
    assert "batch_size" not in single.identity() and batched.identity()["batch_size"] == 4
    single_metrics, batched_metrics = runner.run(single), runner.run(batched)
    # Six samples in batches of four: the second batch is two samples and two copies of its first.
    assert outputs(batched) == outputs(single)
    assert [r["sample_id"] for r in rundir.read_records(batched.output_dir() / rundir.PREDICTIONS)] == [
        f"len400-depth{i:02d}" for i in range(6)]
    assert batched_metrics["n_samples"] == 6 and batched_metrics["metrics"] == single_metrics["metrics"]
    records = rundir.read_records(batched.output_dir() / rundir.PREDICTIONS)
    assert {r["gen"]["batch_size"] for r in records} == {4}
    assert all(r["gen"]["ttft_s"] > 0 and r["gen"]["new_tokens"] == len(r["output_ids"]) for r in records)


ON_CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("name", ["full", "icecache"])
def test_a_samples_tokens_do_not_depend_on_the_samples_beside_it(device, name, tmp_path):
    """The model's products over the batch as they are (on CUDA in bf16, as the GSM8K grid runs, its steps
    captured): a sample gives the same tokens beside other samples, beside copies of itself (a batch filled up),
    and in another row of the batch."""
    model_settings = dict(TINY_RUN["model"], device=device, dtype="float32" if device == "cpu" else "bfloat16")
    config = make_config(tmp_path, batch_size=3, model=model_settings, method=method_settings(name))
    task, method = runner.prepare(config)
    tokenizer, samples = runner.build_samples(task, config)
    model, tokenizer = runner.loaded_model(config, tokenizer)
    eos = default_eos_token_ids(tokenizer, getattr(model, "generation_config", None))

    def tokens(group):
        return {r["sample_id"]: r["output_ids"] for r in runner.run_batch(config, task, method, model, tokenizer,
                                                                            group, eos)}

    first, second, third = tokens(samples[0:3]), tokens([samples[0], samples[4], samples[5]]), tokens([samples[0]])
    moved = tokens([samples[5], samples[1], samples[0]])
    sample_id = samples[0].sample_id
    assert first[sample_id] == second[sample_id] == third[sample_id] == moved[sample_id]
    assert list(third) == [sample_id]  # the filling copies write nothing


def test_a_killed_batched_run_resumes_without_loss_or_duplicates(tmp_path, monkeypatch):
    from icecache.core import batched_generation

    real = batched_generation.batched_greedy_generate
    calls = []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed while decoding the second batch
        return real(*args, **kwargs)

    monkeypatch.setattr(batched_generation, "batched_greedy_generate", dying)
    config = make_config(tmp_path, batch_size=4)
    with pytest.raises(KeyboardInterrupt):
        runner.run(config)
    predictions = config.output_dir() / rundir.PREDICTIONS
    assert len(rundir.read_records(predictions)) == 4  # the first batch, whole; nothing of the second
    monkeypatch.setattr(batched_generation, "batched_greedy_generate", real)
    metrics = runner.run(config)
    ids = [json.loads(line)["sample_id"] for line in predictions.read_text().splitlines()]
    assert ids == [f"len400-depth{i:02d}" for i in range(6)] and metrics["n_samples"] == 6
    # Resumed, the last two samples ran as a batch of their own (filled up): the same tokens as in one go.
    whole = make_config(tmp_path / "whole", batch_size=4)
    runner.run(whole)
    assert outputs(config) == outputs(whole)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"batch_size": 0}, "batch_size=0 must be at least 1"),
        ({"batch_size": 2, "measure_selection": True}, "run it with batch_size=1"),
        ({"batch_size": 2, "measure_phases": True}, "run it with batch_size=1"),
    ],
)
def test_a_batch_setting_that_cannot_run_is_refused_in_one_line(changes, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        make_config(tmp_path, **changes)
    assert not any(tmp_path.iterdir())
