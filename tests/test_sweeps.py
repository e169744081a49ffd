"""Every experiment's sweep: each configured cell composes and passes its checks, and each runs on a tiny model
(the experiment's own task at a tiny size); IceCache's budget-64 cells run with the fitted fixed pages, recorded
in their config. CPU only."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from eval import sweep

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"

# The swept data axis pinned to one small value and the task shrunk to one or two samples: the cells (method x
# budget) are the experiment's own.
TINY_TASKS = {
    "table2": ["task.source=local", f"task.data_dir={FIXTURES / 'longbench'}", "task.datasets=[narrativeqa]",
               "task.limit=1"],
    "passkey": ["task.lengths=[400]", "task.num_depths=1"],
    "gsm8k": [f"task.path={FIXTURES / 'gsm8k' / 'test.jsonl'}", "task.limit=1"],
    "ruler": [f"task.data_dir={FIXTURES / 'ruler'}", "task.tasks=[niah_single_1]", "task.lengths=[1024]",
              "task.num_samples=1"],
    "accuracy_passkey": ["task.lengths=[400]", "task.num_depths=1"],
    "accuracy_ruler": [f"task.data_dir={FIXTURES / 'ruler'}", "task.tasks=[fwe]", "task.lengths=[1024]",
                       "task.num_samples=1"],  # fwe: 50 new tokens, the fewest of the tasks that fit at 1024
    "accuracy_long_passkey": ["task.lengths=[400]", "task.num_depths=1"],
    "accuracy_long_ruler": [f"task.data_dir={FIXTURES / 'ruler'}", "task.tasks=[fwe]", "task.lengths=[1024]",
                            "task.num_samples=1"],
    "accuracy_gsm8k": [f"task.path={FIXTURES / 'gsm8k' / 'test.jsonl'}", "task.limit=1"],
}
SWEPT = sorted(TINY_TASKS)


def grid(experiment: str) -> set[tuple[str, int | None]]:
    """(method, budget) of every configured cell: the sweeper's methods x budgets, the full caches budget-free."""
    from omegaconf import OmegaConf

    from eval.cli import hydra_context, sweep_jobs
    from eval.plugins import method_class

    with hydra_context():
        _, base = sweep_jobs([f"experiment={experiment}"])
        params = OmegaConf.to_container(base.hydra.sweeper.params)
        budgets = [int(b) for b in str(params.get("budget", base.budget)).split(",")]
        cells = {(m, b if method_class(m).uses_budget else None) for m in str(params["method"]).split(",")
                 for b in budgets}
        if base.get("reference_runs"):
            cells.add(("full", None))
    return cells


def test_every_experiment_with_a_sweep_is_tested():
    experiments = sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml"))
    drivers = [e for e in experiments if "bench:" in (REPO / "configs" / "experiment" / f"{e}.yaml").read_text()]
    assert sorted(set(experiments) - set(drivers)) == SWEPT


@pytest.mark.parametrize("experiment", SWEPT)
def test_every_configured_cell_composes_and_passes_its_checks(experiment):
    """The whole configured grid on the experiment's own model (settings checks: budget rules, types, lengths),
    as ``sweep.py --dry-run --strict`` counts it."""
    jobs, _ = sweep.expand([f"experiment={experiment}"], device="cuda")
    assert jobs and not [(j.overrides, j.error) for j in jobs if j.error]
    budgets = {(j.run_dir.parts[-3], j.run_dir.parts[-2]) for j in jobs}
    expected = {(m, f"budget-{'none' if b is None else b}") for m, b in grid(experiment)}
    assert budgets == expected


@pytest.mark.parametrize("experiment", SWEPT)
def test_every_configured_cell_runs_on_a_tiny_model(experiment, tmp_path):
    from eval.config import RunConfig
    from eval.runner import run

    overrides = [f"experiment={experiment}", "model=tiny_llama", f"output_root={tmp_path}", *TINY_TASKS[experiment]]
    jobs, _ = sweep.expand(overrides, device="cpu")  # with the tiny model's geometry: the methods' own checks too
    assert not [(j.overrides, j.error) for j in jobs if j.error]
    distinct = [j for j in jobs if j.duplicate_of is None]
    cells = set()
    for job in distinct:
        config = RunConfig.from_dict(_values(job.overrides))
        metrics = run(config)
        assert metrics["n_samples"] >= 1 and (config.output_dir() / "metrics.json").exists(), job.overrides
        cells.add((config.method["name"], config.method.get("budget")))
        if config.method["name"].startswith("icecache") and config.method["budget"] == 64:
            # 4 pages of 16: 1 sink + 2 selected + 1 window, recorded where the run's settings are
            recorded = json.loads((config.output_dir() / "metrics.json").read_text())["settings"]["method"]
            assert (recorded["n_sink_pages"], recorded["n_window_pages"]) == (1, 1)
            assert "n_sink_pages: 1" in (config.output_dir() / "config.yaml").read_text()
    assert cells == grid(experiment)


