#!/usr/bin/env python
"""Throughput benchmark: decode tokens per second against batch size, per method, up to each one's memory limit.

    python scripts/bench/throughput.py --lengths 32768 --methods quest arkvale shadowkv icecache --budget 256
    python scripts/bench/throughput.py --lengths 131072 --methods arkvale --batch-sizes 1 2 4 8 16

``full_static`` is added first: every method's best throughput is set against its best at the same length. Rows
are prefilled one at a time and decoded in batches of growing size until the first out-of-memory error, which is
recorded as the method's limit (eval/throughput.py says how). Writes results/bench/throughput_<host>_<date>.json
and prints a table. Bad settings stop before the model is built with one line starting ``error:``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eval import throughput
from icecache.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model config name in configs/model (or a YAML path); default llama31_8b")
    parser.add_argument("--source", help="model source; default random (real architecture, random weights)")
    parser.add_argument("--lengths", type=int, nargs="+", help="context lengths in tokens")
    parser.add_argument("--methods", nargs="+", help="method config names or variants (full_static is added)")
    parser.add_argument("--budget", type=int, help="KV token budget per query head")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="increasing batch sizes; default 1 2 4 8 16 32")
    parser.add_argument("--decode-steps", type=int, help="decode steps per batch size (TPOT: median of 2..N)")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--prefill-chunk-size", type=int, help="prefill each layer in chunks of this many tokens; 8192")
    parser.add_argument("--no-layer-by-layer", dest="layer_by_layer", action="store_false", default=None,
                        help="prefill the whole model at once instead of one decoder layer at a time")
    parser.add_argument("--residual-on-host", action="store_true", default=None,
                        help="keep the layer-by-layer prefill's residual stream in host memory")
    parser.add_argument("--rows-in-turn", dest="row_streams", action="store_false", default=None,
                        help="the rows of a batch attend one after the other on the model's stream (default: each "
                             "on a CUDA stream of its own, side by side; methods with host work in their step keep "
                             "taking turns either way)")
    parser.add_argument("--row-groups", type=int,
                        help="groups of rows that ShadowKV's and ArkVale's one launch per kernel serves each, side "
                             "by side (default 1: one launch for all rows)")
    parser.add_argument("--set", nargs="*", action="extend", default=[], metavar="METHOD.KEY=VALUE",
                        help="method setting overrides, e.g. icecache.n_reuse_layers=4")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, help="seed of the random prompts")
    parser.add_argument("--profile-steps", type=int,
                        help="after each batch's timed steps, profile this many more (CUDA): the GPU's busy time per "
                             "step beside its wall time, and the leading kernels; default 0")
    parser.add_argument("--no-link-probe", dest="link_probe", action="store_false", default=None,
                        help="skip the probe of how fast the GPU reads pinned host memory (recorded as `link`)")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"), help="output folder")
    parser.add_argument("--figure", type=Path, nargs="+", metavar="FILE",
                        help="only draw the figure of throughput files (beside the first; a context from the last "
                             "file that has it), measuring nothing")
    parser.add_argument("--resume", type=Path, metavar="FILE",
                        help="a throughput file this command left unfinished: measure what it lacks, with its settings")
    return parser


def main(argv: list[str] | None = None) -> Path:
    cli = parser()
    args = vars(cli.parse_args(argv))
    out, resume, drawn = args.pop("out"), args.pop("resume"), args.pop("figure")
    if drawn is not None:
        for path in throughput.figure(*drawn):
            print(f"wrote {path}")
        return drawn[0]
    try:
        settings = throughput.ThroughputSettings.compose(args)
    except ConfigError as error:
        cli.error(str(error))
    try:
        return throughput.measure(settings, out, resume=resume)
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None


if __name__ == "__main__":
    main()
