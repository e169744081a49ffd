"""Table and plot builders on synthetic result files (eval/tasks/report), and the notebook that redraws them."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pandas as pd
import pytest

from eval.report.collect import (
    LONGBENCH_16,
    REFERENCE_DIR,
    References,
    collect_latency,
    collect_scores,
    load_bench,
    load_runs,
    ruler_categories,
)
from eval.report.summary import write_summary
from eval.report.tables import longbench_table, ruler_table

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "results" / "paper"
LLAMA = "llama-3.1-8b-instruct"


def write_run(root: Path, task: str, model: str, method: str, budget, metrics: dict, n: int, tag: str,
              latency: dict | None = None) -> Path:
    """A finished run as the runner lays it out: <root>/<task>/<model>/<method>/budget-<b>/<hash>/metrics.json."""
    run_dir = root / task / model / method / f"budget-{'none' if budget is None else budget}" / tag
    run_dir.mkdir(parents=True)
    payload = {"task": task, "model": model, "method": method, "budget": budget, "config_hash": tag,
               "n_samples": n, "metrics": metrics, "latency": latency or {}, "settings": {}, "provenance": {}}
    (run_dir / "metrics.json").write_text(json.dumps(payload))
    return run_dir


def longbench_metrics(scores: dict[str, float], n_each: int = 10) -> dict:
    return {"score": statistics.fmean(scores.values()), "datasets": scores,
            "n_per_dataset": {k: n_each for k in scores}, "categories": {}}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """Synthetic results/: LongBench full (all 16, one job per dataset), IceCache@256 (all 16, split in two jobs,
    plus a smaller conflicting smoke run), SnapKV@256 with only 3 datasets; RULER; passkey; one benchmark file."""
    runs = tmp_path / "results" / "runs"
    # full: dataset i scores 40 + i, one job per dataset (the table2 sweep's layout), budget-free
    for i, name in enumerate(LONGBENCH_16):
        write_run(runs, "longbench", LLAMA, "full", None, longbench_metrics({name: 40.0 + i}), 10, f"f{i}",
                  latency={"median_tpot_s": 0.03, "median_tt2t_s": 1.0})
    # icecache@256: 39 + i, datasets split over two jobs
    first, second = LONGBENCH_16[:8], LONGBENCH_16[8:]
    write_run(runs, "longbench", LLAMA, "icecache", 256,
              longbench_metrics({d: 39.0 + LONGBENCH_16.index(d) for d in first}), 80, "ia",
              latency={"median_tpot_s": 0.10})
    write_run(runs, "longbench", LLAMA, "icecache", 256,
              longbench_metrics({d: 39.0 + LONGBENCH_16.index(d) for d in second}), 80, "ib",
              latency={"median_tpot_s": 0.12})
    # a smoke run (task.limit=2) of the same cell with a different score: fewer samples, so it must lose
    write_run(runs, "longbench", LLAMA, "icecache", 256, longbench_metrics({"narrativeqa": 0.0}, n_each=2), 2, "ismoke")
    write_run(runs, "longbench", LLAMA, "snapkv", 256,
              longbench_metrics({"narrativeqa": 20.0, "qasper": 21.0, "trec": 22.0}), 30, "s")
    ruler = {"score": 0, "n": 0, "lengths": {"150000": 95.0},
             "tasks": {"niah_single_1": {"150000": 100.0}, "niah_single_2": {"150000": 90.0},
                       "niah_multikey_1": {"150000": 80.0}, "qa_1": {"150000": 70.0}, "qa_2": {"150000": 60.0},
                       "vt": {"150000": 10.0}}}
    write_run(runs, "ruler", "qwen3-4b-instruct-2507", "icecache", 256, ruler, 600, "r")
    write_run(runs, "passkey", "tiny-llama", "streaming_llm", 32,
              {"score": 50.0, "n": 4, "by_length": {"200": 100.0, "400": 0.0}}, 4, "p")
    # an unfinished run: predictions without metrics.json (one complete line and a torn one)
    partial = runs / "passkey" / "tiny-llama" / "quest" / "budget-32" / "q"
    partial.mkdir(parents=True)
    (partial / "predictions.jsonl").write_text('{"sample_id": "a", "score": 1}\n{"sample_id": "b", "sc')
    bench = tmp_path / "results" / "bench"
    bench.mkdir(parents=True)
    summary = []
    for context, full_ms, ice_ms in ((16384, 40.0, 60.0), (36000, 50.0, 70.0)):
        for method, ms in (("full", full_ms), ("icecache", ice_ms)):
            summary.append({"method": method, "budget": 256, "context": context, "model": LLAMA, "repeats": 3,
                            "ttft_s_median": 2.0, "ttft_s_min": 1.9, "ttft_s_max": 2.1, "tt2t_s_median": 2.1,
                            "tt2t_s_min": 2.0, "tt2t_s_max": 2.2, "tpot_s_median": ms / 1000,
                            "tpot_s_min": ms / 1000 - 0.002, "tpot_s_max": ms / 1000 + 0.002,
                            "phases_s": {"select": 0.01, "load": 0.005, "model": ms / 1000 - 0.015},
                            "tpot_ratio_to_full": ms / full_ms})
    (bench / "latency_host_20260101-000000.json").write_text(json.dumps(
        {"kind": "latency", "settings": {}, "provenance": {"host": "host", "date": "2026-01-01"}, "summary": summary}))
    shutil.copytree(REFERENCE, tmp_path / "results" / "paper")
    return tmp_path / "results"


def test_reference_files_are_complete():
    # every table of the paper's numbers is in the repository and says where each number comes from
    for name in ("paper_longbench.csv", "paper_latency.csv", "paper_scaling.csv", "paper_ruler.csv"):
        frame = pd.read_csv(REFERENCE / name)
        assert "source" in frame and frame["source"].notna().all(), name
    assert REFERENCE_DIR == REFERENCE  # what collect reads by default, wherever it is run from
    longbench = pd.read_csv(REFERENCE / "paper_longbench.csv")
    assert len(longbench) == 22 and list(longbench.columns[3:19]) == LONGBENCH_16
    assert longbench["source"].str.contains("Table 2").all()
    # the paper's Avg is the plain mean of its 16 columns to within 0.75
    assert ((longbench[LONGBENCH_16].mean(axis=1) - longbench["avg_reported"]).abs() <= 0.75).all()
    scaling = pd.read_csv(REFERENCE / "paper_scaling.csv")
    # the paper's scaling figure: IceCache (r) at 300k is 153 ms
    assert scaling.query("method == 'IceCache(r)' and context_tokens == 300000")["tpot_ms"].item() == 153


def test_paper_breakdown_keeps_the_context_it_was_measured_at():
    """The paper's TPOT breakdown is at ~36k: a figure of another context labels its bar with that, not its own."""
    from eval.report.collect import load_paper_latency
    from eval.report.plots import PHASE_COLORS, paper_breakdown

    parts = paper_breakdown(load_paper_latency(REFERENCE / "paper_latency.csv"))["icecache"]
    assert parts["context_tokens"] == 36000
    assert "context_tokens" not in PHASE_COLORS  # so it is never stacked as a part
    assert sum(parts[group] for group in PHASE_COLORS if group in parts) == pytest.approx(0.11)