def _values(job: list[str]) -> dict:
    from eval.cli import JobComposer, hydra_context, run_values

    with hydra_context():
        return run_values(JobComposer().compose(sweep.normalise_overrides(job)))


@pytest.mark.parametrize("experiment", SWEPT)
def test_the_fast_job_composer_equals_hydra_compose(experiment):
    """eval/sweep.py and run.py -m compose a sweep's jobs once per choice of config groups plus Hydra's own override
    code; the result is what Hydra's full composition gives for each job."""
    from hydra import compose
    from omegaconf import OmegaConf

    from eval.cli import JobComposer, hydra_context, sweep_jobs

    with hydra_context():
        jobs, _ = sweep_jobs([f"experiment={experiment}", "model=tiny_llama", "method=full,icecache,quest"])
        composer = JobComposer()
        for job in jobs[:: max(1, len(jobs) // 12)]:
            fast = OmegaConf.to_container(composer.compose(job), resolve=True)
            full = OmegaConf.to_container(compose(config_name="config", overrides=job), resolve=True)
            assert fast == full, job


def test_icecache_reuse_prompt_within_the_budget_and_decode_past_it():
    import torch

    from eval.plugins import build_method
    from icecache.core.cache import HarnessCache
    from icecache.core.generation import GenerationRequest, greedy_generate
    from tests.conftest import tiny_model

    model, _, info = tiny_model("llama")
    ids = torch.randint(0, 500, (250,), generator=torch.Generator().manual_seed(7)).tolist()
    # The prompt fits in the budget, so every layer offloads at the decode step that crosses it, and the owner's
    # first window insert comes in that step, before its reusers' prompt jobs: they lay out the index as built.
    result = greedy_generate(model, HarnessCache(build_method({"name": "icecache_reuse", "budget": 256}, info)),
                             GenerationRequest(ids, 64))
    assert len(result.token_ids) == 64 and result.counters["pages_loaded"] > 0


# ---------------------------------------------------------------------------------------------------------------
# run.py -m: a job whose run fails is reported, with its log, and the sweep exits non-zero, on every launcher;
# the sweep's own files and the closing hint follow output_root


def run_py(argv: list[str], monkeypatch) -> int:
    """``run.py <argv>`` in this process (eval/cli.py's main); -> its exit status."""
    from hydra.core.global_hydra import GlobalHydra

    from eval import cli

    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["run.py", *argv])
    try:
        cli.main()
    except SystemExit as stopped:
        return stopped.code
    finally:
        GlobalHydra.instance().clear()
    return 0


def sweep_with_a_run_that_fails(tmp_path: Path, monkeypatch, *launcher: str) -> tuple[int, Path, Path]:
    """``run.py -m`` over two GSM8K files, the first removed once the command line's checks have passed: only its
    job can tell (as a file missing on a cluster's node). -> (exit status, output root, the removed file)."""
    from eval import cli

    doomed = tmp_path / "data" / "test.jsonl"
    doomed.parent.mkdir()
    doomed.write_text((FIXTURES / "gsm8k" / "test.jsonl").read_text())
    checks = cli.precheck

    def checks_then_removal(argv):
        checks(argv)
        doomed.unlink()

    monkeypatch.setattr(cli, "precheck", checks_then_removal)
    root = tmp_path / "runs"
    code = run_py(["-m", "experiment=gsm8k", "model=tiny_llama", "method=full", "budget=256", "task.limit=1",
                   f"task.path={doomed},{FIXTURES / 'gsm8k' / 'test.jsonl'}", f"output_root={root}", *launcher],
                  monkeypatch)
    return code, root, doomed


def failed_reports(output: str) -> dict[int, tuple[str, str, str]]:
    """{index: (reason, log, command)} of each job the sweep's report lists as failed."""
    return {int(index): (reason, log, command) for index, reason, log, command in re.findall(
        r"^\[ +(\d+)\] failed: (.+)\n +log: (.+)\n +python run\.py (.+)$", output, re.M)}


def sweep_files_in_the_clone() -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in (REPO / "results" / "sweeps").rglob("*")} \
        if (REPO / "results" / "sweeps").exists() else {}


