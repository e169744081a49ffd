"""Batched decode (core.batch): every method decodes a batch whose rows equal the same sequences decoded alone.

A row's attention and selection run the batch-1 code on the row's inputs; what a batch changes is only the matrix
products of the transformer's own layers, which a BLAS may round differently for B rows than for one. With those
products computed row by row (``row_by_row_linear``), a batch must reproduce batch 1 bit for bit: tokens and logits,
for every method and variant on the four tiny architectures, with ragged rows that stop at different steps. Without
it, the full cache's logits must agree within float32 rounding.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from eval.plugins import METHODS, build_method, method_class
from icecache.core.batch import BatchCache
from icecache.core.batched_generation import batched_greedy_generate, decode_batch, prefill_row
from icecache.core.cache import HarnessCache
from icecache.core.cuda_driver import HostFunctions
from icecache.core.generation import GenerationRequest, greedy_generate
from icecache.core.method import Method, MethodConfig
from icecache.errors import ConfigError
from tests.conftest import ARCHITECTURES, tiny_model, tiny_model_on
from tests.test_method_invariants import method_config

CASES = [*METHODS.names(), *(f"{name}+{variant}" for name in METHODS.names()
                              for variant in method_class(name).variants)]


def case_config(case: str) -> dict:
    name = case.partition("+")[0]
    return method_config(case, 64) if method_class(name).uses_budget else {"name": name}


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Ragged rows (different prompt lengths) that stop at different steps (different max_new_tokens, one on an EOS).
def requests() -> list[GenerationRequest]:
    return [GenerationRequest(prompt(300, 1), 8), GenerationRequest(prompt(250, 2), 5),
            GenerationRequest(prompt(280, 3), 8)]


@pytest.fixture
def row_by_row_linear(monkeypatch):
    """``nn.Linear`` computed one batch row at a time: each row's product is then the batch-1 product."""
    def forward(self, x):
        if x.dim() < 3 or x.shape[0] == 1:
            return F.linear(x, self.weight, self.bias)
        return torch.cat([F.linear(x[b : b + 1], self.weight, self.bias) for b in range(x.shape[0])])

    monkeypatch.setattr(torch.nn.Linear, "forward", forward)


ON_CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


def alone(model, method, request: GenerationRequest):
    with HarnessCache(method) as cache:
        return greedy_generate(model, cache, request, keep_logits=True)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("case", CASES)
