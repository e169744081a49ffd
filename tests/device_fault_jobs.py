"""Job runners for the host launcher's tests (eval/sweep.py): device faults injected where a CPU cannot make one.

A spawned worker imports them by name (the parent's sys.path travels with it), as it imports eval.sweep.run_job.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FAULT = "CUDA error: an illegal memory access was encountered"


def fault_first_call(values: dict[str, Any]) -> None:
    """The first job run anywhere ends in a device fault; every call, that one included, is logged in order."""
    from eval.sweep import run_job

    folder = Path(values["output_root"]).parent / "faults"
    folder.mkdir(exist_ok=True)
    with open(folder / "calls", "a", encoding="utf-8") as log:
        log.write(f"{values['method']['name']} {os.getpid()}\n")
    marker = folder / "faulted"
    if not marker.exists():
        marker.touch()
        raise RuntimeError(FAULT)
    run_job(values)


def always_fault(values: dict[str, Any]) -> None:
    """Every job ends in a device fault, after a marker named by its process."""
    folder = Path(values["output_root"]).parent / "faults"
    folder.mkdir(exist_ok=True)
    (folder / str(os.getpid())).touch()
    raise RuntimeError(FAULT)


OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 24.00 MiB. GPU 0 has a total capacity of 79.18 GiB"


def out_of_memory_first_call(values: dict[str, Any]) -> None:
    """The first job run anywhere runs out of GPU memory; every call is logged in order, with its process."""
    from eval.sweep import run_job

    folder = Path(values["output_root"]).parent / "memory"
    folder.mkdir(exist_ok=True)
    with open(folder / "calls", "a", encoding="utf-8") as log:
        log.write(f"{values['method']['name']} {os.getpid()}\n")
    marker = folder / "ran_out"
    if not marker.exists():
        marker.touch()
        raise RuntimeError(OUT_OF_MEMORY)
    run_job(values)


def always_out_of_memory(values: dict[str, Any]) -> None:
    """Every job runs out of GPU memory; every call is logged."""
    folder = Path(values["output_root"]).parent / "memory"
    folder.mkdir(exist_ok=True)
    with open(folder / "calls", "a", encoding="utf-8") as log:
        log.write(f"{values['method']['name']} {os.getpid()}\n")
    raise RuntimeError(OUT_OF_MEMORY)