def test_scores_merge_split_jobs_and_prefer_the_larger_run(results):
    scores = collect_scores(load_runs(results / "runs"))
    ice = scores[(scores["method"] == "icecache") & (scores["task"] == "longbench")]
    assert sorted(ice["dataset"]) == sorted(LONGBENCH_16)  # two jobs of 8 datasets each, merged
    # the smoke run (2 samples, narrativeqa = 0) loses to the 10-sample run (narrativeqa = 39 + 0)
    assert ice.loc[ice["dataset"] == "narrativeqa", "score"].item() == 39.0
    full = scores[scores["method"] == "full"]
    assert full["budget"].isna().all() and len(full) == 16


def test_table2_cells_deltas_avg_and_missing(results, tmp_path):
    scores = collect_scores(load_runs(results / "runs"))
    refs = References.load(results / "paper")
    table = longbench_table(scores, refs.longbench, "Llama-3.1-8B-Instruct")
    paper = refs.longbench.set_index(["paper_method"])
    # our narrativeqa for icecache@256 is 39.0; the paper's is 30.6 -> delta +8.4
    assert table.value("ours", "icecache", 256, "narrativeqa") == 39.0
    assert table.value("paper", "icecache", 256, "narrativeqa") == 30.6
    assert math.isclose(table.value("delta", "icecache", 256, "narrativeqa"), 39.0 - 30.6)
    # Avg: mean of 39..54 = 46.5 for icecache, 40..55 = 47.5 for full; relative = 46.5 / 47.5
    assert math.isclose(table.value("ours", "icecache", 256, "Avg"), 46.5)
    assert math.isclose(table.value("ours", "full", None, "Avg"), 47.5)
    rel = table.rel_full.at["icecache@256", "ours"]
    assert math.isclose(rel, 100 * 46.5 / 47.5)
    # the paper's own relative accuracy uses its reported Avg: 49.0 / 49.5
    assert math.isclose(table.rel_full.at["icecache@256", "paper"], 100 * 49.0 / 49.5)
    # SnapKV has 3 of 16 datasets: those cells are there, the rest and the Avg are missing (not zero)
    assert table.value("ours", "snapkv", 256, "trec") == 22.0
    assert table.value("ours", "snapkv", 256, "qasper") == 21.0
    assert table.value("ours", "snapkv", 256, "lcc") is None
    assert table.value("ours", "snapkv", 256, "Avg") is None
    assert table.value("delta", "snapkv", 256, "lcc") is None
    # rows the paper has but we never ran: present, ours missing; paper-only methods keep their numbers
    assert table.value("ours", "arkvale", 256, "trec") is None
    assert table.value("paper", "omnikv", 256, "Avg") == paper.loc["OmniKV"].query(
        "model == 'Llama-3.1-8B-Instruct'")["avg_reported"].item()

    paths = table.write(tmp_path / "out" / "table2_llama")
    assert [p.suffix for p in paths] == [".md", ".csv", ".tex"] and all(p.stat().st_size for p in paths)
    markdown = paths[0].read_text()
    assert "| IceCache | 256 | ours | 39.0 (+8.4) |" in markdown
    snapkv_line = next(line for line in markdown.splitlines() if line.startswith("| SnapKV | 256 | ours"))
    assert snapkv_line.count("—") == 13 + 1 + 1  # 13 missing datasets, Avg and % of full
    assert " 0.0 " not in snapkv_line
    csv = pd.read_csv(paths[1], keep_default_na=True)
    snap = csv[(csv["method"] == "snapkv") & (csv["source"] == "ours")].iloc[0]
    assert snap["trec"] == 22.0 and pd.isna(snap["lcc"]) and pd.isna(snap["Avg"])
    delta = csv[(csv["method"] == "icecache") & (csv["budget"] == 256) & (csv["source"] == "delta")].iloc[0]
    assert math.isclose(delta["narrativeqa"], 8.4, abs_tol=1e-9)
    latex = paths[2].read_text()
    assert r"\begin{tabular}" in latex and r"multifieldqa\_en" in latex and "--" in latex


