"""The Slurm path against a real one-node cluster on this machine (scripts/slurm_local_cluster.sh: munged,
slurmctld, slurmd): a sweep is one job array submitted through hydra-submitit-launcher whose tasks all finish and
are collected; a preempted task comes back and resumes its run from predictions.jsonl; a task that fails is
reported with its log while the others finish, by scripts/sweep.py and by run.py -m alike; a finished sweep submits
nothing. The tests marked ``slurm`` are
skipped, with the reason, only where Slurm cannot be installed or started (no apt-get, not root)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
CLUSTER = REPO / "scripts" / "slurm_local_cluster.sh"
CLUSTER_DIR = Path(os.environ.get("ICECACHE_SLURM_DIR", "/var/tmp/icecache-slurm"))
NOT_AVAILABLE = 3  # the script's exit status when the packages are missing and cannot be installed
FIXTURES = REPO / "tests" / "fixtures"

# What a CPU-only test cluster can give each task; every knob the config keeps for cluster users is set.
LAUNCHER = ["hydra/launcher=slurm", "hydra.launcher.partition=cpu", "hydra.launcher.gpus_per_node=0",
            "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]


@pytest.fixture(scope="session")
def slurm_cluster():
    """The cluster, started for the session (and stopped after it) unless one is already up."""
    env = {**os.environ, "ICECACHE_SLURM_DIR": str(CLUSTER_DIR)}
    already_up = subprocess.run(["bash", str(CLUSTER), "status"], env=env, capture_output=True,
                                text=True).returncode == 0
    if not already_up:
        apt_timeout = int(os.environ.get("ICECACHE_SLURM_APT_TIMEOUT", "900"))
        started = subprocess.run(["bash", str(CLUSTER), "start"], env=env, capture_output=True, text=True,
                                 timeout=apt_timeout + 300)
        if started.returncode == NOT_AVAILABLE:
            reason = started.stderr.strip().splitlines()[-1] if started.stderr.strip() else "no reason given"
            pytest.skip(f"no Slurm cluster on this machine: {reason.removeprefix('error: ')}")
        assert started.returncode == 0, f"the local Slurm cluster did not start:\n{started.stdout}{started.stderr}"
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(CLUSTER_DIR / "slurm.conf")
    yield CLUSTER_DIR
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous
    if not already_up:
        stopped = subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True, text=True,
                                 timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def sweep(*overrides: str, timeout: int = 420) -> subprocess.CompletedProcess:
    return subprocess.run([PY, str(REPO / "scripts" / "sweep.py"), *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def array_id(output: str) -> str:
    match = re.search(r"submitted job array (\d+) ", output)
    assert match, output
    return match.group(1)


def scontrol_records(job_id: str) -> list[dict[str, str]]:
    """``scontrol show job -o``: one {key: value} per job (each task of an array)."""
    result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [dict(field.split("=", 1) for field in line.split() if "=" in field)
            for line in result.stdout.splitlines() if line.strip()]


ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def ended_records(job_id: str, timeout: float = 120) -> list[dict[str, str]]:
    """The records once every task has ended. A task's result file is written before its process exits, so the
    sweep can report it finished while the controller still shows it RUNNING or COMPLETING for a moment."""
    return wait_for(lambda: (records := scontrol_records(job_id)) and
                    all(r["JobState"] in ENDED for r in records) and records, timeout,
                    f"every task of job {job_id} to end")


def next_job_id() -> int:
    """The id the controller gives the next job submitted: unchanged when nothing was submitted."""
    result = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return int(re.search(r"^NEXT_JOB_ID\s*=\s*(\d+)", result.stdout, re.M).group(1))


def complete_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")] \
        if path.exists() else []


def sample_ids(path: Path) -> list[str]:
    return [json.loads(line)["sample_id"] for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------------
# One sweep that finishes, shared by the tests that read it


@pytest.fixture(scope="module")
def finished_sweep(slurm_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-sweep")
    overrides = ["experiment=passkey", "model=tiny_llama", "method=full,streaming_llm", "budget=32",
                 "task.lengths=[400]", "task.num_depths=2", f"output_root={root / 'runs'}",
                 f"hydra.sweep.dir={root / 'sweep'}", *LAUNCHER, "hydra.launcher.array_parallelism=2"]
    result = sweep(*overrides)
    return root, overrides, result


@pytest.mark.slurm
def test_a_sweep_is_one_job_array_whose_tasks_all_finish(finished_sweep):
    root, _, result = finished_sweep
    assert result.returncode == 0, result.stdout + result.stderr
    assert "sweep: 2 tasks: 2 finished, 0 failed, 0 crashed" in result.stdout
    tasks = ended_records(array_id(result.stdout))
    # one array of two tasks, with the settings the command line gave the launcher
    assert sorted(t["ArrayTaskId"] for t in tasks) == ["0", "1"]
    assert {t["ArrayJobId"] for t in tasks} == {array_id(result.stdout)}
    for task in tasks:
        assert task["JobState"] == "COMPLETED" and task["Restarts"] == "0"
        assert (task["Partition"], task["NumCPUs"], task["MinMemoryNode"], task["TimeLimit"]) == \
            ("cpu", "1", "1G", "00:10:00")
        assert task["ArrayTaskThrottle"] == "2" and task["Requeue"] == "1"
    metrics = sorted((root / "runs").rglob("metrics.json"))
    assert sorted(p.parts[-4] for p in metrics) == ["full", "streaming_llm"]
    for path in metrics:
        assert json.loads(path.read_text())["n_samples"] == 2
        ids = sample_ids(path.parent / "predictions.jsonl")
        assert len(ids) == len(set(ids)) == 2


@pytest.mark.slurm
def test_collect_builds_the_table_from_the_slurm_runs(finished_sweep):
    import pandas as pd

    root, _, result = finished_sweep
    assert result.returncode == 0, result.stdout + result.stderr
    out = root / "summary"
    collected = subprocess.run([PY, str(REPO / "scripts" / "collect.py"), str(root / "runs"), "--out", str(out),
                                "--no-plots"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stderr
    table = pd.read_csv(out / "passkey.csv")
    assert sorted(table["method"]) == ["full", "streaming_llm"]
    assert (pd.read_csv(out / "runs.csv")["n_samples"] == 2).all()


@pytest.mark.slurm
def test_resubmitting_a_finished_sweep_submits_nothing(finished_sweep):
    root, overrides, result = finished_sweep
    assert result.returncode == 0, result.stdout + result.stderr
    next_id, folders = next_job_id(), sorted((root / "sweep" / ".submitit").iterdir())
    again = sweep(*overrides)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "all 2 runs of the sweep are done; nothing to submit" in again.stdout
    assert next_job_id() == next_id  # no job reached the controller
    assert sorted((root / "sweep" / ".submitit").iterdir()) == folders


@pytest.mark.slurm
def test_a_submission_sbatch_refuses_is_one_error_line_and_submits_nothing(slurm_cluster, tmp_path):
    next_id = next_job_id()
    launcher = [o for o in LAUNCHER if not o.startswith("hydra.launcher.partition=")]
    result = sweep("experiment=passkey", "model=tiny_llama", "method=full", "task.lengths=[400]",
                   "task.num_depths=1", f"output_root={tmp_path / 'runs'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                   *launcher, "hydra.launcher.partition=nosuch")
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: the submission failed, nothing was submitted: ")
    assert "partition" in errors[0].lower()
    assert next_job_id() == next_id


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slurm
def test_failed_and_killed_tasks_are_reported_with_their_logs_and_the_other_finishes(slurm_cluster, tmp_path):
    missing = tmp_path / "absent" / "test.jsonl"  # data missing on the node: only the task itself can tell
    good = FIXTURES / "gsm8k" / "test.jsonl"
    copy = tmp_path / "copy" / "test.jsonl"  # the same data elsewhere: a third run, which the test kills
    copy.parent.mkdir()
    copy.write_text(good.read_text())
    overrides = ["experiment=gsm8k", "model=tiny_llama", "method=full", f"task.path={missing},{good},{copy}",
                 "task.limit=1", f"output_root={tmp_path / 'runs'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                 *LAUNCHER, "hydra.launcher.array_parallelism=2"]
    log = tmp_path / "sweep.out"
    with open(log, "w") as out:
        driver = subprocess.Popen([PY, str(REPO / "scripts" / "sweep.py"), *overrides], cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    array = None
    try:
        array = wait_for(lambda: re.search(r"submitted job array (\d+) ", log.read_text()), 300,
                         "the submission").group(1)
        # task 2 (the copy) starts once task 0 has failed; killed while it loads, it never writes a result
        wait_for(lambda: any(t["ArrayTaskId"] == "2" and t["JobState"] == "RUNNING"
                             for t in scontrol_records(array)), 300, "task 2 to start")
        subprocess.run(["scancel", f"{array}_2"], check=True, timeout=60)
        driver.wait(timeout=300)
    finally:
        if driver.poll() is None:  # the test failed half-way: free the cluster for the next test
            driver.kill()
            if array:
                subprocess.run(["scancel", array], timeout=60)
    output = log.read_text()
    assert driver.returncode == 1, output  # 1: a task crashed (2 would be failures with an error line only)
    assert "sweep: 3 tasks: 1 finished, 1 failed, 1 crashed" in output
    reports = dict((int(index), rest) for index, rest in re.findall(
        r"\[ +(\d+)\] (\w+: .+\n +log: .+\n +python run\.py .+)\n", output))
    assert sorted(reports) == [0, 2], output
    failed = re.match(r"failed: (.+)\n +log: (.+)\n +python run\.py (.+)", reports[0])
    reason, task_log, command = failed.groups()
    assert str(missing) in reason and "not found" in reason and f"task.path={missing}" in command
    assert Path(task_log) == tmp_path / "sweep" / ".submitit" / f"{array}_0" / f"{array}_0_0_log.out"
    assert f"error: {reason}" in Path(task_log).read_text()
    crashed = re.match(r"crashed: (.+)\n +log: (.+)\n +python run\.py (.+)", reports[2])
    reason, task_log, command = crashed.groups()
    assert "without a result" in reason and "CANCELLED" in reason and f"task.path={copy}" in command
    assert Path(task_log) == tmp_path / "sweep" / ".submitit" / f"{array}_2" / f"{array}_2_0_log.out"
    [finished] = (tmp_path / "runs").rglob("metrics.json")
    assert json.loads(finished.read_text())["settings"]["task"]["path"] == str(good)
    # Slurm itself saw task 0 end normally: only the sweep's report tells that its run failed
    states = {t["ArrayTaskId"]: t["JobState"] for t in ended_records(array)}
    assert states == {"0": "COMPLETED", "1": "COMPLETED", "2": "CANCELLED"}


@pytest.mark.slurm
def test_run_py_m_reports_a_task_whose_run_failed_with_its_log_and_exits_2(slurm_cluster, tmp_path, monkeypatch,
                                                                          capfd):
    """Hydra's own path (run.py -m): the task of a file missing once the checks passed is reported as failed, with
    its log under the output root, though Slurm saw it end normally; the other task finishes."""
    from tests.test_sweeps import failed_reports, sweep_with_a_run_that_fails

    code, root, doomed = sweep_with_a_run_that_fails(tmp_path, monkeypatch, *LAUNCHER)
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert "sweep: 2 tasks: 1 finished, 1 failed, 0 crashed" in out, out + err
    [(index, (reason, log, command))] = failed_reports(out).items()
    array = array_id(out)
    assert index == 0 and str(doomed) in reason and "not found" in reason and f"task.path={doomed}" in command
    assert Path(log) == root / ".sweeps" / "gsm8k" / "tiny-llama" / ".submitit" / f"{array}_0" / f"{array}_0_0_log.out"
    assert f"error: {reason}" in Path(log).read_text()
    assert "error: 1 job(s) of the sweep did not finish" in err
    [finished] = root.rglob("metrics.json")
    assert json.loads(finished.read_text())["settings"]["task"]["path"] == str(FIXTURES / "gsm8k" / "test.jsonl")
    assert {t["ArrayTaskId"]: t["JobState"] for t in ended_records(array)} == {"0": "COMPLETED", "1": "COMPLETED"}


@pytest.mark.slurm
def test_preempted_array_tasks_come_back_and_resume_their_runs(slurm_cluster, tmp_path):
    # two tasks of 80 samples of 2000 tokens, both running (one CPU each): seconds of work, so that the
    # preemption lands in the middle of the runs (the runs go on until its SIGKILL, 5-7 s after its SIGTERM,
    # which submitit ignores)
    overrides = ["experiment=passkey", "model=tiny_llama", "method=streaming_llm", "budget=32,64",
                 "task.lengths=[2000]", "task.num_depths=80", f"output_root={tmp_path / 'runs'}",
                 f"hydra.sweep.dir={tmp_path / 'sweep'}", *LAUNCHER, "hydra.launcher.array_parallelism=2"]
    log = tmp_path / "sweep.out"
    with open(log, "w") as out:
        driver = subprocess.Popen([PY, str(REPO / "scripts" / "sweep.py"), *overrides], cwd=REPO, stdout=out,
                                  stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    runs = tmp_path / "runs"
    try:
        files = wait_for(lambda: (found := sorted(runs.rglob("predictions.jsonl"))) and len(found) == 2 and found,
                         300, "both tasks to start their runs")
        wait_for(lambda: all(complete_lines(path) for path in files), 120, "a first sample in both runs")
        array = array_id(log.read_text())
        assert sorted(t["JobState"] for t in scontrol_records(array)) == ["RUNNING", "RUNNING"]
        cpus = subprocess.run(["sinfo", "-h", "-n", "localnode", "-o", "%c"], capture_output=True, text=True,
                              timeout=60).stdout.strip()
        # a job of the urgent partition that needs every CPU: Slurm requeues both running cpu tasks
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-c", cpus, "--mem=100M",
                                 f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 1"],
                                capture_output=True, text=True, timeout=60)
        assert urgent.returncode == 0, urgent.stderr
        wait_for(lambda: [(t["Restarts"], t["JobState"]) for t in scontrol_records(array)] == [("1", "PENDING")] * 2,
                 120, "both preempted tasks to be back in the queue")
        # what the killed tasks had written, read while they wait in the queue, before they start again
        before = {path: complete_lines(path) for path in files}
        finished_early = [path for path in files if (path.parent / "metrics.json").exists()]
        assert {t["JobState"] for t in scontrol_records(array)} == {"PENDING"}
        driver.wait(timeout=420)
    finally:
        if driver.poll() is None:  # the test failed half-way: free the cluster for the next test
            driver.kill()
            submitted = re.search(r"submitted job array (\d+) ", log.read_text())
            if submitted:
                subprocess.run(["scancel", submitted.group(1)], timeout=60)
    output = log.read_text()
    assert driver.returncode == 0, output
    assert not finished_early, "a run finished before the preemption killed it; give the runs more samples"
    assert "sweep: 2 tasks: 2 finished, 0 failed, 0 crashed" in output
    for path in files:
        assert 1 <= len(before[path]) < 80
        lines = path.read_text().splitlines(keepends=True)
        assert lines[: len(before[path])] == before[path], path  # the samples written before are kept as written
        ids = sample_ids(path)
        assert len(ids) == len(set(ids)) == 80, path  # none lost, none twice
        assert json.loads((path.parent / "metrics.json").read_text())["n_samples"] == 80
    for task in ended_records(array):
        assert (task["JobState"], task["Restarts"]) == ("COMPLETED", "1")
        task_log = Path(task["StdOut"]).read_text()
        assert "DUE TO PREEMPTION" in task_log and task_log.count("Starting with JobEnvironment") == 2
    assert ended_records(urgent.stdout.strip())[0]["JobState"] == "COMPLETED"


# ---------------------------------------------------------------------------------------------------------------
# Without a cluster


def test_the_launcher_knobs_are_overrides_with_the_documented_defaults():
    from eval.sweep import expand, launcher_summary

    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \| `(--[\w-]+)", (REPO / "docs" / "reproduce.md").read_text(), re.M)
    knobs = {"partition", "account", "qos", "timeout_min", "gpus_per_node", "cpus_per_task", "mem_gb",
             "array_parallelism"}
    assert {key for key, _, _ in rows} == knobs
    _, base = expand(["experiment=passkey", "hydra/launcher=slurm"], resolve_dirs=False)
    for key, default, _ in rows:
        assert str(base.hydra.launcher[key]).replace("None", "null") == default, key
    values = {"partition": "gpu", "account": "abc", "qos": "high", "timeout_min": "600", "gpus_per_node": "2",
              "cpus_per_task": "8", "mem_gb": "64", "array_parallelism": "4"}
    _, base = expand(["experiment=passkey", "hydra/launcher=slurm",
                            *(f"hydra.launcher.{k}={v}" for k, v in values.items())], resolve_dirs=False)
    sbatch = launcher_summary(base, 10).split("sbatch ", 1)[1].splitlines()[0].split()
    assert {"--partition=gpu", "--account=abc", "--qos=high", "--time=600", "--gpus-per-node=2",
            "--cpus-per-task=8", "--mem=64GB", "--array=0-9%4"} <= set(sbatch)
    assert "export OMP_NUM_THREADS=8" in launcher_summary(base, 10)


def test_the_cluster_script_says_in_one_line_why_it_cannot_start(tmp_path):
    # a machine with neither Slurm nor apt-get: only `id` on the PATH
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "id").symlink_to(subprocess.run(["sh", "-c", "command -v id"], capture_output=True,
                                                         text=True).stdout.strip())
    env = {"PATH": str(tmp_path / "bin"), "ICECACHE_SLURM_DIR": str(tmp_path / "cluster")}
    result = subprocess.run(["/bin/bash", str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == NOT_AVAILABLE
    [line] = result.stderr.splitlines()
    assert line.startswith("error: Slurm is not installed and ")
    assert "apt-get" in line or "root" in line
    bad = subprocess.run(["/bin/bash", str(CLUSTER), "restart"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown command 'restart'")
    assert len(bad.stderr.splitlines()) == 1


def wait_for(condition, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
