#!/usr/bin/env bash
# Real-model sanity runs on a CPU (the numbers in BENCHMARKS.md, "CPU accuracy"): SmolLM2-135M with the
# full cache on RULER (4k, 8k) and a GSM8K subset, then passkey at 4k tokens and budget 256 for every method
# (20 depths for full / oracle / Quest / StreamingLLM, 10 for the slower ones on a 2-core CPU).
# Resumable like every run: rerun to continue. Usage: bash scripts/cpu_sanity.sh [output_root]
set -uo pipefail
cd "$(dirname "$0")/.."
root=${1:-results/runs}
py=${PY:-.venv/bin/python}
$py run.py method=full task=ruler task.lengths=[4096,8000] \
    task.tasks=[niah_single_2,niah_multikey_1,vt,qa_1] task.num_samples=5 output_root=$root
$py run.py method=full task=gsm8k task.limit=20 output_root=$root
for method in full oracle_topk quest; do
    $py run.py method=$method budget=256 task=passkey task.lengths=[4096] output_root=$root
done
for method in streaming_llm icecache icecache_reuse snapkv arkvale h2o; do
    $py run.py method=$method budget=256 task=passkey task.lengths=[4096] task.num_depths=10 output_root=$root
done