def test_ruler_categories_and_table(results):
    scores = collect_scores(load_runs(results / "runs"))
    categories = ruler_categories(scores)
    by = categories.set_index("category")["score"]
    # Single-NIAH: mean(100, 90) = 95; Multi-keys: 80 alone; QA: mean(70, 60) = 65; vt belongs to no column
    assert by["single_niah"] == 95.0 and by["multikey_niah"] == 80.0 and by["qa"] == 65.0
    refs = References.load(results / "paper")
    table = ruler_table(categories, refs.ruler, "qwen3-4b-instruct-2507", 150000)
    # the paper's RULER table: IceCache at 150k, Multi-keys NIAH 98.0 -> delta 80 - 98 = -18
    assert table.value("paper", "icecache", 256, "Multi-keys NIAH") == 98.0
    assert math.isclose(table.value("delta", "icecache", 256, "Multi-keys NIAH"), -18.0)
    # the full cache has only the paper's numbers here
    assert table.value("ours", "full", None, "QA") is None and table.value("paper", "full", None, "QA") == 93.0


def test_write_summary_writes_tables_and_all_plots(results, tmp_path):
    out = tmp_path / "summary"
    summary = write_summary(results / "runs", out, bench_root=results / "bench",
                            reference_dir=results / "paper")
    names = {p.name for p in summary.files}
    for stem in ("table2_llama-3.1-8b-instruct", "ruler_qwen3-4b-instruct-2507_150k"):
        assert {f"{stem}.md", f"{stem}.csv", f"{stem}.tex"} <= names
    assert {"passkey.md", "passkey.csv", "latency.md", "runs.csv", "partial_runs.csv"} <= names
    for plot in ("accuracy_vs_budget_llama-3.1-8b-instruct", "accuracy_vs_tpot_llama-3.1-8b-instruct",
                 "tt2t_llama-3.1-8b-instruct", "tpot_breakdown_llama-3.1-8b-instruct",
                 "latency_vs_context_llama-3.1-8b-instruct"):
        for suffix in (".png", ".pdf"):
            path = out / "plots" / (plot + suffix)
            assert path.exists() and path.stat().st_size > 1000, path
    # no table for Mistral: we have no runs of it (paper-only tables are opt-in)
    assert not any("mistral" in n for n in names)
    # 16 full + 3 icecache (two halves and the smoke run) + snapkv + ruler + passkey
    assert len(summary.runs) == 16 + 3 + 1 + 1 + 1 and summary.partial["n_written"].tolist() == [1]
    passkey = pd.read_csv(out / "passkey.csv")
    assert passkey.loc[0, "400"] == 0.0 and passkey.loc[0, "200"] == 100.0  # a real zero stays


