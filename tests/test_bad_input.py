"""Every bad input is one ``error:`` line and exit code 2, found before the model's weights load (and, where the
settings alone show it, before the model's config or tokenizer is read), with no run directory left behind.

The cases run ``run.py``'s ``main`` (eval/cli.py) in this process; each forbids the loading steps its error must come
before (the step raises if it is reached), so "before any model load" is checked by structure, not by the clock."""

from __future__ import annotations

import random
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
    noise = bytes(random.Random(0).randrange(256) for _ in range(4096))  # no UTF-8 text
    (folder / "gsm8k_noise.jsonl").write_bytes(noise)
    (folder / "gsm8k_utf16.jsonl").write_text(rows[0] + "\n", encoding="utf-16")
    (folder / "gsm8k_locked.jsonl").write_text(rows[0] + "\n")  # unreadable: the case's setup says so
    (folder / "lb_noise").mkdir()
    (folder / "lb_noise" / "trec.jsonl").write_bytes(noise)
    (folder / "ruler_noise").mkdir()
    for source in (FIXTURES / "ruler").glob("*.json"):
        (folder / "ruler_noise" / source.name).write_bytes(source.read_bytes())
    (folder / "ruler_noise" / "PaulGrahamEssays.json").write_bytes(noise)
    (folder / "afile").write_text("a file, not a folder\n")
    (folder / "readonly").mkdir()
    return {"lb": folder / "lb", "torn": folder / "gsm8k_torn.jsonl", "noq": folder / "gsm8k_noq.jsonl",
            "empty": folder / "gsm8k_empty.jsonl", "noise": folder / "gsm8k_noise.jsonl",
            "utf16": folder / "gsm8k_utf16.jsonl", "locked": folder / "gsm8k_locked.jsonl",
            "lb_noise": folder / "lb_noise", "ruler_noise": folder / "ruler_noise", "folder": folder,
            "afile": folder / "afile", "readonly": folder / "readonly"}


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
    ("passkey past the model's positions", [TINY, "model.max_length=20000", "task.lengths=[16000]",
                                            "task.calibration=tokens"],
     "longer than the 8192 positions of model", MODEL_CONFIG),
    # inputs found only once the model had loaded
    ("passkey length under its fixed text", [TINY, "task.lengths=[10]"], "passkey length 10 is shorter", TOKENIZER),
    ("GSM8K row without question", [TINY, "task=gsm8k", "task.path={noq}"], "row 2 of", SETTINGS),
    ("RULER length too short for a task", [TINY, "task=ruler", "task.data_dir={ruler}", "task.tasks=[qa_1]",
                                           "task.lengths=[100]"], "ruler length 100 is too short", TOKENIZER),
    ("IceCache budget below 3 pages", [TINY, "budget=32"], "budget 32 gives 2 pages", SETTINGS),
    ("unknown method setting", [TINY, "method.no_such_knob=3"], "no_such_knob", SETTINGS),
    # tried as a new user would, beyond the cases above: what each gave before is in the comment
    # data files: a traceback (UnicodeDecodeError, PermissionError, or a folder called missing)
    ("GSM8K file of random bytes", [TINY, "task=gsm8k", "task.path={noise}"],
     "gsm8k_noise.jsonl is not UTF-8 text (line 1 is not)", SETTINGS),
    ("GSM8K file in UTF-16", [TINY, "task=gsm8k", "task.path={utf16}"], "gsm8k_utf16.jsonl is not UTF-8 text",
     SETTINGS),
    ("unreadable GSM8K file", [TINY, "task=gsm8k", "task.path={locked}"],
     "gsm8k_locked.jsonl cannot be read by this user (permission denied): make it readable (chmod a+r", SETTINGS),
    ("LongBench file of random bytes", [TINY, "task=longbench", "task.source=local", "task.data_dir={lb_noise}",
                                        "task.datasets=[trec]"], "trec.jsonl is not UTF-8 text", SETTINGS),
    ("RULER essays of random bytes", [TINY, "task=ruler", "task.data_dir={ruler_noise}", "task.lengths=[1000]"],
     "PaulGrahamEssays.json cannot be read as JSON (UnicodeDecodeError)", TOKENIZER),
    ("GSM8K path a folder", [TINY, "task=gsm8k", "task.path={folder}"], "data is a folder; set task.path", SETTINGS),
    # keys: accepted silently (+foo), or refused without the key meant
    ("unknown top-level key +foo=bar", [TINY, "+foo=bar"], "the run has no setting foo;", SETTINGS),
    ("misspelt top-level key", [TINY, "budgte=64"], "no key budgte (did you mean budget?)", SETTINGS),
    ("misspelt config group", [TINY, "methd=quest"], "no key methd (did you mean method?)", SETTINGS),
    ("misspelt model key", ["mdoel=tiny_llama"], "no key mdoel (did you mean model?)", SETTINGS),
    ("misspelt task key", [TINY, "task.lenghts=[400]"], "no key task.lenghts (did you mean task.lengths?)",
     SETTINGS),
    ("misspelt method key with +", [TINY, "+method.page_sise=16"], "no setting page_sise (did you mean page_size?)",
     SETTINGS),
    ("+ on a key that exists", [TINY, "+method.budget=128"], "An item is already at 'method.budget'", SETTINGS),
    ("a removed key others read (~budget)", [TINY, "~budget"], "method.budget cannot be resolved", SETTINGS),
    # conflicting settings: the method's budget won silently
    ("budget and method.budget differ", [TINY, "budget=256", "method.budget=128"],
     "budget=256 and method.budget=128 conflict: set the budget once", SETTINGS),
    # budgets: told to "add budget=<tokens>" when given one; two minimums in one line; no [4096] hint
    ("budget=-64", [TINY, "budget=-64"], "budget=-64: method 'icecache' needs a positive number of tokens", SETTINGS),
    ("budget=0 on Quest", [TINY, "method=quest", "budget=0"], "budget=0: method 'quest' needs a positive", SETTINGS),
    ("budget=null on IceCache", [TINY, "budget=null"], "method 'icecache' needs a budget: add budget=<tokens>",
     SETTINGS),
    ("budget=64.5", [TINY, "budget=64.5"], "budget=64.5 must be a whole number", SETTINGS),
    ("budget= (empty)", [TINY, "budget="], "budget='' must be a whole number", SETTINGS),
    ("budget=40 under IceCache's three pages", [TINY, "budget=40"],
     "icecache needs at least 48 = (1 sink + 1 selected + 1 window page) x page_size=16: use budget=48", SETTINGS),
    ("-m: a negative budget in the grid", ["-m", TINY, "method=quest", "budget=64,-64"],
     "1 of the sweep's 2 jobs cannot run; the first, [1] model=tiny_llama method=quest budget=-64", SETTINGS),
    # types and ranges
    ("task.lengths=4096 (no list)", [TINY, "task.lengths=4096"],
     "task.lengths=4096 must be a list of whole numbers: write task.lengths=[4096]", SETTINGS),
    ("task.datasets=trec (no list)", [TINY, "task=longbench", "task.source=local", "task.data_dir={lb}",
                                      "task.datasets=trec"], "write task.datasets=[trec]", SETTINGS),
    ("task.lengths with a word", [TINY, "task.lengths=[400,abc]"], "must be a list of whole numbers", SETTINGS),
    ("task.lengths=[0]", [TINY, "task.lengths=[0]"], "task.lengths must be a non-empty list of positive", SETTINGS),
    ("task.limit=-1", [TINY, "task.limit=-1"], "task.limit must be at least 1", SETTINGS),
    ("resume=maybe", [TINY, "resume=maybe"], "resume='maybe' must be true or false", SETTINGS),
    ("shard past n_shards", [TINY, "shard=3", "n_shards=2"], "shard=3 of n_shards=2", SETTINGS),
    ("prefill_chunk_size=-1", [TINY, "prefill_chunk_size=-1"], "prefill_chunk_size must be positive", SETTINGS),
    ("model.dtype=float64", [TINY, "model.dtype=float64"], "model.dtype=float64 unknown", SETTINGS),
    # output_root
    ("output_root a file", [TINY, "output_root={afile}"], "afile is a file, not a folder", SETTINGS),
    ("output_root under a file", [TINY, "output_root={afile}/runs"], "afile is a file, not a folder", SETTINGS),
    ("read-only output_root", [TINY, "output_root={readonly}/runs"], "cannot create folders under", SETTINGS),
    # Hydra syntax: a non-ASCII path was a "malformed override" with no hint to quote it
    ("unquoted non-ASCII path", [TINY, "task=gsm8k", "task.path=/data/données.jsonl"],
     "write \"task.path='/data/données.jsonl'\"", SETTINGS),
    ("unclosed list", [TINY, "task.lengths=[400"], "malformed override task.lengths=[400 (", SETTINGS),
    ("double =", [TINY, "budget==64"], "malformed override budget==64", SETTINGS),
    ("a bare word", [TINY, "quest"], "malformed override quest", SETTINGS),
    ("a misspelt flag", ["--cgf", "job", TINY], "unknown flag --cgf", SETTINGS),
    ("empty config choice", [TINY, "task="], "unknown task ''", SETTINGS),
]


