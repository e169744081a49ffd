"""eval.report.benchmarks (BENCHMARKS.md's renderer) on small synthetic result files: which file is newest, which
rows a table shows, the ratios, the headline, and the rewriting and checking of a page's table regions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.report.names import method_text, split_method

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench_tables():
    from eval.report import benchmarks

    return benchmarks


def provenance(date: str, commit: str) -> dict:
    return {"git_commit": commit * 8, "git_dirty": False, "date": date, "gpu": "Test GPU", "torch": "0.0"}


def summary_row(method: str, context: int, tpot_s: float, **extra) -> dict:
    return {"method": method, "context": context, "tpot_s_median": tpot_s, "tpot_s_min": tpot_s * 0.9,
            "tpot_s_max": tpot_s * 1.1, "ttft_s_median": 1.0, "tt2t_s_median": 2.0, "peak_gpu_bytes": 2**30,
            "phases_s": {"model": tpot_s}, "gpu_kv_bytes": 2**20, "cpu_kv_bytes": 0, **extra}


def write_latency(folder: Path, name: str, date: str, commit: str, rows: list[dict], experiment=None) -> None:
    settings = {"model": "no_such_model", "source": "random", "budget": 256, "threads": 4, "repeats": 2, "warmup": 1,
                "decode_steps": 64, "prefill_chunk_size": None, "dtype_resolved": "torch.bfloat16",
                "experiment": experiment}
    payload = {"kind": "latency", "settings": settings, "provenance": provenance(date, commit), "summary": rows}
    (folder / name).write_text(json.dumps(payload))


def table_rows(markdown: str) -> list[list[str]]:
    """The body rows of the first Markdown table in ``markdown``, as lists of cells."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


@pytest.fixture
def latency_folder(tmp_path: Path) -> Path:
    # File names sort against their dates on purpose: "newest" must follow the recorded date.
    write_latency(tmp_path, "latency_gpu_20990101-000000.json", "2026-01-01T00:00:00+00:00", "a", [
        summary_row("full", 1024, 0.020), summary_row("full_static", 1024, 0.010),
        summary_row("icecache", 1024, 0.100), summary_row("quest", 1024, 0.030),
        summary_row("icecache:old_variant=1", 1024, 0.090),
        summary_row("full", 4096, 0.040), summary_row("icecache", 4096, 0.200),
    ])
    write_latency(tmp_path, "latency_gpu_20000101-000000.json", "2026-02-01T00:00:00+00:00", "b", [
        summary_row("full", 1024, 0.025), summary_row("full_static", 1024, 0.005),
        summary_row("icecache", 1024, 0.050), summary_row("icecache:new_variant=1", 1024, 0.060),
    ])
    return tmp_path


def test_latency_takes_the_newest_file_per_context_and_method(bench_tables, latency_folder):
    rendered = bench_tables.render_latency(latency_folder, {})
    rows = {(row[0], row[1].strip("`")): row for row in table_rows(rendered)}
    newer, older = "latency_gpu_20000101-000000.json", "latency_gpu_20990101-000000.json"
    assert rows[("1024", "icecache")][10] == f"`{newer}`"
    assert rows[("1024", "full")][10] == f"`{newer}`"
    assert rows[("1024", "quest")][10] == f"`{older}`"  # only the older file measured it
    assert rows[("4096", "icecache")][10] == f"`{older}`"
    assert rows[("1024", "icecache")][11] == "bbbbbbb"
    # A variant appears beside its base method's row only: the old one was measured beside a superseded row.
    assert ("1024", "icecache (new_variant=1)") in rows
    assert ("1024", "icecache (old_variant=1)") not in rows
    keys = list(rows)
    assert set(keys) == {("1024", "full"), ("1024", "full_static"), ("1024", "icecache"), ("1024", "quest"),
                         ("1024", "icecache (new_variant=1)"), ("4096", "full"), ("4096", "icecache")}
    # by context, then the methods' display order, a variant right after its method
    assert keys == sorted(keys, key=lambda key: (int(key[0]), bench_tables.method_sort_key(key[1])))
    assert keys.index(("1024", "icecache (new_variant=1)")) == keys.index(("1024", "icecache")) + 1


def test_latency_ratios_are_to_the_full_caches_of_the_same_file(bench_tables, latency_folder):
    rows = {(row[0], row[1].strip("`")): row for row in table_rows(bench_tables.render_latency(latency_folder, {}))}
    assert rows[("1024", "icecache")][2] == "50.0"
    assert rows[("1024", "icecache")][4:6] == ["2.00", "10.00"]  # 50 ms against 25 and 5 ms of the newer file
    assert rows[("1024", "quest")][4:6] == ["1.50", "3.00"]  # 30 ms against 20 and 10 ms of the older file
    assert rows[("4096", "icecache")][4:6] == ["5.00", "-"]  # no full_static at 4096
    assert rows[("1024", "full_static")][4:6] == ["0.20", "1.00"]


def test_the_paper_column_is_filled_at_the_context_nearest_the_papers(bench_tables, latency_folder):
    paper = {"latency": {"context_tokens": 3000, "tpot_ms": {"icecache": 100}, "tt2t_s": {"icecache": 7.5}}}
    rows = {(row[0], row[1].strip("`")): row for row in table_rows(bench_tables.render_latency(latency_folder, paper))}
    assert rows[("4096", "icecache")][9] == "100 ms / 7.50 s"
    assert rows[("1024", "icecache")][9] == "-"
    assert rows[("4096", "full")][9] == "-"


def test_scaling_files_fill_the_scaling_table_beside_the_paper_and_only_it(bench_tables, latency_folder):
    write_latency(latency_folder, "latency_gpu_20990102-000000.json", "2026-03-01T00:00:00+00:00", "c", [
        summary_row("full", 150000, 0.030), summary_row("full_static", 150000, 0.015),
        summary_row("icecache", 150000, 0.300, cpu_kv_bytes=2 * 2**30, host_kv_ratio=1.15),
    ], experiment="scaling")
    paper = {"scaling": {"model": "M", "task": "T", "hardware": "H",
                         "tpot_ms": {"150000": {"full": 190, "icecache": 228}}}}
    scaling = table_rows(bench_tables.render_scaling(latency_folder, paper))
    assert [(row[0], row[1]) for row in scaling] == [("150000", "`full`"), ("150000", "`full_static`"),
                                                     ("150000", "`icecache`")]
    icecache = scaling[2]
    assert icecache[2:5] == ["300.0", "10.00", "20.00"]  # TPOT ms, x full, x full_static
    assert icecache[7:11] == ["2.0", "1.15", "228", "1.32"]  # host KV GiB, host / KV, paper, ours / paper
    latency = table_rows(bench_tables.render_latency(latency_folder, {}))
    assert all(row[0] != "150000" for row in latency)


