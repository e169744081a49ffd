#!/usr/bin/env python
"""The accuracy table's figures drawn again from curated files alone (no run directories needed):
accuracy_vs_budget_<model>.png, accuracy_vs_tpot_<model>.png (TPOT from the latency files in --bench) and
mass_by_layer_<model>.png, as ``scripts/sweep.py --curate`` draws them beside the file.

    python scripts/accuracy_figures.py results/bench/accuracy_smollm2-135m_20261207-064023.json
    make accuracy-figures CURATED=results/bench/accuracy_smollm2-135m_20261207-064023.json

Selection grids (``--curate selection``) name their figures with ``--prefix selection_``; several curated files of
one model (e.g. one grid per length) are drawn as one figure, a panel per task and length:

    python scripts/accuracy_figures.py results/bench/selection_qwen2.5-coder-0.5b_*.json --prefix selection_ \
        --only mass_by_layer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    from eval.report import accuracy as A
    from eval.report.collect import reference_bench_rows
    from eval.report.summary import ACCURACY_FIGURES, accuracy_figures

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("curated", type=Path, nargs="+", help="curated accuracy files (results/bench/accuracy_*.json)")
    parser.add_argument("--bench", type=Path, default=REPO / "results" / "bench", help="latency_*.json folder")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "bench", help="folder of the figures")
    parser.add_argument("--prefix", default="", help="before the model in each figure's name (selection_ for the "
                        "selection grids' files)")
    parser.add_argument("--only", choices=ACCURACY_FIGURES, nargs="+", help="draw these figures alone (default: all)")
    args = parser.parse_args(argv)
    runs = [run for path in args.curated for run in json.loads(path.read_text(encoding="utf-8"))["runs"]]
    rows = A.accuracy_rows(runs)
    for figure in accuracy_figures(rows, reference_bench_rows(args.bench), args.out, prefix=args.prefix,
                                   only=tuple(args.only or ACCURACY_FIGURES)):
        if figure.suffix == ".png":
            print(f"wrote {figure}")
        else:
            figure.unlink()  # the PNG is what the page shows, as curating keeps it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
