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

A launch submits only the runs that are not done (a finished sweep submits nothing; partial runs resume). With
``hydra/launcher=slurm`` or ``slurm_local`` they go as one job array through hydra-submitit-launcher's launcher
(Hydra's own ``run.py -m`` would submit every job of the grid and, on Slurm, report a task whose run stopped with
an error as completed); the sweep waits for every task and reports each that did not finish: ``failed`` with the
run's error line, ``crashed`` (an exception, or the task left the queue without a result: killed, out of memory),
each with its log file. Exit status: 0 all finished, 2 some failed, 1 some crashed. The local launcher runs
``run.py -m`` here.

Run directories contain a hash of the settings, device and dtype included; ``--device cuda`` computes them as a
GPU host will (the default is this machine's device, or cuda for a Slurm launcher that asks for GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
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
    values: dict[str, Any] | None = None  # the run's composed settings (RunConfig.from_dict), when resolved
    reference: bool = False  # one of the experiment's reference runs (what the tables' "% of full" divides by)

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


def expand(overrides: list[str], device: str | None = None, resolve_dirs: bool = True,
           check: bool = True, infos: dict[str, Any] | None = None) -> tuple[list[Job], Any]:
    """The jobs ``run.py -m <overrides>`` (plus the experiment's reference runs) would launch, and the composed
    config without the swept keys (its ``hydra`` node tells the launcher). ``resolve_dirs=False`` skips composing
    every job (fast; run directories stay unknown). With ``check``, each job also gets the checks its settings
    allow without data or weights: its task's settings against the model's max_length and, where the model's
    config can be read here (random, local or GGUF models), the method's checks against the model's geometry;
    a job that fails one is listed with its error, as a job that does not compose is. ``infos`` holds the models'
    geometries read so far; a caller expanding several sweeps passes one dict so that each model is read once."""
    from run import JobComposer, first_line, hydra_context, run_values, sweep_jobs

    overrides = normalise_overrides(overrides)
    with hydra_context():
        job_overrides, base = sweep_jobs(overrides)
        n_grid = len(job_overrides)  # the jobs after these are the reference runs'
        reference = reference_overrides(base, overrides)
        if reference:
            job_overrides, base = sweep_jobs(overrides, [reference])
        if not resolve_dirs:
            return [Job(o, None, reference=i >= n_grid) for i, o in enumerate(job_overrides)], base
        composer = JobComposer()
        jobs: list[Job] = []
        seen: dict[str, int] = {}
        infos = {} if infos is None else infos
        known = set(infos)  # read by an earlier sweep, whose notes are printed already
        with _as_device(device):
            from eval.runner import RunConfig

            for index, job_override in enumerate(job_overrides):
                try:
                    values = run_values(composer.compose(job_override))
                    config = RunConfig.from_dict(values)
                    run_dir = config.output_dir()
                    if check:
                        check_job(config, infos)
                except Exception as error:  # noqa: BLE001  a job that cannot compose or run is listed, not fatal
                    jobs.append(Job(job_override, None, first_line(error)))
                    continue
                job = Job(job_override, run_dir, values=values, reference=index >= n_grid)
                if str(run_dir) in seen:
                    job.duplicate_of = seen[str(run_dir)]
                    jobs[seen[str(run_dir)]].reference |= job.reference
                else:
                    seen[str(run_dir)] = len(jobs)
                jobs.append(job)
    for key, info in infos.items():
        if key not in known and isinstance(info, str):
            print(f"note: model {info}; the methods' checks against its geometry were skipped", file=sys.stderr)
    return jobs, base


def check_job(config, infos: dict[str, Any]) -> None:
    """The checks of one job that need neither its data nor its weights (``ConfigError`` if one fails)."""
    import eval.tasks  # noqa: F401  importing the package registers every task
    from eval.plugins import build_method
    from eval.tasks.base import TASKS

    task_cls = TASKS.get(config.task.get("name"))
    task_cls(task_cls.config_class.from_dict(dict(config.task))).check_max_length(config.model.max_length)
    info = cheap_model_info(config.model, infos)
    if info is not None and not isinstance(info, str):
        build_method(config.method, info)


def cheap_model_info(spec, infos: dict[str, Any]):
    """The model's geometry when its config is on this machine (random, local folder, GGUF file or package),
    read once per model; None for a hub id, the reason as a string when it cannot be read."""
    from icecache.core.models import check_model, model_info
    from icecache.errors import ConfigError

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


def gpu_nodes(base) -> bool:
    """Whether the launcher runs the jobs on Slurm nodes with GPUs (``gpus_per_node`` above 0)."""
    launcher = base.hydra.launcher
    return "SlurmLauncher" in str(launcher.get("_target_", "")) and bool(launcher.get("gpus_per_node"))


def cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def launcher_summary(base, n_jobs: int) -> str:
    """How the launcher will submit the ``n_jobs`` runs that are not done (done ones are never submitted)."""
    from omegaconf import OmegaConf

    launcher = base.hydra.launcher
    target = str(launcher.get("_target_", ""))
    if not n_jobs:
        return "launcher: nothing to submit (every run is done)"
    if "Slurm" not in target:
        kind = "submitit local processes" if "Local" in target else "one after another in this process"
        return f"launcher: {kind} ({n_jobs} jobs)"
    raw = OmegaConf.to_container(launcher, resolve=False)
    parallel = min(n_jobs, int(raw.get("array_parallelism") or n_jobs))
    flags = [f"--array=0-{n_jobs - 1}%{parallel}", f"--time={raw.get('timeout_min')}",
             f"--gpus-per-node={raw.get('gpus_per_node')}", f"--cpus-per-task={raw.get('cpus_per_task')}",
             f"--mem={raw.get('mem_gb')}GB", f"--signal=USR2@{raw.get('signal_delay_s')}"]
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        if raw.get(key):
            flags.append(f"--{key}={raw[key]}")
    for key, value in (raw.get("additional_parameters") or {}).items():
        flags.append(f"--{key.replace('_', '-')}" + ("" if value is True else f"={value}"))
    return (f"launcher: Slurm job array of {n_jobs} tasks: sbatch " + " ".join(flags)
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
        if args.device is None and gpu_nodes(base) and not cuda_here():
            # The nodes hash their run directories with device cuda: a run done here on the CPU is another run.
            print("note: run directories as the launcher's GPU nodes compute them (--device cuda); "
                  "--device cpu for CPU nodes", file=sys.stderr)
            jobs, base = expand(args.overrides, "cuda")
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
            print(launcher_summary(base, len(unique) - done))
        return 2 if errors and args.strict else 0

    if errors:
        fail(f"{len(errors)} of the sweep's {len(jobs)} jobs cannot run; the first, {' '.join(errors[0].overrides)}: "
             f"{errors[0].error} (--dry-run lists them all)")
    check_launcher(base)
    todo = [job for job in unique if job.status() != "done"]
    if not todo:
        print(f"all {len(unique)} runs of the sweep are done; nothing to submit")
        print(COLLECT_HINT)
        return 0
    overrides = normalise_overrides(args.overrides)
    if is_submitit(base):
        code = launch_submitit(overrides, todo, len(unique) - len(todo))
        print(COLLECT_HINT)
        return code
    commands = [[sys.executable, str(REPO / "run.py"), "-m", *overrides]]
    reference = reference_overrides(base, overrides)
    if reference:
        commands.insert(0, [*commands[0], *reference])
    for command in commands:
        print("+ " + " ".join(shlex.quote(c) for c in command), flush=True)
    codes = [subprocess.call(c, cwd=REPO) for c in commands]
    print(COLLECT_HINT)
    return max(codes, default=0)


COLLECT_HINT = ("collect the results (whatever the exit code): "
                "python scripts/collect.py results/runs --out results/summary")


# ---------------------------------------------------------------------------------------------------------------
# Submitit launches (hydra/launcher=slurm, slurm_local): the runs that are not done, as one job array, through
# hydra-submitit-launcher's launcher object, then a report of every task from its own outcome


def is_submitit(base) -> bool:
    return "hydra_submitit_launcher" in str(base.hydra.launcher.get("_target_", ""))


def task_overrides(overrides: list[str]) -> list[str]:
    """A job's overrides without the ``hydra...`` ones: those belong to the sweep's config, which the launcher
    composes each task from (as Hydra's own sweeper hands its launcher only the task overrides)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o.input_line for o in OverridesParser.create().parse_overrides(overrides) if not o.is_hydra_override()]


def run_task(cfg) -> dict | None:
    """One task of the array (on the node): the run, as ``run.py`` runs it. None when it stopped with an
    ``error:`` line (in the task's log), so that the sweep reports the task as failed instead of completed."""
    sys.path.insert(0, str(REPO))
    from eval.runner import main_from_dict
    from run import run_values

    return main_from_dict(run_values(cfg), exit_on_error=False)


@dataclass
class TaskOutcome:
    index: int
    job: Job
    status: str = "pending"  # finished, failed (an error line), crashed (raised, killed, vanished)
    reason: str = ""
    log: Path | None = None


def launch_submitit(overrides: list[str], todo: list[Job], n_done: int) -> int:
    """Submit ``todo`` as one array with the configured submitit launcher, wait for every task, report each:
    0 when all finished, 2 when some stopped with an error line, 1 when one crashed or vanished."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode
    from omegaconf import OmegaConf

    # Relative paths (output_root, the sweep dir) mean the same on the nodes as here: tasks start in the folder
    # sbatch was called from, which is the repository, as for run.py -m.
    os.chdir(REPO)
    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="run", config_search_path=create_config_search_path(str(CONFIG_DIR)))
    cfg = hydra.compose_config("config", overrides, run_mode=RunMode.MULTIRUN)
    context = HydraContext(config_loader=hydra.config_loader, callbacks=Callbacks(cfg))
    if run_task.__module__ != "__main__":
        import cloudpickle  # the nodes cannot import scripts/sweep.py as a module: send the function itself

        cloudpickle.register_pickle_by_value(sys.modules[run_task.__module__])
    launcher = Plugins.instance().instantiate_launcher(config=cfg, hydra_context=context, task_function=run_task)
    sweep_dir = Path(str(cfg.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, sweep_dir / "multirun.yaml")
    slurm = launcher._EXECUTOR == "slurm"
    runs = f"{len(todo)} run{'s' if len(todo) != 1 else ''}"
    kind = ("to Slurm" + (" as one job array" if len(todo) > 1 else "")) if slurm else "as submitit local processes"
    print(f"submitting {runs} {kind}" + (f" ({n_done} done, skipped)" if n_done else ""), flush=True)
    try:
        # submitit prints sbatch's stderr before it raises; the reason goes in the one error line instead
        with contextlib.redirect_stderr(io.StringIO()):
            jobs = submit_array(launcher, [task_overrides(job.overrides) for job in todo])
    except Exception as error:  # noqa: BLE001  sbatch refused the array (a partition, account or QOS it rejects)
        from run import fail

        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        fail(f"the submission failed, nothing was submitted: {lines[-1] if lines else type(error).__name__}")
    if slurm:
        # submitit submits a lone task as a plain job, not an array of one
        what = (f"job array {jobs[0].job_id.split('_')[0]} (tasks 0-{len(jobs) - 1})" if len(jobs) > 1
                else f"job {jobs[0].job_id}")
        print(f"submitted {what}; logs: {jobs[0].paths.folder.parent}; waiting for it (interrupting leaves it "
              f"running)", flush=True)
    outcomes = [TaskOutcome(i, job, log=submitted.paths.stdout) for i, (job, submitted) in enumerate(zip(todo, jobs))]
    try:
        wait_for_tasks(jobs, outcomes, slurm)
    except KeyboardInterrupt:
        print("interrupted: the tasks go on; resubmit the same sweep later to wait for (or rerun) what is left",
              file=sys.stderr)
        return 130
    return report(outcomes)


def submit_array(launcher, job_overrides: list[list[str]]):
    """What ``BaseSubmititLauncher.launch`` submits (its executor, its parameters, the launcher object as each
    task's callable), returning the submitit jobs instead of waiting on them in order: that method returns
    only when every task wrote a result and raises at the first one that did not, dropping the others' report."""
    import submitit
    from hydra.core.singleton import Singleton
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    params, executor_name = launcher.params, launcher._EXECUTOR
    init_keys = {"max_num_timeout", "submitit_folder"}
    executor = submitit.AutoExecutor(
        cluster=executor_name, folder=params["submitit_folder"],
        **{f"{executor_name}_{k}": v for k, v in params.items() if k == "max_num_timeout"})
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in shared else f"{executor_name}_{k}": v
                                  for k, v in params.items() if k not in init_keys})
    arguments = [(overrides, "hydra.sweep.dir", index, f"job_id_for_{index}", Singleton.get_state())
                 for index, overrides in enumerate(job_overrides)]
    return executor.map_array(launcher, *zip(*arguments))


# squeue states of a task that may still write its result (a preempted task is PENDING again once requeued).
ACTIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "RESIZING",
                           "SUSPENDED", "SIGNALING", "STAGE_OUT"})