def test_bench_summary_is_read(results):
    bench = load_bench(results / "bench")
    assert len(bench) == 4 and "phase_select_s" in bench
    assert bench.query("method == 'icecache' and context == 36000")["tpot_ratio_to_full"].item() == 70.0 / 50.0


def test_notebook_runs_top_to_bottom(results, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("ICECACHE_RESULTS", str(results))
    monkeypatch.setenv("ICECACHE_SUMMARY", str(tmp_path / "nb_summary"))
    notebook = nbformat.read(REPO / "notebooks" / "reproduce.ipynb", as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO / "notebooks")}})
    client.execute()
    outputs = json.dumps([cell.get("outputs", []) for cell in notebook.cells])
    assert "image/png" in outputs and "IceCache" in outputs
    assert (tmp_path / "nb_summary" / "plots" / "tt2t_llama-3.1-8b-instruct.png").exists()
    assert os.environ["ICECACHE_RESULTS"] == str(results)


# ---------------------------------------------------------------------------------------------------------------
# A mixed results tree: LongBench and LongBench-E, runs of different settings, passkey at several lengths


def settings(task: dict, method: dict, device: str = "cuda") -> dict:
    return {"model": {"name": LLAMA, "device": device, "dtype": "torch.bfloat16"}, "task": task, "method": method,
            "prefill_chunk_size": None}


