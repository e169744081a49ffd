#!/usr/bin/env python
"""The cost of one hand-off of host work in a captured decode step, on this CUDA host.

    python scripts/bench/handoff.py                       # 30 layers, copies of 8 KB and 1 MB
    python scripts/bench/handoff.py --layers 32 --copy-bytes 8192 819200 --out results/bench

Captures a step of N layers of two tiny kernels each in one CUDA graph per variant and prints, per layer, what
each way of handing work to the host costs over the plain step: the driver's host function running Python or a C
function, the stream-memory channel with a native entry or a Python callable, and copies of the given sizes
(icecache/core/handoff_probe.py says exactly what each variant enqueues). With --out, writes
handoff_<host>_<date>.json with provenance there. The latency benchmark records the same probe in its file's
settings (scripts/bench/latency.py; --no-handoff-probe turns it off).
"""

from __future__ import annotations

import argparse

from icecache.core import handoff_probe


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=handoff_probe.DEFAULT_LAYERS, help="hand-offs per step")
    parser.add_argument("--replays", type=int, default=handoff_probe.DEFAULT_REPLAYS, help="timed replays")
    parser.add_argument("--copy-bytes", type=int, nargs="*", default=list(handoff_probe.DEFAULT_COPY_BYTES),
                        help="sizes of the per-layer copies to time (none: no copies)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="folder for a handoff_<host>_<date>.json result file")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.replays < 1 or any(size < 1 for size in args.copy_bytes):
        parser.error("--layers, --replays and every --copy-bytes must be positive")
    try:
        result = handoff_probe.measure(args.device, layers=args.layers, replays=args.replays,
                                       copy_bytes=tuple(args.copy_bytes))
    except RuntimeError as error:
        raise SystemExit(f"error: {error}") from None
    print(handoff_probe.format_table(result))
    if args.out:
        from eval import provenance

        provenance.write_result(args.out, "handoff", {**result, "provenance": provenance.collect()})
    return result


if __name__ == "__main__":
    main()
