"""The reproduction pipeline: experiment configs compose, dry runs list the right jobs, the Slurm launcher config
says what the issue asks, a tiny sweep survives an interruption and is collected, the latency driver writes its
file. CPU only."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval import sweep
from tests.conftest import load_script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

EXPERIMENTS = sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml"))
PY = sys.executable


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import eval.plugins  # noqa: F401  the method defaults configs/method/*.yaml start from

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=sweep.normalise_overrides(overrides),
                             return_hydra_config=True)


def test_all_experiments_exist():
    assert {"table2", "ruler", "passkey", "gsm8k", "latency", "scaling"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_experiment_composes(experiment, launcher):
    cfg = compose([f"experiment={experiment}", f"hydra/launcher={launcher}"])
    if "bench" in cfg:
        # driver experiments: every method and the model they name have configs
        assert (REPO / "configs" / "model" / f"{cfg.bench.model}.yaml").exists()
        for method in cfg.bench.methods:
            assert (REPO / "configs" / "method" / f"{method}.yaml").exists(), method
        assert cfg.bench.decode_steps >= 64 and cfg.measure_phases
        return
    params = cfg.hydra.sweeper.params
    # an experiment is named after its task (the accuracy experiments: accuracy_<task>, accuracy_long_<task>)
    task = experiment.replace("table2", "longbench").removeprefix("accuracy_").removeprefix("long_")
    assert "method" in params and cfg.task.name == task
    # deterministic sweep dir (no ${now:}), so a resubmitted sweep reuses it
    assert "now" not in str(cfg.hydra.sweep.dir)
    for method in str(params.method).split(","):
        assert (REPO / "configs" / "method" / f"{method}.yaml").exists(), method


@pytest.mark.parametrize("experiment", ["table2", "ruler", "passkey", "gsm8k"])
def test_every_grid_point_composes_and_builds_a_run_config(experiment):
    """One job per swept method (the first value of every other swept key) composes into a RunConfig."""
    jobs, _ = sweep.expand([f"experiment={experiment}"], resolve_dirs=False)
    firsts: dict[str, list[str]] = {}
    for job in jobs:
        method = next(o for o in job.overrides if o.startswith("method="))
        firsts.setdefault(method, job.overrides)
    resolved, _ = sweep.expand(next(iter(firsts.values()))[:0] + [f"experiment={experiment}"] + [
        "method=" + ",".join(m.split("=", 1)[1] for m in firsts)] + _first_values(experiment))
    assert resolved and not [job.error for job in resolved if job.error]


def _first_values(experiment: str) -> list[str]:
    """Pin every swept key except method to its first value (keeps the test fast)."""
    cfg = compose([f"experiment={experiment}"])
    out = []
    for key, value in cfg.hydra.sweeper.params.items():
        if key in ("method",):
            continue
        first = str(value).split("],")[0] + "]" if str(value).startswith("[") else str(value).split(",")[0]
        out.append(f"{key}={first}")
    return out


def test_table2_grid_size_and_reference_runs():
    # 12 budgeted methods x 3 budgets x 16 datasets, plus the full cache once per dataset (budget null)
    jobs, base = sweep.expand(["experiment=table2"], resolve_dirs=False)
    assert len(jobs) == 12 * 3 * 16 + 16
    full = [j for j in jobs if "method=full" in j.overrides]
    assert len(full) == 16 and all("budget=null" in j.overrides for j in full)
    assert [j for j in jobs if j.reference] == full  # the reference sweep's jobs, and only they, are flagged
    # a command-line override replaces the swept key (Hydra's BasicSweeper rule); naming the method also drops the
    # full-cache reference sweep (method=icecache asks for IceCache only)
    jobs, _ = sweep.expand(["experiment=table2", "method=icecache", "budget=128"], resolve_dirs=False)
    assert len(jobs) == 16 and all("method=icecache" in j.overrides for j in jobs)
    assert not any(j.reference for j in jobs)


def test_dry_run_lists_the_expected_jobs_and_the_slurm_array(tmp_path):
    overrides = ["experiment=table2", "model=tiny_llama", "method=snapkv,quest", "budget=64,256",
                 "task.datasets=[trec],[lcc]", f"output_root={tmp_path}", "hydra/launcher=slurm"]
    jobs, _ = sweep.expand(overrides, device="cpu")
    # 2 methods x 2 budgets x 2 datasets (the methods are named, so no full-cache reference sweep)
    assert len(jobs) == 8 and not [j.error for j in jobs if j.error]
    dirs = [j.run_dir for j in jobs]
    assert len(set(dirs)) == 8
    parts = sorted((d.parts[-3], d.parts[-2]) for d in dirs)
    assert parts == sorted([(m, f"budget-{b}") for m in ("snapkv", "quest") for b in (64, 256)] * 2)
    assert all(str(d).startswith(str(tmp_path / "longbench" / "tiny-llama")) for d in dirs)

    result = subprocess.run([PY, str(REPO / "scripts" / "sweep.py"), *overrides, "--dry-run"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "8 jobs: 8 distinct runs (0 done)" in result.stdout
    assert "--array=0-7%8" in result.stdout and "--gpus-per-node=1" in result.stdout
    assert "--requeue" in result.stdout and "--signal=USR2@120" in result.stdout
    assert result.stdout.count("python run.py ") == 8
    # without a method override the full cache comes in once per dataset, budget-free
    jobs, _ = sweep.expand(["experiment=table2", "model=tiny_llama", "budget=64", "task.datasets=[trec],[lcc]",
                            f"output_root={tmp_path}"], device="cpu", resolve_dirs=False)
    assert sum("method=full" in j.overrides and "budget=null" in j.overrides for j in jobs) == 2
    resolved, _ = sweep.expand(["experiment=table2", "model=tiny_llama", "budget=64", "task.datasets=[trec]",
                                f"output_root={tmp_path}"], device="cpu")
    assert [j.run_dir.parts[-3] for j in resolved if j.reference] == ["full"]


def test_dry_run_of_a_driver_experiment_prints_the_driver():
    result = subprocess.run([PY, str(REPO / "scripts" / "sweep.py"), "experiment=scaling", "--dry-run"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "scripts/bench/latency.py --experiment scaling" in result.stdout


def test_slurm_launcher_settings():
    launcher = compose(["hydra/launcher=slurm"]).hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.gpus_per_node == 1 and launcher.cpus_per_task >= 1 and launcher.mem_gb > 0
    assert launcher.timeout_min > 0 and launcher.array_parallelism >= 1
    assert launcher.max_num_timeout > 0  # requeue on timeout (preemption always requeues)
    assert launcher.additional_parameters.requeue is True


# ---------------------------------------------------------------------------------------------------------------
# A tiny sweep, interrupted, resumed and collected


def _second_method() -> str:
    for name in ("streaming_llm", "snapkv", "h2o", "oracle_topk"):
        if (REPO / "configs" / "method" / f"{name}.yaml").exists():
            return name
    pytest.skip("no second method config yet")


def _sweep_command(tmp_path: Path, method: str) -> list[str]:
    # 400 tokens: the passkey prompt's fixed text alone is 247 byte-tokens, so 200 cannot fit

    return [PY, str(REPO / "run.py"), "-m", "model=tiny_llama", f"method=full,{method}", "budget=32",
            "task=passkey", "task.lengths=[400]", "task.num_depths=2", f"output_root={tmp_path / 'runs'}",
            f"hydra.sweep.dir={tmp_path / 'sweeps'}"]


def _predictions(root: Path) -> dict[Path, list[str]]:
    return {p.parent: p.read_text().splitlines(keepends=True) for p in root.rglob("predictions.jsonl")}


def _unfinished_with_samples(root: Path) -> list[Path]:
    return [run_dir for run_dir, lines in _predictions(root).items()
            if lines and not (run_dir / "metrics.json").exists()]


def test_tiny_sweep_interrupted_resumed_and_collected(tmp_path):
    method = _second_method()
    command = _sweep_command(tmp_path, method)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HYDRA_FULL_ERROR": "1"}
    runs = tmp_path / "runs"

    # 1. start the sweep and kill it (SIGKILL, as a preempted node would) once a run has samples on disk but no
    # metrics.json. The kill races the tiny model; a lost race (a run finished between two polls) is retried from
    # scratch rather than turned into a test of something else.
    for _attempt in range(4):
        shutil.rmtree(runs, ignore_errors=True)
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   start_new_session=True)
        deadline = time.time() + 240
        while time.time() < deadline and process.poll() is None:
            if _unfinished_with_samples(runs):
                break
            time.sleep(0.005)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if _unfinished_with_samples(runs):
            break
    interrupted = _unfinished_with_samples(runs)
    assert interrupted, "every attempt's kill came between samples of finished runs: nothing was interrupted"
    # complete lines only: the kill itself may have torn one, which the resumed run must drop
    before = {run_dir: [line for line in lines if line.endswith("\n")] for run_dir, lines in _predictions(runs).items()}
    # and tear the last line of an unfinished run's file, as a kill in the middle of a write leaves it
    torn_dir = interrupted[0]
    with open(torn_dir / "predictions.jsonl", "a") as handle:
        handle.write('{"sample_id": "torn-')
    finished_before = {p.parent for p in runs.rglob("metrics.json")}
    assert len(finished_before) < 2

    # 2. resubmit the same sweep as is: it finishes, keeps what was written, writes no sample twice
    resumed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    after = _predictions(runs)
    metrics = sorted(runs.rglob("metrics.json"))
    assert len(metrics) == 2
    for run_dir, lines in after.items():
        ids = [json.loads(line)["sample_id"] for line in lines]
        assert len(ids) == len(set(ids)) == 2, run_dir  # two depths, each once; the torn line is gone
        kept = before.get(run_dir, [])
        assert lines[: len(kept)] == kept  # samples written before the kill are untouched

    # 3. a third submission finds everything done and rewrites nothing
    stamps = {p: p.stat().st_mtime_ns for p in metrics}
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.count("already done") == 2
    assert {p: p.stat().st_mtime_ns for p in metrics} == stamps
    assert finished_before <= {p.parent for p in metrics}

    # 4. collect, independent of the launcher
    out = tmp_path / "summary"
    collected = subprocess.run([PY, str(REPO / "scripts" / "collect.py"), str(runs), "--out", str(out),
                                "--no-plots"], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stderr
    import pandas as pd

    table = pd.read_csv(out / "passkey.csv")
    assert sorted(table["method"]) == sorted(["full", method])
    assert table["budget"].isna().tolist() == [m == "full" for m in table["method"]]  # full is budget-free
    runs_csv = pd.read_csv(out / "runs.csv")
    assert (runs_csv["n_samples"] == 2).all()


def test_bench_latency_driver_writes_its_file(tmp_path):
    method = _second_method()
    command = [PY, str(REPO / "scripts" / "bench" / "latency.py"), "--model", "tiny_llama", "--lengths", "48",
               "--methods", method, "--budget", "32", "--repeats", "1", "--warmup", "0", "--decode-steps", "64",
               "--bandwidth-probe-gib", "0.01", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    files = list(tmp_path.glob("latency_*.json"))
    assert len(files) == 1
    payload = json.loads(files[0].read_text())
    assert payload["provenance"]["git_commit"] is not None or "git_commit" in payload["provenance"]
    summary = {row["method"]: row for row in payload["summary"]}
    assert set(summary) == {"full", "full_static", method}  # both full caches are always measured alongside
    assert summary["full"]["tpot_ratio_to_full"] == 1.0
    assert summary["full_static"]["tpot_ratio_to_full_static"] == 1.0
    assert payload["complete"] is True
    assert payload["settings"]["host_read_gbps"] > 0 and payload["settings"]["host_first_touch_gbps"] > 0
    assert payload["settings"]["host_index_read_gbps"] > 0  # the rate on the index's own OpenMP threads
    for row in summary.values():
        assert row["tpot_s_median"] > 0 and row["tt2t_s_median"] > row["ttft_s_median"]
        assert row["phases_s"]  # measure_phases on: at least the model remainder
    # 64 decode steps per run (N >= 64), one measured round per method
    assert [m["decode_steps"] for m in payload["measurements"]] == [64, 64, 64]
    # the full caches load nothing; a page method's loads are counted per decode step
    assert summary["full"]["pages_loaded_per_step"] == summary["full_static"]["pages_loaded_per_step"] == 0
    assert all(row["bytes_to_gpu_per_step"] is not None for row in summary.values())
    assert "TPOT ms" in result.stdout

    short = subprocess.run(command[:-4] + ["--decode-steps", "8", "--out", str(tmp_path)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert short.returncode != 0 and "at least 64" in short.stderr


def test_a_latency_run_killed_midway_keeps_the_methods_it_finished(tmp_path, monkeypatch):

    import icecache.core.generation as generation

    bench = load_script("bench/latency")
    real, calls = generation.greedy_generate, []

    def killed_on_the_third(*args, **kwargs):  # full, full_static, then the method: killed as a time limit would
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "greedy_generate", killed_on_the_third)
    method = _second_method()
    arguments = ["--model", "tiny_llama", "--lengths", "48", "--methods", method, "--budget", "32",
                 "--repeats", "1", "--warmup", "0", "--decode-steps", "64", "--bandwidth-probe-gib", "0.01"]
    with pytest.raises(KeyboardInterrupt):
        bench.main([*arguments, "--out", str(tmp_path)])
    [path] = tmp_path.glob("latency_*.json")
    payload = json.loads(path.read_text())
    assert payload["complete"] is False
    assert [m["method"] for m in payload["measurements"]] == ["full", "full_static"]
    assert {row["method"] for row in payload["summary"]} == {"full", "full_static"}
    assert not list(tmp_path.glob("*.tmp"))

    # --resume measures only the method that is missing, into a file of the same name, and says so
    resumed_out = tmp_path / "resumed"
    counted = []
    monkeypatch.setattr(generation, "greedy_generate", lambda *a, **k: counted.append(1) or real(*a, **k))
    bench.main([*arguments, "--out", str(resumed_out), "--resume", str(path)])
    assert len(counted) == 1
    whole = json.loads((resumed_out / path.name).read_text())
    assert whole["complete"] is True and len(whole["resumed_by"]) == 1
    assert [(m["method"], m["process"]) for m in whole["measurements"]] == [
        ("full", 0), ("full_static", 0), (method, 1)]
    assert whole["measurements"][:2] == payload["measurements"]
    assert {row["method"] for row in whole["summary"]} == {"full", "full_static", method}

    # a finished file, or other settings, are refused in one line before anything is built
    with pytest.raises(SystemExit, match="not an unfinished latency file"):
        bench.main([*arguments, "--out", str(tmp_path), "--resume", str(resumed_out / path.name)])
    with pytest.raises(SystemExit, match="budget=32"):
        at = arguments.index("--budget")
        bench.main([*arguments[:at], "--budget", "64", *arguments[at + 2:], "--out", str(tmp_path),
                    "--resume", str(path)])


def test_a_method_out_of_memory_is_recorded_and_the_others_are_measured(tmp_path, monkeypatch):
    """A run that runs out of memory (a full cache at a context its GPU cannot hold) is recorded with its error and
    not run again, in later rounds or a resumption; the other methods are measured and their ratios to it are
    empty, not a crash."""
    import torch

    import icecache.core.generation as generation

    bench = load_script("bench/latency")
    real, calls = generation.greedy_generate, []

    def full_runs_out(*args, **kwargs):  # interleaved: full, full_static, the method, then the second round
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.\nmore detail")
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "greedy_generate", full_runs_out)
    method = _second_method()
    bench.main(["--model", "tiny_llama", "--lengths", "48", "--methods", method, "--budget", "32", "--repeats", "2",
                "--warmup", "0", "--decode-steps", "64", "--bandwidth-probe-gib", "0.01", "--out", str(tmp_path)])
    assert len(calls) == 5  # full's second round is not run
    [path] = tmp_path.glob("latency_*.json")
    payload = json.loads(path.read_text())
    assert payload["complete"] is True
    assert payload["out_of_memory"] == [{"context": 48, "method": "full", "process": 0, "stage": "during the run",
                                         "error": "GPU memory: CUDA out of memory. Tried to allocate 1.00 GiB."}]
    assert [m["method"] for m in payload["measurements"]] == ["full_static", method, "full_static", method]
    summary = {row["method"]: row for row in payload["summary"]}
    assert set(summary) == {"full_static", method}
    assert summary[method]["tpot_ratio_to_full"] is None and summary[method]["tpot_ratio_to_full_static"] > 0

    # any other error is the run's own and is raised
    monkeypatch.setattr(generation, "greedy_generate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bad")))
    with pytest.raises(RuntimeError, match="bad"):
        bench.main(["--model", "tiny_llama", "--lengths", "48", "--methods", method, "--budget", "32",
                    "--repeats", "1", "--warmup", "0", "--bandwidth-probe-gib", "0", "--out", str(tmp_path / "b")])


def test_a_full_cache_that_cannot_fit_its_gpu_is_refused_before_its_prefill(monkeypatch):
    """The full caches keep every token's KV on the GPU: where that cannot fit beside the model, the latency driver
    records it before a prefill that would run for minutes first; methods with a budget are left to run."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig

    from eval import latency

    # Llama-3.1-8B's geometry, 32 layers of 8 KV heads of 128: 128 KiB a token in bf16
    llama = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096)
    assert latency.full_kv_bytes(llama, 1, 2) == 128 * 1024
    model = SimpleNamespace(config=llama, dtype=torch.bfloat16)
    cuda = SimpleNamespace(type="cuda")
    full = SimpleNamespace(config=SimpleNamespace(budget=None))
    sparse = SimpleNamespace(config=SimpleNamespace(budget=256))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (64 * 2**30, 80 * 2**30))
    assert latency.gpu_shortfall(model, full, 2**19, cuda) is None  # 64 GiB of KV in 64 GiB free: it fits
    short = latency.gpu_shortfall(model, full, 2**19 + 1, cuda)
    assert short.startswith("GPU memory: its KV of 524289 tokens needs 64.0 GiB, and 64.0 of the GPU's 80.0 GiB")
    assert latency.gpu_shortfall(model, sparse, 2**22, cuda) is None
    assert latency.gpu_shortfall(model, full, 2**22, SimpleNamespace(type="cpu")) is None


