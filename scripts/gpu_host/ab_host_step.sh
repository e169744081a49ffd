#!/usr/bin/env bash
# One layer's IceCache host step (scripts/bench/host_step.py) timed in two copies of the code on one host: BASE, a
# folder holding another version's icecache/, eval/, baselines/, configs/, scripts/ and setup.py (e.g. made by
# `git archive <rev> icecache eval baselines configs scripts setup.py pyproject.toml | tar -x -C BASE`), and this
# working tree. Both are built, then the two run in turns, ROUNDS times each, so that the host's drift hits both
# alike; host steps of different hosts are not comparable (BENCHMARKS.md, host variance). Each run writes its
# host_step file to $OUT/ab_host_step/{base,new}/; the last lines are the medians of each run's search and host step.
#
# The files of each side name its commit: ICECACHE_GIT_COMMIT the working tree's, BASE_COMMIT the base's.
#
#   [ROUNDS=4] [LENGTH=32768] [THREADS=16] [OUT=results/bench] [BASE_COMMIT=<sha>] \
#       bash scripts/gpu_host/ab_host_step.sh BASE
set -uo pipefail
[ $# -eq 1 ] && [ -f "$1/setup.py" ] || { echo "usage: $0 BASE (a folder with the other version's setup.py)" >&2; exit 2; }
rounds=${ROUNDS:-4} length=${LENGTH:-32768} threads=${THREADS:-16}
for value in "$rounds" "$length" "$threads"; do
    [[ $value =~ ^[1-9][0-9]*$ ]] || { echo "error: ROUNDS, LENGTH and THREADS must be whole numbers, not '$value'" >&2; exit 2; }
done
export PYTHONUNBUFFERED=1 OMP_PROC_BIND=false ICECACHE_GIT_COMMIT=${ICECACHE_GIT_COMMIT:-unknown}
base=$(cd "$1" && pwd) new=$PWD out=${OUT:-results/bench}/ab_host_step
# absolute: each side's runs write from their own tree's folder
case $out in /*) ;; *) out=$PWD/$out ;; esac
python=${PYTHON:-python3}
source scripts/gpu_host/runner_packages.sh  # the runner's wheels, before the builds
(cd "$base" && "$python" setup.py build_ext --inplace -q 2>&1 | grep -i " error") &
"$python" setup.py build_ext --inplace -q 2>&1 | grep -i " error"
wait
mkdir -p "$out/base" "$out/new"
for round in $(seq "$rounds"); do
    for side in base new; do
        tree=$base commit=${BASE_COMMIT:-unknown}
        [ "$side" = new ] && tree=$new commit=$ICECACHE_GIT_COMMIT
        (cd "$tree" && PYTHONPATH=$tree:$PYTHONPATH ICECACHE_GIT_COMMIT=$commit "$python" scripts/bench/host_step.py --length "$length" --steps 64 \
            --threads "$threads" --out "$out/$side" 2>&1 | grep -v "it/s\]$" | tail -2 | sed "s/^/$side $round: /")
    done
done
"$python" - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
for side in ("base", "new"):
    files = sorted(Path(sys.argv[1], side).glob("host_step_*.json"))
    search, step, phases = [], [], {}
    for path in files:
        for variant in json.loads(path.read_text(encoding="utf-8"))["variants"]:
            search.append(variant["median_ms"]["search"])
            step.append(variant["median_ms"]["host_step"])
            for name, ms in variant["search_phases_ms"].items():
                phases.setdefault(name, []).append(ms)
    if files:
        print(f"{side}: {len(files)} runs, median of their medians: search {statistics.median(search):.3f} ms, "
              f"host step {statistics.median(step):.3f} ms a layer; phases "
              + " ".join(f"{name} {statistics.median(ms):.3f}" for name, ms in phases.items()))
EOF