def write_settled_run(root: Path, tag: str, task: str, method: dict, task_settings: dict, metrics: dict, n: int,
                      latency: dict | None = None, model: str = LLAMA) -> Path:
    budget = method.get("budget")
    run_dir = root / task / model / method["name"] / f"budget-{'none' if budget is None else budget}" / tag
    run_dir.mkdir(parents=True)
    payload = {"task": task, "model": model, "method": method["name"], "budget": budget, "config_hash": tag,
               "n_samples": n, "metrics": metrics, "latency": latency or {},
               "settings": settings({"name": task, **task_settings}, method), "provenance": {}}
    (run_dir / "metrics.json").write_text(json.dumps(payload))
    return run_dir


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    runs = tmp_path / "runs"
    ice = {"name": "icecache", "budget": 256, "n_sink_pages": 2}
    v1 = {"variant": "v1", "datasets": ["qasper"], "limit": None}
    lb = lambda score, n: {"score": score, "datasets": {"qasper": score}, "n_per_dataset": {"qasper": n}}  # noqa: E731
    write_settled_run(runs, "a", "longbench", ice, v1, lb(40.0, 200), 200)
    write_settled_run(runs, "b", "longbench", ice, {**v1, "limit": 5}, lb(10.0, 5), 5)  # a smoke run
    write_settled_run(runs, "c", "longbench", {**ice, "n_sink_pages": 1}, v1, lb(30.0, 200), 200)
    # LongBench-E qasper_e: the same dataset name in the metrics, another benchmark
    write_settled_run(runs, "e", "longbench", ice, {"variant": "e", "datasets": ["qasper"], "limit": None},
                      {"score": 90.0, "datasets": {"qasper": 90.0}, "n_per_dataset": {"qasper": 224},
                       "buckets": {"qasper": {"0-4k": 80.0, "4-8k": 100.0, "8k+": None}},
                       "n_per_bucket": {"qasper": {"0-4k": 100, "4-8k": 124, "8k+": 0}}}, 224)
    full = {"name": "full", "budget": None}
    write_settled_run(runs, "f", "longbench", full, v1, lb(45.0, 200), 200)
    # passkey: one run per length (the sweep's layout) and one run of two lengths
    for length, tpot in ((10000, 0.01), (30000, 0.05), (4096, 0.002)):
        write_settled_run(runs, f"p{length}", "passkey", full, {"lengths": [length], "num_depths": 20},
                          {"score": 100.0, "by_length": {str(length): 100.0}, "n_by_length": {str(length): 20}}, 20,
                          latency={"median_tpot_s": tpot, "by_length": {str(length): {"median_tpot_s": tpot}}})
    write_settled_run(runs, "pq", "passkey", {"name": "quest", "budget": 256, "page_size": 16},
                      {"lengths": [4096, 10000], "num_depths": 20},
                      {"score": 50.0, "by_length": {"4096": 60.0, "10000": 40.0},
                       "n_by_length": {"4096": 20, "10000": 20}}, 40,
                      latency={"median_tpot_s": 0.03, "by_length": {"4096": {"median_tpot_s": 0.02},
                                                                     "10000": {"median_tpot_s": 0.04}}})
    return runs


def test_collect_never_puts_longbench_e_into_longbench_cells(mixed):
    scores = collect_scores(load_runs(mixed))
    assert set(scores.loc[scores["dataset"] == "qasper", "task"]) == {"longbench", "longbench_e"}
    table = longbench_table(scores, None, LLAMA)
    values = {table.value("ours", m, b, "qasper", s) for m, b, s in table.rows}
    assert 90.0 not in values  # the LongBench-E score is in no Table 2 cell
    e = scores[scores["task"] == "longbench_e"].set_index("length")
    assert e.loc["0-4k", "score"] == 80.0 and e.loc["4-8k", "n"] == 124


def test_collect_keeps_runs_of_different_settings_in_separate_labelled_rows_with_n(mixed, tmp_path):
    scores = collect_scores(load_runs(mixed))
    table = longbench_table(scores, None, LLAMA)
    ice = {s: table.value("ours", m, b, "qasper", s) for m, b, s in table.rows if m == "icecache"}
    # three icecache@256 rows, one per settings, each with its own score and labelled with what differs
    assert sorted(ice.values()) == [10.0, 30.0, 40.0]
    assert ice["method.n_sink_pages=2, task.limit=null"] == 40.0
    assert ice["method.n_sink_pages=2, task.limit=5"] == 10.0
    assert ice["method.n_sink_pages=1, task.limit=null"] == 30.0
    assert table.value("n", "icecache", 256, "qasper", "method.n_sink_pages=2, task.limit=5") == 5
    # % of full only against the full cache run of the same samples (limit null), never the smoke run's
    full_key = next(k for k in table.rows if k[0] == "full")
    assert math.isnan(table.rel_full.at["icecache@256[method.n_sink_pages=2, task.limit=5]", "ours"])
    assert full_key[2] == "task.limit=null"
    markdown = table.to_markdown()
    assert "| IceCache [method.n_sink_pages=2, task.limit=5] | 256 | n | — | 5 |" in markdown
    csv = table.to_frame()
    assert set(csv["source"]) >= {"ours", "n"} and csv["budget"].dropna().tolist() == [256] * len(
        csv["budget"].dropna())


