"""The Makefile's long-grid targets: their one-line refusals of a bad PART or LENGTH, and the commands they run
(``PY=echo`` prints each command instead of running it; ``STAMP=`` skips the environment's set-up)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-s", *args, "STAMP=", "PY=echo"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("part,experiment,length", [("passkey", "accuracy_long_passkey", "task.lengths=[16384]"),
                                                   ("ruler", "accuracy_long_ruler", "task.lengths=[16384]"),
                                                   ("gsm8k", "accuracy_gsm8k", None)])
def test_each_part_of_the_long_grid_runs_its_sweeps_then_curates_the_grid(part, experiment, length):
    result = make("reproduce-accuracy-long", f"PART={part}", "LENGTH=16k")
    assert result.returncode == 0, result.stderr
    sweep, curate = result.stdout.splitlines()[:2]
    assert sweep.startswith("scripts/sweep.py") and sweep.count("--sweep") == 2
    assert sweep.count(f"experiment={experiment}") == 2 and "method=icecache method.lookahead=true" in sweep
    if length:
        assert sweep.count(length) == 2
    assert "--restore" in sweep  # the finished runs of the curated files come back first
    assert "--no-run --curate accuracy" in curate and "task.lengths" not in curate  # the whole grid, every length


@pytest.mark.parametrize("target", ["reproduce-accuracy-long", "reproduce-determinism"])
@pytest.mark.parametrize("args,message", [(("PART=bogus",), "PART=ruler, passkey or gsm8k"),
                                          ((), "PART=ruler, passkey or gsm8k"),
                                          (("PART=ruler", "LENGTH=8k"), "LENGTH=16k or 32k")])
def test_a_bad_part_or_length_stops_with_one_line(target, args, message):
    result = make(target, *args)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "scripts/" not in result.stdout  # nothing ran


def test_determinism_runs_the_part_again_elsewhere_and_compares_it_with_the_curated_grid(tmp_path):
    curated, again = tmp_path / "accuracy_model_20990101-000000.json", tmp_path / "again"
    curated.write_text("{}")
    result = make("reproduce-determinism", "PART=passkey", "LENGTH=32k", f"CURATED={curated}", f"AGAIN_ROOT={again}")
    assert result.returncode == 0, result.stderr
    sweep, compare = result.stdout.splitlines()
    assert sweep.count("--sweep") == 2 == sweep.count(f"output_root={again}")
    assert sweep.count("task.lengths=[31500]") == 2 and "--restore" not in sweep
    words = compare.split()
    assert words[:3] == ["scripts/compare_runs.py", str(curated), str(again)]
    assert words[words.index("--out") + 1].startswith("results/bench/determinism_passkey_32k_")


def test_determinism_without_a_curated_grid_says_which_file_to_give(tmp_path):
    result = make("reproduce-determinism", "PART=ruler", f"CURATED={tmp_path / 'missing.json'}")
    assert result.returncode != 0 and "give CURATED=" in result.stderr and not result.stdout
    # another model's grid is not the default model's curated file: it has to be named
    result = make("reproduce-determinism", "PART=ruler", "MODEL=smollm2_135m")
    assert result.returncode != 0 and "give CURATED=" in result.stderr and not result.stdout


@pytest.mark.parametrize("target, experiment", [("reproduce-selection", "experiment=accuracy_ruler "),
                                                ("reproduce-selection-long", "experiment=accuracy_long_ruler ")])
def test_the_selection_diagnostic_runs_every_method_at_one_budget_and_curates_under_its_own_name(target, experiment):
    result = make(target, "SELECTION_SAMPLES=3")
    assert result.returncode == 0, result.stderr
    [sweep] = result.stdout.splitlines()
    assert sweep.count("--sweep") == 2 and sweep.count("measure_selection=true") == 2 == sweep.count(experiment)
    # the diagnostic measures one sample's steps: the short grid's batches of 16 are undone
    assert sweep.count("batch_size=1") == 2
    assert sweep.count("budget=256") == 2 and sweep.count("task.num_samples=3") == 2
    assert "method=icecache method.lookahead=true" in sweep and "--curate selection" in sweep
    assert "--restore" not in sweep  # its runs are its own: none of the grid's comes back


def test_the_long_selection_grid_runs_at_the_length_asked_for():
    default, longer = (make("reproduce-selection-long", *extra) for extra in ((), ("SELECTION_LONG_LENGTH=32768",)))
    assert default.returncode == 0 == longer.returncode, default.stderr + longer.stderr
    assert default.stdout.count("task.lengths=[16384]") == 2 and "32768" not in default.stdout
    assert longer.stdout.count("task.lengths=[32768]") == 2 and "16384" not in longer.stdout
