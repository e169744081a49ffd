"""Provenance of a result file: code version, machine, library versions, date."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_label() -> str:
    """What a result file name says about where it ran: the GPU model ("h200" for an NVIDIA H200) when there is
    one, else the host name (cloud GPU hosts are often all called "vm")."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower().replace("nvidia", "")
    else:
        name = socket.gethostname().split(".")[0].lower()
    return "".join(ch if ch.isalnum() else "-" for ch in name.strip()).strip("-") or "unknown"


def result_path(folder: str | Path, kind: str) -> Path:
    """``<folder>/<kind>_<machine>_<date-time>.json``, the name every result file of ``kind`` takes."""
    return Path(folder) / f"{kind}_{machine_label()}_{_dt.datetime.now():%Y%m%d-%H%M%S}.json"


def write_result(folder: str | Path, kind: str, payload: dict[str, Any], path: Path | None = None,
                 quiet: bool = False) -> Path:
    """Write ``payload`` to ``path`` (default: a new ``result_path``) through a temporary file, so that a killed run
    leaves no half-written result, print where unless ``quiet``, and return the path. A long run passes the same
    ``path`` after each part it finishes, so that what it measured survives a kill."""
    import json

    path = Path(path) if path is not None else result_path(folder, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    tmp.replace(path)
    if not quiet:
        print(f"wrote {path}")
    return path


def numa_nodes() -> int | None:
    """The host's NUMA nodes (Linux ``/sys/devices/system/node``; None where it cannot be read)."""
    nodes = Path("/sys/devices/system/node")
    found = list(nodes.glob("node[0-9]*")) if nodes.is_dir() else []
    return len(found) or None


def check_resume_machine(path: str | Path, prior: dict[str, Any]) -> None:
    """Refuse in one line to complete the unfinished result file ``path`` (payload ``prior``) on another kind of
    GPU (or on a CPU where it began on a GPU, or the reverse): its rows would set two machines side by side."""
    import torch

    from icecache.errors import ConfigError

    here = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    began = (prior.get("provenance") or {}).get("gpu")
    if began != here:
        raise ConfigError(f"--resume {path}: it began on {began or 'no GPU'} and this machine has {here or 'no GPU'}; "
                          "resume it where it began, or start a new file")


def collect() -> dict[str, Any]:
    import torch
    import transformers

    # A copied tree (e.g. a git-archive snapshot on a GPU host) names its commit through the environment; that wins
    # over git, which would otherwise find whatever checkout encloses the copy.
    named_commit = os.environ.get("ICECACHE_GIT_COMMIT")
    info: dict[str, Any] = {
        "git_commit": named_commit or _git("rev-parse", "HEAD"),
        "git_dirty": False if named_commit else bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        # Where host-memory-bound work may run: the NUMA nodes and the threads' binding (a search's bandwidth
        # depends on both).
        "numa_nodes": numa_nodes(),
        "omp_proc_bind": os.environ.get("OMP_PROC_BIND"),
        "omp_places": os.environ.get("OMP_PLACES"),
        # How many hardware queues the GPU's streams share (CUDA's default 8): work on more streams than queues, as
        # in a batch whose rows attend on streams of their own, may wait behind another stream's.
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "command": " ".join(sys.argv),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001  triton is optional
        info["triton"] = None
    # The DCI kernels' instruction set decides the order of a score's sums (docs/dci.md, kernels), and the scan's
    # settings its speed: both are the process's, so both are recorded.
    try:
        from icecache import dci

        info["dci_isa"] = dci.active_isa()
        info["dci_supported_isa"] = dci.supported_isa()
        info["dci_scan_tuning"] = dci.scan_tuning()
    except Exception as exc:  # noqa: BLE001  an unbuilt extension must not stop a result from being written
        info["dci_isa"] = f"unavailable: {exc}"
    return info