def test_scaling_files_of_other_gpus_get_a_table_of_their_own_per_gpu_and_context(bench_tables, tmp_path):
    """A scaling file in a folder of results/bench/ fills the other-GPU scaling table only: one line per GPU and
    context, each method's TPOT with its ratio to the full_static of its own file, the paper's figure beside."""
    write_latency(tmp_path, "latency_gpu_20260101-000000.json", "2026-01-01T00:00:00+00:00", "a", [
        summary_row("full_static", 150000, 0.015), summary_row("icecache", 150000, 0.300)], experiment="scaling")
    other = tmp_path / "h100_20260102"
    other.mkdir()
    write_latency(other, "latency_h100_20260102-000000.json", "2026-01-02T00:00:00+00:00", "b", [
        summary_row("full", 150000, 0.030), summary_row("full_static", 150000, 0.020),
        summary_row("icecache", 150000, 0.100)], experiment="scaling")
    write_latency(other, "latency_h100_20260103-000000.json", "2026-01-03T00:00:00+00:00", "c", [
        summary_row("full_static", 300000, 0.025), summary_row("icecache_reuse", 300000, 0.050)],
        experiment="scaling")
    write_latency(other, "latency_h100_20260104-000000.json", "2026-01-04T00:00:00+00:00", "d", [
        summary_row("full_static", 150000, 0.001)])  # not the scaling experiment: the other latency table's
    paper = {"scaling": {"model": "M", "task": "T", "hardware": "H",
                         "tpot_ms": {"150000": {"full": 190, "icecache": 228}}}}
    rendered = bench_tables.render_other_gpus_scaling(tmp_path, paper)
    header = [line for line in rendered.splitlines() if line.startswith("|")][0]
    assert "`icecache_reuse` TPOT ms (x full_static)" in header and "paper `icecache`" in header
    rows = table_rows(rendered)
    assert [row[:2] for row in rows] == [["Test GPU", "150k"], ["Test GPU", "300k"]]
    at_150k, at_300k = rows
    # full, full_static, icecache, icecache_reuse, paper full, paper icecache, file, commit
    assert at_150k[2:8] == ["30.0 (1.50x)", "20.0 (1.00x)", "100.0 (5.00x)", "-", "190", "228"]
    assert at_150k[8:] == ["`h100_20260102/latency_h100_20260102-000000.json`", "b" * 7]
    assert at_300k[2:8] == ["-", "25.0 (1.00x)", "-", "50.0 (2.00x)", "-", "-"]
    assert at_300k[9] == "c" * 7
    main = table_rows(bench_tables.render_scaling(tmp_path, paper))  # results/bench/ itself only
    assert [(row[1], row[2]) for row in main] == [("`full_static`", "15.0"), ("`icecache`", "300.0")]
    assert bench_tables.render_other_gpus_scaling(tmp_path / "h100_20260102", paper).startswith("None")

    # a newer file where the full caches did not fit their GPU at 150k: those cells say so, with that file
    payload = json.loads((other / "latency_h100_20260103-000000.json").read_text())
    payload["provenance"] = provenance("2026-01-05T00:00:00+00:00", "e")
    payload["summary"] = [summary_row("icecache_reuse", 150000, 0.040)]
    payload["out_of_memory"] = [{"context": 150000, "method": m, "process": 0, "stage": "before the prefill",
                                 "error": "GPU memory: its KV of 150065 tokens needs 90.0 GiB"}
                                for m in ("full", "full_static")]
    (other / "latency_h100_20260105-000000.json").write_text(json.dumps(payload))
    at_150k = table_rows(bench_tables.render_other_gpus_scaling(tmp_path, paper))[0]
    assert at_150k[2:6] == ["out of GPU memory", "out of GPU memory", "100.0 (5.00x)", "40.0"]
    assert "latency_h100_20260105-000000.json" in at_150k[8] and at_150k[9] == ", ".join(sorted(["b" * 7, "e" * 7]))


def test_breakdown_lists_icecache_rows_with_their_phases(bench_tables, tmp_path):
    phases = {"query": 0.030, "load": 0.010, "model": 0.020, "insert": 0.0}
    write_latency(tmp_path, "latency_gpu_20260101-000000.json", "2026-01-01T00:00:00+00:00", "c", [
        summary_row("full", 2048, 0.02), summary_row("icecache", 2048, 0.060, phases_s=phases,
                                                     pages_loaded_per_step=100.0, bytes_to_gpu_per_step=2e6),
        summary_row("quest", 2048, 0.03),
    ])
    rows = table_rows(bench_tables.render_breakdown(tmp_path, {}))
    assert len(rows) == 1
    row = rows[0]
    assert row[:8] == ["2048", "`icecache`", "60.0", "30.0", "10.0", "20.0", "-", "1.00"]
    assert row[8:10] == ["100", "2.0"]


def test_llama_weight_bytes_from_the_model_config(bench_tables):
    # Llama-3.1-8B: 8,030,261,248 parameters.
    bf16 = "torch.bfloat16"
    assert bench_tables.model_weight_bytes({"model": "llama31_8b", "dtype_resolved": bf16}) == 2 * 8030261248
    assert bench_tables.model_weight_bytes({"model": "no_such_model", "dtype_resolved": bf16}) is None


def test_dci_keeps_the_newest_row_per_host_size_threads_and_precision(bench_tables, tmp_path):
    def dci_file(name, date, rows):
        payload = {"benchmark": "dci", "provenance": provenance(date, "d"), "rows": rows}
        (tmp_path / name).write_text(json.dumps(payload))

    def dci_row(n, threads, query_ms, precision=None):
        return {"n": n, "threads": threads, "score_precision": precision, "build_s": 0.1, "query_ms": query_ms,
                "exact_ms": 1.0, "page_recall": 0.9, "token_recall": 0.9, "mass_recall": 0.99}

    dci_file("dci_box_20260101-000000.json", "2026-01-01T00:00:00+00:00", [dci_row(100, 1, 5.0), dci_row(100, 2, 3.0)])
    dci_file("dci_box_20260102-000000.json", "2026-01-02T00:00:00+00:00",
             [dci_row(100, 2, 2.0, "float32"), dci_row(100, 2, 1.5, "half")])
    rows = table_rows(bench_tables.render_dci(tmp_path, {}))
    assert [(r[0], r[3], r[4], r[5], r[8]) for r in rows] == [
        ("box", "1", "false", "float32", "5.000"), ("box", "2", "false", "float32", "2.000"),
        ("box", "2", "false", "half", "1.500")]

    # threads bound to cores are their own rows, beside the unbound ones they are measured against
    payload = {"benchmark": "dci", "provenance": {**provenance("2026-01-03T00:00:00+00:00", "d"),
                                                  "omp_proc_bind": "close", "omp_places": "cores"},
               "rows": [dci_row(100, 2, 1.8, "float32")]}
    (tmp_path / "dci_box_20260103-000000.json").write_text(json.dumps(payload))
    rows = table_rows(bench_tables.render_dci(tmp_path, {}))
    assert [(r[4], r[8]) for r in rows if r[3] == "2" and r[5] == "float32"] == [
        ("close (cores)", "1.800"), ("false", "2.000")]

    # kernel variants measured side by side in one file are rows of their own, with their share of the read rate
    variants = [{**dci_row(100, 2, ms, "float32"), "key_dtype": "bfloat16", "variant": variant, "read_share": share}
                for variant, ms, share in (("avx2:0:0", 2.5, 0.35), ("avx512:32:256", 1.9, 0.48))]
    dci_file("dci_box_20260104-000000.json", "2026-01-04T00:00:00+00:00", variants)
    rows = table_rows(bench_tables.render_dci(tmp_path, {}))
    assert [(r[2], r[6], r[8], r[9]) for r in rows if r[2] == "bfloat16"] == [
        ("bfloat16", "`avx2:0:0`", "2.500", "0.35"), ("bfloat16", "`avx512:32:256`", "1.900", "0.48")]

    # bf16 queries are rows of their own, said in the dtype column, beside the float32 queries of the same variant
    bf16_queries = [{**v, "query_dtype": "bfloat16", "query_ms": 1.7} for v in variants[1:]]
    dci_file("dci_box_20260105-000000.json", "2026-01-05T00:00:00+00:00", bf16_queries)
    rows = table_rows(bench_tables.render_dci(tmp_path, {}))
    assert sorted((r[2], r[8]) for r in rows if r[6] == "`avx512:32:256`") == [
        ("bfloat16", "1.900"), ("bfloat16 (queries bfloat16)", "1.700")]


