#!/usr/bin/env bash
# The GPU tests (make test-gpu) bounded in time, their output in <out>/gpu_tests.txt, a summary printed. A blocked
# host step hangs its test, so each test is named as it starts (-vv, which the target's -q brings to -v), a test
# running past a third of the deadline has its Python stacks written (pytest's faulthandler_timeout, without stopping
# it), and at the deadline the threads' kernel waits and native stacks (gdb or py-spy, where the host has one) are
# written before the run is stopped: the file then says which test hung and where each thread was.
# Usage: [GPU_TESTS="tests/a.py ..."] bash scripts/gpu_host/gpu_tests.sh <out> [timeout seconds, default 300 |
#        summary: only summarise the <out>/gpu_tests.txt an earlier call left, if any]
out=$1
limit=${2:-300}
log=$out/gpu_tests.txt
if [ "$limit" = summary ]; then
    [ -f "$log" ] || exit 0
else
    files=()  # GPU_TESTS="tests/a.py tests/b.py": those files only (the Makefile's list by default)
    [ -n "${GPU_TESTS:-}" ] && files=("GPU_TESTS=$GPU_TESTS")
    PYTHONFAULTHANDLER=1 PYTEST_ADDOPTS="-vv -o faulthandler_timeout=$((limit / 3))" make -s test-gpu "${files[@]}" \
        >"$log" 2>&1 &
    pid=$!
    for _ in $(seq "$limit"); do kill -0 $pid 2>/dev/null || break; sleep 1; done
    if kill -0 $pid 2>/dev/null; then
        echo "GPU tests: still running after $limit s, stopped; the hung test and its threads in $log"
        grep -E "^tests/.*::" "$log" | tail -1 | sed 's/^/the test running: /'
        target=$(pgrep -n -f "pytest -q -m gpu")
        if [ -n "$target" ]; then
            {
                echo "== still running after $limit s: the threads of pytest ($target), their kernel waits"
                for task in /proc/$target/task/*; do echo "$task $(cat $task/comm) $(cat $task/wchan 2>/dev/null)"; done
                if command -v gdb >/dev/null; then
                    timeout 60 gdb -p "$target" -batch -ex "thread apply all bt 25" 2>/dev/null | grep -E "^Thread|^#"
                elif command -v py-spy >/dev/null; then
                    timeout 60 py-spy dump --native --pid "$target"
                fi
            } >>"$log" 2>&1
            kill -ABRT "$target" 2>/dev/null  # Python's stacks, from faulthandler
            sleep 3
        fi
        pkill -9 -P $pid 2>/dev/null
        kill -9 $pid 2>/dev/null
    fi
    wait $pid 2>/dev/null || echo "GPU tests: exit status $?"
fi
grep -E "^(FAILED|ERROR)|Error|passed|failed" "$log" | grep -v " PASSED" | tail -25
grep -A12 "Current thread" "$log" | grep -v site-packages | head -20
