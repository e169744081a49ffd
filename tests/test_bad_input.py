"""Every bad input is one ``error:`` line and exit code 2, found before the model's weights load (and, where the
settings alone show it, before the model's config or tokenizer is read), with no run directory left behind.

The cases run ``run.py``'s ``main`` (eval/cli.py) in this process; each forbids the loading steps its error must come
before (the step raises if it is reached), so "before any model load" is checked by structure, not by the clock."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from eval import cli

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"

SETTINGS, MODEL_CONFIG, TOKENIZER = "settings", "model config", "tokenizer"  # the last step each case may reach


class Reached(BaseException):
    """A loading step that the case's error must come before (BaseException: Hydra does not catch it)."""


def data(tmp_path: Path) -> dict[str, Path]:
    folder = tmp_path / "data"
    (folder / "lb").mkdir(parents=True)
    (folder / "lb" / "trec.jsonl").write_text((FIXTURES / "longbench" / "trec.jsonl").read_text().splitlines()[0]
                                              + '\n{"input": "torn\n')
    rows = (FIXTURES / "gsm8k" / "test.jsonl").read_text().splitlines()
    (folder / "gsm8k_torn.jsonl").write_text(rows[0] + '\n{"question": "q", "answ\n')
    (folder / "gsm8k_noq.jsonl").write_text(rows[0] + '\n{"answer": "#### 2"}\n')
    (folder / "gsm8k_empty.jsonl").write_text("\n")
    return {"lb": folder / "lb", "torn": folder / "gsm8k_torn.jsonl", "noq": folder / "gsm8k_noq.jsonl",
            "empty": folder / "gsm8k_empty.jsonl"}


TINY = "model=tiny_llama"
# (id, overrides (may use {lb}, {torn}, {noq}, {empty}, {ruler}), what the line says, last step it may reach)
CASES = [
    # inputs that ended in a traceback
    ("missing model.path folder", ["model=llama31_8b", "model.path=/nonexistent/Llama-3.1-8B-Instruct"],
     "model.path=/nonexistent/Llama-3.1-8B-Instruct does not exist", SETTINGS),
    ("malformed LongBench line", [TINY, "task=longbench", "task.source=local", "task.data_dir={lb}",
                                  "task.datasets=[trec]"], "trec.jsonl line 2 is not valid JSON", SETTINGS),
    ("malformed GSM8K line", [TINY, "task=gsm8k", "task.path={torn}"], "gsm8k_torn.jsonl line 2 is not valid JSON",
     SETTINGS),
    ("budget=abc", [TINY, "budget=abc"], "budget='abc' must be a whole number", SETTINGS),
    ("task.lengths=abc", [TINY, "task.lengths=abc"], "task.lengths='abc' must be a list of whole numbers", SETTINGS),
    ("output_root=/proc/x", [TINY, "output_root=/proc/x"], "output_root=/proc/x: cannot create folders", SETTINGS),
    ("threads=-1", [TINY, "threads=-1"], "threads=-1 must be at least 1", SETTINGS),
    ("slurm without a cluster", ["-m", TINY, "method=full", "hydra/launcher=slurm"],
     "hydra/launcher=slurm needs a Slurm cluster", SETTINGS),
    ("-m: a value that does not compose", ["-m", TINY, "task.no_such_key=1,2"],
     "2 of the sweep's 2 jobs cannot run; the first, [0]", SETTINGS),
    ("-m: a value of the wrong type", ["-m", TINY, "budget=64,abc"], "1 of the sweep's 2 jobs cannot run", SETTINGS),
    ("-m: a cell its method refuses", ["-m", TINY, "method=full,icecache", "budget=32"],
     "1 of the sweep's 2 jobs cannot run; the first, [1] model=tiny_llama method=icecache budget=32", SETTINGS),
    ("a sweep value without -m", [TINY, "method=full,quest"], "needs -m", SETTINGS),
    # inputs that were accepted without a word
    ("budget=250 on IceCache pages", [TINY, "budget=250"], "budget 250 is not a multiple of icecache's page size 16",
     SETTINGS),
    ("budget=250 on Quest pages", [TINY, "method=quest", "budget=250"], "use budget=256 or 240", SETTINGS),
    ("threads=0", [TINY, "threads=0"], "threads=0 must be at least 1", SETTINGS),
    ("passkey task.limit=0", [TINY, "task.limit=0"], "task.limit must be at least 1", SETTINGS),
    ("empty GSM8K file", [TINY, "task=gsm8k", "task.path={empty}"], "has no problems", SETTINGS),
    ("passkey longer than the model", [TINY, "task.lengths=[9000]"], "exceeds the model's max_length 8000", SETTINGS),
    ("RULER longer than the model", [TINY, "task=ruler", "task.data_dir={ruler}", "task.lengths=[9000]"],
     "ruler length 9000 exceeds the model's max_length 8000", SETTINGS),
    # inputs found only once the model had loaded
    ("passkey length under its fixed text", [TINY, "task.lengths=[10]"], "passkey length 10 is shorter", TOKENIZER),
    ("GSM8K row without question", [TINY, "task=gsm8k", "task.path={noq}"], "row 2 of", SETTINGS),
    ("RULER length too short for a task", [TINY, "task=ruler", "task.data_dir={ruler}", "task.tasks=[qa_1]",
                                           "task.lengths=[100]"], "ruler length 100 is too short", TOKENIZER),
    ("IceCache budget below 3 pages", [TINY, "budget=32"], "budget 32 gives 2 pages", SETTINGS),
    ("unknown method setting", [TINY, "method.no_such_knob=3"], "no_such_knob", SETTINGS),
]


