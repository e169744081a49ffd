#!/usr/bin/env bash
# scripts/bench/latency.py until its file is complete. A process that dies part-way (killed for memory, a device
# fault, a host's time limit) leaves its finished measurements on disk; the next process completes that file with
# --resume, up to TRIES processes in all. Run again over the same folder, it goes on with the newest unfinished
# file there (after a host restart, say) instead of starting over.
#
#   [TRIES=3] [PYTHON=python3] bash scripts/bench/latency_resumed.sh OUT_DIR LATENCY_ARGUMENTS...
#       (the arguments of scripts/bench/latency.py, without --out and --resume)
#
# e.g. the 512k scaling row, detached from the GPU-host calls (BENCHMARKS.md, "Scaling: Qwen3-4B from 150k to 512k tokens"):
#   bash scripts/gpu_host/detached.sh start scaling512k 'bash scripts/bench/latency_resumed.sh "$DETACHED_OUT"
#       --experiment scaling --lengths 524288 --repeats 1 --warmup 0 --threads 16'
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUT_DIR LATENCY_ARGUMENTS..." >&2; exit 2; }
out=$1
shift
for argument in "$@"; do
    case $argument in --out | --out=* | --resume | --resume=*)
        echo "error: $argument is this script's to set: give OUT_DIR as its first argument instead" >&2; exit 2 ;;
    esac
done
tries=${TRIES:-3}
[[ $tries =~ ^[1-9][0-9]*$ ]] || { echo "error: TRIES must be a whole number of at least 1, not '$tries'" >&2; exit 2; }
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
# The repository's eval/ and baselines/, wherever this is started from (a GPU host has no virtual environment).
export PYTHONPATH=$(cd "$here/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}
python=${PYTHON:-python3}

# The newest latency file in OUT_DIR that a killed process left unfinished, if any.
unfinished() {
    "$python" - "$out" <<'EOF'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("latency_*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        continue
    if payload.get("kind") == "latency" and payload.get("complete") is False:
        print(path)
    break
EOF
}

for try in $(seq "$tries"); do
    file=$(unfinished)
    if [ -n "$file" ]; then
        echo "process $try of at most $tries: completing $file"
        "$python" "$here/latency.py" "$@" --out "$out" --resume "$file"
    else
        echo "process $try of at most $tries"
        "$python" "$here/latency.py" "$@" --out "$out"
    fi
    status=$?
    if [ $status -eq 0 ]; then
        exit 0
    fi
    echo "latency.py ended with status $status"
    [ -n "$(unfinished)" ] || { echo "error: it left no unfinished file to complete" >&2; exit "$status"; }
done
echo "error: the file is still unfinished after $tries processes: $(unfinished)" >&2
exit 1