def test_a_batch_reproduces_each_sequence_alone(case, arch, device, row_by_row_linear):
    """On CUDA both sides replay captured steps (batch 1's graph, the batch's graph), and the batch's captured
    steps must equal its eager ones."""
    model, info = tiny_model_on(arch, device) if device == "cuda" else tiny_model(arch)[::2]
    method = build_method(case_config(case), info)
    batch_requests = requests()
    # The third row stops on an EOS: the first token its batch-1 run generates that differs from its first (so that
    # min_new_tokens=1 changes nothing before it), or that first token itself, with min_new_tokens=0.
    third = alone(model, method, batch_requests[2]).token_ids
    later = [token for token in third if token != third[0]]
    batch_requests[2].eos_token_ids = (later[0] if later else third[0],)
    batch_requests[2].min_new_tokens = 1 if later else 0
    singles = [alone(model, method, request) for request in batch_requests]
    rows, result = batched_greedy_generate(model, method, batch_requests, keep_logits=True)
    assert [row.generated for row in rows] == [single.token_ids for single in singles]
    assert [row.stop_reason for row in rows] == [single.stop_reason for single in singles]
    assert rows[2].stop_reason == "eos"
    for row, single in zip(rows, singles):
        assert len(row.logits) == len(single.logits)
        for ours, theirs in zip(row.logits, single.logits):
            assert torch.equal(ours, theirs)
    assert len(result.step_times_s) == 7  # the longest row's 7 decode steps, the others stepping along
    if device == "cuda":
        assert result.counters.get("graph_replays", 0) > 0 or not method.captures_decode_step
        eager_rows, _ = batched_greedy_generate(model, method, batch_requests, keep_logits=True, cuda_graph=False)
        for row, eager in zip(rows, eager_rows):
            assert row.generated == eager.generated
            assert all(torch.equal(ours, theirs) for ours, theirs in zip(row.logits, eager.logits))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("row_streams", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_rows_side_by_side_or_in_turn_reproduce_each_sequence_alone(case, row_streams, row_by_row_linear,
                                                                     monkeypatch):
    """With ``row_streams`` (the default) each row attends on a stream of its own, side by side, in eager and
    captured steps; without, the rows take turns on the model's stream. Either way the rows are their batch-1 selves
    bit for bit. A method with host work in its step (its channel in use) keeps its rows in turn."""
    from icecache.core.cache import KVHandle

    model, info = tiny_model_on("llama", "cuda")
    method = build_method(case_config(case), info)
    batch_requests = requests()
    singles = [alone(model, method, request) for request in batch_requests]
    attend, streams = KVHandle.attend, []

    def watched(self, query, attention_mask, scaling):
        if type(self) is KVHandle and query.shape[-2] == 1:
            streams.append(torch.cuda.current_stream(query.device))
        return attend(self, query, attention_mask, scaling)

    monkeypatch.setattr(KVHandle, "attend", watched)
    rows, result = batched_greedy_generate(model, method, batch_requests, keep_logits=True, row_streams=row_streams)
    assert [row.generated for row in rows] == [single.token_ids for single in singles]
    for row, single in zip(rows, singles):
        assert all(torch.equal(ours, theirs) for ours, theirs in zip(row.logits, single.logits))
    assert result.counters.get("graph_replays", 0) > 0 or not method.captures_decode_step
    if row_streams and "host_channel" not in result.counters:
        assert len(set(streams)) >= len(batch_requests)
    else:
        assert len(set(streams)) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("case", ["shadowkv", "arkvale"])
@pytest.mark.parametrize("row_groups", [1, 2])
def test_a_batch_of_one_length_steps_its_rows_together_as_each_alone(case, arch, row_groups, row_by_row_linear,
                                                                     monkeypatch):
    """Rows of one length share a layout, so ShadowKV and ArkVale step them together (``decode_rows``: one launch of
    each kernel for the batch, or for each of two groups of rows side by side on their streams); its tokens and
    logits, captured and eager, are still each row's alone."""
    from baselines.arkvale import ArkValeKV
    from baselines.shadowkv import ShadowKVKV

    layer_class = {"shadowkv": ShadowKVKV, "arkvale": ArkValeKV}[case]
    model, info = tiny_model_on(arch, "cuda")
    method = build_method(case_config(case), info)
    together = []
    rows_at_once = layer_class.decode_rows.__func__

    def counted(cls, layers, *args):
        out = rows_at_once(cls, layers, *args)
        together.append(out is not None)
        return out

    monkeypatch.setattr(layer_class, "decode_rows", classmethod(counted))
    batch_requests = [GenerationRequest(prompt(300, seed), 8) for seed in (4, 5, 6)]
    singles = [alone(model, method, request) for request in batch_requests]
    for cuda_graph in (True, False):
        together.clear()
        rows, _ = batched_greedy_generate(model, method, batch_requests, keep_logits=True, cuda_graph=cuda_graph,
                                          row_groups=row_groups)
        assert [row.generated for row in rows] == [single.token_ids for single in singles]
        for row, single in zip(rows, singles):
            assert all(torch.equal(ours, theirs) for ours, theirs in zip(row.logits, single.logits))
        assert together and all(together)  # every step of a sparse layer, the eager ones that capture included


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_full_cache_batch_differs_from_batch_one_only_by_rounding(arch):
    model, _, info = tiny_model(arch)
    for name in ("full", "full_static"):
        method = build_method({"name": name}, info)
        singles = [alone(model, method, request) for request in requests()]
        rows, _ = batched_greedy_generate(model, method, requests(), keep_logits=True)
        for row, single in zip(rows, singles):
            assert row.generated == single.token_ids
            for ours, theirs in zip(row.logits, single.logits):
                torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("case", ["icecache", "magicpig", "quest"])
def test_batches_of_growing_size_continue_their_rows(case, device, row_by_row_linear):
    """The throughput benchmark's pattern: rows prefilled one by one, batches of 1, 2, 3 over them, each continuing
    its rows where the last left them (on CUDA each batch captures a graph of its own, on the rows' one channel);
    every row's tokens are its batch-1 tokens."""
    model, info = tiny_model_on("llama", device) if device == "cuda" else tiny_model("llama")[::2]
    method = build_method(case_config(case), info)
    batch_requests = [GenerationRequest(prompt(200 + 20 * i, i), 12) for i in range(3)]
    singles = [alone(model, method, request) for request in batch_requests]
    channel = HostFunctions()
    caches = [HarnessCache(method, host_functions=channel) for _ in batch_requests]
    rows = []
    try:
        for size, (cache, request) in enumerate(zip(caches, batch_requests), start=1):
            rows.append(prefill_row(model, cache, request, reserved_new_tokens=12))
            decode_batch(model, BatchCache(caches[:size]), rows, max_steps=3)
    finally:
        for cache in caches:
            cache.close()
    for row, single in zip(rows, singles):
        assert row.generated == single.token_ids[: len(row.generated)]
    assert [len(row.generated) for row in rows] == [10, 7, 4]


def test_the_rows_of_an_icecache_batch_search_on_one_team():
    """A batch's rows take turns on the process's one search team: a team per row would keep every other row's
    workers spinning through a row's search, on the cores that search needs."""
    model, info = tiny_model("llama")[::2]
    method = build_method(case_config("icecache"), info)
    batch_requests = [GenerationRequest(prompt(200 + 20 * i, i), 4) for i in range(3)]
    channel = HostFunctions()
    caches = [HarnessCache(method, host_functions=channel) for _ in batch_requests]
    try:
        rows = [prefill_row(model, cache, request, reserved_new_tokens=4)
                for cache, request in zip(caches, batch_requests)]
        decode_batch(model, BatchCache(caches), rows, max_steps=3)
        teams = {kv.sequence.native.team_id for cache in caches for kv in cache.layer_kvs
                 if hasattr(kv, "sequence")}
    finally:
        for cache in caches:
            cache.close()
    assert len(teams) == 1 and 0 not in teams


def test_a_batch_refuses_what_it_cannot_run():
    model, _, info = tiny_model("llama")
    method = build_method(case_config("quest"), info)
    other = build_method(case_config("quest"), info)
    channel = HostFunctions()
    with pytest.raises(ValueError, match="one method"):
        BatchCache([HarnessCache(method, host_functions=channel), HarnessCache(other, host_functions=channel)])
    with pytest.raises(ValueError, match="share one hand-off channel"):
        BatchCache([HarnessCache(method), HarnessCache(method)])
    cache = HarnessCache(method, host_functions=channel)
    row = prefill_row(model, cache, GenerationRequest(prompt(100, 1), 4))
    row.request = GenerationRequest(prompt(100, 1), 40)  # more steps than its buffers were announced for
    with pytest.raises(ValueError, match="reserved_new_tokens"):
        decode_batch(model, BatchCache([cache]), [row])
    cache.close()
    with pytest.raises(ConfigError, match="batch_size=0"):
        method.check_batch_size(0)


def test_a_method_that_cannot_batch_says_so_in_one_line():
    class OneAtATime(Method):
        """Decodes one sequence at a time (its selection state is shared by every sequence of the method)."""

        uses_budget = False
        batches_decode = False
        batch_refusal = "its selection state is shared by every sequence of the method"

        def make_sparse_layer(self, layer_idx, seq):
            raise AssertionError("never built")

    _, _, info = tiny_model("llama")
    method = OneAtATime(MethodConfig(name="one_at_a_time"), info)
    method.check_batch_size(1)
    with pytest.raises(ConfigError) as refused:
        batched_greedy_generate(None, method, requests())
    assert str(refused.value) == ("one_at_a_time decodes one sequence at a time (its selection state is shared by "
                                  "every sequence of the method): use batch_size=1")


def run_throughput(tmp_path, **given):
    from eval import throughput

    settings = throughput.ThroughputSettings.compose({
        "model": "tiny_llama", "lengths": [200], "methods": ["quest", "icecache"], "budget": 64,
        "batch_sizes": [1, 2, 4], "decode_steps": 4, **given})
    return settings, json.loads(throughput.measure(settings, tmp_path).read_text())


def test_a_throughput_file_in_row_groups_records_them_and_measures_every_batch(tmp_path):
    """ShadowKV's batches in two groups of rows (on the CPU its rows decline the batched launch, and each group's
    rows attend one by one): every batch measured, the setting in the file for its table to say."""
    settings, payload = run_throughput(tmp_path, methods=["shadowkv"], batch_sizes=[1, 3], row_groups=2)
    assert payload["settings"]["row_groups"] == 2
    assert {(r["method"], r["batch_size"]) for r in payload["rows"]} == {("full_static", 1), ("full_static", 3),
                                                                         ("shadowkv", 1), ("shadowkv", 3)}
    # each row records the settings it ran with: the tables name it by them (eval/report/variants.py)
    from eval.report.variants import measured_variant

    for row in payload["rows"]:
        assert row["method_config"]["name"] == row["method"]
        assert measured_variant(row["method"], row["budget"], row["method_config"]) == row["method"]


def test_the_throughput_benchmark_measures_every_batch_up_to_the_first_out_of_memory(tmp_path, monkeypatch):
    import icecache.core.batched_generation as batched

    real_prefill = batched.prefill_row
    prefilled = {"icecache": 0}

    def prefill_until_the_third(model, cache, request, **kwargs):  # IceCache's third sequence does not fit
        if cache.method.config.name == "icecache":
            prefilled["icecache"] += 1
            if prefilled["icecache"] == 3:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_prefill(model, cache, request, **kwargs)

    monkeypatch.setattr(batched, "prefill_row", prefill_until_the_third)
    _, payload = run_throughput(tmp_path)
    assert payload["complete"] and payload["kind"] == "throughput"
    measured = {(r["method"], r["batch_size"]) for r in payload["rows"]}
    assert measured == {("full_static", 1), ("full_static", 2), ("full_static", 4), ("quest", 1), ("quest", 2),
                        ("quest", 4), ("icecache", 1), ("icecache", 2)}
    [limit] = payload["limits"]
    assert (limit["method"], limit["batch_size"], limit["kind"], limit["stage"]) == ("icecache", 4, "gpu", "prefill")
    for row in payload["rows"]:
        assert row["tokens_per_s"] == pytest.approx(row["batch_size"] / row["tpot_s"])
        assert len(row["step_times_s"]) == 4 and len(row["positions"]) == row["batch_size"]
    rows = {(r["method"], r["batch_size"]): r for r in payload["rows"]}
    # Rows continue from batch to batch: the first row has stepped through every earlier batch.
    assert rows[("quest", 4)]["positions"][0] == 200 + 3 * 4
    assert rows[("quest", 4)]["positions"][3] == 200 + 4
    # IceCache copies selected pages from host memory at every step; the GPU-resident caches copy nothing.
    assert rows[("icecache", 2)]["bytes_to_gpu_per_step"] > 0
    assert rows[("full_static", 4)]["bytes_to_gpu_per_step"] == rows[("quest", 4)]["bytes_to_gpu_per_step"] == 0
    summary = {entry["method"]: entry for entry in payload["summary"]}
    assert summary["icecache"]["largest_batch"] == 2 and summary["icecache"]["first_failed_batch"] == 4
    assert summary["full_static"]["best_over_reference"] == pytest.approx(1.0)
    assert payload["provenance"]["torch"]


def test_the_rows_that_fit_before_a_prefill_runs_out_of_memory_are_measured_as_the_largest_batch(tmp_path,
                                                                                                monkeypatch):
    """Quest's fourth sequence does not fit, in the batch of 4: its three rows are decoded as its largest batch (a
    best throughput that the batch sizes given would miss), and the failed row's cache is closed first, and what the
    failed prefill's frames held is gone by then. When those three do not fit either, nothing more is recorded."""
    import weakref

    import icecache.core.batched_generation as batched

    real_prefill = batched.prefill_row
    real_decode = batched.decode_batch
    closed: list[int] = []
    attempts = {"quest": 0}
    held_by_failed_prefill: list[weakref.ref] = []
    alive_at_largest_fit: list[bool] = []

    def prefill(model, cache, request, **kwargs):
        if cache.method.config.name == "quest":
            attempts["quest"] += 1
            if attempts["quest"] == 4:
                real_close = cache.close
                cache.close = lambda: (closed.append(attempts["quest"]), real_close())[1]
                activations = torch.zeros(16)  # on a GPU: the chunk's activations, the KV being written
                held_by_failed_prefill.append(weakref.ref(activations))
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_prefill(model, cache, request, **kwargs)

    def watched_decode(model, batch, rows, **kwargs):
        if len(rows) == 3:
            alive_at_largest_fit.append(held_by_failed_prefill[0]() is not None)
        return real_decode(model, batch, rows, **kwargs)

    monkeypatch.setattr(batched, "prefill_row", prefill)
    monkeypatch.setattr(batched, "decode_batch", watched_decode)
    _, payload = run_throughput(tmp_path, methods=["quest"], batch_sizes=[1, 2, 4])
    quest = {r["batch_size"]: r for r in payload["rows"] if r["method"] == "quest"}
    assert sorted(quest) == [1, 2, 3] and quest[3].get("at_memory_limit") and not quest[2].get("at_memory_limit")
    assert len(quest[3]["positions"]) == 3 and closed == [4]
    assert alive_at_largest_fit and not any(alive_at_largest_fit)
    [limit] = payload["limits"]
    assert (limit["batch_size"], limit["stage"], limit["rows_prefilled"]) == (4, "prefill", 3)
    summary = {entry["method"]: entry for entry in payload["summary"]}
    assert summary["quest"]["largest_batch"] == 3 and summary["quest"]["first_failed_batch"] == 4

    attempts["quest"] = 0
    held_by_failed_prefill.clear()

    def decode(model, batch, rows, **kwargs):  # the three rows that fit run out of memory in their decode too
        if len(rows) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real_decode(model, batch, rows, **kwargs)

    monkeypatch.setattr(batched, "decode_batch", decode)
    _, payload = run_throughput(tmp_path / "again", methods=["quest"], batch_sizes=[1, 2, 4])
    assert sorted(r["batch_size"] for r in payload["rows"] if r["method"] == "quest") == [1, 2]
    assert [(lim["method"], lim["batch_size"]) for lim in payload["limits"]] == [("quest", 4)]


def test_a_method_that_ran_out_of_memory_leaves_no_row_alive_for_the_next(tmp_path, monkeypatch):
    """full_static runs out of memory at its third sequence; when quest prefills its first, none of full_static's
    caches is alive (the batch and the decode result of its last batch held them: on a GPU, its KV)."""
    import weakref

    import icecache.core.batched_generation as batched

    real_prefill = batched.prefill_row
    earlier: list[weakref.ref] = []
    alive_when_quest_began: list[int] = []

    def prefill(model, cache, request, **kwargs):
        name = cache.method.config.name
        if name == "full_static":
            if len(earlier) == 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            earlier.append(weakref.ref(cache))
        elif not alive_when_quest_began:
            alive_when_quest_began.append(sum(ref() is not None for ref in earlier))
        return real_prefill(model, cache, request, **kwargs)

    monkeypatch.setattr(batched, "prefill_row", prefill)
    _, payload = run_throughput(tmp_path, methods=["quest"], batch_sizes=[1, 2, 4])
    assert len(earlier) == 2 and alive_when_quest_began == [0]
    assert {(lim["method"], lim["batch_size"]) for lim in payload["limits"]} == {("full_static", 4)}
    assert {(r["method"], r["batch_size"]) for r in payload["rows"]} >= {("quest", 4), ("full_static", 2)}


def test_a_killed_throughput_run_resumes_without_repeating_a_row(tmp_path):
    from eval import throughput

    settings, payload = run_throughput(tmp_path, methods=["quest"], batch_sizes=[1, 2])
    path = next(tmp_path.glob("throughput_*.json"))
    # As if killed during quest's batch of 2: full_static finished, quest has one row of two.
    payload["complete"] = False
    payload["finished"] = [[200, "full_static"]]
    payload["rows"] = [r for r in payload["rows"] if (r["method"], r["batch_size"]) != ("quest", 2)]
    path.write_text(json.dumps(payload))
    out = tmp_path / "resumed"
    resumed = json.loads(throughput.measure(settings, out, resume=path).read_text())
    assert resumed["complete"]
    keys = [(r["method"], r["batch_size"]) for r in resumed["rows"]]
    assert sorted(keys) == [("full_static", 1), ("full_static", 2), ("quest", 1), ("quest", 2)]
    assert resumed["rows"][:2] == payload["rows"][:2]  # the finished method's rows stand as measured
    with pytest.raises(ConfigError, match="complete"):
        throughput.measure(settings, tmp_path / "again", resume=out / path.name)
    # A file begun on a GPU is not completed on another machine: its rows would compare two machines.
    payload["provenance"]["gpu"] = "NVIDIA H200"
    path.write_text(json.dumps(payload))
    with pytest.raises(ConfigError, match="began on NVIDIA H200 and this machine has no GPU"):
        throughput.measure(settings, tmp_path / "elsewhere", resume=path)
    assert not (tmp_path / "elsewhere").exists()
    with pytest.raises(ConfigError, match="batch_sizes"):
        throughput.read_unfinished(path, throughput.ThroughputSettings.compose(
            {"model": "tiny_llama", "lengths": [200], "methods": ["quest"], "budget": 64, "batch_sizes": [1, 2, 4],
             "decode_steps": 4}))


def test_throughput_settings_are_checked_in_one_line():
    from eval import throughput

    with pytest.raises(ConfigError, match="increasing whole numbers"):
        throughput.ThroughputSettings.compose({"batch_sizes": [4, 2]})
    with pytest.raises(ConfigError, match="at least 4"):
        throughput.ThroughputSettings.compose({"decode_steps": 2})
    with pytest.raises(ConfigError, match="unknown throughput settings: batch"):
        throughput.ThroughputSettings.compose({"batch": 2})
    with pytest.raises(ConfigError, match="--row-groups 0"):
        throughput.ThroughputSettings.compose({"row_groups": 0})
    assert throughput.ThroughputSettings.compose({"methods": ["quest"]}).methods == ["full_static", "quest"]


def test_only_allocation_failures_count_as_a_memory_limit():
    from eval import throughput
    from eval.latency import allocation_failure  # the latency and throughput drivers' one test

    assert allocation_failure(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate")) == "gpu"
    assert allocation_failure(RuntimeError("cuMemHostAlloc failed with CUDA driver error 2")) == "host"
    assert allocation_failure(throughput.HostMemoryForecast("3.0 GiB left")) == "host"
    assert allocation_failure(RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    assert allocation_failure(ValueError("out of memory")) is None


def test_busy_time_is_the_union_of_the_kernels_inside_the_window():
    from eval.throughput import busy_time

    # Two overlapping kernels (0-4, 2-6), one alone (8-9), one outside the window, one cut by its end.
    kernels = [(2.0, 6.0), (0.0, 4.0), (8.0, 9.0), (20.0, 30.0), (9.5, 12.0)]
    assert busy_time(kernels, (0.0, 10.0)) == (pytest.approx(7.5), pytest.approx(9.5))
    assert busy_time(kernels, (3.0, 5.0)) == (pytest.approx(2.0), pytest.approx(3.0))
    assert busy_time([], (0.0, 1.0)) == (0.0, 0.0)


def test_a_step_profile_leaves_out_the_eager_and_capturing_steps():
    from types import SimpleNamespace

    from eval.throughput import step_profile
    from icecache.core.batched_generation import STEP_RANGE

    def event(name, start, end, device="CPU", annotation=False):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                               device_type=SimpleNamespace(name=device), is_user_annotation=annotation)

    steps = [event(STEP_RANGE, 1000 * i, 1000 * i + 800) for i in range(4)]  # 0.8 ms each
    # Each range shows on the GPU's timeline too, over its kernels: neither a step nor work.
    steps += [event(STEP_RANGE, 1000 * i + 10, 1000 * i + 790, "CUDA", annotation=True) for i in range(4)]
    kernels = [event("eager_kernel", 100, 700, "CUDA")]  # in the first step: left out
    for i in (2, 3):  # two kernels side by side, then one after
        kernels += [event("wide", 1000 * i, 1000 * i + 400, "CUDA"), event("narrow", 1000 * i + 100,
                                                                           1000 * i + 300, "CUDA"),
                    event("narrow", 1000 * i + 500, 1000 * i + 600, "CUDA")]
    found = step_profile(steps + kernels + [event("aten::mm", 2000, 2100)])
    assert found["steps"] == 2
    assert found["wall_ms"] == pytest.approx(0.8)
    assert found["gpu_busy_ms"] == pytest.approx(0.5)
    assert found["kernel_ms"] == pytest.approx(0.7)
    assert found["kernels"] == 3
    assert [(k["kernel"], k["ms"], k["launches"]) for k in found["top_kernels"]] == [
        ("wide", pytest.approx(0.4), 1), ("narrow", pytest.approx(0.3), 2)]
    assert step_profile(steps) is None  # no kernel: a CPU run
    assert step_profile(steps[:2] + steps[4:] + kernels) is None  # no step past the unprofiled ones


def test_a_profiled_throughput_run_steps_past_its_timed_steps_with_room_for_them(tmp_path):
    settings, payload = run_throughput(tmp_path, methods=["quest"], batch_sizes=[1, 2], profile_steps=2)
    assert settings.steps_per_batch == 4 + 2 + 2
    rows = {(r["method"], r["batch_size"]): r for r in payload["rows"]}
    # Each batch steps its rows through its timed and its profiled steps: the first row through both batches'.
    assert rows[("quest", 2)]["positions"] == [200 + 2 * 8, 200 + 8]
    assert all(row["profile"] is None for row in payload["rows"])  # no kernels on a CPU
    assert len(rows[("quest", 2)]["step_times_s"]) == 4


def test_each_step_of_a_batch_is_a_named_range_in_a_profile():
    from torch.profiler import ProfilerActivity, profile

    from icecache.core.batched_generation import STEP_RANGE

    model, info = tiny_model("llama")[::2]
    method = build_method({"name": "quest", "budget": 64, **method_class("quest").test_settings}, info)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batched_greedy_generate(model, method, requests()[:2])
    steps = [e for e in prof.events() if e.name == STEP_RANGE]
    assert len(steps) == max(r.max_new_tokens for r in requests()[:2]) - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_profiled_gpu_batch_records_its_kernels_and_busy_time(tmp_path):
    _, payload = run_throughput(tmp_path, methods=["quest"], batch_sizes=[1, 2], profile_steps=2, device="cuda")
    for row in payload["rows"]:
        found = row["profile"]
        assert found["steps"] == 2 and found["kernels"] > 0 and found["top_kernels"]
        assert 0 < found["gpu_busy_ms"] <= found["wall_ms"] * 1.01
        assert found["kernel_ms"] >= found["gpu_busy_ms"] * 0.99