def test_host_step_rows_are_per_kernel_setting_and_the_newest_per_host_threads_and_context(bench_tables, tmp_path):
    def host_step_file(name, date, **data):
        payload = {"provenance": provenance(date, "d"), "threads": 1, "length": 100, "steps": 8, **data}
        (tmp_path / name).write_text(json.dumps(payload))

    def ms(search):
        return {"search": search, "stage": 0.1, "rest": 0.01, "host_step": search + 0.11}

    host_step_file("host_step_box_20260101-000000.json", "2026-01-01T00:00:00+00:00", median_ms=ms(3.0))
    host_step_file("host_step_box_20260102-000000.json", "2026-01-02T00:00:00+00:00", median_ms=ms(2.0),
                   variants=[{"kernel_settings": "avx512:32:256:1", "median_ms": ms(2.0)},
                             {"kernel_settings": "avx512bf16:32:256:2", "median_ms": ms(1.5)}])
    rows = table_rows(bench_tables.render_host_step(tmp_path, {}))
    assert [(r[3], r[4], r[9]) for r in rows] == [
        ("-", "3.00", "`host_step_box_20260101-000000.json`"),
        ("`avx512:32:256:1`", "2.00", "`host_step_box_20260102-000000.json`"),
        ("`avx512bf16:32:256:2`", "1.50", "`host_step_box_20260102-000000.json`")]


def run_record(method: str, date: str, command: str, score: float, budget=256) -> dict:
    return {"task": "passkey", "model": "tiny", "method": method, "budget": budget, "n_samples": 10,
            "metrics": {"score": score, "n": 10}, "latency": {"mean_attended_tokens": 200.0},
            "provenance": {"date": date, "git_commit": "e" * 40, "git_dirty": False, "command": command}}


def test_cpu_accuracy_takes_the_newest_run_per_settings(bench_tables, tmp_path):
    runs_old = [run_record("quest", "2026-01-01T00:00:00+00:00", "run.py method=quest task.lengths=[4096]", 40.0),
                run_record("full", "2026-01-01T00:00:00+00:00", "run.py method=full budget=256", 100.0)]
    runs_new = [run_record("quest", "2026-01-02T00:00:00+00:00",
                           "run.py method=quest task.lengths=[4096] output_root=/tmp/x threads=2", 60.0),
                run_record("quest", "2026-01-02T00:00:00+00:00",
                           "run.py method=quest task.lengths=[4096] task.decode_question=true", 20.0),
                run_record("full", "2026-01-02T00:00:00+00:00", "run.py method=full", 90.0, budget=None)]
    (tmp_path / "cpu_accuracy_a.json").write_text(json.dumps({"kind": "cpu_accuracy", "runs": runs_old}))
    (tmp_path / "cpu_accuracy_b.json").write_text(json.dumps({"kind": "cpu_accuracy", "runs": runs_new}))
    rows = table_rows(bench_tables.render_cpu_accuracy(tmp_path, {}))
    got = [(r[2], r[3], r[4], r[6], r[11]) for r in rows]
    assert got == [
        # output_root and threads do not change a result, so they do not make a run distinct; the full cache's
        # budget is ignored, so its two runs are one, and the newer counts
        ("`full`", "-", "-", "90.0", "`cpu_accuracy_b.json`"),
        ("`quest`", "256", "`task.lengths=[4096]`", "60.0", "`cpu_accuracy_b.json`"),
        ("`quest`", "256", "`task.lengths=[4096] task.decode_question=true`", "20.0", "`cpu_accuracy_b.json`"),
    ]


def test_page_regions_are_rewritten_and_checked(bench_tables, latency_folder, capsys):
    page = latency_folder / "PAGE.md"
    page.write_text("# Title\n\nProse stays.\n\n<!-- table:latency -->\nold table\n<!-- /table:latency -->\n\nEnd.\n")
    paper = latency_folder / "paper.json"
    paper.write_text("{}")
    args = ["--page", str(page), "--results", str(latency_folder), "--paper", str(paper)]
    assert bench_tables.main([*args, "--check"]) == 1
    assert "old table" in page.read_text()  # --check writes nothing
    assert bench_tables.main(args) == 0
    text = page.read_text()
    assert text.startswith("# Title\n\nProse stays.\n\n<!-- table:latency -->\n| context | method |")
    assert text.endswith("<!-- /table:latency -->\n\nEnd.\n")
    assert "old table" not in text
    assert bench_tables.main([*args, "--check"]) == 0
    assert bench_tables.main(args) == 0 and page.read_text() == text  # idempotent
    # a new result file makes the page stale
    write_latency(latency_folder, "latency_gpu_21000101-000000.json", "2026-03-01T00:00:00+00:00", "f",
                  [summary_row("full", 1024, 0.030)])
    assert bench_tables.main([*args, "--check"]) == 1
    assert "stale in: latency" in capsys.readouterr().err


def test_an_unknown_region_is_an_error(bench_tables, tmp_path):
    page = tmp_path / "PAGE.md"
    page.write_text("<!-- table:nonsense -->\n<!-- /table:nonsense -->\n")
    with pytest.raises(SystemExit, match="unknown table region"):
        bench_tables.main(["--page", str(page), "--results", str(tmp_path), "--paper", str(tmp_path / "none.json")])


def test_benchmarks_page_matches_its_result_files(bench_tables):
    """BENCHMARKS.md's tables are what results/bench/ renders (rerun scripts/bench/tables.py after adding a file)."""
    assert bench_tables.main(["--check"]) == 0


def test_accuracy_keeps_the_newest_file_per_model_and_device(bench_tables, tmp_path):
    """A CPU run of the accuracy experiments does not hide the GPU host's table for the same model: the newest file
    per (model, device) is rendered, each with its own source line."""
    from tests.test_accuracy_report import payload

    def curated(name, date, gpu, score):
        runs = [payload("passkey", "full", None, 4096, 100.0, mass=1.0, attended=None),
                payload("passkey", "quest", 256, 4096, score)]
        for run in runs:
            run["provenance"]["gpu"] = gpu
        (tmp_path / name).write_text(json.dumps({"model": "smollm2-135m", "provenance": provenance(date, "a"),
                                                 "runs": runs, "sweeps": ["experiment=x"]}))

    curated("accuracy_smollm2-135m_1.json", "2026-01-01T00:00:00+00:00", "NVIDIA H200", 60.0)
    curated("accuracy_smollm2-135m_2.json", "2026-02-01T00:00:00+00:00", "NVIDIA H200", 70.0)
    curated("accuracy_cpu_smollm2-135m_3.json", "2026-03-01T00:00:00+00:00", None, 50.0)
    text = bench_tables.render_accuracy(tmp_path, {})
    assert "`accuracy_smollm2-135m_2.json`" in text and "`accuracy_cpu_smollm2-135m_3.json`" in text
    assert "`accuracy_smollm2-135m_1.json`" not in text
    # the GPU's grid comes first though the CPU host's check is newer
    assert text.index("#### smollm2-135m, NVIDIA H200") < text.index("#### smollm2-135m, CPU")