def test_a_look_ahead_latency_row_carries_its_label_and_its_miss_rate(tmp_path):
    command = [PY, str(REPO / "scripts" / "bench" / "latency.py"), "--model", "tiny_llama", "--lengths", "300",
               "--methods", "icecache:lookahead=true", "--budget", "64", "--repeats", "1", "--warmup", "0",
               "--decode-steps", "64", "--bandwidth-probe-gib", "0.01", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    [path] = tmp_path.glob("latency_*.json")
    summary = {row["method"]: row for row in json.loads(path.read_text())["summary"]}
    row = summary["icecache:lookahead=true"]
    assert row["method_label"] == "icecache+lookahead" and summary["full"]["method_label"] == "full"
    # every decode step after the prompt's offload looks ahead in each owner layer below layer 0 (layers 2, 3)
    assert row["lookahead_searches_per_step"] == pytest.approx(2.0, abs=0.05)
    assert 0.0 <= row["lookahead_miss_rate"] <= 1.0
    assert row["search_gbps"] is None  # its query phase is a wait, not the search: no rate from it
    assert summary["full"]["lookahead_miss_rate"] is None
    # the row records every setting it ran with, so that a later default does not rename it (report/variants.py)
    assert row["method_config"]["lookahead"] is True and row["method_config"]["budget"] == 64
    from eval.report.variants import measured_variant

    assert measured_variant(row["method"], row["budget"], row["method_config"]) == "icecache:lookahead=true"


def test_bench_method_values_take_set_overrides_then_a_variants_own():
    import dataclasses

    from eval import latency
    from eval.plugins import method_class
    from icecache.errors import ConfigError

    plain = latency.method_values("icecache", 256, [])
    assert plain["name"] == "icecache" and plain["budget"] == 256 and plain["cuda_graph"] is True
    variant = latency.method_values("icecache:cuda_graph=false,cpu_threads=8", 256,
                                    ["icecache.cpu_threads=4", "icecache.n_sink_pages=1", "quest.x=1"])
    assert variant["cuda_graph"] is False and variant["cpu_threads"] == 8  # the variant's own setting wins
    assert variant["n_sink_pages"] == 1 and "x" not in variant  # --set applies to the base config, by name
    # every key of the method's config class is there to override, written once (its default) in the class
    assert set(variant) == {f.name for f in dataclasses.fields(method_class("icecache").config_class)}
    with pytest.raises(ConfigError, match="method.x"):  # a key the class does not have: one line
        latency.method_values("quest:x=1", 256, [])


def test_the_latency_settings_come_from_the_flags_then_the_experiment_then_the_defaults():
    from eval import latency
    from icecache.errors import ConfigError

    settings = latency.LatencySettings.compose({"experiment": "scaling", "lengths": [150000], "budget": None})
    assert settings.model == "qwen3_4b_2507" and settings.lengths == [150000] and settings.budget == 256
    assert settings.methods[:2] == ["full", "full_static"] and settings.layer_by_layer is True
    assert latency.LatencySettings.compose({"methods": ["quest", "full"]}).methods == ["full", "full_static", "quest"]
    with pytest.raises(ConfigError, match="no bench block"):
        latency.LatencySettings.compose({"experiment": "passkey"})
    with pytest.raises(ConfigError, match="at least 64"):
        latency.LatencySettings.compose({"decode_steps": 8})


def test_compare_runs_pairs_runs_by_task_model_method_budget_and_counts_identical_predictions(tmp_path):
    import compare_runs

    def make_run(root, config_hash, predictions, score):
        run_dir = root / "passkey" / "tiny" / "icecache" / "budget-64" / config_hash
        run_dir.mkdir(parents=True)
        lines = [json.dumps({"sample_id": sid, "prediction": text, "output_ids": [len(text)]})
                 for sid, text in predictions.items()]
        (run_dir / "predictions.jsonl").write_text("\n".join(lines) + "\n")
        (run_dir / "metrics.json").write_text(json.dumps({"score": score}))

    make_run(tmp_path / "a", "hash-a", {"s1": "12", "s2": "34", "s3": "56"}, 100.0)
    make_run(tmp_path / "b", "hash-b", {"s1": "12", "s2": "35", "s3": "56"}, 66.7)  # another config hash: paired
    result = compare_runs.compare(tmp_path / "a", tmp_path / "b")
    [pair] = result["pairs"]
    assert pair["run"] == "passkey/tiny/icecache/budget-64"
    assert (pair["n_samples"], pair["identical"], pair["differ"]) == (3, 2, ["s2"])
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 1  # a difference fails the check
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "a")]) == 0


