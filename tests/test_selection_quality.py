"""The selection-quality diagnostic (``measure_selection``, icecache/core/selection_quality.py) for every registered
method on the tiny models: what it records equals a direct computation from the traced selection, the share is 1
when the budget covers the sequence, the oracle of the same size is never below the method, and measuring changes
no token or logit."""

from __future__ import annotations

import pytest
import torch

from eval.plugins import METHODS, build_method, method_class
from icecache.core.cache import HarnessCache
from icecache.core.generation import GenerationRequest, greedy_generate
from tests.conftest import ARCHITECTURES, tiny_model, tiny_model_on

ALL_METHODS = METHODS.names()
SPARSE_METHODS = [name for name in ALL_METHODS if method_class(name).uses_budget]
# Each sparse method on one architecture, in turn, so that every architecture is measured without running all 40.
METHOD_ARCH = [(name, ARCHITECTURES[i % len(ARCHITECTURES)]) for i, name in enumerate(SPARSE_METHODS)]
PROMPT, NEW = 300, 6


def method_config(name: str, budget: int) -> dict:
    cls = method_class(name)
    return {"name": name, "budget": budget, **cls.test_settings} if cls.uses_budget else {"name": name}


def prompt_ids(n: int, seed: int = 7) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def measured_run(name: str, arch: str, budget: int, n_prompt: int = PROMPT, record: bool = False, **kwargs):
    """(result, per-layer records of every decode step: (query, keys so far, attended, scaling)) of one measured
    generation; the records come from the layers themselves, beside the meter."""
    model, _, info = tiny_model(arch)
    method = build_method(method_config(name, budget), info)
    cache = HarnessCache(method, measure_selection=True)
    steps: dict[int, list] = {}
    if record:
        for kv in cache.layer_kvs[method.config.n_dense_layers:]:
            keys: list[torch.Tensor] = []

            def prefill(query, key, value, mask, scaling, kv=kv, keys=keys, original=kv.prefill):
                keys.append(key[0].clone())
                return original(query, key, value, mask, scaling)

            def decode(query, key, value, scaling, kv=kv, keys=keys, original=kv.decode):
                keys.append(key[0].clone())
                out = original(query, key, value, scaling)
                steps.setdefault(kv.layer_idx, []).append(
                    (query[0, :, 0].clone(), torch.cat(keys, dim=1), kv.last_attended.clone(), scaling))
                return out

            kv.prefill, kv.decode = prefill, decode
    result = greedy_generate(model, cache, GenerationRequest(prompt_ids(n_prompt), NEW), **kwargs)
    return result, steps