def test_collect_keeps_context_lengths_apart_sorts_them_as_numbers_and_prints_budgets_as_integers(mixed, tmp_path):
    runs = load_runs(mixed)
    latency = collect_latency(runs)
    full = latency[(latency["task"] == "passkey") & (latency["method"] == "full")].set_index("length")
    assert full["median_tpot_s"].to_dict() == {10000: 0.01, 30000: 0.05, 4096: 0.002}  # never pooled
    quest = latency[latency["method"] == "quest"].set_index("length")
    assert quest["median_tpot_s"].to_dict() == {4096: 0.02, 10000: 0.04}
    summary = write_summary(mixed, tmp_path / "out", plots=False)
    passkey = (tmp_path / "out" / "passkey.md").read_text()
    header = passkey.splitlines()[2]
    assert header.index("| 4k |") < header.index("| 10k |") < header.index("| 30k |")
    assert "| n 10k |" in header
    assert "256.0" not in passkey and "| quest | 256 |" in passkey
    runs_csv = (tmp_path / "out" / "runs.csv").read_text()
    assert ",256.0," not in runs_csv and ",256," in runs_csv
    assert "longbench_e" in summary.tables and (tmp_path / "out" / "longbench_e.md").exists()


def test_collect_draws_latency_figures_only_from_the_benchmark_files_it_is_given(results, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "summary"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "collect.py"), str(results / "runs"),
                             "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    plots = {p.name for p in (out / "plots").glob("*.png")}
    assert "accuracy_vs_budget_llama-3.1-8b-instruct.png" in plots  # from the runs given
    assert not any(name.startswith(("tt2t_", "tpot_breakdown_", "latency_vs_context_")) for name in plots)
    assert not (out / "latency.md").exists()
    # and the paper's numbers are found from any working directory
    assert "paper" in (out / "table2_llama-3.1-8b-instruct.md").read_text()


def test_variant_lines_differ_in_style_and_every_legend_entry_has_points(mixed, tmp_path):
    from eval.report import plots as P

    scores = collect_scores(load_runs(mixed))
    table = longbench_table(scores, None, LLAMA, datasets=["qasper"])  # Avg = qasper: every row has a point
    captured = {}
    original = P.save

    def keep(fig, stem):
        captured["fig"] = fig
        return original(fig, stem)

    P.save = keep
    try:
        assert P.accuracy_vs_budget(table, tmp_path / "acc")
    finally:
        P.save = original
    ax = captured["fig"].axes[0]
    lines = [line for line in ax.get_lines() if len(line.get_xdata()) and line.get_linestyle() != "None"
             and line.get_color() == P.color("icecache")]
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == len(lines) == 3
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "paper (hollow)" not in labels  # no paper points in this figure
    assert sum(label.startswith("IceCache (") for label in labels) == 3


def test_latency_table_orders_contexts_as_numbers_and_prints_budgets_as_integers():
    from eval.report.tables import frame_to_markdown, latency_table

    rows = [{"model": "m", "method": method, "budget": budget, "context": context, "tpot_s_median": 0.01}
            for context in (16384, 131072, 36000) for method, budget in (("full", None), ("icecache", 256))]
    markdown = frame_to_markdown(latency_table(pd.DataFrame(rows)))
    header = markdown.splitlines()[0]
    assert header.index("@16k") < header.index("@36k") < header.index("@128k")
    assert "| icecache | 256 |" in markdown and "256.0" not in markdown