def simulate(case_id: str, paths: dict[str, Path], monkeypatch) -> None:
    """What this machine cannot show as root: a file this user may not read, a folder it may not write."""
    import pathlib
    import tempfile

    if case_id == "unreadable GSM8K file":
        real_open = pathlib.Path.open

        def open_(self, *args, **kwargs):
            if self == paths["locked"]:
                raise PermissionError(13, "Permission denied", str(self))
            return real_open(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "open", open_)
    if case_id == "read-only output_root":
        real_mkdtemp = tempfile.mkdtemp

        def mkdtemp(*args, dir=None, **kwargs):
            if dir is not None and Path(dir) == paths["readonly"]:
                raise PermissionError(13, "Permission denied")
            return real_mkdtemp(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)


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
    case_id, overrides, message, stage = case
    paths = {**data(tmp_path), "ruler": FIXTURES / "ruler"}
    out = tmp_path / "runs"
    argv = [o.format(**paths) for o in overrides]
    simulate(case_id, paths, monkeypatch)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    if not any(o.startswith("output_root=") for o in argv):
        argv.append(f"output_root={out}")
    guarded(stage)
    stopped = main(argv + [f"hydra.sweep.dir={tmp_path / 'sweeps'}"] if "-m" in argv else argv, monkeypatch)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("loading ")]
    assert stopped.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err
    assert "Traceback" not in err
    assert not out.exists() and not (tmp_path / "sweeps").exists()  # no run directory, no sweep directory
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing made, nothing lost


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


