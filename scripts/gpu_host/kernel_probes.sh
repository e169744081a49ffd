#!/usr/bin/env bash
# One GPU-host call of the probes that decide kernel launch settings, after the GPU tests of the kernels they time:
# the link probe (scripts/bench/link.py: the copy engines and the block copy's zero-copy reads, 1-16 entries a
# program), ShadowKV's score sweep (scripts/diagnostics/shadowkv_score_sweep.py) and, with ATTENTION=1, the paged
# attention's (scripts/diagnostics/attention_sweep.py). Results and the test log go to $OUT (or results/bench).
# Usage: [ATTENTION=1] bash scripts/gpu_host/kernel_probes.sh [extra shadowkv_score_sweep.py arguments]
# (carry .parts/w)
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_PROC_BIND=false
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# A git-archive copy has no .git: name the commit (ICECACHE_GIT_COMMIT=<sha> bash ...) so result files carry it.
export ICECACHE_GIT_COMMIT=${ICECACHE_GIT_COMMIT:-unknown}
out=${OUT:-results/bench}
source scripts/gpu_host/runner_packages.sh  # the runner's wheels (the tests import it), before the build
mkdir -p "$out"
python3 setup.py build_ext --inplace -q 2>&1 | grep -i error
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu tests/test_shadowkv_kernels.py \
    tests/test_selection_kernels.py tests/test_link_probe.py tests/test_row_table.py \
    >"$out/gpu_tests_kernel_probes.txt" 2>&1 || echo "GPU tests: exit status $? (124: past the deadline)"
grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_tests_kernel_probes.txt" | tail -12
python3 scripts/bench/link.py --out "$out"
if [ -n "${ATTENTION:-}" ]; then
    python3 scripts/diagnostics/attention_sweep.py --out "$out" | tail -40
fi
python3 scripts/diagnostics/shadowkv_score_sweep.py --out "$out" "$@" | tail -80