def test_compare_runs_tells_a_cells_lengths_and_variants_apart_when_their_hashes_differ(tmp_path):
    """A curated grid holds, under one ``task/model/method/budget`` cell, a run per length and the look-ahead
    beside the plain method; a second pass with fewer samples has other hashes. Each run finds its own partner."""
    from eval.report.compare import compare

    def make_run(root, method, label, length, config_hash, predictions):
        run_dir = root / "ruler" / "tiny" / method / "budget-64" / config_hash
        run_dir.mkdir(parents=True)
        lines = [json.dumps({"sample_id": sid, "prediction": text, "output_ids": [len(text)]})
                 for sid, text in predictions.items()]
        (run_dir / "predictions.jsonl").write_text("\n".join(lines) + "\n")
        settings = {"task": {"name": "ruler", "lengths": [length]}}
        (run_dir / "metrics.json").write_text(json.dumps({"method_label": label, "settings": settings}))

    grid = {("icecache", "icecache", 16384): "a", ("icecache", "icecache", 32000): "b",
            ("icecache", "icecache+lookahead", 32000): "c"}
    for (method, label, length), text in grid.items():
        make_run(tmp_path / "before", method, label, length, f"h{length}{label[-1]}",
                 {"s1": text, "s2": text + "2", "s3": text + "3"})
    # the second pass: 32k only, two samples a run, other hashes; the look-ahead's second sample differs
    make_run(tmp_path / "after", "icecache", "icecache", 32000, "x1", {"s1": "b", "s2": "b2"})
    make_run(tmp_path / "after", "icecache", "icecache+lookahead", 32000, "x2", {"s1": "c", "s2": "other"})
    result = compare(tmp_path / "before", tmp_path / "after")
    by_run = {pair["run"]: (pair["n_samples"], pair["differ"]) for pair in result["pairs"]}
    assert by_run == {"ruler/tiny/icecache/budget-64 lengths=32000": (2, []),
                      "ruler/tiny/icecache/budget-64 icecache+lookahead lengths=32000": (2, ["s2"])}
    assert result["unpaired"] == ["ruler/tiny/icecache/budget-64/h16384e"]