def direct(query, keys, attended, scaling):
    """Mass, top-count mass and count of each query head, written out head by head."""
    n_tokens = keys.shape[1]
    assert not attended[:, n_tokens:].any()  # a trace wider than the tokens seen is False past them
    attended = attended[:, :n_tokens]
    group = query.shape[0] // keys.shape[0]
    rows = []
    for head in range(query.shape[0]):
        scores = (keys[head // group].double() @ query[head].double()) * scaling
        probs = torch.softmax(scores, dim=0)
        chosen = attended[head]
        count = int(chosen.sum())
        rows.append((float(probs[chosen].sum()), float(probs.sort(descending=True).values[:count].sum()), count))
    return rows


@pytest.mark.parametrize("name,arch", METHOD_ARCH + [("full", "llama"), ("full_static", "qwen3")])
def test_recorded_share_equals_a_direct_computation_from_the_traced_selection(name, arch):
    result, steps = measured_run(name, arch, 64, record=True)
    selection = result.selection
    assert selection["layers"] == sorted(steps) and selection["steps"] == NEW - 1
    for position, layer in enumerate(selection["layers"]):
        rows = [row for step in steps[layer] for row in direct(*step)]
        assert len(rows) == (NEW - 1) * tiny_model(arch)[2].n_heads
        mass, oracle, count = (sum(column) / len(rows) for column in zip(*rows))
        assert selection["mass"][position] == pytest.approx(mass, abs=2e-6)
        assert selection["oracle_mass"][position] == pytest.approx(oracle, abs=2e-6)
        assert selection["attended"][position] == pytest.approx(count, abs=1e-3)
    budget_free = not method_class(name).uses_budget
    assert (min(selection["mass"]) == pytest.approx(1.0)) == budget_free  # 64 of ~300 tokens hold less
    if method_class(name).traces_in_graph:  # one trace shape for the whole sequence, as a captured step needs
        assert {step[2].shape for layer in steps.values() for step in layer} == {
            (tiny_model(arch)[2].n_heads, PROMPT + NEW)}


@pytest.mark.parametrize("name", SPARSE_METHODS)
def test_share_is_one_when_the_budget_covers_every_token(name):
    result, _ = measured_run(name, "llama", 256, n_prompt=120)  # 126 tokens at most
    selection = result.selection
    assert selection["mass"] == pytest.approx([1.0] * len(selection["layers"]), abs=1e-9)
    assert selection["oracle_mass"] == pytest.approx(selection["mass"], abs=1e-9)
    mean_tokens = 120 + NEW / 2  # decode steps at 121 .. 125 tokens
    assert selection["attended"] == pytest.approx([mean_tokens] * len(selection["layers"]), abs=1e-3)


@pytest.mark.parametrize("name,arch", METHOD_ARCH)
def test_the_oracle_of_the_same_size_is_never_below_the_method(name, arch):
    selection = measured_run(name, arch, 64)[0].selection
    assert max(selection["attended"]) <= 64
    for mass, oracle in zip(selection["mass"], selection["oracle_mass"]):
        assert 0.0 < mass <= oracle + 1e-9 <= 1.0 + 1e-9


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_oracle_topk_holds_exactly_the_oracle_mass(arch):
    """Its selection is the top ``budget`` keys by q.k, i.e. the top of each head's softmax: the oracle's set."""
    selection = measured_run("oracle_topk", arch, 64)[0].selection
    assert selection["mass"] == pytest.approx(selection["oracle_mass"], abs=1e-6)
    assert selection["attended"] == pytest.approx([64.0] * len(selection["layers"]))


@pytest.mark.parametrize("name", ALL_METHODS)
def test_measuring_changes_no_token_or_logit(name):
    model, _, info = tiny_model("mistral")
    request = GenerationRequest(prompt_ids(PROMPT, seed=3), NEW)
    results = []
    for measure in (False, True):
        cache = HarnessCache(build_method(method_config(name, 64), info), measure_selection=measure)
        assert (cache.seq.selection_meter is not None) == measure
        results.append(greedy_generate(model, cache, request, keep_logits=True, prefill_chunk_size=128))
    plain, measured = results
    assert plain.selection is None and measured.selection is not None
    assert measured.token_ids == plain.token_ids
    for ours, theirs in zip(measured.logits, plain.logits):
        assert torch.equal(ours, theirs)


def test_a_decode_step_that_traces_nothing_is_refused():
    model, _, info = tiny_model("llama")
    method = build_method(method_config("quest", 64), info)
    cache = HarnessCache(method, measure_selection=True)
    layer = cache.layer_kvs[-1]

    def untraced(query, key, value, scaling, original=layer.decode):
        out = original(query, key, value, scaling)
        layer.last_attended = None
        return out

    layer.decode = untraced
    with pytest.raises(RuntimeError, match="last_attended"):
        greedy_generate(model, cache, GenerationRequest(prompt_ids(PROMPT), NEW))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ALL_METHODS)
def test_a_measured_run_captured_in_a_cuda_graph_measures_what_the_eager_one_does(name):
    """On CUDA a measured run of a method that traces on the device replays its steps from a CUDA graph (the
    meter's work inside it); the others stay eager. Either way: the tokens of the unmeasured (default) run, and,
    captured, the measurement of the same run stepped eagerly."""
    model, info = tiny_model_on("llama", "cuda", torch.bfloat16)
    request = GenerationRequest(prompt_ids(PROMPT, seed=5), 24)
    results = {}
    for label, measure, graph in [("plain", False, True), ("captured", True, True), ("eager", True, False)]:
        cache = HarnessCache(build_method(method_config(name, 64), info), measure_selection=measure)
        results[label] = greedy_generate(model, cache, request, cuda_graph=graph)
    assert results["captured"].token_ids == results["plain"].token_ids == results["eager"].token_ids
    captured, eager = results["captured"], results["eager"]
    method = build_method(method_config(name, 64), info)
    replayed = captured.counters.get("graph_replays", 0)
    assert (replayed > 0) == (method.captures_decode_step and method.traces_in_graph), captured.counters
    assert captured.selection["steps"] == eager.selection["steps"] == 23
    for key in ("mass", "oracle_mass", "attended"):
        assert captured.selection[key] == pytest.approx(eager.selection[key], abs=1e-5), key


def test_a_measured_run_records_each_sample_and_summarises_them(tmp_path):
    """The runner's ``measure_selection``: its own run directory (an unmeasured run's settings and hash are as
    before), one record per sample with the per-layer means, metrics.json's summary the mean of those, and the
    generated tokens of the unmeasured run."""
    import json

    from eval.config import RunConfig
    from eval.rundir import read_records
    from eval.runner import run
    from tests.conftest import tiny_spec

    base = {"model": dict(vars(tiny_spec("llama"))), "method": method_config("quest", 64),
            "task": {"name": "passkey", "lengths": [400], "num_depths": 3}, "output_root": str(tmp_path)}
    plain = RunConfig.from_dict(dict(base))
    measured = RunConfig.from_dict({**base, "measure_selection": True})
    assert "measure_selection" not in plain.identity() and measured.identity()["measure_selection"] is True
    assert plain.output_dir() != measured.output_dir()
    metrics = [run(plain), run(measured)]
    plain_records, records = (read_records(c.output_dir() / "predictions.jsonl") for c in (plain, measured))
    assert [r["output_ids"] for r in records] == [r["output_ids"] for r in plain_records]
    assert "selection" not in metrics[0] and all("selection" not in r for r in plain_records)
    summary = metrics[1]["selection"]
    assert summary["layers"] == [2, 3] and summary["n_samples"] == 3
    for position in range(2):
        mean = sum(r["selection"]["mass"][position] for r in records) / 3
        assert summary["mass"][position] == pytest.approx(mean, abs=1e-6)
    assert summary["by_length"]["400"]["mean_mass"] == summary["mean_mass"]
    assert summary["mean_oracle_mass"] >= summary["mean_mass"]
    written = json.loads((measured.output_dir() / "metrics.json").read_text())
    assert written["selection"] == summary and "measure_selection: true" in (
        measured.output_dir() / "config.yaml").read_text()
    low, high = written["confidence"]["intervals"]["by_length.400"]
    assert low <= written["metrics"]["by_length"]["400"] <= high
