"""Job runners for the host launcher's tests (eval/sweep.py): device faults and a full GPU memory injected where a
CPU cannot make them.

A spawned worker imports them by name (the parent's sys.path travels with it), as it imports eval.sweep.run_job.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FAULT = "CUDA error: an illegal memory access was encountered"
OUT_OF_MEMORY = "CUDA out of memory. Tried to allocate 24.00 MiB. GPU 0 has a total capacity of 79.18 GiB"


def _logged(values: dict[str, Any], folder_name: str) -> Path:
    """The folder beside the runs' output root, with this call (method and process) appended to its calls log."""
    folder = Path(values["output_root"]).parent / folder_name
    folder.mkdir(exist_ok=True)
    with open(folder / "calls", "a", encoding="utf-8") as log:
        log.write(f"{values['method']['name']} {os.getpid()}\n")
    return folder


def _first_call_fails(values: dict[str, Any], folder_name: str, message: str) -> None:
    """The first job run anywhere raises `message`; every other one runs."""
    from eval.sweep import run_job

    marker = _logged(values, folder_name) / "failed"
    if not marker.exists():
        marker.touch()
        raise RuntimeError(message)
    run_job(values)


def fault_first_call(values: dict[str, Any]) -> None:
    """The first job run anywhere ends in a device fault; every call, that one included, is logged in order."""
    _first_call_fails(values, "faults", FAULT)


def always_fault(values: dict[str, Any]) -> None:
    """Every job ends in a device fault, after a marker named by its process."""
    folder = Path(values["output_root"]).parent / "faults"
    folder.mkdir(exist_ok=True)
    (folder / str(os.getpid())).touch()
    raise RuntimeError(FAULT)


def out_of_memory_first_call(values: dict[str, Any]) -> None:
    """The first job run anywhere runs out of GPU memory; every call is logged in order, with its process."""
    _first_call_fails(values, "memory", OUT_OF_MEMORY)


def always_out_of_memory(values: dict[str, Any]) -> None:
    """Every job runs out of GPU memory; every call is logged."""
    _logged(values, "memory")
    raise RuntimeError(OUT_OF_MEMORY)
