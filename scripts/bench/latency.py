#!/usr/bin/env python
"""Latency benchmark: TTFT, TT2T, TPOT (with its phase breakdown) and KV memory of several methods, side by side.

    python scripts/bench/latency.py --experiment latency                     # the paper's latency figures
    python scripts/bench/latency.py --experiment scaling                     # decode latency vs context
    python scripts/bench/latency.py --model llama31_8b --lengths 36000 --methods full icecache --budget 256

All methods run in one process on the same random prompt, interleaved with both full caches (eval/latency.py says
how); an experiment's ``bench`` block (configs/experiment/<name>.yaml) gives the settings a flag leaves out.
Writes results/bench/latency_<host>_<date>.json (settings, provenance, every measurement, the summary) and prints
a table. Bad settings stop before the model is built with one line starting ``error:``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eval import latency
from icecache.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", help="read defaults from configs/experiment/<name>.yaml (latency, scaling)")
    parser.add_argument("--model", help="model config name in configs/model (or a YAML path); default llama31_8b")
    parser.add_argument("--source", help="model source; default random (real architecture, random weights)")
    parser.add_argument("--lengths", type=int, nargs="+", help="context lengths in tokens")
    parser.add_argument("--methods", nargs="+",
                        help="method config names, or variants such as icecache:cuda_graph=true (full and full_static "
                             "are added)")
    parser.add_argument("--budget", type=int, help="KV token budget per query head")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, help="measured rounds")
    parser.add_argument("--warmup", type=int, help="unmeasured rounds first")
    parser.add_argument("--warmup-length", type=int,
                        help="run the warm-up rounds once, at this context, instead of at every length (long contexts)")
    parser.add_argument("--decode-steps", type=int, help=f"N decode steps per run (>= {latency.MIN_DECODE_STEPS})")
    parser.add_argument("--prefill-chunk-size", type=int, help="prefill in chunks of this many tokens")
    parser.add_argument("--layer-by-layer", action="store_true", default=None,
                        help="prefill one decoder layer at a time (same result; bounds prefill memory)")
    parser.add_argument("--residual-on-host", action="store_true", default=None,
                        help="with --layer-by-layer: keep the prefill's residual stream in host memory")
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="METHOD.KEY=VALUE",
                        help="method setting overrides, e.g. icecache.n_reuse_layers=4")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    parser.add_argument("--bandwidth-probe-gib", type=float, default=2.0,
                        help="GiB read by the host-memory bandwidth probe run first (0: none)")
    parser.add_argument("--no-handoff-probe", dest="handoff_probe", action="store_false", default=None,
                        help="on CUDA, skip the hand-off probe run first (its costs go in the file's settings)")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"), help="output folder")
    parser.add_argument("--resume", type=Path, metavar="FILE",
                        help="a latency file this command left unfinished (complete: false): measure only what it "
                             "lacks, with its settings, and write the whole to <out>/<its name>")
    return parser


def main(argv: list[str] | None = None) -> Path:
    cli = parser()
    args = vars(cli.parse_args(argv))
    out, resume = args.pop("out"), args.pop("resume")
    try:
        settings = latency.LatencySettings.compose(args)
    except ConfigError as error:
        cli.error(str(error))
    try:
        return latency.measure(settings, out, resume=resume)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