def test_the_largest_context_is_where_a_line_through_the_measured_memory_meets_the_capacity(bench_tables, tmp_path,
                                                                                          monkeypatch):
    gib = 2**30
    monkeypatch.setattr(bench_tables, "CAPACITY_GIB", {"gpu": {"gpu": 60.0, "host": 41.0}})

    def rows(context: int) -> list[dict]:
        scale = context / 100_000
        return [summary_row("full", context, 0.02, peak_gpu_bytes=10 * gib * scale, host_rss_bytes=gib),
                summary_row("full_static", context, 0.01, peak_gpu_bytes=10 * gib * scale, host_rss_bytes=gib),
                summary_row("icecache", context, 0.1, peak_gpu_bytes=5 * gib + gib * scale,
                            cpu_kv_bytes=10 * gib * scale)]

    write_latency(tmp_path, "latency_gpu_20260101-000000.json", "2026-01-01T00:00:00+00:00", "a", rows(100_000))
    write_latency(tmp_path, "latency_gpu_20260101-000001.json", "2026-01-01T00:00:01+00:00", "a", rows(200_000))
    write_latency(tmp_path, "latency_gpu_20260101-000002.json", "2026-01-01T00:00:02+00:00", "a",
                  [summary_row("quest", 100_000, 0.02)])
    table = {row[1]: row for row in table_rows(bench_tables.render_capacity(tmp_path, {}))}
    # the full caches: 10 GiB per 100k tokens on the GPU, so 60 GiB at 600k; their host memory does not grow
    assert table["`full_static`"][2] == "100k, 200k"
    assert table["`full_static`"][5:9] == ["600k", "-", "600k", "gpu"]
    # IceCache: 10 GiB of host KV per 100k tokens over the full cache's 1 GiB resident: 41 GiB at 400k
    assert table["`icecache`"][6:9] == ["400k", "400k", "host"]
    assert table["`icecache`"][4] == "10.00"
    assert "`quest`" not in table  # one context: nothing to draw a line through, and the note says so
    assert "`quest` (no_such_model)" in bench_tables.render_capacity(tmp_path, {})
    assert table["`icecache`"][10] == "-"  # nothing measured past the fit
    # A later commit's run past the fitted contexts checks the line there: IceCache's GPU memory was as the line
    # says (5 + 1 per 100k at 300k: 8 GiB), its host memory less (25 GiB of KV over 1 GiB, where the line says 31).
    later = [summary_row("full_static", 300_000, 0.01, peak_gpu_bytes=30 * gib, host_rss_bytes=gib),
             summary_row("icecache", 300_000, 0.1, peak_gpu_bytes=8 * gib, cpu_kv_bytes=25 * gib)]
    write_latency(tmp_path, "latency_gpu_20260101-000003.json", "2026-01-01T00:00:03+00:00", "b", later)
    table = {row[1]: row for row in table_rows(bench_tables.render_capacity(tmp_path, {}))}
    assert table["`icecache`"][2] == "100k, 200k"  # the fit keeps to one commit's contexts
    assert table["`icecache`"][10] == ("300k: GPU 8.0 / 8.0, host 31.0 / 26.0 "
                                        "(`latency_gpu_20260101-000003.json`)")
    assert table["`full`"][10] == "-"


def test_a_capacity_fit_keeps_to_the_prefill_settings_of_the_newest_measurement(bench_tables, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_tables, "CAPACITY_GIB", {"gpu": {"gpu": 60.0, "host": 41.0}})
    write_latency(tmp_path, "latency_gpu_20260101-000000.json", "2026-01-01T00:00:00+00:00", "a",
                  [summary_row("full", 1000, 0.02, peak_gpu_bytes=5 * 2**30)])
    path = tmp_path / "latency_gpu_20260101-000000.json"
    payload = json.loads(path.read_text())
    payload["settings"]["prefill_chunk_size"] = 8192  # another prefill: its peak is not on the same line
    path.write_text(json.dumps(payload))
    write_latency(tmp_path, "latency_gpu_20260102-000000.json", "2026-01-02T00:00:00+00:00", "b",
                  [summary_row("full", 2000, 0.02, peak_gpu_bytes=1 * 2**30)])
    rendered = bench_tables.render_capacity(tmp_path, {})
    assert table_rows(rendered) == [] and "`full` (no_such_model)" in rendered


def test_an_unfinished_or_resumed_file_says_so_under_the_table(bench_tables, tmp_path):
    write_latency(tmp_path, "latency_gpu_20990101-000000.json", "2026-01-01T00:00:00+00:00", "a", [
        summary_row("full", 1024, 0.020), summary_row("full_static", 1024, 0.010)])
    path = tmp_path / "latency_gpu_20990101-000000.json"
    payload = json.loads(path.read_text())
    note = bench_tables.render_latency(tmp_path, {})
    assert "unfinished" not in note and "--resume" not in note
    payload["complete"] = False
    path.write_text(json.dumps(payload))
    assert "unfinished (its process ended after the methods shown" in bench_tables.render_latency(tmp_path, {})
    payload["complete"] = True
    payload["resumed_by"] = [{"provenance": provenance("2026-01-02T00:00:00+00:00", "d")}]
    path.write_text(json.dumps(payload))
    note = bench_tables.render_latency(tmp_path, {})
    assert "unfinished" not in note
    assert "continued by another process at commit ddddddd, 2026-01-02T00:00:00+00:00 (--resume)" in note


def test_a_row_measured_by_the_process_that_resumed_a_file_names_that_process_commit(bench_tables, tmp_path):
    write_latency(tmp_path, "latency_gpu_20990101-000000.json", "2026-01-01T00:00:00+00:00", "a", [
        summary_row("full", 1024, 0.020), summary_row("full_static", 1024, 0.010),
        summary_row("icecache", 1024, 0.100)], experiment="scaling")
    path = tmp_path / "latency_gpu_20990101-000000.json"
    payload = json.loads(path.read_text())
    payload["measurements"] = [{"method": "full", "context": 1024, "process": 0},
                               {"method": "full_static", "context": 1024, "process": 0},
                               {"method": "icecache", "context": 1024, "process": 1}]
    payload["resumed_by"] = [{"provenance": provenance("2026-01-02T00:00:00+00:00", "d")}]
    path.write_text(json.dumps(payload))
    commits = {row[1]: row[-1] for row in table_rows(bench_tables.render_scaling(tmp_path, {}))}
    assert commits == {"`full`": "aaaaaaa", "`full_static`": "aaaaaaa", "`icecache`": "ddddddd"}


