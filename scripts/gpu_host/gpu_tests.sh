#!/usr/bin/env bash
# The GPU tests (make test-gpu) bounded in time, their output in <out>/gpu_tests.txt, a summary printed: a blocked
# host function hangs the stream, so on a hang the run is aborted and shows where each thread was.
# Usage: bash scripts/gpu_host/gpu_tests.sh <out> [timeout seconds, default 300 | summary: only summarise the
#        <out>/gpu_tests.txt an earlier call left, if any]
out=$1
limit=${2:-300}
if [ "$limit" = summary ]; then
    [ -f "$out/gpu_tests.txt" ] || exit 0
else
    PYTHONFAULTHANDLER=1 timeout -s ABRT "$limit" make -s test-gpu >"$out/gpu_tests.txt" 2>&1 \
        || echo "GPU tests: exit status $? (134: killed after $limit s)"
fi
grep -E "^(FAILED|ERROR)|Error|passed|failed" "$out/gpu_tests.txt" | tail -25
grep -A12 "Current thread" "$out/gpu_tests.txt" | grep -v site-packages | head -20