def test_a_declared_variant_is_drawn_under_its_label_and_a_one_off_setting_is_not_drawn():
    from eval.report.collect import curve_method
    from eval.report.methods import display_name

    assert curve_method("icecache", "icecache") == "icecache"
    assert curve_method("icecache:lookahead=true", "icecache+lookahead") == "icecache+lookahead"
    assert curve_method("icecache:prompt_workers=1", "icecache") is None  # a diagnostic row, not a method's curve
    assert curve_method("quest:cuda_graph=false", None) is None  # files from before rows carried a label
    assert display_name("icecache+lookahead") == "IceCache (lookahead)"


def test_collect_plots_the_accuracy_runs_given_whatever_their_task(tmp_path):
    # A user's own runs, no LongBench and no benchmark files: each task still gets its score figure, per model.
    import subprocess
    import sys

    runs = tmp_path / "my runs"
    for method, budget, by_length in (("full", None, {"4096": 100.0, "8192": 90.0}),
                                      ("icecache", 128, {"4096": 80.0, "8192": 60.0}),
                                      ("icecache", 256, {"4096": 95.0, "8192": 85.0})):
        write_run(runs, "passkey", "tiny-llama", method, budget, {"score": 0, "by_length": by_length}, 8,
                  f"p{method}{budget}")
    ruler = {"tasks": {"niah_single_1": {"4096": 100.0}, "vt": {"4096": 50.0}}}
    write_run(runs, "ruler", "tiny-llama", "quest", 128, ruler, 40, "r1")
    write_run(runs, "ruler", "tiny-llama", "quest", 256, {"tasks": {"vt": {"4096": 70.0}}}, 20, "r2")  # one subtask
    write_run(runs, "gsm8k", "tiny-llama", "snapkv", 64, {"score": 12.5, "n": 8}, 8, "g")
    out = tmp_path / "summary"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "collect.py"), str(runs), "--out", str(out)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    for stem in ("score_vs_budget_passkey_tiny-llama", "score_vs_budget_ruler_tiny-llama",
                 "score_vs_budget_gsm8k_tiny-llama"):
        for suffix in (".png", ".pdf"):
            path = out / "plots" / (stem + suffix)
            assert path.exists() and path.stat().st_size > 1000, path

    from eval.report.summary import task_score_points

    scores = collect_scores(load_runs(runs))
    passkey = {(p.length, p.method, p.budget): p.score for p in task_score_points(scores, "passkey", "tiny-llama")}
    assert passkey[(8192, "icecache", 128)] == 60.0 and passkey[(4096, "full", None)] == 100.0
    # RULER: the mean over the subtasks, only for a row that has them all (budget 256 ran vt alone: not drawn)
    ruler_points = task_score_points(scores, "ruler", "tiny-llama")
    assert [(p.budget, p.score) for p in ruler_points] == [(128, 75.0)]


def test_latency_markdown_is_one_narrow_table_per_measure(results, tmp_path):
    out = tmp_path / "summary"
    write_summary(results / "runs", out, bench_root=results / "bench", reference_dir=results / "paper", plots=False)
    text = (out / "latency.md").read_text()
    tables = [block for block in text.split("\n\n") if block.startswith("|")]
    assert len(tables) == 3  # TPOT, TT2T, ratio to full (no full_static rows in the benchmark file)
    for table in tables:
        header = table.splitlines()[0]
        assert header.split("|")[1:-1] == [" model ", " method ", " budget ", " 16k ", " 36k "]
    assert "TPOT (ms), by context length" in text and "| icecache | 256 | 60.000 | 70.000 |" in text
    # the CSV keeps every measure in one wide row per model, method and budget
    assert "tpot_ms@16k" in pd.read_csv(out / "latency.csv").columns