def test_a_method_with_settings_is_written_one_way_whatever_its_file_recorded():
    assert method_text("icecache:lookahead=true") == method_text("icecache+lookahead") == "icecache (lookahead)"
    assert method_text("icecache:prompt_workers=1,cpu_threads=8") == "icecache (prompt_workers=1, cpu_threads=8)"
    assert method_text("quest") == "quest" and split_method("icecache (lookahead)") == ("icecache", "lookahead")


def test_the_headline_puts_each_method_s_share_of_full_beside_its_speed(bench_tables, latency_folder):
    from tests.test_accuracy_report import payload

    runs = [payload("passkey", "full", None, 4096, 100.0), payload("passkey", "icecache", 256, 4096, 80.0),
            payload("passkey", "icecache", 128, 4096, 10.0),  # another budget than the latency files'
            {**payload("passkey", "icecache", 256, 4096, 90.0), "method_label": "icecache+new_variant"}]
    (latency_folder / "accuracy_tiny_1.json").write_text(json.dumps(
        {"model": "tiny", "provenance": provenance("2026-01-01T00:00:00+00:00", "a"), "runs": runs}))
    rendered = bench_tables.render_headline(latency_folder, {})
    lines = [line for line in rendered.splitlines() if line.startswith("|")]
    assert lines[0] == "| method | passkey 4k, % of full | 1k, x full_static |"  # 4096 has no full_static
    rows = {row[0].strip("`"): row[1:] for row in table_rows(rendered)}
    assert rows["icecache"] == ["80%", "10.00"]  # budget 256 only; 50 ms over the newer file's 5 ms
    assert rows["quest"] == ["-", "3.00"] and rows["full"] == ["100%", "5.00"]
    # the run's declared variant and the latency file's inline settings are one row
    assert rows["icecache (new_variant=1)"] == ["-", "12.00"] and rows["icecache (new_variant)"] == ["90%", "-"]
    assert "`accuracy_tiny_1.json`" in rendered and "budget 256" in rendered
    # a newer check on the CPU host does not replace the GPU grid's shares
    cpu_runs = [{**run, "provenance": {**run["provenance"], "gpu": None}, "score": 0.0} for run in runs]
    (latency_folder / "accuracy_cpu_tiny_2.json").write_text(json.dumps(
        {"model": "tiny", "provenance": provenance("2026-02-01T00:00:00+00:00", "b"), "runs": cpu_runs}))
    rendered = bench_tables.render_headline(latency_folder, {})
    assert "`accuracy_tiny_1.json`" in rendered and "accuracy_cpu_tiny_2" not in rendered
    assert {row[0].strip("`"): row[1:] for row in table_rows(rendered)}["icecache"] == ["80%", "10.00"]
    # nor does a newer GPU grid of shorter contexts (another model's); a newer one as long does
    short = [payload("passkey", "full", None, 2048, 100.0), payload("passkey", "icecache", 256, 2048, 50.0)]
    (latency_folder / "accuracy_short_3.json").write_text(json.dumps(
        {"model": "short", "provenance": provenance("2026-03-01T00:00:00+00:00", "c"), "runs": short}))
    assert "`accuracy_tiny_1.json`" in bench_tables.render_headline(latency_folder, {})
    again = [payload("passkey", "full", None, 4096, 100.0), payload("passkey", "icecache", 256, 4096, 70.0)]
    (latency_folder / "accuracy_tiny_4.json").write_text(json.dumps(
        {"model": "tiny", "provenance": provenance("2026-04-01T00:00:00+00:00", "d"), "runs": again}))
    rendered = bench_tables.render_headline(latency_folder, {})
    assert "`accuracy_tiny_4.json`" in rendered
    assert {row[0].strip("`"): row[1:] for row in table_rows(rendered)}["icecache"] == ["70%", "10.00"]


def test_the_summaries_are_one_line_per_method_and_per_context(bench_tables, latency_folder):
    paper = {"latency": {"context_tokens": 3000, "tpot_ms": {"icecache": 100}, "tt2t_s": {"icecache": 7.5}}}
    rows = {row[0]: row[1:] for row in table_rows(bench_tables.render_latency_summary(latency_folder, paper))}
    assert rows["`icecache`"] == ["50.0", "200.0", "2.00", "2.00", "100", "7.50"]  # TPOT 1k 4k, TT2T 1k 4k, paper
    assert rows["`quest`"][:2] == ["30.0", "-"]
    write_latency(latency_folder, "latency_gpu_20990102-000000.json", "2026-03-01T00:00:00+00:00", "c", [
        summary_row("full", 150000, 0.030), summary_row("icecache", 150000, 0.300)], experiment="scaling")
    paper = {"scaling": {"tpot_ms": {"150000": {"full": 190, "icecache": 228}}}}
    scaling = table_rows(bench_tables.render_scaling_summary(latency_folder, paper))
    assert scaling == [["150k", "30.0", "300.0", "190", "228"]]


def test_the_regression_gate_flags_a_newer_file_slower_than_the_best_beyond_noise(bench_tables, tmp_path):
    # quest: 1.0x full_static at first, then 1.5x (slower, beyond the 20% spread of its rounds); h2o: 1.0x then
    # 1.1x (inside its noise); a method in one file only has nothing to compare with.
    write_latency(tmp_path, "latency_gpu_20260101-000000.json", "2026-01-01T00:00:00+00:00", "a", [
        summary_row("full_static", 1024, 0.010), summary_row("quest", 1024, 0.010), summary_row("h2o", 1024, 0.010),
    ])
    write_latency(tmp_path, "latency_gpu_20260201-000000.json", "2026-02-01T00:00:00+00:00", "b", [
        summary_row("full_static", 1024, 0.020), summary_row("quest", 1024, 0.030), summary_row("h2o", 1024, 0.022),
        summary_row("snapkv", 1024, 0.020),
    ])
    checks = {c["row"]["method"]: c for c in bench_tables.regression_checks(tmp_path)}
    assert checks["quest"]["verdict"] == "slower" and checks["quest"]["change"] == pytest.approx(0.5)
    assert checks["h2o"]["verdict"] == "within noise"
    assert checks["snapkv"]["verdict"] == "first file" and checks["snapkv"]["best"] is None
    summary = bench_tables.render_regression_summary(tmp_path, {})
    assert "1 slower beyond noise" in summary and "`quest` at 1k (+50%" in summary
    rows = {row[1]: row for row in table_rows(bench_tables.render_regression(tmp_path, {}))}
    assert rows["`quest`"][-1] == "**slower**" and "latency_gpu_20260101-000000.json" in rows["`quest`"][3]


def test_the_regression_gate_compares_with_the_best_file_not_the_previous_one(bench_tables, tmp_path):
    for day, tpot in (("01", 0.010), ("02", 0.020), ("03", 0.012)):
        write_latency(tmp_path, f"latency_gpu_202601{day}-000000.json", f"2026-01-{day}T00:00:00+00:00", day[-1], [
            summary_row("full_static", 1024, 0.010), summary_row("quest", 1024, tpot),
        ])
    (check,) = [c for c in bench_tables.regression_checks(tmp_path) if c["row"]["method"] == "quest"]
    assert check["best"][2].name == "latency_gpu_20260101-000000.json"
    assert check["change"] == pytest.approx(0.2) and check["verdict"] == "within noise"  # spread 0.9-1.1: 20%