LOST_AFTER_S = 10.0  # a task gone from squeue's active states with no result for this long has died


def wait_for_tasks(jobs, outcomes: list[TaskOutcome], slurm: bool) -> None:
    """Until every task has an outcome: its result file (what the task returned or raised), or, for a Slurm task
    that left the queue without one (killed, out of memory, node failure), "crashed". Slurm states come from
    squeue, which every cluster has (sacct needs an accounting database)."""
    import time

    start = time.time()
    inactive_since: dict[int, float] = {}
    pending = {outcome.index for outcome in outcomes}
    while pending:
        states = squeue_states(jobs[0].job_id.split("_")[0]) if slurm else None
        now = time.time()
        for index in sorted(pending):
            job, outcome = jobs[index], outcomes[index]
            if job.paths.result_pickle.exists() or (not slurm and job.done()):
                read_outcome(job, outcome)
                pending.discard(index)
            elif states is not None and states.get(job.job_id) not in ACTIVE_STATES:
                first = inactive_since.setdefault(index, now)
                refresh_listing(job.paths.folder)
                if job.paths.result_pickle.exists():
                    continue  # read at the next poll
                if now - first >= LOST_AFTER_S:
                    state = states.get(job.job_id, "gone from the queue")
                    outcome.status, outcome.reason = "crashed", f"the task ended without a result (Slurm: {state})"
                    pending.discard(index)
            else:
                inactive_since.pop(index, None)
        if pending:
            time.sleep(min(30.0, max(2.0, (time.time() - start) / 10)))


