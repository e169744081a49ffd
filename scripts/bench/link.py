#!/usr/bin/env python
"""How fast this host's GPU reads pinned host memory: the copy engines, and the offloading methods' zero-copy reads.

    python scripts/bench/link.py                          # a 2 GiB store, blocks of 1, 2, 4 and 8 KB
    python scripts/bench/link.py --block-bytes 2048 --entries 8192 --out results/bench

Prints a table (icecache/core/link_probe.py says what each line measures). With --out, writes
link_<host>_<date>.json with provenance there; with --json, prints the result as one JSON line instead of the table
(what the throughput benchmark reads).
"""

from __future__ import annotations

import argparse
import json

from icecache.core import link_probe


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store-gib", type=float, default=link_probe.DEFAULT_STORE_BYTES / 2**30,
                        help="size of the pinned store the blocks are read from")
    parser.add_argument("--block-bytes", type=int, nargs="+", default=list(link_probe.DEFAULT_BLOCK_BYTES),
                        help="block sizes to read (even numbers of bytes)")
    parser.add_argument("--entries", type=int, default=link_probe.DEFAULT_ENTRIES, help="blocks per array a launch")
    parser.add_argument("--repeats", type=int, default=link_probe.DEFAULT_REPEATS, help="timed launches")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--out", help="folder for a link_<host>_<date>.json result file")
    args = parser.parse_args(argv)
    store_bytes = int(args.store_gib * 2**30)
    if args.entries < 1 or args.repeats < 1 or any(size < 2 or size % 2 for size in args.block_bytes):
        parser.error("--entries and --repeats must be positive, every --block-bytes an even number of bytes")
    if any(2 * args.entries * size > store_bytes for size in args.block_bytes):
        parser.error(f"--store-gib {args.store_gib} is too small for {args.entries} blocks of "
                     f"{max(args.block_bytes)} B in each of two arrays: give a larger store or fewer --entries")
    try:
        result = link_probe.measure(args.device, store_bytes=store_bytes, block_bytes=tuple(args.block_bytes),
                                    entries=args.entries, repeats=args.repeats)
    except RuntimeError as error:
        raise SystemExit(f"error: {error}") from None
    print(json.dumps(result) if args.json else link_probe.format_table(result), flush=True)
    if args.out:
        from eval import provenance

        provenance.write_result(args.out, "link", {**result, "provenance": provenance.collect()})
    return result


if __name__ == "__main__":
    main()