def test_the_icecache_floor_adds_the_searches_at_the_read_rate_and_the_hand_offs_to_full_static(bench_tables,
                                                                                                 tmp_path):
    # Llama-3.1-8B has 32 layers, IceCache keeps 2 dense: 30 indexed layers. 1 GB read at 100 GB/s is 10 ms; 30
    # hand-offs of 10 us and 30 exchanges of 50 us are 0.3 and 1.5 ms; full_static's step is 8 ms.
    probe = {"layers": 30, "us_per_layer_over_floor": {"stream_memory_native": 10.0, "copies_1048576": 50.0}}
    settings = {"model": "llama31_8b", "source": "random", "budget": 256, "threads": 16, "repeats": 1, "warmup": 0,
                "decode_steps": 64, "dtype_resolved": "torch.bfloat16", "host_read_gbps": 100.0,
                "handoff_costs": probe}
    rows = [summary_row("full_static", 32768, 0.008),
            summary_row("icecache", 32768, 0.040, search_bytes_read_per_step=1e9,
                        phases_s={"query": 0.02, "load": 0.005, "model": 0.015})]
    payload = {"kind": "latency", "settings": settings, "summary": rows,
               "provenance": provenance("2026-01-01T00:00:00+00:00", "a")}
    (tmp_path / "latency_gpu_20260101-000000.json").write_text(json.dumps(payload))
    (row,) = table_rows(bench_tables.render_floor(tmp_path, {}))
    assert row[:4] == ["32768", "`icecache`", "40.0", "5.00"]
    assert row[4] == "20.0 / 5.0 / 15.0"
    assert row[5:10] == ["8.0", "10.0", "0.30", "1.5", "19.8"]
    assert row[10:12] == [f"{19.8 / 8:.2f}", f"{40 / 19.8:.2f}"] and row[-1] == "same file"


def test_throughput_comes_from_the_newest_file_of_each_context_with_its_limits(bench_tables, tmp_path):
    def row(method, batch, tokens_per_s):
        return {"context": 32768, "method": method, "method_label": method, "batch_size": batch,
                "tokens_per_s": tokens_per_s, "tpot_s": batch / tokens_per_s, "peak_gpu_bytes": 40 * 2**30}

    def write(name, date, rows, limits):
        from eval.throughput import summarise

        payload = {"kind": "throughput", "settings": {"model_name": "llama", "budget": 256, "decode_steps": 16},
                   "provenance": provenance(date, "abc1234"), "rows": rows, "limits": limits,
                   "summary": summarise(rows, limits)}
        (tmp_path / name).write_text(json.dumps(payload))

    write("throughput_h200_20261201-100000.json", "2026-12-01", [row("full_static", 1, 100.0)], [])
    write("throughput_h200_20261202-100000.json", "2026-12-02",
          [row("full_static", 1, 110.0), row("full_static", 2, 200.0), row("quest", 1, 100.0),
           row("quest", 2, 190.0), row("quest", 4, 360.0)],
          [{"context": 32768, "method": "full_static", "method_label": "full_static", "batch_size": 4,
            "kind": "gpu", "stage": "prefill"}])
    text = bench_tables.render_throughput(tmp_path, {})
    assert "throughput_h200_20261202-100000.json" in text and "20261201" not in text
    rows = {r[0]: r for r in table_rows(text)}
    assert rows["`full_static`"][1:4] == ["110", "200", "-"]
    assert rows["`full_static`"][5:7] == ["1.00x", "gpu memory at 4"]
    assert rows["`quest`"][4:7] == ["360 (4)", "1.80x", "none up to 4"]
    assert "side by side" not in text

    # A later file whose rows ran side by side gets a table of its own beside the newest one whose rows took turns.
    write("throughput_h200_20261203-100000.json", "2026-12-03", [row("full_static", 1, 120.0)], [])
    side = json.loads((tmp_path / "throughput_h200_20261203-100000.json").read_text())
    side["settings"]["row_streams"] = True
    (tmp_path / "throughput_h200_20261203-100000.json").write_text(json.dumps(side))
    text = bench_tables.render_throughput(tmp_path, {})
    in_turn, side_by_side = text.split("\n\n", 2)[0], text.split("\n\n")[2]
    assert "20261202-100000" in in_turn and "side by side" not in in_turn
    assert "20261203-100000" in side_by_side and "side by side on streams of their own" in side_by_side


def test_throughput_tables_give_each_best_batch_s_host_reads_and_the_file_s_link(bench_tables, tmp_path):
    """The last column: what the best batch's step copied from host memory and that over its step time; the caption:
    the file's link probe. A file without either shows neither."""
    from eval.throughput import summarise

    rows = [{"context": 32768, "method": method, "method_label": method, "batch_size": batch,
             "tokens_per_s": batch / step, "tpot_s": step, "peak_gpu_bytes": 2**30, **extra}
            for method, batch, step, extra in (("full_static", 1, 0.01, {}),
                                               ("shadowkv", 2, 0.02, {"bytes_to_gpu_per_step": 100e6}),
                                               ("shadowkv", 4, 0.025, {"bytes_to_gpu_per_step": 200e6,
                                                                       "host_rss_bytes": 40 * 2**30}))]
    link = {"dma_gbps": 52.4, "zero_copy_gbps": {"4096": {"random": 41.2, "sequential": 45.0},
                                                 "1024": {"random": 20.6, "sequential": 30.0}}}
    payload = {"kind": "throughput", "settings": {"model_name": "llama", "budget": 256, "decode_steps": 8,
                                                  "link": link},
               "provenance": provenance("2026-12-01", "abc1234"), "rows": rows, "limits": [],
               "summary": summarise(rows, [])}
    (tmp_path / "throughput_h200_20261201-100000.json").write_text(json.dumps(payload))
    text = bench_tables.render_throughput(tmp_path, {})
    by_method = {r[0]: r for r in table_rows(text)}
    assert by_method["`shadowkv`"][-1] == "200, 8.0"  # the best batch (4): 200 MB over 25 ms
    assert by_method["`shadowkv`"][-3] == "1 / 40" and by_method["`full_static`"][-3] == "1 / -"  # GPU / host GiB
    assert by_method["`full_static`"][-1] == "-"
    assert "at 52 GB/s with its copy engines" in text and "1 KB 21, 4 KB 41 GB/s" in text
    assert "not measured" not in text
    del payload["settings"]["link"]
    # full_static's third prefill failed with two rows fitted, whose batch was not measured: the table says so.
    payload["limits"] = [{"context": 32768, "method": "full_static", "method_label": "full_static", "batch_size": 3,
                          "kind": "gpu", "stage": "prefill", "rows_prefilled": 2}]
    payload["summary"] = summarise(rows, payload["limits"])
    (tmp_path / "throughput_h200_20261201-100000.json").write_text(json.dumps(payload))
    text = bench_tables.render_throughput(tmp_path, {})
    assert "copy engines" not in text
    assert {r[0]: r for r in table_rows(text)}["`full_static`"][-4] == "gpu memory at 3 (2 fitted, not measured)"
    assert "2 rows that fit were not measured" in text and "overstate" in text
    assert "groups of rows" not in text
    # A file whose batched methods ran in groups of rows gets a table of its own, which says so.
    payload["settings"]["row_groups"] = 2
    (tmp_path / "throughput_h200_20261202-100000.json").write_text(json.dumps(payload))
    text = bench_tables.render_throughput(tmp_path, {})
    assert "20261201-100000" in text and "20261202-100000" in text
    assert text.count("in 2 groups of rows, a launch each (`--row-groups 2`)") == 1


