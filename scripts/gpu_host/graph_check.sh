#!/usr/bin/env bash
# The captured IceCache decode step on the GPU host: its tests, each with a deadline; a test still running at the
# deadline gets its Python and native stacks dumped (to tell a hang from slowness) and is killed.
# Usage: bash scripts/gpu_host/graph_check.sh [pytest -k expression] [deadline seconds]
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_PROC_BIND=false
# Run from the repository's root: its eval/ and baselines/ are found through PYTHONPATH (no virtual environment).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-/tmp}
expr=${1:-"graph or capture or cuda_driver"}
deadline=${2:-90}
python3 setup.py build_ext --inplace -q 2>&1 | grep -i error
python3 -X faulthandler -m pytest -q -m gpu tests/test_cuda_driver.py tests/test_gpu_methods.py -k "$expr" \
    -p no:cacheprovider -rf -o faulthandler_timeout=$((deadline / 2)) >"$out/graph_tests.txt" 2>&1 &
pid=$!
for _ in $(seq "$deadline"); do kill -0 $pid 2>/dev/null || break; sleep 1; done
if kill -0 $pid 2>/dev/null; then
    echo "still running after ${deadline}s: native stacks"
    child=$(pgrep -P $pid | head -1); target=${child:-$pid}
    for task in /proc/$target/task/*; do echo "$task $(cat $task/comm) $(cat $task/wchan 2>/dev/null)"; done
    if command -v gdb >/dev/null; then
        gdb -p $target -batch -ex "thread apply all bt 25" 2>/dev/null | grep -E "^Thread|^#" | head -120
    elif command -v py-spy >/dev/null; then py-spy dump --native --pid $target | head -120
    fi
    kill -9 $pid
fi
wait $pid; echo "pytest rc=$?"
grep -E "passed|failed|^FAILED|^ERROR|Error" "$out/graph_tests.txt" | tail -15
grep -n -B2 -A14 "Timeout\|Current thread\|Thread 0x" "$out/graph_tests.txt" | grep -v "site-packages\|threading.py" | head -60