@pytest.fixture
def guarded(monkeypatch):
    """Install the guards for a case's last allowed step; returns the installer."""
    import icecache.core.models as models
    from eval import runner

    def install(stage: str) -> None:
        def forbid(name):
            def step(*args, **kwargs):
                raise Reached(f"{name} was reached; the error must come before it")
            return step

        monkeypatch.setattr(models, "load_model", forbid("loading the weights"))
        if stage in (SETTINGS, MODEL_CONFIG):
            monkeypatch.setattr(models, "load_tokenizer", forbid("loading the tokenizer"))
        if stage == SETTINGS:
            monkeypatch.setattr(runner, "model_info", forbid("reading the model's config"))
        monkeypatch.setattr(cli.shutil, "which", lambda name: None)  # no Slurm here, whatever the machine has

    return install


def main(argv: list[str], monkeypatch) -> SystemExit:
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["run.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    GlobalHydra.instance().clear()
    return stopped.value


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_before_any_model_load_and_leaves_nothing(case, tmp_path, monkeypatch, capfd,
                                                                                 guarded):
    _, overrides, message, stage = case
    paths = {**data(tmp_path), "ruler": FIXTURES / "ruler"}
    out = tmp_path / "runs"
    argv = [o.format(**paths) for o in overrides]
    if not any(o.startswith("output_root=") for o in argv):
        argv.append(f"output_root={out}")
    guarded(stage)
    start = time.monotonic()
    stopped = main(argv + [f"hydra.sweep.dir={tmp_path / 'sweeps'}"] if "-m" in argv else argv, monkeypatch)
    elapsed = time.monotonic() - start
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("loading ")]
    assert stopped.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err
    assert "Traceback" not in err
    assert not out.exists() and not (tmp_path / "sweeps").exists()  # no run directory, no sweep directory
    assert elapsed < 120  # generous: the structure above is the real check


def test_a_hub_model_without_network_is_one_line(tmp_path, monkeypatch, capfd, guarded):
    from eval import runner

    def offline(spec):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them "
                      "in the cached files.\nCheck your internet connection.")

    guarded(MODEL_CONFIG)
    monkeypatch.setattr(runner, "model_info", offline)
    stopped = main(["model=llama31_8b", f"output_root={tmp_path / 'runs'}"], monkeypatch)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert stopped.code == 2 and len(lines) == 1
    assert lines[0].startswith("error: could not load model llama-3.1-8b-instruct (meta-llama/Llama-3.1-8B-Instruct)"
                               " from the hub: We couldn't connect") and "set model.path=" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_hydras_own_cfg_flag_prints_the_config(monkeypatch, capfd):
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["run.py", "--cfg", "job", TINY, "method=quest"])
    cli.main()
    GlobalHydra.instance().clear()
    out = capfd.readouterr().out
    assert "name: quest" in out and "name: tiny-llama" in out
    assert cli.split_argv(["--cfg", "job", "-p", "task", "budget=64", "--info", "defaults", "-m"]) == (
        ["budget=64"], ["--cfg", "job", "-p", "task", "--info", "defaults", "-m"])


def test_a_local_sweep_goes_on_after_a_failing_job_and_says_where_results_are(tmp_path, monkeypatch, capfd):
    """A job that fails once it runs (here: a passkey length under its fixed text, found with the tokenizer)
    prints its line; the next job still runs, and the sweep exits 2 at the end."""
    out = tmp_path / "runs"
    stopped = main(["-m", TINY, "method=full", "task.lengths=[10],[400]", "task.num_depths=1", f"output_root={out}",
                    f"hydra.sweep.dir={tmp_path / 'sweeps'}"], monkeypatch)
    captured = capfd.readouterr()
    assert stopped.code == 2
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "passkey length 10 is shorter" in errors[0] and "1 job(s)" in errors[1]
    finished = list(out.rglob("metrics.json"))
    assert len(finished) == 1  # the job after the failing one ran
    assert f"results: {finished[0].parent}" in captured.out