@pytest.mark.parametrize("launcher", ["local", "slurm_local"])
def test_run_py_m_reports_a_job_whose_run_failed_with_its_log_and_exits_2(launcher, tmp_path, monkeypatch, capfd):
    before = sweep_files_in_the_clone()
    code, root, doomed = sweep_with_a_run_that_fails(tmp_path, monkeypatch, f"hydra/launcher={launcher}")
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert "sweep: 2 tasks: 1 finished, 1 failed, 0 crashed" in out, out + err
    [(index, (reason, log, command))] = failed_reports(out).items()
    assert index == 0 and str(doomed) in reason and f"task.path={doomed}" in command, out
    if launcher == "local":
        assert log == "this process's output, above" and f"error: {reason}" in err
    else:  # the task's own log, under the output root's sweep folder
        assert Path(log).parent.parent == root / ".sweeps" / "gsm8k" / "tiny-llama" / ".submitit"
        assert f"error: {reason}" in Path(log).read_text()
    assert [line for line in err.splitlines() if line.startswith("error: ")][-1].startswith(
        "error: 1 job(s) of the sweep did not finish")
    [finished] = root.rglob("metrics.json")  # the other job ran to the end
    assert json.loads(finished.read_text())["settings"]["task"]["path"] == str(FIXTURES / "gsm8k" / "test.jsonl")
    # defect: the sweep's folder and the hint followed the clone's results/, not output_root
    assert (root / ".sweeps" / "gsm8k" / "tiny-llama" / "multirun.yaml").exists()
    assert sweep_files_in_the_clone() == before
    assert f"python scripts/collect.py {root} --out results/summary" in out


def test_run_py_m_exits_0_when_every_job_finishes(tmp_path, monkeypatch, capfd):
    code = run_py(["-m", "model=tiny_llama", "method=full", "task=gsm8k", "task.limit=1",
                   f"task.path={FIXTURES / 'gsm8k' / 'test.jsonl'}", f"output_root={tmp_path}"], monkeypatch)
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert "sweep: 1 tasks: 1 finished, 0 failed, 0 crashed" in out and not failed_reports(out)
    assert (tmp_path / ".sweeps" / "multirun.yaml").exists()


def test_the_sweep_folder_is_inside_the_output_root_and_no_part_of_a_run(tmp_path):
    from eval.cli import JobComposer, compose_one, hydra_context, run_values

    with hydra_context():
        experiment = ["experiment=passkey", "model=tiny_llama"]
        for overrides, tail in (([], ".sweeps"), (experiment, ".sweeps/passkey/tiny-llama")):
            for root in ("results/runs", str(tmp_path)):
                cfg = compose_one([f"output_root={root}", *overrides], with_hydra=True)
                assert cfg.hydra.sweep.dir == f"{root}/{tail}"
        # the run's settings (and so its directory's hash) hold nothing of the hydra node
        values = run_values(JobComposer().compose([f"output_root={tmp_path}", "hydra.sweep.dir=/elsewhere"]))
        assert "hydra" not in values and values == run_values(JobComposer().compose([f"output_root={tmp_path}"]))


def test_scripts_sweep_names_the_output_root_in_its_closing_hint(tmp_path, capsys):
    overrides = ["experiment=passkey", "model=tiny_llama", "method=full", "budget=256", "task.lengths=[400]",
                 "task.num_depths=1", f"output_root={tmp_path}"]
    [job], _ = sweep.expand(overrides, device="cpu")
    job.path.mkdir(parents=True)
    (job.path / "metrics.json").write_text("{}")  # done: the call runs nothing
    assert sweep.main(overrides) == 0
    out = capsys.readouterr().out
    assert f"python scripts/collect.py {tmp_path} --out results/summary" in out and "results/runs" not in out
