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
this machine (done / partial n / todo), and the one-line command that runs it alone. Each job is checked as far
as its settings allow without its data or weights (budget rules, unknown keys, types, lengths against the model's
max_length, the method against the model's geometry where its config is on this machine); a job that fails is
listed with its one-line error, ``--strict`` then exits 2, and a launch refuses to start.

Run directories contain a hash of the settings, device and dtype included; ``--device cuda`` computes them as a
GPU host will (the default is this machine's device).
"""

from __future__ import annotations

import argparse
import dataclasses
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
            from icecache_harness.report.collect import count_complete_lines

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


def expand(overrides: list[str], device: str | None = None, resolve_dirs: bool = True,
           check: bool = True) -> tuple[list[Job], Any]:
    """The jobs ``run.py -m <overrides>`` (plus the experiment's reference runs) would launch, and the composed
    config without the swept keys (its ``hydra`` node tells the launcher). ``resolve_dirs=False`` skips composing
    every job (fast; run directories stay unknown). With ``check``, each job also gets the checks its settings
    allow without data or weights: its task's settings against the model's max_length and, where the model's
    config can be read here (random, local or GGUF models), the method's checks against the model's geometry;
    a job that fails one is listed with its error, as a job that does not compose is."""
    from run import JobComposer, first_line, hydra_context, run_values, sweep_jobs

    overrides = normalise_overrides(overrides)
    with hydra_context():
        job_overrides, base = sweep_jobs(overrides)
        reference = reference_overrides(base, overrides)
        if reference:
            job_overrides, base = sweep_jobs(overrides, [reference])
        if not resolve_dirs:
            return [Job(o, None) for o in job_overrides], base
        composer = JobComposer()
        jobs: list[Job] = []
        seen: dict[str, int] = {}
        infos: dict[str, Any] = {}
        with _as_device(device):
            from icecache_harness.runner import RunConfig

            for job_override in job_overrides:
                try:
                    config = RunConfig.from_dict(run_values(composer.compose(job_override)))
                    run_dir = config.output_dir()
                    if check:
                        check_job(config, infos)
                except Exception as error:  # noqa: BLE001  a job that cannot compose or run is listed, not fatal
                    jobs.append(Job(job_override, None, first_line(error)))
                    continue
                job = Job(job_override, run_dir)
                if str(run_dir) in seen:
                    job.duplicate_of = seen[str(run_dir)]
                else:
                    seen[str(run_dir)] = len(jobs)
                jobs.append(job)
    for info in infos.values():
        if isinstance(info, str):
            print(f"note: model {info}; the methods' checks against its geometry were skipped", file=sys.stderr)
    return jobs, base


def check_job(config, infos: dict[str, Any]) -> None:
    """The checks of one job that need neither its data nor its weights (``ConfigError`` if one fails)."""
    import icecache.tasks  # noqa: F401  importing the package registers every task
    from icecache.methods import build_method
    from icecache.tasks.base import TASKS

    task_cls = TASKS.get(config.task.get("name"))
    task_cls(task_cls.config_class.from_dict(dict(config.task))).check_max_length(config.model.max_length)
    info = cheap_model_info(config.model, infos)
    if info is not None and not isinstance(info, str):
        build_method(config.method, info)


def cheap_model_info(spec, infos: dict[str, Any]):
    """The model's geometry when its config is on this machine (random, local folder, GGUF file or package),
    read once per model; None for a hub id, the reason as a string when it cannot be read."""
    from icecache.core.errors import ConfigError
    from icecache.core.models import check_model, model_info

    key = json.dumps(dataclasses.asdict(spec), sort_keys=True, default=str)
    if key not in infos:
        local_hub = spec.source == "hub" and spec.path and Path(spec.path).expanduser().is_dir()
        if spec.source not in ("random", "local", "gguf", "gguf_package") and not local_hub:
            infos[key] = None
        else:
            try:
                check_model(spec)
                infos[key] = model_info(spec)
            except (ConfigError, OSError, ValueError) as error:
                infos[key] = f"{spec.name}: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    info = infos[key]
    return info


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

    from run import check_launcher, check_syntax, fail, first_line

    # Syntax and choices here; every job is composed and checked by expand (a job that fails is listed).
    check_syntax([o.replace("+experiment=", "experiment=") for o in args.overrides])
    try:
        jobs, base = expand(args.overrides, args.device)
    except Exception as error:  # noqa: BLE001  the sweep itself does not compose (not one of its jobs)
        fail(f"bad override: {first_line(error)}")
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
                  f"{len(jobs) - len(unique) - len(errors)} duplicates, {len(errors)} that cannot run (error)")
            print(launcher_summary(base, len(unique)))
        return 2 if errors and args.strict else 0

    if errors:
        fail(f"{len(errors)} of the sweep's {len(jobs)} jobs cannot run; the first, {' '.join(errors[0].overrides)}: "
             f"{errors[0].error} (--dry-run lists them all)")
    check_launcher(base)
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