def test_throughput_files_of_other_gpus_get_tables_of_their_own_per_gpu(bench_tables, tmp_path):
    """A throughput file in a folder of results/bench/ stays out of the main throughput tables and fills the other-GPU
    ones, one per GPU (the newest file of each), named with its folder."""
    from eval.throughput import summarise

    def write(folder, name, gpu, date, tokens_per_s):
        rows = [{"context": 131072, "method": method, "method_label": method.partition(":")[0], "batch_size": batch,
                 "tokens_per_s": tokens, "tpot_s": batch / tokens, "peak_gpu_bytes": 2**30}
                for method, batch, tokens in (("full_static", 1, 60.0), ("shadowkv", 4, tokens_per_s),
                                              ("shadowkv:batch_kernels=false", 2, 90.0))]
        folder.mkdir(exist_ok=True)
        payload = {"kind": "throughput", "settings": {"model_name": "llama", "budget": 256, "decode_steps": 8,
                                                      "row_streams": True},
                   "provenance": {**provenance(date, "abc1234"), "gpu": gpu}, "rows": rows, "limits": [],
                   "summary": summarise(rows, [])}
        (folder / name).write_text(json.dumps(payload))

    write(tmp_path / "h100_20261201", "throughput_h100_20261201-100000.json", "GPU A", "2026-12-01", 120.0)
    write(tmp_path / "h100_20261202", "throughput_h100_20261202-100000.json", "GPU A", "2026-12-02", 240.0)
    write(tmp_path / "b200_20261202", "throughput_b200_20261202-100000.json", "GPU B", "2026-12-02", 300.0)
    assert "No throughput file yet" in bench_tables.render_throughput(tmp_path, {})
    text = bench_tables.render_other_gpus_throughput(tmp_path, {})
    assert "`h100_20261202/throughput_h100_20261202-100000.json`" in text and "20261201" not in text
    assert "`b200_20261202/throughput_b200_20261202-100000.json`" in text
    assert text.index("GPU A") < text.index("GPU B")
    variant = [r for r in table_rows(text) if r[0] == "`shadowkv (batch_kernels=false)`"]
    # Columns B=1, B=2, B=4: the variant has its own row and numbers, not its base method's.
    assert [r[1:6] for r in variant] == [["-", "90", "-", "90 (2)", "1.50x"]] * 2
    shadowkv = [r[4:6] for r in table_rows(text) if r[0] == "`shadowkv`"]
    assert shadowkv == [["240 (4)", "4.00x"], ["300 (4)", "5.00x"]]  # GPU A's newest file, then GPU B's
    assert "resumed across GPUs" not in text
    # A file finished on another GPU than it began says so: its ratio is not one machine's.
    path = tmp_path / "b200_20261202" / "throughput_b200_20261202-100000.json"
    data = json.loads(path.read_text())
    data["resumed_by"] = [{"provenance": {"gpu": "GPU A"}}]
    path.write_text(json.dumps(data))
    assert "resumed across GPUs (GPU B + GPU A)" in bench_tables.render_other_gpus_throughput(tmp_path, {})
    assert "ended before its last batch" not in bench_tables.render_other_gpus_throughput(tmp_path, {})
    data["complete"] = False  # a run that ran out of time says so
    path.write_text(json.dumps(data))
    assert "ended before its last batch" in bench_tables.render_other_gpus_throughput(tmp_path, {})


def test_other_gpus_come_from_the_folders_with_last_round_times_and_ratios_of_their_own_file(bench_tables, tmp_path):
    """Files in a folder of results/bench/ fill the other-GPU table only; per GPU the newest row of each method,
    ratios to its own file's full caches, TTFT and TT2T from the last round (a variant's rounds its own)."""
    write_latency(tmp_path, "latency_gpu_20260101-000000.json", "2026-01-01T00:00:00+00:00", "a",
                  [summary_row("full_static", 1024, 0.010)])
    other = tmp_path / "h100_20260102"
    other.mkdir()
    write_latency(other, "latency_h100_20260102-000000.json", "2026-01-02T00:00:00+00:00", "b", [
        summary_row("full", 1024, 0.020), summary_row("full_static", 1024, 0.010),
        summary_row("pqcache", 1024, 0.030), summary_row("pqcache:kmeans_on=host", 1024, 0.040)])
    path = other / "latency_h100_20260102-000000.json"
    data = json.loads(path.read_text())
    data["provenance"]["gpu"] = "Other GPU"
    data["measurements"] = [
        {"method": method, "method_label": method.split(":")[0], "context": 1024, "round": r, "ttft_s": ttft,
         "tt2t_s": ttft + 0.5}
        for method, firsts in (("full", (4.0, 2.0)), ("pqcache", (8.0, 3.0)), ("pqcache:kmeans_on=host", (9.0, 2.5)))
        for r, ttft in enumerate(firsts)]
    path.write_text(json.dumps(data))
    write_latency(other, "latency_h100_20260101-000000.json", "2026-01-01T00:00:00+00:00", "c",
                  [summary_row("full_static", 1024, 0.009), summary_row("quest", 1024, 0.011)])
    rows = {(row[0], row[2]): row for row in table_rows(bench_tables.render_other_gpus(tmp_path, {}))}
    other_gpu = {"`full`", "`full_static`", "`pqcache`", "`pqcache (kmeans_on=host)`"}
    assert set(rows) == {("Other GPU", m) for m in other_gpu} | {("Test GPU", "`full_static`"), ("Test GPU", "`quest`")}
    assert rows["Other GPU", "`pqcache`"][1:8] == ["1k", "`pqcache`", "30.0", "3.00", "3.00", "1.50", "3.50"]
    assert rows["Other GPU", "`pqcache (kmeans_on=host)`"][5:7] == ["2.50", "1.25"]
    assert rows["Test GPU", "`quest`"][4] == "1.22"  # to the full_static of its own file
    assert rows["Other GPU", "`full_static`"][-1] == "b" * 7
    assert all(row[0] != "`quest`" for row in table_rows(bench_tables.render_latency_summary(tmp_path, {})))


