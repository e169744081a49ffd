#!/usr/bin/env python
"""Render BENCHMARKS.md's tables from the result files in results/bench/ (eval.report.benchmarks).

    python scripts/bench/tables.py            # rewrite every table region of BENCHMARKS.md
    python scripts/bench/tables.py --check    # exit 1 if a region differs from what the files render
"""

import sys

from eval.report.benchmarks import main

if __name__ == "__main__":
    sys.exit(main())