def refresh_listing(folder: Path) -> None:
    """Make an NFS client look at the folder again (a file another node wrote may not show yet otherwise)."""
    try:
        folder.chmod(folder.stat().st_mode)
    except OSError:
        pass


def squeue_states(array_id: str) -> dict[str, str] | None:
    """{"<array>_<task>": state} of the array's tasks still in the queue (finished ones stay MinJobAge); None
    when squeue does not answer (then nothing is declared crashed)."""
    try:
        result = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", array_id, "-o", "%i %T"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return dict(line.split(None, 1) for line in result.stdout.splitlines() if len(line.split(None, 1)) == 2)


def read_outcome(job, outcome: TaskOutcome) -> None:
    from run import first_line

    try:
        returned = job.result()
    except Exception as error:  # noqa: BLE001  the task raised outside the run (submitit's own failure)
        outcome.status, outcome.reason = "crashed", first_line(error)
        return
    value = getattr(returned, "_return_value", None)
    if getattr(getattr(returned, "status", None), "name", "") == "FAILED":
        outcome.status, outcome.reason = "crashed", f"{type(value).__name__}: {first_line(value)}"
    elif value is None:
        outcome.status, outcome.reason = "failed", last_error_line(outcome.log) or "the run stopped with an error"
    else:
        outcome.status = "finished"


def last_error_line(log: Path | None) -> str | None:
    try:
        lines = log.read_text(errors="replace").splitlines() if log else []
    except OSError:
        return None
    return next((line.removeprefix("error: ") for line in reversed(lines) if line.startswith("error: ")), None)


def report(outcomes: list[TaskOutcome]) -> int:
    counts = {status: sum(o.status == status for o in outcomes) for status in ("finished", "failed", "crashed")}
    print(f"sweep: {len(outcomes)} tasks: {counts['finished']} finished, {counts['failed']} failed, "
          f"{counts['crashed']} crashed")
    for outcome in outcomes:
        if outcome.status == "finished":
            continue
        alone = "python run.py " + " ".join(shlex.quote(o) for o in task_overrides(outcome.job.overrides))
        print(f"[{outcome.index:4d}] {outcome.status}: {outcome.reason}\n       log: {outcome.log}\n       {alone}")
    if counts["failed"] or counts["crashed"]:
        print("resubmit the same sweep after fixing them: finished runs are skipped, partial ones resume",
              file=sys.stderr)
    return 1 if counts["crashed"] else 2 if counts["failed"] else 0

if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    sys.exit(main())