def test_a_speed_goal_is_checked_against_the_newest_file_of_each_gpu_with_its_reference(bench_tables, tmp_path,
                                                                                       monkeypatch):
    """Each goal a method declares gets, per GPU, the ratio from the newest file holding the method and the goal's
    reference at that context (an older, faster file does not decide it, but is named beside it as the best), met
    or missed by how much, or "not measured"."""
    from baselines.shadowkv import ShadowKV
    from icecache.core.method import SpeedGoal

    monkeypatch.setattr(ShadowKV, "speed_goals", (SpeedGoal(4096, "tpot", 0.85, "a test"),
                                                 SpeedGoal(4096, "ttft", 1.2, "a test")))
    write_latency(tmp_path, "latency_gpu_20990101-000000.json", "2026-01-01T00:00:00+00:00", "a", [
        summary_row("full", 4096, 0.040), summary_row("full_static", 4096, 0.010),
        summary_row("shadowkv", 4096, 0.008)])
    write_latency(tmp_path, "latency_gpu_20990101-000001.json", "2026-01-02T00:00:00+00:00", "b", [
        summary_row("full", 4096, 0.040), summary_row("full_static", 4096, 0.010),
        summary_row("shadowkv", 4096, 0.009, ttft_s_median=1.5)])
    (tmp_path / "other").mkdir()
    write_latency(tmp_path / "other", "latency_gpu_20990101-000002.json", "2026-01-03T00:00:00+00:00", "c", [
        summary_row("shadowkv", 4096, 0.001)])  # no reference in its file: not a measurement of the goal
    rows = {(row[0], row[2]): row for row in table_rows(bench_tables.render_speed_goals(tmp_path, {}))}
    tpot, ttft = rows[("`shadowkv`", "tpot")], rows[("`shadowkv`", "ttft")]
    assert tpot[4] == ("0.90, missed by 6% (`latency_gpu_20990101-000001.json`, bbbbbbb); "
                       "best 0.80, met (`latency_gpu_20990101-000000.json`, aaaaaaa)")
    assert ttft[4].startswith("1.50, missed by 25%") and ttft[-1] == "a test"
    assert ttft[4].endswith("; best 1.00, met (`latency_gpu_20990101-000000.json`, aaaaaaa)")
    assert not any(row[0] == "`shadowkv`" and "0.10" in row[4] for row in rows.values())
    # a newest file as good as the best names no other
    write_latency(tmp_path, "latency_gpu_20990101-000003.json", "2026-01-04T00:00:00+00:00", "d", [
        summary_row("full", 4096, 0.040), summary_row("full_static", 4096, 0.010),
        summary_row("shadowkv", 4096, 0.007)])
    rows = {(row[0], row[2]): row for row in table_rows(bench_tables.render_speed_goals(tmp_path, {}))}
    assert rows[("`shadowkv`", "tpot")][4] == "0.70, met (`latency_gpu_20990101-000003.json`, ddddddd)"
    assert rows[("`shadowkv`", "ttft")][4] == "1.00, met (`latency_gpu_20990101-000003.json`, ddddddd)"


def test_a_throughput_goal_is_a_lower_bound_on_the_best_over_full_static_s_best(bench_tables, tmp_path, monkeypatch):
    from baselines.shadowkv import ShadowKV
    from icecache.core.method import SpeedGoal

    monkeypatch.setattr(ShadowKV, "speed_goals", (SpeedGoal(4096, "throughput", 3.0, "a test"),))
    summary = [{"context": 4096, "method": "full_static", "best_tokens_per_s": 100.0, "largest_batch": 2},
               {"context": 4096, "method": "shadowkv", "best_tokens_per_s": 250.0, "largest_batch": 8}]
    limits = [{"context": 4096, "method": "full_static", "stage": "prefill", "rows_prefilled": 3}]
    (tmp_path / "throughput_gpu_20990101-000000.json").write_text(json.dumps(
        {"kind": "throughput", "settings": {}, "provenance": provenance("2026-01-01T00:00:00+00:00", "a"),
         "rows": [], "limits": limits, "summary": summary}))
    [row] = [row for row in table_rows(bench_tables.render_speed_goals(tmp_path, {})) if row[0] == "`shadowkv`"]
    assert row[3] == "≥ 3" and row[4].startswith("2.50, missed by 17%, overstated: `full_static`'s fitted rows")


def test_a_latency_row_is_named_by_the_settings_it_ran_with_against_today_s_defaults(bench_tables, tmp_path):
    """A default that changes after a file was written does not rename that file's rows: a row that recorded its
    settings is named by those that differ from the method's defaults of today, whatever its command called it."""
    import dataclasses

    from eval.latency import method_values
    from eval.report.variants import measured_variant
    from icecache.core.method import method_settings

    def ran(variant: str) -> dict:  # the settings a latency run of ``variant`` records (eval/latency.py)
        return dataclasses.asdict(method_settings(method_values(variant, 256, [])))

    today = ran("pqcache")["cache_copy_programs"]
    older = today + 7  # a file from the day this setting had another default
    assert measured_variant("pqcache", 256, {**ran("pqcache"), "cache_copy_programs": older}) == \
        f"pqcache:cache_copy_programs={older}"
    assert measured_variant(f"pqcache:cache_copy_programs={today}", 256, ran(f"pqcache:cache_copy_programs={today}")) \
        == "pqcache"
    assert measured_variant("icecache:lookahead=true", 256, ran("icecache:lookahead=true")) == "icecache:lookahead=true"
    assert measured_variant("pqcache", 256, None) == "pqcache"  # a file from before rows recorded their settings

    # in the tables: an older file's typed "pqcache" is the old setting; a newer file's typed variant is today's
    reference = {"name": "full_static", "cuda_graph": False}  # a reference keeps its name: every ratio is to it
    write_latency(tmp_path, "latency_gpu_20260101-000000.json", "2026-01-01T00:00:00+00:00", "a", [
        summary_row("full_static", 1024, 0.010, method_config=reference),
        summary_row("pqcache", 1024, 0.030, budget=256,
                    method_config={**ran("pqcache"), "cache_copy_programs": older})])
    write_latency(tmp_path, "latency_gpu_20260102-000000.json", "2026-01-02T00:00:00+00:00", "b", [
        summary_row("full_static", 1024, 0.010, method_config=reference),
        summary_row(f"pqcache:cache_copy_programs={today}", 1024, 0.020, budget=256,
                    method_config=ran(f"pqcache:cache_copy_programs={today}"))])
    first = bench_tables.Result(tmp_path / "latency_gpu_20260101-000000.json")
    assert [row["method"] for row in first.data["summary"]] == ["full_static", f"pqcache:cache_copy_programs={older}"]
    rows = {row[1]: row for row in table_rows(bench_tables.render_latency(tmp_path, {}))}
    assert rows["`pqcache`"][2] == "20.0" and rows["`pqcache`"][-1] == "b" * 7
    assert rows["`full_static`"][-1] == "b" * 7


def test_today_s_defaults_of_every_method_are_its_config_class_s_as_a_run_composes_them():
    """The renaming reads a method's defaults from its config class, without Hydra (the report package sits below
    the application): they must be what a run composes from configs/method/<name>.yaml."""
    import dataclasses

    from eval.latency import method_values
    from eval.report.names import LATENCY_REFERENCES
    from eval.report.variants import _defaults, measured_variant
    from icecache.core.layer import ModelInfo
    from icecache.core.method import METHODS, build_method, method_class, method_settings

    for name in METHODS.names():
        if name in LATENCY_REFERENCES:
            continue
        budget = 256 if method_class(name).uses_budget else None
        composed = dataclasses.asdict(method_settings(method_values(name, budget, [])))
        assert _defaults(name, budget) == composed, name
        # a method built for a model keeps its settings: a default run is named by its method alone
        built = build_method(composed, ModelInfo(n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128))
        assert measured_variant(name, budget, dataclasses.asdict(built.config)) == name
