"""Job runners for scripts/run_jobs.py's tests: device faults injected where a CPU cannot make one.

A spawned worker imports them by name (the parent's sys.path travels with it), as it imports run_jobs.run_job.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FAULT = "CUDA error: an illegal memory access was encountered"


def fault_once_per_process(values: dict[str, Any]) -> None:
    """The first job a process runs ends in a device fault after its process has written a marker; later jobs of
    that process, and every job once two markers exist, run normally."""
    import run_jobs

    folder = Path(values["output_root"]).parent / "faults"
    folder.mkdir(exist_ok=True)
    marker = folder / str(os.getpid())
    if not marker.exists() and len(list(folder.iterdir())) < 2:
        marker.touch()
        raise RuntimeError(FAULT)
    run_jobs.run_job(values)


def always_fault(values: dict[str, Any]) -> None:
    (Path(values["output_root"]).parent / "faults").mkdir(exist_ok=True)
    (Path(values["output_root"]).parent / "faults" / str(os.getpid())).touch()
    raise RuntimeError(FAULT)
