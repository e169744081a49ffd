#!/usr/bin/env python
"""Expand, preview or launch an experiment's sweep.

    python scripts/sweep.py experiment=table2 model=llama31_8b --dry-run        # list the jobs, run nothing
    python scripts/sweep.py experiment=table2 hydra/launcher=slurm --dry-run    # ... and the Slurm array it makes
    python scripts/sweep.py experiment=table2 model=llama31_8b hydra/launcher=slurm   # launch (blocks until done)
    python scripts/sweep.py experiment=latency                                   # runs scripts/bench_latency.py

The grid is what ``python run.py -m <overrides>`` would run: the experiment's ``hydra.sweeper.params`` with the
command-line overrides replacing keys they name (Hydra's BasicSweeper rule, reused here). An experiment with
``reference_runs`` (the budget-free full cache) adds a second sweep: the same grid with those keys replaced, and
runs whose directories coincide are listed once. The dry run prints each job's run directory and its status on
this machine (done / partial n / todo), and the one-line command that runs it alone.

Run directories contain a hash of the settings, device and dtype included; ``--device cuda`` computes them as a
GPU host will (the default is this machine's device).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "configs"
sys.path.insert(0, str(REPO))


@dataclass
class Job:
    overrides: list[str]
    run_dir: Path | None
    error: str | None = None
    duplicate_of: int | None = None

    def status(self) -> str:
        if self.error:
            return "error"
        if self.run_dir is None:
            return "?"
        if (REPO / self.run_dir / "metrics.json").exists() or (self.run_dir / "metrics.json").exists():
            return "done"
        predictions = self.run_dir / "predictions.jsonl"
        if not predictions.is_absolute():
            predictions = REPO / predictions
        if predictions.exists():
            from eval.report.collect import count_complete_lines

            return f"partial {count_complete_lines(predictions)}"
        return "todo"

    def command(self) -> str:
        return "python run.py " + " ".join(shlex.quote(o) for o in self.overrides)


def experiment_in_defaults() -> bool:
    """Whether configs/config.yaml lists an ``experiment`` default (then ``experiment=x``; else ``+experiment=x``)."""
    import yaml

    defaults = yaml.safe_load((CONFIG_DIR / "config.yaml").read_text()).get("defaults", [])
    return any(isinstance(d, dict) and any(k.split("@")[0].removeprefix("optional ") == "experiment" for k in d)
               for d in defaults)


def normalise_overrides(overrides: list[str]) -> list[str]:
    """``experiment=x`` <-> ``+experiment=x`` depending on the top-level config, so both spellings work."""
    has_default = experiment_in_defaults()
    out = []
    for override in overrides:
        key = override.split("=", 1)[0]
        if key in ("experiment", "+experiment"):
            value = override.split("=", 1)[1]
            override = f"experiment={value}" if has_default else f"+experiment={value}"
        out.append(override)
    return out


@contextmanager
def _as_device(device: str | None):
    """Compute run directories as on a host with ``device`` (the hash includes the resolved device and dtype)."""
    if device is None:
        yield
        return
    import torch

    from icecache.core.models import ModelSpec

    original = ModelSpec.resolved_device

    def resolved(self):
        return torch.device(device) if self.device == "auto" else torch.device(self.device)

    ModelSpec.resolved_device = resolved
    try:
        yield
    finally:
        ModelSpec.resolved_device = original


def _compose(overrides: list[str], with_hydra: bool = False):
    from hydra import compose

    return compose(config_name="config", overrides=overrides, return_hydra_config=with_hydra)


def expand(overrides: list[str], device: str | None = None, resolve_dirs: bool = True) -> tuple[list[Job], Any]:
    """The jobs ``run.py -m <overrides>`` (plus the experiment's reference runs) would launch, and the composed
    config without the swept keys (its ``hydra`` node tells the launcher). ``resolve_dirs=False`` skips composing
    every job (fast; run directories stay unknown)."""
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    overrides = normalise_overrides(overrides)
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    plain = [o.input_line for o in parsed if not o.is_sweep_override()]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        base = _compose(plain, with_hydra=True)
        sweeper_params = base.hydra.sweeper.get("params")
        params = [f"{k}={v}" for k, v in (OmegaConf.to_container(sweeper_params) if sweeper_params else {}).items()]
        grids = [params + overrides]
        reference = reference_overrides(base, overrides)
        if reference:
            grids.append(params + overrides + reference)
        job_overrides: list[list[str]] = []
        for grid in grids:
            for batch in BasicSweeper.split_arguments(parser.parse_overrides(grid), None):
                job_overrides += [list(job) for job in batch]
        jobs: list[Job] = []
        seen: dict[str, int] = {}
        if not resolve_dirs:
            GlobalHydra.instance().clear()
            return [Job(o, None) for o in job_overrides], base
        with _as_device(device):
            from icecache.runner import RunConfig

            for job_override in job_overrides:
                try:
                    cfg = _compose(job_override)
                    values = OmegaConf.to_container(cfg, resolve=True)
                    for key in ("experiment", "reference_runs", "bench"):
                        values.pop(key, None)
                    run_dir = RunConfig.from_dict(values).output_dir()
                except Exception as error:  # noqa: BLE001  a job that cannot compose is listed, not fatal
                    jobs.append(Job(job_override, None, str(error).strip().splitlines()[0]))
                    continue
                job = Job(job_override, run_dir)
                if str(run_dir) in seen:
                    job.duplicate_of = seen[str(run_dir)]
                else:
                    seen[str(run_dir)] = len(jobs)
                jobs.append(job)
    GlobalHydra.instance().clear()
    return jobs, base


def reference_overrides(base, overrides: list[str]) -> list[str]:
    """The experiment's ``reference_runs`` as overrides, or none when the command line names the methods
    (``method=icecache`` asks for IceCache only, not for the full cache as well; ``budget=64`` keeps it)."""
    reference = base.get("reference_runs")
    if not reference:
        return []
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    if "method" in given:
        return []
    return [f"{k}={'null' if v is None else v}" for k, v in reference.items()]


def launcher_summary(base, n_jobs: int) -> str:
    from omegaconf import OmegaConf

    launcher = base.hydra.launcher
    target = str(launcher.get("_target_", ""))
    if "Slurm" not in target:
        kind = "submitit local processes" if "Local" in target else "one after another in this process"
        return f"launcher: {kind} ({n_jobs} jobs)"
    raw = OmegaConf.to_container(launcher, resolve=False)
    parallel = min(n_jobs, int(raw.get("array_parallelism") or n_jobs)) if n_jobs else 0
    flags = [f"--array=0-{max(n_jobs - 1, 0)}%{parallel}", f"--time={raw.get('timeout_min')}",
             f"--gpus-per-node={raw.get('gpus_per_node')}", f"--cpus-per-task={raw.get('cpus_per_task')}",
             f"--mem={raw.get('mem_gb')}GB", f"--signal=USR2@{raw.get('signal_delay_s')}"]
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        if raw.get(key):
            flags.append(f"--{key}={raw[key]}")
    for key, value in (raw.get("additional_parameters") or {}).items():
        flags.append(f"--{key.replace('_', '-')}" + ("" if value is True else f"={value}"))
    return (f"launcher: Slurm job array of {n_jobs} tasks (one sbatch per launch batch): sbatch " + " ".join(flags)
            + f"\n  requeue: on preemption always, on timeout up to {raw.get('max_num_timeout')} times"
            + "\n  setup: " + "; ".join(line.replace("${hydra.launcher.cpus_per_task}", str(raw.get("cpus_per_task")))
                                       for line in raw.get("setup") or []))


def bench_command(base) -> list[str] | None:
    """The latency driver's command line for an experiment with a ``bench`` block."""
    bench = base.get("bench")
    if not bench:
        return None
    experiment = base.hydra.runtime.choices.get("experiment") if "runtime" in base.hydra else None
    command = [sys.executable, str(REPO / bench.driver)]
    command += ["--experiment", experiment] if experiment else []
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for run.py -m")
    parser.add_argument("--dry-run", action="store_true", help="list the jobs and the launch; run nothing")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="compute run directories as on a host with this device (default: this machine)")
    parser.add_argument("--json", action="store_true", help="with --dry-run: print the jobs as JSON lines")
    parser.add_argument("--strict", action="store_true", help="exit 2 if any job fails to compose")
    args = parser.parse_intermixed_args(argv)

    from run import precheck

    # Choices and syntax only ("-m": composition is checked per job below, as run.py -m does).
    precheck([o.replace("+experiment=", "experiment=") for o in args.overrides] + ["-m"])
    jobs, base = expand(args.overrides, args.device)
    driver = bench_command(base)
    if driver is not None:
        extra = [o for o in args.overrides if not o.split("=", 1)[0].lstrip("+") == "experiment"]
        if extra:
            print(f"note: {base.bench.driver} takes its own options; ignoring {' '.join(extra)}", file=sys.stderr)
        print("this experiment runs through its driver:\n  " + " ".join(shlex.quote(c) for c in driver))
        if args.dry_run:
            return 0
        return subprocess.call(driver, cwd=REPO)

    unique = [job for job in jobs if job.duplicate_of is None and not job.error]
    errors = [job for job in jobs if job.error]
    if args.dry_run:
        for index, job in enumerate(jobs):
            if args.json:
                print(json.dumps({"index": index, "overrides": job.overrides, "run_dir": str(job.run_dir),
                                  "status": job.status(), "error": job.error, "duplicate_of": job.duplicate_of}))
                continue
            if job.error:
                line = f"[{index:4d}] error: {job.error}\n       {job.command()}"
            elif job.duplicate_of is not None:
                line = f"[{index:4d}] same run as [{job.duplicate_of}]: {job.run_dir}"
            else:
                line = f"[{index:4d}] {job.status():<12} {job.run_dir}\n       {job.command()}"
            print(line)
        if not args.json:
            done = sum(job.status() == "done" for job in unique)
            print(f"{len(jobs)} jobs: {len(unique)} distinct runs ({done} done), "
                  f"{len(jobs) - len(unique) - len(errors)} duplicates, {len(errors)} that do not compose")
            print(launcher_summary(base, len(unique)))
        return 2 if errors and args.strict else 0

    overrides = normalise_overrides(args.overrides)
    commands = [[sys.executable, str(REPO / "run.py"), "-m", *overrides]]
    reference = reference_overrides(base, overrides)
    if reference:
        commands.insert(0, [*commands[0], *reference])
    slurm = "Slurm" in str(base.hydra.launcher.get("_target_", ""))
    for command in commands:
        print("+ " + " ".join(shlex.quote(c) for c in command), flush=True)
    if slurm:
        # Each Hydra multirun blocks until its array ends; submit both arrays at once.
        processes = [subprocess.Popen(c, cwd=REPO) for c in commands]
        codes = [p.wait() for p in processes]
    else:
        codes = [subprocess.call(c, cwd=REPO) for c in commands]
    print("collect the results (whatever the exit codes): python scripts/collect.py results/runs --out results/summary")
    return max(codes, default=0)


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    sys.exit(main())
