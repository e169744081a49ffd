#!/usr/bin/env bash
# One GPU-host call: where IceCache's index search spends its time on this host. Builds the extension, then prints
# the phases of the search (fork, descend, group, scan, merge: DCIIndex.last_query_phases) for one layer's host step
# at 32k under the thread settings given (scripts/bench/host_step.py), for the DCI bench's query (bf16 keys and
# queries), and, unless NO_LATENCY=1, for the latency engine's IceCache step beside both full caches. The DCI
# kernel settings in $KERNELS (ISA:PREFETCH_ROWS:CHUNK_ROWS[:PREFETCH_LEVEL], docs/dci.md) take turns in the host
# step and the DCI bench; those the CPU cannot run are left out. LATENCY_ISAS="avx512 avx512bf16" times the latency
# once per instruction set (ICECACHE_DCI_ISA), each file with both full caches. It also times one layer's prompt
# job (the index build TT2T waits for: scripts/bench/prompt_index.py) at 32k and 128k. Results go to $OUT.
# Usage: bash scripts/gpu_host/search_profile.sh ["<OpenMP settings, ;-separated>"] [scripts/bench/latency.py args]
#   e.g. "OMP_WAIT_POLICY=passive;OMP_WAIT_POLICY=active"
set -uo pipefail
export PYTHONUNBUFFERED=1 OMP_PROC_BIND=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export ICECACHE_GIT_COMMIT=${ICECACHE_GIT_COMMIT:-unknown}
out=${OUT:-results/bench}
source scripts/gpu_host/runner_packages.sh  # the runner's wheels, before the build
settings=${1:-"OMP_WAIT_POLICY=passive"}
shift 1 2>/dev/null || shift $#
mkdir -p "$out"
python3 setup.py build_ext --inplace -q 2>&1 | grep -i " error"
kernels=()
for k in ${KERNELS:-avx512:32:256:1 avx512:32:256:2 avx512:16:256:2 avx512bf16:32:256:2 avx512bf16:16:256:2}; do
    if python3 -c "from icecache.dci import KernelSettings; KernelSettings.parse('$k')" 2>/dev/null; then
        kernels+=("$k")
    else
        echo "kernel setting $k: malformed or not run by this CPU, left out"
    fi
done
IFS=';' read -ra variants <<< "$settings"
for variant in "${variants[@]}"; do
    echo "== host step, 32k, 16 threads, $variant"
    env $variant python3 scripts/bench/host_step.py --length 32768 --steps 32 --threads 16 --out "$out" \
        --variants "${kernels[@]}" 2>&1 | grep -v "^wrote"
done
python3 scripts/bench/dci.py --sizes 32768 --threads 16 --key-dtype bfloat16 --query-dtype bfloat16 --repeats 20 \
    --variants "${kernels[@]}" --out "$out" 2>&1 | grep "threads=16"
python3 scripts/bench/prompt_index.py --lengths 32768 131072 --threads 16 --repeats 2 --out "$out" 2>&1 \
    | grep "tokens, first"
if [ -z "${NO_LATENCY:-}" ]; then
    for isa in ${LATENCY_ISAS:-avx512}; do
        ICECACHE_DCI_ISA=$isa python3 scripts/bench/latency.py --model llama31_8b --lengths 32768 --methods full \
            full_static icecache icecache_reuse --budget 256 --repeats 2 --warmup 1 --warmup-length 8192 \
            --threads 16 --out "$out" --no-handoff-probe "$@" 2>&1 | tail -8
    done
fi
