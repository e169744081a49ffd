"""scripts/device_detached.sh (a command that outlives the call that started it, and its waits) and
scripts/bench_latency_resumed.sh (a latency file completed over as many processes as it takes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "device_detached.sh"


def small_repository(tmp_path: Path) -> Path:
    """A repository of the script and one file (the script runs its command in a copy of its repository)."""
    repo = tmp_path / "repo"
    if not repo.exists():
        (repo / "scripts").mkdir(parents=True)
        (repo / "scripts" / SCRIPT.name).write_text(SCRIPT.read_text())
        (repo / "inputs.txt").write_text("from the repository\n")
        (repo / ".venv").mkdir()
        (repo / ".venv" / "big").write_text("not copied")
    return repo


def detached(tmp_path: Path, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "ICECACHE_DETACHED_ROOT": str(tmp_path / "root"), "OUT": str(out or tmp_path)}
    script = small_repository(tmp_path) / "scripts" / SCRIPT.name
    return subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_detached_command_survives_the_end_of_the_call_and_wait_hands_over_its_files(tmp_path):
    gate = tmp_path / "gate"
    # It reads a file of the repository from its copy, and changes to the repository after the start do not reach it.
    command = ('echo "before the gate" > "$DETACHED_OUT/started.txt"; '
               f'while [ ! -e {gate} ]; do sleep 0.1; done; cp inputs.txt "$DETACHED_OUT/result.txt"; '
               'ls -A "$DETACHED_TREE" > "$DETACHED_OUT/tree.txt"; echo finished')
    script = small_repository(tmp_path) / "scripts" / SCRIPT.name
    # The call that starts it runs in its own process group, which is then killed, as the GPU host does when a
    # call returns.
    env = {**os.environ, "ICECACHE_DETACHED_ROOT": str(tmp_path / "root")}
    call = subprocess.Popen(["bash", "-c", f'bash {script} start row "$0"; sleep 30', command], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    pid_file = tmp_path / "root" / "row" / "pid"
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        time.sleep(0.1)
    os.killpg(call.pid, signal.SIGKILL)
    call.wait()

    early = tmp_path / "early"
    early.mkdir()
    still = detached(tmp_path, "wait", "row", "0", out=early)
    assert still.returncode == 3 and "still running" in still.stdout  # the kill did not reach it
    assert (early / "started.txt").read_text() == "before the gate\n"  # what it wrote so far came back already
    (tmp_path / "repo" / "inputs.txt").write_text("a later copy of the working tree\n")
    gate.touch()
    out = tmp_path / "out"
    out.mkdir()
    ended = detached(tmp_path, "wait", "row", "30", out=out)
    assert ended.returncode == 0, ended.stdout + ended.stderr
    assert "finished" in ended.stdout  # the end of its log
    assert (out / "result.txt").read_text() == "from the repository\n"
    assert (out / "tree.txt").read_text().split() == ["inputs.txt", "scripts"]  # no virtual environment


def test_wait_reports_a_failed_command_and_refuses_what_was_never_started(tmp_path):
    assert detached(tmp_path, "start", "bad", "exit 7").returncode == 0
    failed = detached(tmp_path, "wait", "bad", "30")
    assert failed.returncode == 1 and "status 7" in failed.stdout
    never = detached(tmp_path, "wait", "other")
    assert never.returncode == 2 and "nothing was started as other" in never.stderr
    assert detached(tmp_path, "start", "../up", "true").returncode == 2  # a name, not a path
    assert detached(tmp_path, "wait", "bad", "soon").returncode == 2


def test_a_second_start_under_a_running_name_is_refused(tmp_path):
    gate = tmp_path / "gate"
    assert detached(tmp_path, "start", "row", f"while [ ! -e {gate} ]; do sleep 0.1; done").returncode == 0
    again = detached(tmp_path, "start", "row", "true")
    assert again.returncode == 2 and "running already" in again.stderr
    gate.touch()
    assert detached(tmp_path, "wait", "row", "30").returncode == 0


def resumed(tmp_path: Path, *args: str, tries: int = 3) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "TRIES": str(tries)}
    return subprocess.run(["bash", str(REPO / "scripts" / "bench_latency_resumed.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


BENCH = ["--model", "tiny_llama", "--lengths", "48", "--methods", "streaming_llm", "--budget", "32", "--repeats", "1",
         "--warmup", "0", "--decode-steps", "64", "--bandwidth-probe-gib", "0.01"]


def test_bench_latency_resumed_completes_the_file_a_killed_process_left(tmp_path):
    out = tmp_path / "out"
    first = resumed(tmp_path, str(out), *BENCH)
    assert first.returncode == 0, first.stdout + first.stderr
    [path] = out.glob("latency_*.json")
    whole = json.loads(path.read_text())
    assert whole["complete"] is True and [m["method"] for m in whole["measurements"]] == [
        "full", "full_static", "streaming_llm"]

    # What a process killed after its second measurement leaves: the file unfinished, two measurements in.
    cut = dict(whole, complete=False, measurements=whole["measurements"][:2])
    path.write_text(json.dumps(cut))
    again = resumed(tmp_path, str(out), *BENCH)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"completing {path}" in again.stdout
    assert [p.name for p in out.glob("latency_*.json")] == [path.name]  # the same file, completed
    done = json.loads(path.read_text())
    assert done["complete"] is True and len(done["resumed_by"]) == 1
    assert [(m["method"], m["process"]) for m in done["measurements"]] == [
        ("full", 0), ("full_static", 0), ("streaming_llm", 1)]


def test_bench_latency_resumed_refuses_what_is_its_own_to_set(tmp_path):
    for argument in ("--out", "--resume=x.json"):
        refused = resumed(tmp_path, str(tmp_path), *BENCH, argument)
        assert refused.returncode == 2 and f"{argument} is this script's to set" in refused.stderr
    refused = resumed(tmp_path, str(tmp_path), *BENCH, tries=0)
    assert refused.returncode == 2 and "TRIES must be" in refused.stderr
    assert not list(tmp_path.glob("latency_*.json"))  # refused before anything ran


def test_attention_probe_refuses_a_host_without_cuda_in_one_line(tmp_path):
    probe = subprocess.run([sys.executable, str(REPO / "scripts" / "attention_probe.py"), "--kv", "1024",
                            "--chunk", "256", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert probe.returncode != 0
    assert probe.stderr.strip().splitlines()[-1] == ("error: attention_probe.py times CUDA kernels: run it on a GPU "
                                                      "host")
    assert not list(tmp_path.iterdir())
