"""The accuracy table: bootstrap intervals, cells read from metrics.json payloads, TPOT matched from latency files,
the experiments that make it (every registered method), the host launcher (eval/sweep.py: parallel, deadline,
resume, curation) and the rendering into BENCHMARKS.md and results/summary. CPU only."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import sys
from pathlib import Path

import pytest

import eval.sweep as launcher
from eval.report import accuracy as A
from eval.report.bootstrap import bootstrap_intervals, paired_difference
from eval.tasks.base import build_task
from eval.tasks.ruler import aggregate_ruler
from tests.conftest import load_script

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))


def ruler_records(scores: dict[str, list[float]], length: int = 4096) -> list[dict]:
    return [{"score": s, "meta": {"task": task, "length": length}} for task, values in scores.items() for s in values]


# --------------------------------------------------------------------------------------------------------------
# Bootstrap


def test_intervals_resample_within_cells_and_bracket_the_task_s_own_numbers():
    # Every task's samples agree within it: resampling inside the (length, task) cells cannot move any score.
    constant = ruler_records({"niah_single_1": [1.0] * 10, "vt": [0.0] * 10})
    result = bootstrap_intervals(constant, aggregate_ruler, resamples=200)
    assert result["intervals"]["lengths.4096"] == [50.0, 50.0] and result["intervals"]["score"] == [50.0, 50.0]
    random.seed(0)
    mixed = ruler_records({"niah_single_1": [float(random.random() < 0.7) for _ in range(40)],
                           "qa_1": [float(random.random() < 0.3) for _ in range(40)]})
    point = aggregate_ruler(mixed)
    result = bootstrap_intervals(mixed, aggregate_ruler, resamples=500)
    for key, value in (("score", point["score"]), ("tasks.qa_1.4096", point["tasks"]["qa_1"][4096])):
        low, high = result["intervals"][key]
        assert low < value < high
    assert "n" not in result["intervals"] and not any(k.startswith("n_") for k in result["intervals"])
    assert bootstrap_intervals(mixed, aggregate_ruler, resamples=500) == result  # seeded


def test_a_proportion_s_interval_has_the_binomial_width():
    task = build_task({"name": "passkey", "lengths": [4096]})
    records = [{"score": float(i % 2), "first_integer": 0.0, "meta": {"length": 4096}} for i in range(100)]
    low, high = bootstrap_intervals(records, task.aggregate, resamples=2000)["intervals"]["by_length.4096"]
    half_width = 1.96 * (0.25 / 100) ** 0.5 * 100  # normal approximation: 9.8 points
    assert (high - low) / 2 == pytest.approx(half_width, abs=1.5) and low < 50 < high


def with_ids(records: list[dict]) -> list[dict]:
    return [{**record, "sample_id": f"s{i}"} for i, record in enumerate(records)]


def test_a_paired_difference_cancels_what_two_runs_share_and_pairs_only_the_same_samples():
    random.seed(1)
    # Each sample is easy or hard for both runs alike; the method misses one in ten of the easy ones.
    easy = [random.random() < 0.5 for _ in range(120)]
    tasks = ["niah_single_1", "qa_1", "vt"]
    reference = with_ids([{"score": float(e), "meta": {"task": tasks[i % 3], "length": 4096}}
                          for i, e in enumerate(easy)])
    method = [{**r, "score": r["score"] * float(i % 10 != 3)} for i, r in enumerate(reference)]
    paired = paired_difference(method, reference, aggregate_ruler, resamples=500)
    point = aggregate_ruler(method)["score"] - aggregate_ruler(reference)["score"]
    assert paired["difference"]["score"] == pytest.approx(point, abs=0.01) and point < 0
    low, high = paired["intervals"]["score"]
    assert low <= point <= high < 0  # the loss is real: the interval stays below zero
    own_width = [b - a for a, b in (bootstrap_intervals(run, aggregate_ruler, resamples=500)["intervals"]["score"]
                                    for run in (method, reference))]
    assert high - low < 0.75 * min(own_width)  # the spread of the samples' difficulty cancels
    # The same samples in another order pair the same way; a run with itself differs by nothing.
    assert paired_difference(method[::-1], reference, aggregate_ruler, resamples=500)["difference"] == \
        paired["difference"]
    itself = paired_difference(reference, reference, aggregate_ruler, resamples=200)
    assert itself["intervals"] and all(v == [0.0, 0.0] for v in itself["intervals"].values())
    assert set(itself["difference"].values()) == {0.0}
    # Other samples, or a sample missing from either side: nothing to pair.
    assert paired_difference(method[1:], reference, aggregate_ruler) is None
    assert paired_difference(method, reference[1:], aggregate_ruler) is None
    assert paired_difference([], [], aggregate_ruler) is None


def test_curating_pairs_each_run_with_the_full_cache_of_its_own_settings_and_only_over_its_samples(tmp_path):
    from eval.report.paired import attach_paired

    def run(name: str, method: str, length: int, scores: list[float], **extra) -> dict:
        folder = tmp_path / name
        folder.mkdir()
        records = with_ids([{"score": s, "first_integer": s, "meta": {"length": length}} for s in scores])
        (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        task = {"name": "passkey", "lengths": [length]}
        return {"task": "passkey", "model": "m", "method": method, "n_samples": len(scores), "config_hash": name,
                "settings": {"task": task, "model": {"name": "m"}}, "run_dir": str(folder), **extra}

    payloads = [run("full_a", "full", 400, [1, 1, 0, 0]), run("full_b", "full", 800, [1, 1, 1, 1]),
                run("quest_a", "quest", 400, [1, 0, 0, 0]), run("quest_b", "quest", 800, [0, 1, 1, 1]),
                run("other_samples", "quest", 400, [1, 0, 0]),  # 3 samples against the reference's 4
                run("kept", "h2o", 1600, [1], paired={"reference": "full", "difference": {"score": -5.0}})]
    assert attach_paired(payloads, lambda p: Path(p["run_dir"])) == 2
    by_name = {p["config_hash"]: p for p in payloads}
    assert by_name["quest_a"]["paired"]["difference"]["score"] == -25.0  # against full_a, not full_b
    assert by_name["quest_b"]["paired"]["difference"]["score"] == -25.0
    assert by_name["quest_b"]["paired"]["reference_run"] == "full_b"
    assert "paired" not in by_name["other_samples"] and "paired" not in by_name["full_a"]
    assert by_name["kept"]["paired"]["difference"] == {"score": -5.0}  # no reference here: what it had stays


# --------------------------------------------------------------------------------------------------------------
# Cells from payloads


def payload(task: str, method: str, budget: int | None, length: int, score: float, *, mass: float | None = 0.9,
            n: int = 20, date: str = "2026-12-01T00:00:00+00:00", attended: float | None = 200.0) -> dict:
    if task == "passkey":
        metrics = {"score": score, "n": n, "by_length": {str(length): score}, "n_by_length": {str(length): n}}
        key = f"by_length.{length}"
    else:
        metrics = {"score": score, "n": n, "tasks": {"vt": {str(length): score}},
                   "n_per_task": {"vt": {str(length): n}}, "lengths": {str(length): score}}
        key = f"lengths.{length}"
    selection = None if mass is None else {"layers": [2, 3], "mass": [mass - 0.05, mass + 0.05],
                                           "oracle_mass": [0.95, 0.97], "mean_mass": mass, "mean_oracle_mass": 0.96,
                                           "attended": [attended, attended], "mean_attended": attended}
    out = {"task": task, "model": "smollm2-135m", "method": method, "budget": budget, "n_samples": n,
           "metrics": metrics, "confidence": {"intervals": {key: [score - 10, score + 5], "score": [0, 100]}},
           "latency": {"mean_attended_tokens": attended, "median_tpot_s": 0.5, "by_length": {
               str(length): {"mean_attended_tokens": attended}}},
           "settings": {"measure_selection": True}, "provenance": {"git_commit": "abc", "date": date, "gpu": "X"}}
    if selection:
        out["selection"] = {**selection, "by_length": {str(length): selection}}
    return out


def test_rows_take_every_number_from_the_payloads_and_the_share_of_full():
    payloads = [payload("passkey", "full", None, 4096, 80.0, mass=1.0, attended=None),
                payload("passkey", "quest", 256, 4096, 60.0, mass=0.8),
                payload("passkey", "quest", 256, 4096, 20.0, n=10, date="2027-01-01"),  # fewer samples: loses
                payload("passkey", "quest", 256, 8000, 40.0),  # no full at 8000: no share
                payload("ruler", "quest", 128, 4096, 33.3)]
    rows = A.accuracy_rows(payloads)
    assert [(r.task, r.length, r.method, r.budget) for r in rows] == [
        ("passkey", 4096, "full", None), ("passkey", 4096, "quest", 256), ("passkey", 8000, "quest", 256),
        ("ruler", 4096, "quest", 128)]
    quest = rows[1]
    assert (quest.score, quest.interval, quest.n, quest.attended, quest.mass) == (60.0, (50.0, 65.0), 20, 200.0, 0.8)
    assert quest.share_of_full == pytest.approx(75.0) and rows[2].share_of_full is None
    assert quest.mass_by_layer == pytest.approx([0.75, 0.85]) and quest.oracle_by_layer == [0.95, 0.97]
    assert rows[3].n == 20 and rows[3].interval == pytest.approx((23.3, 38.3))
    text = A.render_tables(rows)
    assert "**passkey, smollm2-135m**" in text and "**ruler, smollm2-135m**" in text
    line = next(li for li in text.splitlines() if li.startswith("| `quest` | 256"))
    assert "60.0 [50.0, 65.0] | 20 | 75% | 200 | 0.800 (0.960)" in line
    assert line.rstrip(" |").endswith("0.900 (0.960)")  # its 8k cell, no full cache there: "-" for the share
    assert "| - | 200 | 0.900" in line


def test_a_variant_s_runs_are_rows_of_their_own_after_their_method():
    from eval.report.methods import display_name, ordered
    from icecache.core.method import method_label

    exact = payload("ruler", "icecache", 256, 4096, 25.0)
    ahead = {**payload("ruler", "icecache", 256, 4096, 24.0), "method_label": "icecache+lookahead"}
    later = payload("ruler", "icecache_reuse", 256, 4096, 2.0)
    rows = A.accuracy_rows([later, ahead, exact])
    assert [(r.method, r.score) for r in rows] == [("icecache", 25.0), ("icecache+lookahead", 24.0),
                                                   ("icecache_reuse", 2.0)]
    assert ordered(["icecache_reuse", "icecache+lookahead", "icecache"]) == \
        ["icecache", "icecache+lookahead", "icecache_reuse"]
    assert display_name("icecache+lookahead") == "IceCache (lookahead)"
    # the runner's label: a declared variant's settings, all of them, else the method's name
    assert method_label({"name": "icecache", "budget": 256, "lookahead": True}) == "icecache+lookahead"
    assert method_label({"name": "icecache", "budget": 256, "lookahead": False}) == "icecache"
    assert method_label({"name": "icecache_reuse", "lookahead": True}) == "icecache_reuse+lookahead"
    assert method_label({"name": "quest", "budget": 256}) == "quest"
    # TPOT: the variant's row by the latency rows of its label, the method's own by its plain name only
    bench = [{"method": "icecache:lookahead=true", "method_label": "icecache+lookahead", "budget": 256,
              "context": 32768, "model": "smollm2-135m", "tpot_s_median": 0.05, "date": "2026-12-02"},
             {"method": "icecache:prompt_workers=1", "method_label": "icecache", "budget": 256, "context": 32768,
              "model": "smollm2-135m", "tpot_s_median": 0.09, "date": "2026-12-03"},
             {"method": "icecache", "method_label": "icecache", "budget": 256, "context": 32768,
              "model": "smollm2-135m", "tpot_s_median": 0.08, "date": "2026-12-01"}]
    assert A.tpot_for(rows[1], bench)["tpot_s_median"] == 0.05
    assert A.tpot_for(rows[0], bench)["tpot_s_median"] == 0.08


def test_tpot_is_matched_by_method_and_budget_then_model_then_context():
    row = A.rows_of_run(payload("passkey", "quest", 256, 4096, 60.0))[0]
    bench = [
        {"method": "quest", "budget": 256, "context": 8192, "model": "llama-3.1-8b-instruct", "tpot_s_median": 0.01,
         "date": "2026-12-01", "file": "a"},
        {"method": "quest", "budget": 256, "context": 32768, "model": "llama-3.1-8b-instruct", "tpot_s_median": 0.02,
         "date": "2026-12-02", "file": "b"},
        {"method": "quest", "budget": 128, "context": 4096, "model": "smollm2-135m", "tpot_s_median": 0.03,
         "date": "2026-12-01", "file": "c"},
    ]
    assert A.tpot_for(row, bench)["file"] == "a"  # same budget; nearest context
    at_16k = A.rows_of_run(payload("passkey", "quest", 256, 16384, 60.0))[0]
    assert A.tpot_for(at_16k, bench)["file"] == "b"  # as near 8k as 32k by ratio: the newer file
    bench[1]["date"] = bench[0]["date"]
    assert A.tpot_for(at_16k, bench)["file"] == "b"  # and of one date, the longer context
    bench.append({"method": "quest", "budget": 256, "context": 65536, "model": "SmolLM2-135M",
                  "tpot_s_median": 0.04, "date": "2026-11-01", "file": "d"})
    assert A.tpot_for(row, bench)["file"] == "d"  # the same model wins over a nearer context
    full = A.rows_of_run(payload("passkey", "full", None, 4096, 80.0))[0]
    assert A.tpot_for(full, bench) is None
    bench.append({"method": "full", "budget": 256, "context": 8192, "model": "x", "tpot_s_median": 0.05})
    assert A.tpot_for(full, bench)["tpot_s_median"] == 0.05  # budget-free: any budget
    # a task whose prompts have no set length (GSM8K) has no context to take a decode time at
    unsized = dataclasses.replace(row, task="gsm8k", length=None)
    assert A.tpot_for(unsized, bench) is None


# --------------------------------------------------------------------------------------------------------------
# The experiments


@pytest.mark.parametrize("experiment", ["accuracy_passkey", "accuracy_ruler"])
def test_the_accuracy_experiments_run_every_registered_method_at_three_budgets(experiment):
    from omegaconf import OmegaConf

    from eval.cli import hydra_context, sweep_jobs
    from eval.plugins import METHODS

    with hydra_context():
        _, base = sweep_jobs([f"experiment={experiment}"])
    params = OmegaConf.to_container(base.hydra.sweeper.params)
    swept = set(str(params["method"]).split(",")) | {base.reference_runs.method}
    missing = sorted(set(METHODS.names()) - swept)
    assert not missing, f"add {', '.join(missing)} to the method list of configs/experiment/{experiment}.yaml"
    # Passkey's character-calibrated filler makes an 8000-length prompt longer than SmolLM2's 8k context.
    lengths = {"accuracy_passkey": "[4096],[7500]", "accuracy_ruler": "[4096],[8000]"}[experiment]
    assert str(params["budget"]) == "128,256,512" and str(params["task.lengths"]) == lengths
    # every run of the grid decodes 16 samples a step, the full caches' too; the diagnostic is a grid of its own
    assert base.batch_size == 16 and base.measure_selection is False
    if experiment == "accuracy_ruler":
        assert len(base.task.tasks) == 13 and base.task.num_samples >= 10
    else:
        assert base.task.num_depths == 20


# --------------------------------------------------------------------------------------------------------------
# The host launcher (scripts/sweep.py --workers ...), curation, rendering


def test_the_host_launcher_runs_in_parallel_resumes_curates_and_the_table_renders(tmp_path):
    from eval.report import benchmarks as bench_tables
    sweep = (f"experiment=accuracy_passkey model=tiny_llama output_root={tmp_path / 'runs'} method=full,quest "
             "budget=128 task.lengths=[400] task.num_depths=2 "
             "measure_selection=true batch_size=1")
    out = tmp_path / "bench"
    assert launcher.main([*sweep.split(), "--deadline", "0", "--no-plots"]) == 3  # stopped before any job
    assert not list((tmp_path / "runs").rglob("metrics.json"))
    assert launcher.main([*sweep.split(), "--workers", "2", "--curate", "accuracy", "--out", str(out),
                          "--bench", str(tmp_path / "no_latency_files")]) == 0
    assert len(list((tmp_path / "runs").rglob("metrics.json"))) == 2
    curated = json.loads(next(out.glob("accuracy_tiny-llama_*.json")).read_text())
    assert {r["method"] for r in curated["runs"]} == {"full", "quest"} and curated["missing"] == []
    assert all(r["selection"]["layers"] == [2, 3] for r in curated["runs"])
    assert (out / "accuracy_vs_budget_tiny-llama.png").exists() and (out / "mass_by_layer_tiny-llama.png").exists()
    assert not (out / "accuracy_vs_tpot_tiny-llama.png").exists()  # no latency file times these methods
    assert launcher.main(["--sweep", sweep, "--no-plots"]) == 0  # everything done: nothing runs

    rendered = bench_tables.render_accuracy(out, {})
    rows = [line for line in rendered.splitlines() if line.startswith("| `")]
    assert [line.split("|")[1].strip() for line in rows] == ["`full`", "`quest`"]
    quest = [cell.strip() for cell in rows[1].strip("|").split("|")]
    run = next(r for r in curated["runs"] if r["method"] == "quest")
    full = next(r for r in curated["runs"] if r["method"] == "full")
    assert quest[1].startswith(f"{run['metrics']['by_length']['400']:.1f} [")  # passkey 400, budget 128
    # Both runs' predictions were on disk: the quest run carries its paired difference with the full cache.
    assert "paired" not in full and run["paired"]["reference"] == "full"
    difference = run["metrics"]["by_length"]["400"] - full["metrics"]["by_length"]["400"]
    assert run["paired"]["difference"]["by_length.400"] == pytest.approx(difference)
    low, high = run["paired"]["intervals"]["by_length.400"]
    assert low <= difference <= high and f" · Δ {difference:+.1f} [" in quest[1]  # beside the score, in its cell
    assert "**passkey, 400** (2 samples a cell)" in rendered and "| method | budget 128 |" in rendered
    mass = f"{run['selection']['mean_mass']:.3f} ({run['selection']['mean_oracle_mass']:.3f})"
    assert "accuracy_vs_budget_tiny-llama.png" in rendered

    from eval.report.summary import write_summary

    summary = write_summary([next(out.glob("accuracy_*.json"))], tmp_path / "summary", plots=False)
    accuracy_md = (tmp_path / "summary" / "accuracy.md").read_text()
    assert accuracy_md.count("| `quest` | 128 |") == 1
    assert mass in accuracy_md  # the attention mass is the summary's (the page leaves it to the curated file)
    assert len(summary.tables["accuracy"]) == 2
    # From the results tree itself the predictions are there too: the summary pairs the runs as curating does.
    tree = write_summary(tmp_path / "runs", tmp_path / "tree_summary", plots=False).tables["accuracy"]
    assert tree.set_index("method").loc["quest", "difference"] == pytest.approx(difference)
    assert tree.set_index("method")["difference"].isna().tolist() == [True, False]  # full, quest


def test_a_curated_file_reads_back_as_written_with_each_sample_on_a_line_of_its_own():
    samples = [{"sample_id": f"passkey/{i}", "score": float(i % 2), "meta": {"depths": [i / 3], "task": "t"}}
               for i in range(5)]
    payload = {"kind": "accuracy", "n_runs": 3, "runs": [
        {"method": "quest", "samples": samples, "metrics": {"score": 40.0}},
        {"method": "full", "samples": []},  # a run with no sample kept, and one with no samples field
        {"method": "h2o", "note": "@samples of run 0@ inside a value is left alone"}]}
    text = launcher.curated_json(payload)
    assert json.loads(text) == payload
    lines = text.splitlines()
    for sample in samples:
        assert sum(sample["sample_id"] in line for line in lines) == 1  # the whole sample on one line
        assert json.loads(next(line for line in lines if sample["sample_id"] in line).strip().rstrip(",")) == sample
    # everything else as indent=1 would write it, one key a line
    assert '   "method": "quest",' in lines and ' "kind": "accuracy",' in lines


def test_runs_split_into_shards_give_the_runs_unsplit(tmp_path):
    def sweep(root: str) -> str:
        return (f"experiment=accuracy_passkey model=tiny_llama output_root={tmp_path / root} method=full,quest "
                "budget=128 task.lengths=[400] task.num_depths=3")

    assert launcher.main(["--sweep", sweep("whole"), "--no-plots"]) == 0
    assert launcher.main(["--sweep", sweep("sharded"), "--shards", "2", "--workers", "2", "--no-plots"]) == 0
    for whole in sorted((tmp_path / "whole").rglob("metrics.json")):
        sharded = tmp_path / "sharded" / whole.relative_to(tmp_path / "whole")
        assert json.loads(sharded.read_text())["metrics"] == json.loads(whole.read_text())["metrics"]
        ids = [json.loads(line)["sample_id"] for line in (sharded.parent / "predictions.jsonl").open()]
        assert ids == [json.loads(line)["sample_id"] for line in (whole.parent / "predictions.jsonl").open()]
        assert sorted(p.name for p in sharded.parent.glob("predictions*")) == ["predictions.jsonl"]
    assert len(list((tmp_path / "sharded").rglob("metrics.json"))) == 2
    jobs = [launcher.Job([], Path("r"), values={"task": {}})]
    assert [(j.key, j.values["shard"], j.values["n_shards"]) for j in launcher.sharded(jobs, 2)] == [
        ("r#1/2", 0, 2), ("r#2/2", 1, 2)]
    assert launcher.sharded(jobs, 1) == jobs


def test_a_task_that_cannot_run_on_this_host_stops_the_host_launcher_before_any_worker(tmp_path, capsys):
    sweep = (f"experiment=accuracy_ruler model=tiny_llama output_root={tmp_path / 'runs'} method=full budget=128 "
             f"task.lengths=[400] task.num_samples=1 task.data_dir={tmp_path / 'no_ruler_data'}")
    assert launcher.main(["--sweep", sweep, "--workers", "2", "--no-plots"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "task ruler:" in errors[0] and "make ruler-data" in errors[0]
    assert not (tmp_path / "runs").exists()  # nothing started


def test_a_curated_file_of_another_kind_draws_its_figures_under_its_own_name(tmp_path):
    """``--curate selection`` (the long subject's selection diagnostic) writes selection_<model>_<date>.json and
    figures named after it, so that it never replaces the accuracy grid's file or figures."""
    sweep = (f"experiment=accuracy_passkey model=tiny_llama output_root={tmp_path / 'runs'} method=full,quest "
             "budget=128 task.lengths=[400] task.num_depths=2 "
             "measure_selection=true batch_size=1")
    out = tmp_path / "bench"
    assert launcher.main([*sweep.split(), "--workers", "1", "--curate", "selection", "--out", str(out),
                          "--bench", str(tmp_path / "no_latency_files")]) == 0
    assert len(list(out.glob("selection_tiny-llama_*.json"))) == 1 and not list(out.glob("accuracy_*.json"))
    assert not any((out / f"{figure}_tiny-llama.png").exists() for figure in ("accuracy_vs_budget", "mass_by_layer"))
    assert (out / "mass_by_layer_selection_tiny-llama.png").exists()
    assert (out / "accuracy_vs_budget_selection_tiny-llama.png").exists()
    # the file names its own figures, which the page shows beside its table (not the grid's of the same model)
    [curated] = out.glob("selection_tiny-llama_*.json")
    figures = json.loads(curated.read_text())["figures"]
    assert "accuracy_vs_budget_selection_tiny-llama.png" in figures and all((out / f).exists() for f in figures)


def test_a_fresh_host_puts_back_the_finished_runs_of_a_curated_file_instead_of_running_them(tmp_path):
    import shutil

    sweep = (f"experiment=accuracy_passkey model=tiny_llama output_root={tmp_path / 'runs'} method=full,quest "
             "budget=128 task.lengths=[400] task.num_depths=2")
    first, second = tmp_path / "first", tmp_path / "second"
    assert launcher.main(["--sweep", sweep, "--curate", "accuracy", "--out", str(first), "--no-plots"]) == 0
    curated = next(first.glob("accuracy_*.json"))
    shutil.rmtree(tmp_path / "runs")  # the next host has none of the runs' directories
    assert launcher.main(["--sweep", sweep, "--restore", str(curated), "--no-run", "--curate", "accuracy",
                          "--out", str(second), "--no-plots"]) == 0
    assert not list((tmp_path / "runs").rglob("predictions.jsonl"))  # nothing ran
    assert launcher.main(["--sweep", sweep, "--no-plots"]) == 0  # every job counts as done
    assert not list((tmp_path / "runs").rglob("predictions.jsonl"))
    before, after = (json.loads(next(folder.glob("accuracy_*.json")).read_text()) for folder in (first, second))
    assert after["missing"] == [] and len(after["runs"]) == 2
    # every number comes back, the paired difference included, though the predictions behind it are gone
    assert sorted(after["runs"], key=lambda r: r["run_dir"]) == sorted(before["runs"], key=lambda r: r["run_dir"])
    assert [r["method"] for r in after["runs"] if "paired" in r] == ["quest"]
    # Only runs of these sweeps come back, and a file that is not a curated one is refused in one line.
    other = (f"experiment=accuracy_passkey model=tiny_llama output_root={tmp_path / 'other'} method=full "
             "budget=128 task.lengths=[400] task.num_depths=2")
    assert launcher.main(["--sweep", other, "--restore", str(curated), "--dry-run"]) == 0
    assert not (tmp_path / "other").exists()
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(SystemExit, match="not a curated result file"):
        launcher.main(["--sweep", sweep, "--restore", str(tmp_path / "bad.json"), "--dry-run"])


def test_killing_the_host_launcher_stops_its_workers_and_the_next_call_resumes(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    sweep = (f"experiment=accuracy_passkey model=tiny_llama output_root={tmp_path / 'runs'} method=full "
             "budget=128 task.lengths=[400] task.num_depths=60")
    command = [sys.executable, str(REPO / "scripts" / "sweep.py"), *sweep.split()]
    driver = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    predictions = tmp_path / "runs"
    deadline = time.monotonic() + 300
    while not any(p.stat().st_size for p in predictions.rglob("predictions.jsonl")):  # a worker is mid-run
        assert driver.poll() is None and time.monotonic() < deadline, "the job ended before it could be killed"
        time.sleep(0.2)
    children = [int(pid) for pid in Path(f"/proc/{driver.pid}/task/{driver.pid}/children").read_text().split()]
    assert children
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) != 0
    def ended(pid: int) -> bool:  # gone, or a zombie waiting for init: it writes nothing more
        status = Path(f"/proc/{pid}/status")
        return not status.exists() or "State:\tZ" in status.read_text()

    deadline = time.monotonic() + 60
    while not all(ended(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(ended(pid) for pid in children), "a worker outlived its driver"
    assert not list(predictions.rglob("metrics.json"))
    assert launcher.main(["--sweep", sweep, "--no-plots"]) == 0  # the lock was released: it resumes
    [metrics] = predictions.rglob("metrics.json")
    [run_dir] = [metrics.parent]
    lines = (run_dir / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == len({json.loads(line)["sample_id"] for line in lines}) == 60  # none lost, none twice


def test_a_device_fault_ends_its_worker_and_the_job_runs_again_in_a_fresh_process(tmp_path):
    import dataclasses

    from tests import device_fault_jobs

    sweep = (f"experiment=accuracy_passkey model=tiny_llama output_root={tmp_path / 'runs'} method=full,quest "
             "budget=128 task.lengths=[400] task.num_depths=2").split()
    planned = launcher.plan([sweep], None)
    jobs = planned.runs
    assert len(jobs) == 2 and not planned.errors
    # One worker: its first job faults; a fresh process runs that job again before the queue's next one.
    finished, failed = launcher.run_all(jobs, 1, None, run=device_fault_jobs.fault_first_call)
    assert (finished, failed) == (2, [])
    calls = [line.split() for line in (tmp_path / "faults" / "calls").read_text().splitlines()]
    assert [method for method, _ in calls] == ["full", "full", "quest"]
    assert calls[0][1] != calls[1][1] == calls[2][1]  # the retry in a new process, which then goes on
    assert all(job.is_done() for job in jobs)

    # A job that faults in a fresh process too is reported, once, and the call ends.
    (tmp_path / "faults").rename(tmp_path / "faults_before")
    again = [dataclasses.replace(jobs[0], run_dir=tmp_path / "never")]
    finished, failed = launcher.run_all(again, 1, None, run=device_fault_jobs.always_fault)
    assert finished == 0 and len(failed) == 1 and device_fault_jobs.FAULT in failed[0]
    assert len(list((tmp_path / "faults").iterdir())) == 2  # two processes, one attempt each (and no calls log)
    assert launcher.is_device_fault(RuntimeError(device_fault_jobs.FAULT))
    assert not launcher.is_device_fault(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def test_a_job_out_of_gpu_memory_runs_again_alone_after_the_others(tmp_path):
    import dataclasses

    from tests import device_fault_jobs

    sweep = (f"experiment=accuracy_passkey model=tiny_llama output_root={tmp_path / 'runs'} method=full,quest,h2o "
             "budget=128 task.lengths=[400] task.num_depths=2").split()
    jobs = launcher.plan([sweep], None).runs
    assert len(jobs) == 3
    # Two workers: the first job to start runs out of memory; the other two finish, and only then, in a process of
    # its own, does it run again.
    finished, failed = launcher.run_all(jobs, 2, None, run=device_fault_jobs.out_of_memory_first_call)
    assert (finished, failed) == (3, [])
    calls = [line.split() for line in (tmp_path / "memory" / "calls").read_text().splitlines()]
    assert len(calls) == 4
    first_method, first_pid = calls[0]
    assert calls[-1][0] == first_method and sorted(method for method, _ in calls[1:]) == ["full", "h2o", "quest"]
    assert calls[-1][1] not in {pid for _, pid in calls[:-1]}  # a fresh process, started after the others ended
    assert first_pid in {pid for _, pid in calls[1:-1]}  # running out of memory did not end its worker
    assert all(job.is_done() for job in jobs)

    # Out of memory on its second attempt too: reported once, after two attempts.
    (tmp_path / "memory").rename(tmp_path / "memory_before")
    again = [dataclasses.replace(jobs[0], run_dir=tmp_path / "never")]
    finished, failed = launcher.run_all(again, 2, None, run=device_fault_jobs.always_out_of_memory)
    assert finished == 0 and len(failed) == 1 and "CUDA out of memory" in failed[0]
    assert len((tmp_path / "memory" / "calls").read_text().splitlines()) == 2
    assert launcher.is_out_of_memory(RuntimeError(device_fault_jobs.OUT_OF_MEMORY))
    assert not launcher.is_out_of_memory(RuntimeError(device_fault_jobs.FAULT))


def test_several_sweeps_read_each_model_once_and_keep_the_settings_they_composed(tmp_path, monkeypatch):
    from eval.cli import JobComposer, hydra_context, run_values
    from icecache.core import models

    reads = []
    real_model_info = models.model_info
    monkeypatch.setattr(models, "model_info", lambda spec: reads.append(spec.name) or real_model_info(spec))
    common = f"experiment=accuracy_passkey model=tiny_llama output_root={tmp_path} task.num_depths=2"
    sweeps = [f"{common} method=full,quest budget=128 task.lengths=[400]".split(),
              f"{common} method=quest budget=128,256 task.lengths=[400]".split()]
    planned = launcher.plan(sweeps, None)
    jobs = planned.runs
    assert not planned.errors and reads == ["tiny-llama"]  # one geometry read for both sweeps
    assert len(jobs) == 3  # (full), (quest, 128) and (quest, 256): the second sweep's (quest, 128) is the first's
    with hydra_context():
        composer = JobComposer()
        for job in jobs:  # the settings a worker gets are those a fresh composition of the job's overrides gives
            assert job.values == run_values(composer.compose(launcher.normalise_overrides(job.overrides)))


def test_without_accuracy_files_the_page_says_not_measured(tmp_path):
    from eval.report import benchmarks as bench_tables
    assert bench_tables.render_accuracy(tmp_path, {}).startswith("Not measured yet")
    assert bench_tables.render_page_quality(tmp_path, {}).startswith("Not measured yet")


def test_page_quality_files_render_their_means(tmp_path):
    from eval.report import benchmarks as bench_tables
    result = {"mean": {"token_topk": 0.9, "positional": 0.8, "dci": 0.7, "kmeans": 0.75, "dci_fixed": 0.69,
                       "dci_search": 0.6}, "prompt_tokens": [4000, 4001], "page_size": 16, "n_selected_pages": 12}
    for name, date, dci in (("page_quality_gpu_20261201-000000.json", "2026-12-01", 0.7),
                            ("page_quality_gpu_20261202-000000.json", "2026-12-02", 0.71)):
        result["mean"]["dci"] = dci
        (tmp_path / name).write_text(json.dumps({
            "settings": {"model": "smollm2_135m", "task": "passkey", "length": 4096, "budget": 256},
            "result": result, "provenance": {"date": date, "git_commit": "f" * 40}}))
    rendered = bench_tables.render_page_quality(tmp_path, {})
    body = [line for line in rendered.splitlines() if line.startswith("| gpu")]
    assert len(body) == 1 and "| 0.710 |" in body[0] and "20261202" in body[0] and "| 16 | 12 |" in body[0]


def test_the_tpot_figure_title_names_the_model_and_gpu_timed_and_no_files(tmp_path, monkeypatch):
    from eval.report import plots as P
    from eval.report import summary
    from eval.report.collect import reference_bench_rows

    bench = REPO / "results" / "bench"
    [curated] = sorted(bench.glob("accuracy_smollm2-135m_*.json"))[-1:]  # the page's SmolLM2 grid
    rows = A.accuracy_rows(json.loads(curated.read_text())["runs"])
    titles = []
    monkeypatch.setattr(P, "accuracy_vs_tpot_panels", lambda points, stem, title="": titles.append(title) or [])
    monkeypatch.setattr(P, "accuracy_vs_budget_panels", lambda *a, **k: [])
    monkeypatch.setattr(P, "mass_by_layer_panels", lambda *a, **k: [])
    summary.accuracy_figures(rows, reference_bench_rows(bench), tmp_path)
    [title] = titles
    assert len(title.splitlines()) == 1 and len(title) <= 120  # one line that does not set the figure's width
    # whose TPOT it is and on which GPU; the files are the page's
    assert "latency_" not in title and "llama-3.1-8b-instruct" in title and "NVIDIA H200" in title


def test_the_figures_tpots_come_from_the_folders_own_files_not_another_gpus_subfolder(tmp_path):
    from eval.report.collect import latest_bench, load_bench, reference_bench_rows

    def latency_file(path: Path, gpu: str, date: str, tpot: float) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "settings": {}, "provenance": {"gpu": gpu, "date": date},
            "summary": [{"method": "icecache", "model": "m", "budget": 256, "context": 32768, "tpot_s_median": tpot},
                        {"method": "full_static", "model": "m", "budget": None, "context": 32768,
                         "tpot_s_median": 0.01}]}))

    latency_file(tmp_path / "latency_h200_1.json", "NVIDIA H200", "2026-12-01", 0.04)
    latency_file(tmp_path / "h100_2" / "latency_h100_2.json", "NVIDIA H100", "2026-12-02", 0.03)  # newer
    row = A.AccuracyRow(task="ruler", model="m", length=32768, method="icecache", budget=256, score=50.0,
                        interval=None, n=10, share_of_full=80.0)
    everywhere = latest_bench(load_bench(tmp_path)).to_dict("records")
    assert A.tpot_for(row, everywhere)["gpu"] == "NVIDIA H100"  # the newest file wins across folders
    [point] = [p for p in A.tradeoff_points([row], reference_bench_rows(tmp_path)) if p.row.method == "icecache"]
    assert point.timed_gpu == "NVIDIA H200" and abs(point.tpot_ratio - 4.0) < 1e-9


def test_the_queue_hands_out_the_runs_with_the_most_work_left_first(tmp_path):
    import dataclasses

    def job(method: str, budget: int, length: int, samples: int = 0, seconds: float = 1.0, done: bool = False):
        run_dir = tmp_path / f"{method}-{budget}-{length}"
        run_dir.mkdir()
        record = {"gen": {"ttft_s": seconds / 2, "tpot_s": seconds / 20, "new_tokens": 10}}  # a sample: `seconds`
        (run_dir / "predictions.jsonl").write_text("".join(json.dumps({"sample_id": f"s{i}", **record}) + "\n"
                                                           for i in range(samples)))
        if done:
            (run_dir / "metrics.json").write_text("{}")
        values = {"method": {"name": method}, "budget": budget, "task": {"name": "ruler", "lengths": [length]}}
        return launcher.Job([], run_dir, values=values)

    finished = [job("fast", 128, 4096, samples=100, seconds=1.0, done=True),
                job("slow", 128, 4096, samples=100, seconds=10.0, done=True)]
    fresh_fast, fresh_slow = job("fast", 256, 4096), job("slow", 256, 4096)
    nearly_done_slow = job("slow", 512, 4096, samples=95, seconds=10.0)  # 5 samples left: 50 s
    other_length = job("slow", 256, 8000)  # no sample of the method at 8k: its 4k time, the task's run size
    todo = [fresh_fast, nearly_done_slow, other_length, fresh_slow]
    ordered = launcher.longest_first(todo, evidence=[*finished, *todo])
    # 100 samples x 10 s (slow, both lengths), then 100 x 1 s (fast), then 5 x 10 s (the slow run nearly done)
    assert [j.run_dir for j in ordered[:2]] == [fresh_slow.run_dir, other_length.run_dir]
    assert [j.run_dir for j in ordered[2:]] == [fresh_fast.run_dir, nearly_done_slow.run_dir]

    # A reference run (the full cache the tables divide by) goes first, though it has the least work left.
    reference = dataclasses.replace(job("full", 0, 8000), reference=True)
    ordered = launcher.longest_first([*todo, reference], evidence=[*finished, *todo, reference])
    without = launcher.longest_first(todo, evidence=[*finished, *todo])
    assert ordered[0] is reference and [j.run_dir for j in ordered[1:]] == [j.run_dir for j in without]

    # With nothing on disk to go on, the grouping by task and length stands (a stable order).
    blank = [job("a", 128, 8000), job("b", 128, 4096), job("c", 128, 8000)]
    assert [j.values["method"]["name"] for j in launcher.longest_first(blank)] == ["b", "a", "c"]


def test_every_cell_of_a_grid_run_over_two_fresh_hosts_gets_its_paired_interval(tmp_path):
    """The reference runs go first, so on a grid that takes several hosts they finish on an early one whose disk
    the last host never sees: its curated file, put back with --restore, must carry what pairing needs."""
    from eval.report import accuracy as A
    from eval.report import benchmarks as bench_tables

    common = (f"experiment=accuracy_long_passkey model=tiny_llama output_root={tmp_path / 'runs'} "
              "task.lengths=[400] task.num_depths=3 budget=128")
    grid = [f"{common} method=full,full_static,quest,icecache", f"{common} method=icecache method.lookahead=true"]
    first, second = tmp_path / "first", tmp_path / "second"
    # host one: the reference alone (as a deadline leaves it), curated; its disk is then gone
    assert launcher.main(["--sweep", f"{common} method=full", "--curate", "accuracy", "--out", str(first),
                          "--no-plots"]) == 0
    [curated] = first.glob("accuracy_*.json")
    [reference] = json.loads(curated.read_text())["runs"]
    assert len(reference["samples"]) == 3
    assert {"score", "meta", "generated_sha256", "stop_reason"} <= set(reference["samples"][0])
    assert {s["stop_reason"] for s in reference["samples"]} <= {"eos", "stop_string", "length"}
    import shutil

    shutil.rmtree(tmp_path / "runs")
    # host two: the rest, with the first host's file put back
    argv = [arg for sweep in grid for arg in ("--sweep", sweep)]
    assert launcher.main([*argv, "--restore", str(curated), "--curate", "accuracy", "--out", str(second),
                          "--no-plots"]) == 0
    [last] = second.glob("accuracy_*.json")
    runs = json.loads(last.read_text())["runs"]
    labels = sorted(r["method_label"] for r in runs)
    assert labels == ["full", "full_static", "icecache", "icecache+lookahead", "quest"]
    assert not list((tmp_path / "runs" / "passkey" / "tiny-llama" / "full").rglob("predictions.jsonl"))
    rows = [row for row in A.accuracy_rows(runs) if row.method != "full"]
    assert len(rows) == 4 and all(row.difference_interval is not None for row in rows)
    static = next(row for row in rows if row.method == "full_static")
    assert static.difference == 0.0  # the same tokens as the full cache: no difference on any sample
    # the page's table: a Δ full cell with its interval on every row but the reference's
    rendered = bench_tables.render_accuracy(second, {})
    table = [line for line in rendered.splitlines() if line.startswith("| `")]
    assert len(table) == 5 and all(re.search(r"[+-]\d+\.\d \[", line) for line in table if "| `full` |" not in line)


def test_the_same_sweep_run_twice_generates_the_same_and_a_changed_sample_is_counted_per_method(tmp_path):
    from eval.report.compare import compare, render_by_method

    def sweep(root: str) -> list[str]:
        common = (f"experiment=accuracy_long_passkey model=tiny_llama output_root={tmp_path / root} "
                  "task.lengths=[300],[400] task.num_depths=2 budget=128")
        return ["--sweep", f"{common} method=full,quest", "--sweep", f"{common} method=icecache method.lookahead=true"]

    for root in ("a", "b"):
        assert launcher.main([*sweep(root), "--curate", "accuracy", "--out", str(tmp_path / f"curated_{root}"),
                              "--no-plots"]) == 0
    same = compare(tmp_path / "a", tmp_path / "b")
    # two runs of each (method, budget), one per length: paired by their directories, none left over
    assert len(same["pairs"]) == 6 and same["unpaired"] == []
    assert {m: (t["runs"], t["samples"], t["share_differ"]) for m, t in same["by_method"].items()} == {
        "full": (2, 4, 0.0), "icecache+lookahead": (2, 4, 0.0), "quest": (2, 4, 0.0)}

    # one of quest's samples generated otherwise on side b
    [predictions] = [p for p in (tmp_path / "b").rglob("predictions.jsonl") if "/quest/" in str(p)][:1]
    lines = [json.loads(line) for line in predictions.read_text().splitlines()]
    lines[0]["prediction"] += " and more"
    predictions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    changed = compare(tmp_path / "a", tmp_path / "b")
    assert changed["by_method"]["quest"]["share_differ"] == 0.25
    assert changed["by_method"]["full"]["share_differ"] == 0.0
    assert "quest" in render_by_method(changed) and "25.0%" in render_by_method(changed)
    # the curated files carry each sample's generation hash: the same comparison without the runs' directories
    [file_a], [file_b] = (list((tmp_path / f"curated_{root}").glob("accuracy_*.json")) for root in ("a", "b"))
    curated = compare(file_a, file_b)
    assert len(curated["pairs"]) == 6 and all(t["share_differ"] == 0.0 for t in curated["by_method"].values())
    # two run directories given directly
    [run_a] = [p.parent for p in (tmp_path / "a").rglob("predictions.jsonl")
               if p.parent.name == predictions.parent.name]
    assert compare(run_a, predictions.parent)["by_method"]["quest"]["differ"] == 1


def _captured_figure(monkeypatch):
    from eval.report import plots as P

    figures = []
    monkeypatch.setattr(P, "save", lambda fig, stem: figures.append(fig) or [])
    return P, figures


def test_the_trade_off_figures_names_keep_a_gap_between_them(tmp_path, monkeypatch):
    """Twelve methods crowded at the full cache's score near full_static's TPOT: every name drawn, and no two
    names' boxes closer than 2 pixels (names that touch read as one)."""
    from itertools import combinations

    from matplotlib.text import Text

    P, figures = _captured_figure(monkeypatch)
    methods = ["arkvale", "quest", "snapkv", "omnikv", "shadowkv", "oracle_topk", "icecache", "icecache_reuse",
               "pqcache", "magicpig", "h2o", "streaming_llm"]
    points = [A.TradeoffPoint(row=A.AccuracyRow("passkey", "m", 16384, method, 256, 100.0, None, 20),
                              tpot_ratio=0.9 + 0.04 * i, share=100.0, low=None, high=None, paired=False)
              for i, method in enumerate(methods)]
    full = A.AccuracyRow("passkey", "m", 16384, "full_static", None, 100.0, None, 20)
    points.append(A.TradeoffPoint(row=full, tpot_ratio=1.0, share=100.0, low=None, high=None, paired=False))
    P.accuracy_vs_tpot_panels(points, tmp_path / "tradeoff")
    [fig] = figures
    fig.canvas.draw()  # the names' offsets are applied when drawn
    renderer = fig.canvas.get_renderer()
    names = [text for ax in fig.axes for text in ax.texts]
    assert len(names) == len(points)
    # the name's own box (an annotation's extent would take in its leader)
    boxes = [Text.get_window_extent(text, renderer).padded(1.0) for text in names]
    for (a, text_a), (b, text_b) in combinations(zip(boxes, names), 2):
        assert not a.overlaps(b), f"{text_a.get_text()!r} and {text_b.get_text()!r} touch"


def test_the_budget_figures_full_cache_lines_stop_where_the_names_begin(tmp_path, monkeypatch):
    """The full caches' dashed lines and bands end at the lines' end, left of the names at that end, so that no
    name is drawn across a line; each name that had to move is joined to its line's end by a level-then-upright
    leader."""
    from matplotlib.text import Text

    P, figures = _captured_figure(monkeypatch)
    rows = [A.AccuracyRow("ruler", "m", 16384, "full", None, 60.0, (55.0, 65.0), 130)]
    rows += [A.AccuracyRow("ruler", "m", 16384, method, budget, 60.0 - shift, (55.0 - shift, 65.0 - shift), 130)
             for shift, method in ((0.0, "quest"), (0.5, "arkvale"), (1.0, "shadowkv"))
             for budget in (128, 256, 512)]
    P.accuracy_vs_budget_panels(rows, tmp_path / "budget")
    [fig] = figures
    [ax] = [ax for ax in fig.axes if ax.texts]
    fig.canvas.draw()  # the names' offsets are applied when drawn
    renderer = fig.canvas.get_renderer()
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1
    line_end = ax.transAxes.transform((dashed[0].get_xdata()[1], 0))[0]  # an axhline's x is in axes fractions
    names = ax.texts
    assert {text.get_text() for text in names} == {"FULL", "Quest", "ArkVale", "ShadowKV"}
    for text in names:
        assert Text.get_window_extent(text, renderer).x0 > line_end  # the name's own box, not its leader
    leaders = [text.arrow_patch for text in names if text.arrow_patch is not None]
    assert leaders and all("angle" in type(a.get_connectionstyle()).__name__.lower() for a in leaders)


def test_the_figures_script_draws_one_selection_figure_from_each_length_s_file(tmp_path):
    """Two selection grids of one model (one file per length) give one mass-by-layer figure named for the selection
    grid, with a panel per length, and --only leaves the other figures out: not drawn, and a file of theirs that
    is there already stays as it was."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import image

    script = load_script("accuracy_figures")
    files = sorted((REPO / "results" / "bench").glob("selection_qwen2.5-coder-0.5b_*.json"))
    lengths = {run["settings"]["task"]["lengths"][0] for path in files for run in json.loads(path.read_text())["runs"]}
    assert len(files) >= 2 and len(lengths) >= 2  # the committed 16k and 32k grids
    kept = tmp_path / "accuracy_vs_budget_selection_qwen2.5-coder-0.5b.png"
    kept.write_bytes(b"an earlier figure")
    assert script.main([*map(str, files), "--prefix", "selection_", "--only", "mass_by_layer",
                        "--out", str(tmp_path), "--bench", str(tmp_path)]) == 0
    assert kept.read_bytes() == b"an earlier figure"
    kept.unlink()
    [figure] = tmp_path.iterdir()
    assert figure.name == "mass_by_layer_selection_qwen2.5-coder-0.5b.png"
    one = tmp_path / "one"
    one.mkdir()
    assert script.main([str(files[0]), "--prefix", "selection_", "--only", "mass_by_layer", "--out", str(one),
                        "--bench", str(tmp_path)]) == 0
    # a panel per length: the figure of both lengths is taller than the figure of one
    assert image.imread(figure).shape[0] > image.imread(next(one.iterdir())).shape[0]