def test_a_hub_model_without_network_fails_at_once_without_retries(tmp_path, monkeypatch, capfd, guarded):
    """No network (simulated: every connection refused, no name resolves) and the model not in the hub's cache:
    the hub is tried once, with a short timeout, and the model read from the cache alone, so the line comes at once
    instead of after the hub client's retries (22 lines over 30 s)."""
    import socket

    import icecache.core.models as models

    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError(101, "Network is unreachable")

    def no_name(*args, **kwargs):
        attempts.append(args)
        raise socket.gaierror(-2)

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_name)
    monkeypatch.setattr(models, "_HUB_REACHABLE", {}, raising=False)
    guarded(MODEL_CONFIG)
    stopped = main(["model=llama31_8b", "model.path=icecache-harness-test/no-such-model",
                    f"output_root={tmp_path / 'runs'}"], monkeypatch)
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert stopped.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: could not load model llama-3.1-8b-instruct (icecache-harness-test/no-such-"
                               "model) from the hub") and "set model.path=" in lines[0]
    # The probe and at most one more connection before the local cache is read: without the probe the hub
    # client retried a dozen times (about 23 s) before its error.
    assert len(attempts) <= 2, attempts
    assert not (tmp_path / "runs").exists()


ACCEPTED = [
    ("spaces in output_root", ["output_root='{tmp}/my runs'"], "my runs"),
    ("quoted non-ASCII output_root", ["output_root='{tmp}/résultats'"], "résultats"),
    ("budget and method.budget the same", ["budget=128", "method.budget=128", "output_root={tmp}/runs"], "runs"),
]


@pytest.mark.parametrize("case", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_good_input_with_spaces_or_unicode_runs(case, tmp_path, monkeypatch, capfd):
    """Not refused: spaces and (quoted) letters beyond ASCII in a path, one budget given twice; each runs."""
    from hydra.core.global_hydra import GlobalHydra

    _, overrides, root = case
    GlobalHydra.instance().clear()
    argv = [TINY, "task.lengths=[400]", "task.num_depths=1", *(o.format(tmp=tmp_path) for o in overrides)]
    monkeypatch.setattr(sys, "argv", ["run.py", *argv])
    cli.main()
    GlobalHydra.instance().clear()
    assert "error:" not in capfd.readouterr().err
    assert len(list((tmp_path / root).rglob("metrics.json"))) == 1


KILLABLE_RUN = """
import sys, time
from icecache.core import generation
real = generation.greedy_generate
def slow(*args, **kwargs):
    time.sleep(0.3)  # time for the kill to land mid-run
    return real(*args, **kwargs)
generation.greedy_generate = slow
from eval import cli
sys.argv = ["run.py", *sys.argv[1:]]
cli.main()
"""


def test_a_run_killed_with_sigkill_resumes_saying_so_without_losing_or_duplicating_a_sample(tmp_path, monkeypatch,
                                                                                            capfd):
    import json
    import os
    import signal
    import subprocess

    argv = [TINY, "method=full", "task.lengths=[300]", "task.num_depths=8", f"output_root={tmp_path / 'runs'}"]
    job = subprocess.Popen([sys.executable, "-c", KILLABLE_RUN, *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    written: list[Path] = []
    while time.monotonic() < deadline and job.poll() is None:
        written = list((tmp_path / "runs").rglob("predictions.jsonl"))
        if written and len(written[0].read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert job.poll() is None, "the run ended before it could be killed"
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    predictions = written[0]
    kept = [json.loads(line)["sample_id"] for line in predictions.read_text().splitlines() if line.endswith("}")]
    assert 2 <= len(kept) < 8 and not (predictions.parent / "metrics.json").exists()

    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", ["run.py", *argv])
    cli.main()
    GlobalHydra.instance().clear()
    out = capfd.readouterr().out
    assert f"resuming {predictions.parent}: {len(kept)} of 8 samples already written, {8 - len(kept)} to run" in out
    ids = [json.loads(line)["sample_id"] for line in predictions.read_text().splitlines()]
    assert ids[:len(kept)] == kept and sorted(ids) == sorted(set(ids)) and len(ids) == 8  # each once, none lost
    assert json.loads((predictions.parent / "metrics.json").read_text())["n_samples"] == 8
