#!/usr/bin/env bash
# One GPU-host call for issue 8: build, the GPU tests (CUDA-graph decode, IceCache GPU = CPU tokens, kernels),
# the DCI query with float32 and half first passes side by side, then the latency driver with both full caches.
# Usage: ICECACHE_GIT_COMMIT=<sha> bash scripts/device_perf.sh "<lengths>" [extra bench_latency.py arguments]
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_PROC_BIND=false
export ICECACHE_GIT_COMMIT=${ICECACHE_GIT_COMMIT:-unknown}
out=${OUT:-results/bench}
lengths=${1:-8192 32768}
shift 1 2>/dev/null || true
python3 setup.py build_ext --inplace -q 2>&1 | grep -i error
python3 -m pytest -q -m gpu tests/test_gpu_methods.py tests/test_method_invariants.py tests/test_paged_attention.py 2>&1 | tail -3
if [ -z "${SKIP_DCI:-}" ]; then
    python3 scripts/bench_dci.py --sizes 32768 131072 --threads 16 --score-precision float32 half --out "$out" \
        2>&1 | tail -8
fi
python3 scripts/bench_latency.py --model llama31_8b --lengths $lengths --methods icecache icecache_reuse \
    --budget 256 --repeats 2 --warmup 1 --threads 16 --out "$out" "$@" 2>&1 | tail -14
