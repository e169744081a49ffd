#!/usr/bin/env bash
# Real-model sanity runs on a CPU (the numbers in BENCHMARKS.md "Real-model accuracy"): SmolLM2-135M,
# passkey at 4k tokens for every method at budget 256, and full-cache RULER (4k, 8k) and GSM8K subsets.
# Resumable like every run: rerun to continue. Usage: bash scripts/cpu_sanity.sh [output_root]
set -uo pipefail
cd "$(dirname "$0")/.."
root=${1:-results/runs}
py=${PY:-.venv/bin/python}
for method in full oracle_topk quest streaming_llm h2o snapkv arkvale icecache icecache_reuse; do
    $py run.py method=$method budget=256 task=passkey task.lengths=[4096] output_root=$root
done
$py run.py method=full task=ruler task.lengths=[4096,8192] \
    task.tasks=[niah_single_2,niah_multikey_1,vt,qa_1] task.num_samples=5 output_root=$root
$py run.py method=full task=gsm8k task.limit=20 output_root=$root
