#!/usr/bin/env bash
# The accuracy grid (BENCHMARKS.md, "Accuracy") over calls to one warm GPU host that
# has no package registry: the same command in every call, only the folders it carries change, so that a call
# follows the one before within the host's idle limit. Each call
#   1. keeps the files of the folders given (scripts/gpu_host/stage.sh keep: the pieces scripts/gpu_host/pack.sh made,
#      and a folder holding the runs.tar.gz an earlier host returned, if there is one);
#   2. once the model's three parts, the wheels and RULER's texts are all kept, installs them;
#   3. then starts scripts/gpu_host/accuracy.sh detached (once per host: RUNS_TAR is the runs.tar.gz kept, if any);
#   4. while it runs, waits for it up to WAIT seconds and leaves in $OUT what it has curated so far and a
#      runs.tar.gz of every sample on the host's disk: the RUNS_TAR of the next host, should this one be lost.
# A call before all pieces are kept lists those missing and returns at once.
#
#   ICECACHE_GIT_COMMIT=<sha> DEADLINE=<seconds> [JOBS=N] [SHARDS=4] [MPS=1] [WAIT=540] [MODEL=...] [NAME=...] [CURATE=...] \
#       bash scripts/gpu_host/accuracy_call.sh [FOLDER...]   [experiment ...: after --, as accuracy.sh takes]
#
# DEADLINE counts from the start of the grid (step 3): leave room after it for curating and one last wait. With
# the folders of pack.sh the calls carry .parts/w, then .parts/r, .parts/m1, .parts/m2, then .parts/m3 (the start
# and the first wait come with it), then nothing, until the grid's call ends (a call passes 64 MiB: pack.sh).
# Exit status: 0 it ended with every run done; 1 it ended otherwise (its log's end is printed); 3 pieces missing,
# or still running; 2 bad input.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Both scripts it calls read these; exported once, they agree with this one.
export ICECACHE_STAGE=${ICECACHE_STAGE:-/tmp/icecache-stage}
export ICECACHE_DETACHED_ROOT=${ICECACHE_DETACHED_ROOT:-/tmp/icecache-detached}
stage=$ICECACHE_STAGE root=$ICECACHE_DETACHED_ROOT
# NAME=<word> starts another grid on a host where one has run (each name once a host); CURATE as accuracy.sh takes it
name=${NAME:-accuracy}
wait_s=${WAIT:-540}
folders=() experiments=()
while [ $# -gt 0 ]; do
    if [ "$1" = -- ]; then shift; experiments=("$@"); break; fi
    folders+=("$1"); shift
done
# Bad input first, in every call: a mistake shows in the first one, not after the staging.
[ -n "${ICECACHE_GIT_COMMIT:-}" ] ||
    { echo "error: set ICECACHE_GIT_COMMIT=<sha> (the result files carry it)" >&2; exit 2; }
[[ ${DEADLINE:-} =~ ^[0-9]+$ ]] || { echo "error: set DEADLINE=<seconds> for the grid, a whole number" >&2; exit 2; }
[[ ${JOBS:-1} =~ ^[1-9][0-9]*$ ]] || { echo "error: JOBS must be a whole number of at least 1, not '$JOBS'" >&2; exit 2; }
[[ $wait_s =~ ^[0-9]+$ ]] || { echo "error: WAIT must be a whole number of seconds, not '$wait_s'" >&2; exit 2; }
for folder in "${folders[@]}"; do
    [ -d "$folder" ] || { echo "error: $folder is not a folder: carry it, or leave it out" >&2; exit 2; }
done

if [ ${#folders[@]} -gt 0 ]; then
    bash "$here/stage.sh" keep "${folders[@]}" >/dev/null || exit 2
fi
export PYTHONPATH=$stage/site${PYTHONPATH:+:$PYTHONPATH}
# install unpacks RULER's texts into this folder and the runs read them from it
export ICECACHE_RULER_DATA=${ICECACHE_RULER_DATA:-${ICECACHE_DATA:-$HOME/.cache/icecache-harness}/ruler}
export OMP_PROC_BIND=false
if [ ! -d "$root/$name" ]; then  # not started on this host yet
    if ! gaps=$(bash "$here/stage.sh" missing); then
        echo "staged: still missing"; sed 's/^/  /' <<<"$gaps"; exit 3
    fi
    bash "$here/stage.sh" install >/dev/null || exit 2
    runs_tar=
    [ -f "$stage/runs.tar.gz" ] && runs_tar=$stage/runs.tar.gz
    grid=
    [ ${#experiments[@]} -gt 0 ] && printf -v grid '%q ' "${experiments[@]}"
    # One job per 12.5 GiB of the GPU's memory, 14 at most: a job of the short grid (16 samples a step) held up to
    # 12.5 GiB (8.3 of them its tensors), and 8 of them ran an 80 GB H100 out of memory. A job that runs out all the
    # same runs again once the others have ended (eval/sweep.py).
    jobs=${JOBS:-}
    if [ -z "$jobs" ]; then
        mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
        jobs=14
        [[ $mib =~ ^[0-9]+$ ]] && jobs=$(( mib / 12800 < 14 ? mib / 12800 : 14 ))
        [ "$jobs" -ge 1 ] || jobs=1
        echo "JOBS=$jobs (from the GPU's ${mib:-unknown} MiB)"
    fi
    bash "$here/detached.sh" start "$name" \
        "RUNS_TAR=$runs_tar OUT=\$DETACHED_OUT MPS=${MPS:-1} JOBS=$jobs SHARDS=${SHARDS:-4} \
DEADLINE=$DEADLINE${MODEL:+ MODEL=$MODEL}${CURATE:+ CURATE=$CURATE} bash scripts/gpu_host/accuracy.sh $grid" || exit 2
fi
out=${OUT:-.}
OUT=$out bash "$here/detached.sh" wait "$name" "$wait_s" | tail -c 3000
waited=${PIPESTATUS[0]}
# Every sample on this host's disk, whatever the state of the grid (a torn last line is cut when a run resumes),
# of every output root under results/ (results/runs, and results/runs_again of a determinism pass).
tree=$root/$name/tree
roots=$(cd "$tree" 2>/dev/null && ls -d results/runs results/runs_* 2>/dev/null)
# shellcheck disable=SC2086  # the roots are words without spaces, one per output root
[ -n "$roots" ] && tar -C "$tree" --warning=no-file-changed -czf "$out/runs.tar.gz" $roots
if [ "$waited" = 3 ]; then
    echo "running: call again within the host's idle limit"; exit 3
fi
[ -f "$root/$name/rc" ] || { echo "error: the grid is not running and left no status" >&2; exit 2; }
case $(cat "$root/$name/rc") in
0) echo "ended: every run done"; exit 0 ;;
3) echo "ended: the deadline came first; the next host goes on with RUNS_TAR=runs.tar.gz"; exit 1 ;;
*) echo "ended: status $(cat "$root/$name/rc") (the log's end is above)"; exit 1 ;;
esac
