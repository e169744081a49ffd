#!/usr/bin/env python
"""Expand, preview, launch and curate an experiment's sweeps (eval/sweep.py; --help says everything).

    python scripts/sweep.py experiment=table2 model=llama31_8b --dry-run        # list the jobs, run nothing
    python scripts/sweep.py experiment=table2 model=llama31_8b hydra/launcher=slurm   # one Slurm job array
    python scripts/sweep.py experiment=accuracy_ruler --workers 4 --shards 2 --deadline 3000 --curate accuracy
    python scripts/sweep.py --sweep experiment=accuracy_passkey --sweep experiment=accuracy_ruler \\
        --no-run --curate accuracy --out results/bench                          # the curated file alone
"""

import os
import sys

from eval.sweep import main

if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    sys.exit(main())