def test_series_outside_the_palette_never_share_a_colour():
    from eval.report import plots as P

    labels = ["icecache+task.limit=5", "icecache+task.limit=9", "quest:page_size=32", "not_a_method"]
    colours = [P.color(label) for label in labels]
    assert len(set(colours)) == len(labels)
    assert not set(colours) & (set(P.COLORS.values()) | set(P.VARIANT_COLORS.values()))
    assert P.color("icecache+task.limit=5") == colours[0]  # stable once given
    assert P.method_label("icecache:lookahead=true") == P.method_label("icecache+lookahead") == "IceCache (lookahead)"


@pytest.mark.parametrize("target", ["output_root", "one run folder"])
def test_notebook_reads_the_runs_it_is_pointed_at(results, tmp_path, monkeypatch, target):
    # RUNS (here through ICECACHE_RUNS) is a sweep's output_root elsewhere, or a single run folder inside one.
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    output_root = tmp_path / "elsewhere runs"
    write_run(output_root, "passkey", "tiny-llama", "icecache", 64, {"score": 75.0, "by_length": {"400": 75.0}}, 4,
              "mine")
    run_dir = write_run(output_root, "passkey", "tiny-llama", "quest", 64, {"score": 25.0, "by_length": {"400": 25.0}},
                        4, "other")
    monkeypatch.setenv("ICECACHE_RESULTS", str(results))
    monkeypatch.setenv("ICECACHE_RUNS", str(output_root if target == "output_root" else run_dir))
    monkeypatch.setenv("ICECACHE_SUMMARY", str(tmp_path / "nb_summary"))
    notebook = nbformat.read(REPO / "notebooks" / "reproduce.ipynb", as_version=4)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    runs = pd.read_csv(tmp_path / "nb_summary" / "runs.csv")
    assert sorted(runs["method"]) == (["icecache", "quest"] if target == "output_root" else ["quest"])
    assert set(runs["task"]) == {"passkey"}  # nothing of results/runs
    assert (tmp_path / "nb_summary" / "plots" / "score_vs_budget_passkey_tiny-llama.png").exists()


def test_a_latency_point_of_older_code_is_faded_and_left_off_its_methods_line(tmp_path, monkeypatch):
    """A method measured at 32k and 128k on its newest commit and at 8k on an earlier one: the solid line joins
    32k and 128k only, the 8k point is drawn faded (and the whole curve faint and dotted), and the legend says
    what faded means. A method whose rows are all of one commit has no faded point."""
    from eval.report import plots as P
    from eval.report.summary import current_code

    methods = pd.Series(["icecache", "icecache", "icecache", "quest", "quest"])
    dates = pd.Series(["2026-12-01", "2026-12-05", "2026-12-05", "2026-12-01", "2026-12-01"])
    commits = pd.Series(["aaaaaaa", "bbbbbbb", "bbbbbbb", "ccccccc", "ccccccc"])
    current = current_code(methods, dates, commits)
    assert current.tolist() == [False, True, True, True, True]
    assert current_code(methods, dates, None).all()  # files without a commit: nothing to tell apart

    figures = []
    monkeypatch.setattr(P, "save", lambda fig, stem: figures.append(fig) or [])
    curve = pd.DataFrame({"method": methods, "context": [8192.0, 32768.0, 131072.0, 8192.0, 32768.0],
                          "tpot_ms": [90.0, 34.0, 81.0, 9.0, 9.5], "current": current})
    P.latency_vs_context(curve, None, tmp_path / "curve")
    [fig] = figures
    [ax] = fig.axes
    solid = [line for line in ax.get_lines() if line.get_linestyle() == "-" and line.get_alpha() is None]
    faded = [line for line in ax.get_lines() if line.get_alpha() == P.OLDER_CODE_ALPHA]
    solid_x = sorted(tuple(line.get_xdata()) for line in solid)
    assert solid_x == [(8192.0, 32768.0), (32768.0, 131072.0)]  # quest's line, icecache's newest code
    assert any(tuple(line.get_xdata()) == (8192.0,) and line.get_linestyle() == "None" for line in faded)
    assert any(text.get_text().startswith("faded") for text in ax.get_legend().get_texts())
