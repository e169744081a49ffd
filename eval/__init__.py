"""The evaluation application: run configs and their directories, the runner, sweeps, the latency engine,
provenance, the tasks and the report. It stands above ``icecache`` and ``baselines``; neither imports it."""
