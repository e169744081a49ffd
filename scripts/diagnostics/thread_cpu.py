"""Which threads of a running process use the CPU: every ``--every`` seconds, the threads (name, id) that used the
most CPU time since the last look, from /proc (Linux). For a benchmark whose host work is slower in its process than
alone: a thread spinning beside an OpenMP team shows here as a thread near 100% that is not the team's.

Usage: python scripts/diagnostics/thread_cpu.py PID [--every 2] [--top 8]   (stops when the process ends)
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_times(pid: int) -> dict[tuple[int, str], float]:
    """CPU seconds (user + system) of each thread of ``pid``, by (thread id, name)."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        times[int(task.name), name] = (int(fields[11]) + int(fields[12])) / TICKS
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between looks")
    parser.add_argument("--top", type=int, default=8, help="threads shown per look")
    args = parser.parse_args()
    before, t0 = thread_times(args.pid), time.monotonic()
    while Path(f"/proc/{args.pid}").exists():
        time.sleep(args.every)
        try:
            now, t1 = thread_times(args.pid), time.monotonic()
        except OSError:
            break
        used = sorted(((now[k] - before.get(k, 0.0), k) for k in now), reverse=True)
        busy = [f"{name}:{tid} {100 * seconds / (t1 - t0):.0f}%" for seconds, (tid, name) in used[: args.top]
                if seconds > 0]
        total = sum(seconds for seconds, _ in used) / (t1 - t0)
        print(f"[{time.strftime('%H:%M:%S')}] {len(now)} threads, {total:.1f} cores: " + ", ".join(busy), flush=True)
        before, t0 = now, t1


if __name__ == "__main__":
    main()
