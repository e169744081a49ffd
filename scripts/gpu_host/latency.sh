#!/usr/bin/env bash
# One GPU-host call: build the DCI extension, run the GPU tests (kernels, methods on GPU vs CPU, the CUDA-graphed
# full cache), optionally bench one layer's prompt job (PROMPT_BENCH=1) and the DCI index (DCI_BENCH=1: float32
# and half first passes side by side), then time the methods against both full caches on the Llama-3.1-8B
# architecture (random weights). Results go to $OUT (or results/bench).
# HOST_STEP_BENCH=1 times one layer's host work per decode step at 32k and 128k (scripts/bench/host_step.py).
# Usage: [PROMPT_BENCH=1] [DCI_BENCH=1] [HOST_STEP_BENCH=1] bash scripts/gpu_host/latency.sh "<lengths>" "<methods>" \
#        [scripts/bench/latency.py arguments]
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_PROC_BIND=false
# Run from the repository's root: its eval/ and baselines/ are found through PYTHONPATH (no virtual environment).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# A git-archive copy has no .git: name the commit (ICECACHE_GIT_COMMIT=<sha> bash ...) so result files carry it.
export ICECACHE_GIT_COMMIT=${ICECACHE_GIT_COMMIT:-unknown}
out=${OUT:-results/bench}
source scripts/gpu_host/runner_packages.sh  # the runner's wheels, before the build
lengths=${1:-8192 32768}
methods=${2:-icecache icecache_reuse arkvale quest h2o streaming_llm snapkv oracle_topk}
shift 2 2>/dev/null || shift $#
mkdir -p "$out"
python3 setup.py build_ext --inplace -q 2>&1 | grep -i error
if [ -z "${SKIP_GPU_TESTS:-}" ]; then
    bash scripts/gpu_host/gpu_tests.sh "$out" "${GPU_TEST_TIMEOUT:-300}"
else
    bash scripts/gpu_host/gpu_tests.sh "$out" summary
fi
# If the captured full cache fails its test, it is measured eagerly (and the output says so). IceCache's captured
# step is its default: measure the eager one beside it with the methods "icecache:cuda_graph=false icecache ...".
graph=()
if ! timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_methods.py -k cuda_graph_decode >/dev/null 2>&1; then
    echo "CUDA-graph test failed: full_static measured eagerly"; graph+=(full_static.cuda_graph=false)
fi
[ ${#graph[@]} -gt 0 ] && graph=(--set "${graph[@]}")
if [ -n "${PROMPT_BENCH:-}" ]; then  # one layer's prompt job (build, page rewrite) at 32k and 128k
    python3 scripts/bench/prompt_index.py --lengths 32768 131072 --threads 16 --repeats 2 --out "$out" 2>&1 | tail -3
fi
if [ -n "${DCI_BENCH:-}" ]; then
    python3 scripts/bench/dci.py --sizes 32768 131072 --threads 16 --score-precision float32 half --out "$out" \
        2>&1 | tail -8
fi
if [ -n "${HOST_STEP_BENCH:-}" ]; then
    for length in 32768 131072; do
        python3 scripts/bench/host_step.py --length $length --steps 64 --threads 16 --out "$out" 2>&1 | tail -2
    done
fi
python3 scripts/bench/latency.py --model llama31_8b --lengths $lengths --methods $methods \
    --budget 256 --repeats 2 --warmup 1 --threads 16 --out "$out" "${graph[@]}" "$@" 2>&1 | tail -40