def test_bench_host_step_times_the_parts_of_a_layer_step(tmp_path, capsys):

    bench_host_step = load_script("bench/host_step")
    from icecache import dci

    before = dci.KernelSettings.current()
    settings = [f"{dci.active_isa()}:32:256:1", "portable:0:0:2"]  # two settings taking turns on one layer
    path = bench_host_step.main(["--length", "2048", "--steps", "20", "--threads", "1", "--out", str(tmp_path),
                                 "--variants", *settings])
    assert dci.KernelSettings.current() == dci.KernelSettings.parse(settings[0])  # the first one's left in force
    before.apply()
    with pytest.raises(SystemExit):  # a malformed setting is the command line's one error, before any work
        bench_host_step.main(["--variants", "avx512:32"])
    assert "kernel settings are ISA:PREFETCH_ROWS:CHUNK_ROWS" in capsys.readouterr().err
    payload = json.loads(path.read_text())
    assert [v["kernel_settings"] for v in payload["variants"]] == settings
    assert payload["median_ms"] == payload["variants"][0]["median_ms"]  # the first setting's at the top
    for variant in payload["variants"]:
        seconds = variant["seconds"]
        assert len(seconds["host_step"]) == len(seconds["search"]) == len(seconds["stage"]) == 20
        for total, search, stage, rest in zip(seconds["host_step"], seconds["search"], seconds["stage"],
                                              seconds["rest"]):
            assert 0 < search < total and 0 < stage < total and rest == pytest.approx(total - search - stage)
        # random queries: most of the 12 selected pages of each of the 8 KV heads change at every step
        assert 0 < variant["pages_loaded_per_step"] <= 8 * 12
        assert variant["search_phases_ms"]["scan"] > 0
    assert payload["provenance"]["torch"]


def test_a_latency_run_pins_host_buffers_once_for_all_its_methods(tmp_path):
    """The latency engine gives every method one host pool: the first offloading sequence pins its buffers, and every
    later round of every method reuses them (each measurement records what it had to allocate)."""
    command = [PY, str(REPO / "scripts" / "bench" / "latency.py"), "--model", "tiny_llama", "--lengths", "300",
               "--methods", "arkvale", "omnikv", "--budget", "64", "--repeats", "2", "--warmup", "0",
               "--decode-steps", "64", "--bandwidth-probe-gib", "0.01", "--out", str(tmp_path)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    payload = json.loads(next(tmp_path.glob("latency_*.json")).read_text())
    allocated = {(m["method"], m["round"]): m["host_buffers_allocated_bytes"] for m in payload["measurements"]}
    assert allocated[("full", 0)] == allocated[("full_static", 0)] == 0  # nothing offloaded
    assert allocated[("arkvale", 0)] > 0  # the first sequence that offloads pins the pool's buffers
    assert allocated[("omnikv", 0)] == 0  # a store of the same size: ArkVale's buffers, shared across methods
    assert all(allocated[(method, 1)] == 0 for method in ("full", "full_static", "arkvale", "omnikv"))
