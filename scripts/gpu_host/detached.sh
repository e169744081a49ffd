#!/usr/bin/env bash
# A GPU-host command that outlasts one call's time limit (IceCache's prefill and index builds at 512k tokens): it
# starts with setsid, apart from the call's process group, so the host does not end it when the call returns;
# later calls wait for it. The host must stay up between the calls (the next call comes within its idle limit), and what the
# command writes goes under $DETACHED_OUT, a folder that outlives the calls ($OUT is emptied before each call).
# The command runs in a copy of the repository, <root>/NAME/tree ($DETACHED_TREE), so that the next call's fresh
# copy of the working tree cannot change the files under a running process.
#
#   bash scripts/gpu_host/detached.sh start NAME COMMAND   run COMMAND (one string, through bash) in a copy of the
#                                                        repository, under setsid; its output: <root>/NAME/log
#   bash scripts/gpu_host/detached.sh wait NAME [SECONDS]  wait up to SECONDS (default 540) for it to end, print
#                                                        the end of its log and copy what its DETACHED_OUT holds
#                                                        so far to $OUT (or the current folder): finished or not,
#                                                        so that a host lost before the end loses no finished file
#   Exit status of wait: 0 the command ended with status 0; 1 it ended with another (printed); 3 still running;
#   2 nothing is running and no status was written (the host was restarted or the command was killed).
#
# <root> is $ICECACHE_DETACHED_ROOT, /tmp/icecache-detached by default. Example, the 512k scaling row:
#   bash scripts/gpu_host/detached.sh start scaling512k 'python3 scripts/bench/latency.py --experiment scaling
#       --lengths 524288 --repeats 1 --warmup 0 --threads 16 --out "$DETACHED_OUT"'
#   bash scripts/gpu_host/detached.sh wait scaling512k 560      # again in each following call until it ends
set -uo pipefail
root=${ICECACHE_DETACHED_ROOT:-/tmp/icecache-detached}
usage() { echo "usage: $0 start NAME COMMAND | wait NAME [SECONDS]" >&2; exit 2; }
[ $# -ge 2 ] || usage
action=$1 name=$2
case $name in */* | "" | . | ..) echo "error: NAME must be a plain word, not '$name'" >&2; exit 2 ;; esac
dir=$root/$name

running() { [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; }

case $action in
start)
    [ $# -eq 3 ] || usage
    if running; then
        echo "error: $name is running already (pid $(cat "$dir/pid")): wait for it, or pick another NAME" >&2
        exit 2
    fi
    rm -rf "$dir"
    mkdir -p "$dir/out" "$dir/tree"
    printf '%s\n' "$3" >"$dir/command"
    repo=$(cd "$(dirname "$0")/../.." && pwd)
    # Everything but a virtual environment and the git folder (a GPU host's copy has neither).
    tar -C "$repo" --exclude=./.venv --exclude=./.git -cf - . | tar -C "$dir/tree" -xf - ||
        { echo "error: could not copy $repo to $dir/tree" >&2; exit 2; }
    # The detached shell writes its own pid (setsid may fork) and, last, its status, renamed into place so that wait never
    # reads a half-written one.
    # The copy's eval/ and baselines/ are found through PYTHONPATH (a GPU host has no virtual environment).
    DETACHED_OUT=$dir/out DETACHED_TREE=$dir/tree PYTHONPATH=$dir/tree${PYTHONPATH:+:$PYTHONPATH} \
        setsid bash -c 'echo $$ >"$2/pid"; cd "$2/tree" || exit
        bash -c "$1" >"$2/log" 2>&1; echo $? >"$2/rc.partial"; mv "$2/rc.partial" "$2/rc"' _ "$3" "$dir" \
        </dev/null >/dev/null 2>&1 &
    for _ in $(seq 50); do [ -s "$dir/pid" ] && break; sleep 0.1; done
    [ -s "$dir/pid" ] || { echo "error: $name did not start (its shell wrote no pid)" >&2; exit 2; }
    echo "started $name (pid $(cat "$dir/pid")): its log is $dir/log; wait with: bash $0 wait $name"
    ;;
wait)
    [ $# -le 3 ] || usage
    seconds=${3:-540}
    [[ $seconds =~ ^[0-9]+$ ]] || { echo "error: SECONDS must be a whole number, not '$seconds'" >&2; exit 2; }
    [ -d "$dir" ] || { echo "error: nothing was started as $name under $root" >&2; exit 2; }
    end=$((SECONDS + seconds))
    while [ ! -f "$dir/rc" ] && running && [ $SECONDS -lt "$end" ]; do sleep 1; done
    tail -n 20 "$dir/log" 2>/dev/null
    target=${OUT:-.}
    cp -r "$dir/out/." "$target/"
    if [ -f "$dir/rc" ]; then
        status=$(cat "$dir/rc")
        echo "$name ended with status $status; its files are copied to $target"
        [ "$status" = 0 ] && exit 0 || exit 1
    fi
    if running; then
        echo "$name is still running after ${seconds} s (its files so far are copied to $target): call wait again" \
            "within the host's idle limit"
        exit 3
    fi
    echo "error: $name is not running and wrote no status: it was killed, or the host was restarted" >&2
    exit 2
    ;;
*)
    usage
    ;;
esac
