#!/usr/bin/env bash
# One GPU-host call: build the extensions, optionally run the GPU tests (GPU_TESTS=1; batched steps among them),
# then measure decode throughput against batch size on the Llama-3.1-8B architecture (random weights).
# Results go to $OUT (or results/bench).
# Usage: [GPU_TESTS=1] bash scripts/gpu_host/throughput.sh "<lengths>" "<methods>" "<batch sizes>" \
#        [scripts/bench/throughput.py arguments]
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_PROC_BIND=false
# Segments that grow in place: sequences prefilled one after the other otherwise leave the allocator's blocks too
# fragmented for the next one long before the GPU's memory is used (every method runs under the same setting).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# A git-archive copy has no .git: name the commit (ICECACHE_GIT_COMMIT=<sha> bash ...) so result files carry it.
export ICECACHE_GIT_COMMIT=${ICECACHE_GIT_COMMIT:-unknown}
out=${OUT:-results/bench}
source scripts/gpu_host/runner_packages.sh  # the runner's wheels, before the build
lengths=${1:-32768}
methods=${2:-quest arkvale shadowkv icecache}
batches=${3:-1 2 4 8 16}
shift 3 2>/dev/null || shift $#
mkdir -p "$out"
python3 setup.py build_ext --inplace -q 2>&1 | grep -i error
if [ -n "${GPU_TESTS:-}" ]; then
    bash scripts/gpu_host/gpu_tests.sh "$out" "${GPU_TEST_TIMEOUT:-420}"
fi
python3 scripts/bench/throughput.py --model llama31_8b --lengths $lengths --methods $methods --budget 256 \
    --batch-sizes $batches --threads 16 --out "$out" "$@" 2>&1 | grep -v "it/s\]$\|batch/s\]$" | tail -30
