#!/usr/bin/env python
"""One (model, method, task, budget) run, or with ``-m`` a sweep of them. Examples:

    python run.py                                          # embedded default: SmolLM2 passkey at 4k, IceCache
    python run.py method=quest budget=256 task=passkey task.lengths=[8192]
    python run.py -m method=full,icecache budget=64,256   # a sweep (hydra/launcher=slurm for a cluster)
    python run.py --cfg job method=quest                   # print the composed config, run nothing (Hydra's flag)

Results land in results/runs/<task>/<model>/<method>/budget-<b>/<hash>/ (see README); the run prints where.

Bad input stops before any work with one line starting ``error:`` and exit code 2. Under ``-m`` every job of the
sweep is composed and checked first (``python scripts/sweep.py <same overrides> --dry-run`` lists them); a job
that still fails while the sweep runs prints its line and the others go on; the sweep then exits with code 2.
The checks and the Hydra main are in eval/cli.py.
"""

from eval.cli import main

if __name__ == "__main__":
    main()
