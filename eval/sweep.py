"""Expand, preview, launch and curate an experiment's sweeps (the command line is scripts/sweep.py).

    python scripts/sweep.py experiment=table2 model=llama31_8b --dry-run        # list the jobs, run nothing
    python scripts/sweep.py experiment=table2 hydra/launcher=slurm --dry-run    # ... and the Slurm array it makes
    python scripts/sweep.py experiment=table2 model=llama31_8b hydra/launcher=slurm   # launch (blocks until done)
    python scripts/sweep.py experiment=accuracy_ruler --workers 4 --shards 2 --deadline 3000 --curate accuracy
    python scripts/sweep.py --sweep experiment=accuracy_passkey --sweep experiment=accuracy_ruler \\
        --no-run --curate accuracy --out results/bench                          # the curated file alone
    python scripts/sweep.py experiment=latency                                   # runs the experiment's driver

The grid is what ``python run.py -m <overrides>`` would run: the experiment's ``hydra.sweeper.params`` with the
command-line overrides replacing keys they name (Hydra's BasicSweeper rule, reused here). An experiment with
``reference_runs`` (the budget-free full cache) adds a second sweep: the same grid with those keys replaced, and
runs whose directories coincide are listed once. The positional overrides are one sweep; ``--sweep "OVERRIDES"``
adds another (repeatable), and a run that several sweeps name is run once. The dry run prints each job's run
directory and its status on this machine (done / partial n / todo), and the one-line command that runs it alone.
Each job is checked as far as its settings allow without its data or weights (budget rules, unknown keys, types,
lengths against the model's max_length, the method against the model's geometry where its config is on this
machine); a job that fails is listed with its one-line error, ``--strict`` then exits 2, and a launch refuses to
start.

A launch runs only the runs that are not done (a finished sweep runs nothing; partial runs resume).

On this host (``hydra/launcher=local``, the default) the runs go to ``--workers`` processes, the most work left
first (samples left times a sample's time, both read from the runs on disk; the experiments' reference runs before
all others), each running them one after another with the runner (which keeps the model, its tokenizer and the
built samples between the jobs of a process). Every sample is on disk when it is finished, so a deadline or a kill
loses at most the samples in flight: at ``--deadline`` seconds the workers are stopped and the next call resumes.
``--shards N`` splits each run left into N jobs of every N-th sample (the runner's ``n_shards``), so that a slow
method's run is spread over several workers instead of setting the end of the call; a later call may shard
differently without losing or repeating a sample. Before any worker loads a model, each task's own checks that
need this host (its data, the packages it reads) run once. Exit status: 0 every run done, 2 a job cannot run or
failed, 3 time ran out with runs left.

With ``hydra/launcher=slurm`` or ``slurm_local`` the runs that are not done go as one job array through
hydra-submitit-launcher's launcher (``run.py -m`` submits every job of the grid, done ones included); the sweep
waits for every task and reports each that did not finish, as ``run.py -m`` does (eval/cli.py): ``failed`` with
the run's error line, ``crashed`` (an exception, or the task left the queue without a result: killed, out of
memory), each with its log file. Exit status: 0 all finished, 2 some failed, 1 some crashed.

``--restore CURATED`` first puts back the finished runs of an earlier curated file (their metrics.json, with the
samples' scores the file carries), so that a host without the runs' directories skips them, and curating carries
them into the next file. ``--curate NAME`` then writes ``<out>/<NAME>_<model>_<date>.json``: every finished run of
the sweeps (its metrics.json and directory, each sample's scores, meta and generation hash, and its paired
difference with the full cache over the same samples, from the predictions on disk or the samples put back:
eval/report/paired.py), the runs not finished, the sweeps and this machine's provenance, with the accuracy table's
figures beside it (``accuracy_vs_budget_<model>.png``, ``accuracy_vs_tpot_<model>.png`` with TPOT from the latency
files in ``--bench``, ``mass_by_layer_<model>.png``), from which BENCHMARKS.md's accuracy table is rendered.
``--no-run`` runs nothing (with ``--curate``: curate only).

Run directories contain a hash of the settings, device and dtype included; ``--device cuda`` computes them as a
GPU host will (the default is this machine's device, or cuda for a Slurm launcher that asks for GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import multiprocessing as mp
import os
import queue
import shlex
import signal
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval import cli

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Job:
    overrides: list[str]
    run_dir: Path | None
    error: str | None = None
    duplicate_of: int | None = None  # the index of the job listed first with the same run directory
    values: dict[str, Any] | None = None  # the run's composed settings (RunConfig.from_dict), when resolved
    reference: bool = False  # one of the experiment's reference runs (what the tables' "% of full" divides by)

    @property
    def path(self) -> Path:
        """The run directory as the runner sees it: relative paths are relative to the repository."""
        return self.run_dir if self.run_dir.is_absolute() else REPO / self.run_dir

    @property
    def key(self) -> str:
        """The job's name in a queue: its run directory, and its shard when the run is sharded."""
        n_shards = (self.values or {}).get("n_shards") or 1
        if n_shards > 1:
            return f"{self.run_dir}#{self.values['shard'] + 1}/{n_shards}"
        return str(self.run_dir)

    def is_done(self) -> bool:
        return self.run_dir is not None and (self.path / "metrics.json").exists()

    def status(self) -> str:
        if self.error:
            return "error"
        if self.run_dir is None:
            return "?"
        if self.is_done():
            return "done"
        predictions = self.path / "predictions.jsonl"
        if predictions.exists():
            from eval.report.collect import count_complete_lines

            return f"partial {count_complete_lines(predictions)}"
        return "todo"

    def command(self) -> str:
        return "python run.py " + " ".join(shlex.quote(o) for o in self.overrides)


# ---------------------------------------------------------------------------------------------------------------
# Expansion: the jobs of a sweep, their run directories and the checks their settings allow


def experiment_in_defaults() -> bool:
    """Whether configs/config.yaml lists an ``experiment`` default (then ``experiment=x``; else ``+experiment=x``)."""
    import yaml

    defaults = yaml.safe_load((cli.CONFIG_DIR / "config.yaml").read_text()).get("defaults", [])
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
    overrides = normalise_overrides(overrides)
    with cli.hydra_context():
        job_overrides, base = cli.sweep_jobs(overrides)
        n_grid = len(job_overrides)  # the jobs after these are the reference runs'
        reference = reference_overrides(base, overrides)
        if reference:
            job_overrides, base = cli.sweep_jobs(overrides, [reference])
        if not resolve_dirs:
            return [Job(o, None, reference=i >= n_grid) for i, o in enumerate(job_overrides)], base
        composer = cli.JobComposer()
        jobs: list[Job] = []
        infos = {} if infos is None else infos
        known = set(infos)  # read by an earlier sweep, whose notes are printed already
        with _as_device(device):
            from eval.config import RunConfig

            for index, job_override in enumerate(job_overrides):
                try:
                    values = cli.run_values(composer.compose(job_override))
                    config = RunConfig.from_dict(values)
                    run_dir = config.output_dir()
                    if check:
                        check_job(config, infos)
                except Exception as error:  # noqa: BLE001  a job that cannot compose or run is listed, not fatal
                    jobs.append(Job(job_override, None, cli.first_line(error)))
                    continue
                jobs.append(Job(job_override, run_dir, values=values, reference=index >= n_grid))
    mark_duplicates(jobs)
    for key, info in infos.items():
        if key not in known and isinstance(info, str):
            print(f"note: model {info}; the methods' checks against its geometry were skipped", file=sys.stderr)
    return jobs, base


def mark_duplicates(jobs: list[Job]) -> None:
    """Each job whose run directory an earlier job has gets ``duplicate_of`` that job's index; the first carries
    the reference flag if any of them has it."""
    seen: dict[str, int] = {}
    for index, job in enumerate(jobs):
        job.duplicate_of = None
        if job.error or job.run_dir is None:
            continue
        first = seen.setdefault(str(job.run_dir), index)
        if first != index:
            job.duplicate_of = first
            jobs[first].reference |= job.reference


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
    return infos[key]


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


@dataclass
class Sweep:
    overrides: list[str]  # as given
    jobs: list[Job]
    base: Any  # the composed config without the swept keys


@dataclass
class Plan:
    """The jobs of one or more sweeps, listed in order: a run an earlier job (of any sweep) names is a duplicate."""

    sweeps: list[Sweep]
    jobs: list[Job]

    @property
    def runs(self) -> list[Job]:
        """The distinct runs that can run."""
        return [job for job in self.jobs if job.duplicate_of is None and not job.error]

    @property
    def failed(self) -> list[Job]:
        """The jobs that cannot run."""
        return [job for job in self.jobs if job.error]

    @property
    def errors(self) -> list[str]:
        return [f"{' '.join(job.overrides)}: {job.error}" for job in self.failed]


def plan(sweeps: list[list[str]], device: str | None) -> Plan:
    """Every sweep expanded (each model's geometry read once for all of them), their jobs listed together. With
    no ``device``, the run directories of a sweep whose launcher runs on GPU nodes are those the nodes compute."""
    expanded: list[Sweep] = []
    infos: dict[str, Any] = {}
    for overrides in sweeps:
        jobs, base = expand(overrides, device, infos=infos)
        if device is None and gpu_nodes(base) and not cuda_here():
            # The nodes hash their run directories with device cuda: a run done here on the CPU is another run.
            print("note: run directories as the launcher's GPU nodes compute them (--device cuda); "
                  "--device cpu for CPU nodes", file=sys.stderr)
            jobs, base = expand(overrides, "cuda", infos=infos)
        expanded.append(Sweep(overrides, jobs, base))
    together = [job for sweep in expanded for job in sweep.jobs]
    mark_duplicates(together)
    return Plan(expanded, together)


# ---------------------------------------------------------------------------------------------------------------
# The listing of a dry run


def launcher_summary(base, n_jobs: int, host: HostOptions | None = None) -> str:
    """How the launcher will run the ``n_jobs`` runs that are not done (done ones are never run)."""
    from omegaconf import OmegaConf

    launcher = base.hydra.launcher
    target = str(launcher.get("_target_", ""))
    if not n_jobs:
        return "launcher: nothing to submit (every run is done)"
    if "Slurm" not in target:
        if "Local" in target:
            return f"launcher: submitit local processes ({n_jobs} jobs)"
        host = host or HostOptions()
        return f"launcher: this host, {host.describe()} ({n_jobs} runs)"
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


def print_listing(jobs: list[Job], as_json: bool) -> None:
    for index, job in enumerate(jobs):
        if as_json:
            print(json.dumps({"index": index, "overrides": job.overrides, "run_dir": str(job.run_dir),
                              "status": job.status(), "error": job.error, "duplicate_of": job.duplicate_of}))
        elif job.error:
            print(f"[{index:4d}] error: {job.error}\n       {job.command()}")
        elif job.duplicate_of is not None:
            print(f"[{index:4d}] same run as [{job.duplicate_of}]: {job.run_dir}")
        else:
            print(f"[{index:4d}] {job.status():<12} {job.run_dir}\n       {job.command()}")


def bench_command(base) -> list[str] | None:
    """The latency driver's command line for an experiment with a ``bench`` block."""
    bench = base.get("bench")
    if not bench:
        return None
    experiment = base.hydra.runtime.choices.get("experiment") if "runtime" in base.hydra else None
    command = [sys.executable, str(REPO / bench.driver)]
    command += ["--experiment", experiment] if experiment else []
    return command


# ---------------------------------------------------------------------------------------------------------------
# This host's launcher: several runs at once, the most work first, within a deadline, resumably


@dataclass
class HostOptions:
    workers: int = 1  # runs at once, each in its own process with its own model
    shards: int = 1  # jobs each run left is split into (every shards-th sample)
    deadline_s: float | None = None  # seconds after which the workers are stopped

    def describe(self) -> str:
        text = f"{self.workers} worker process{'es' if self.workers != 1 else ''}"
        if self.shards > 1:
            text += f", each run in {self.shards} shards"
        if self.deadline_s is not None:
            text += f", stopped after {self.deadline_s:.0f} s"
        return text


def check_tasks(jobs: list[Job]) -> list[str]:
    """The one-line errors of the jobs' tasks' own checks, which need this host (their data, the packages they
    read, such as RULER's word lists), each distinct task once, before any worker loads a model."""
    from eval.tasks.base import build_task
    from icecache.errors import ConfigError

    errors, seen = [], set()
    here = Path.cwd()
    os.chdir(REPO)  # as a worker sees the task's paths
    try:
        for job in jobs:
            task = job.values.get("task") or {}
            name = json.dumps(task, sort_keys=True, default=str)
            if name in seen:
                continue
            seen.add(name)
            try:
                build_task(dict(task))
            except ConfigError as error:
                errors.append(f"task {task.get('name')}: {error}")
    finally:
        os.chdir(here)
    return errors


def restore(jobs: list[Job], curated: Path) -> int:
    """Put back the finished runs a curated file holds (``--curate``'s output) that are jobs of these sweeps and
    not finished on this disk: each gets its metrics.json, which marks it done and is all that curating and the
    tables read (its ``samples`` included: the paired differences of the runs still to come need the reference's),
    so a host that has lost the runs' directories (a fresh one) does not run them again. Returns how many it put
    back."""
    from eval.rundir import write_json_atomic

    try:
        payload = json.loads(curated.read_text(encoding="utf-8"))
        runs = payload["runs"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"error: --restore {curated}: not a curated result file ({error})") from None
    wanted = {str(job.run_dir): job for job in jobs if not job.is_done()}
    restored = 0
    for run in runs:
        job = wanted.pop(run.get("run_dir"), None)
        if job is None:
            continue
        job.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(job.path / "metrics.json", {k: v for k, v in run.items() if k != "run_dir"})
        restored += 1
    return restored


def order(job: Job) -> tuple:
    """Jobs of one task and length next to each other: a worker then reuses the samples it built."""
    task = job.values.get("task") or {}
    return (str(task.get("name")), json.dumps(task.get("lengths"), default=str))


def _samples_on_disk(job: Job) -> tuple[int, list[float]]:
    """(samples in the run's predictions files, its shards' included, and the seconds each took: its prefill plus
    its decode steps)."""
    from eval.rundir import run_records

    records = run_records(job.path) if job.path.is_dir() else {}
    seconds = []
    for record in records.values():
        gen = record.get("gen") or {}
        if gen.get("ttft_s") is not None:
            seconds.append(gen["ttft_s"] + (gen.get("tpot_s") or 0.0) * gen.get("new_tokens", 0))
    return len(records), seconds


def sharded(jobs: list[Job], n_shards: int) -> list[Job]:
    """Each job as ``n_shards`` jobs of the same run, next to each other in the order given: the run's samples
    shard, shard + n_shards, ... go to job ``shard``, so that the longest runs end in a fraction of their time
    (the runner merges the shards' files; a run's directory does not depend on its sharding)."""
    if n_shards == 1:
        return jobs
    return [dataclasses.replace(job, values={**job.values, "shard": shard, "n_shards": n_shards})
            for job in jobs for shard in range(n_shards)]


def longest_first(jobs: list[Job], evidence: list[Job] | None = None) -> list[Job]:
    """``jobs`` in the order a queue should hand them out: the most work left first, so that the runs that take
    longest do not start last and leave the other workers idle at the end (longest-processing-time scheduling).
    A job's work left is its samples left times the seconds a sample of its method at its lengths took, both read
    from the predictions on disk of ``evidence`` (default ``jobs``; pass the sweeps' finished runs too): a sample's
    time pooled over the method's runs (budgets pooled; any lengths of the method when none at these; every
    method's when the method has none), a run's sample count from a finished run of the same task settings (else
    the most any run of them holds, else the largest run of the task). Jobs with nothing to go on keep ``order``'s
    grouping, which every tie falls back to. The experiments' reference runs (the full cache the tables divide by)
    go before all others whatever their work: a call that ends at its deadline then leaves every finished run its
    "% of full", and a reference run is among the cheapest of a grid."""
    runs = {str(job.run_dir): job for job in [*(evidence or []), *jobs]}  # each run once
    on_disk = {run_dir: _samples_on_disk(job) for run_dir, job in runs.items()}

    def method(job: Job) -> str | None:
        return (job.values.get("method") or {}).get("name")

    def settings(job: Job) -> str:
        return json.dumps(job.values.get("task"), sort_keys=True, default=str)

    by_method_length: dict[tuple, list[float]] = {}
    by_method: dict[Any, list[float]] = {}
    every: list[float] = []
    finished_size: dict[str, int] = {}  # task settings -> samples of a finished run
    largest_size: dict[str, int] = {}  # task settings -> the most samples any run of them holds
    for run_dir, job in runs.items():
        count, seconds = on_disk[run_dir]
        by_method_length.setdefault((method(job), order(job)[1]), []).extend(seconds)
        by_method.setdefault(method(job), []).extend(seconds)
        every.extend(seconds)
        if job.is_done():
            finished_size[settings(job)] = max(finished_size.get(settings(job), 0), count)
        largest_size[settings(job)] = max(largest_size.get(settings(job), 0), count)
    task_size: dict[str, int] = {}  # task name -> its largest run size, for task settings with no samples yet
    for job in runs.values():
        size = finished_size.get(settings(job)) or largest_size[settings(job)]
        task_size[order(job)[0]] = max(task_size.get(order(job)[0], 0), size)

    def work_left(job: Job) -> float:
        samples = by_method_length[method(job), order(job)[1]] or by_method[method(job)] or every
        if not samples:
            return 0.0
        total = (finished_size.get(settings(job)) or largest_size[settings(job)] or task_size[order(job)[0]]
                 or 1)
        return max(total - on_disk[str(job.run_dir)][0], 1) * sum(samples) / len(samples)

    ordered = sorted(jobs, key=order)  # the grouping first; a stable sort keeps it among equals
    return sorted(ordered, key=lambda job: (job.reference, work_left(job)), reverse=True)


def is_device_fault(error: BaseException) -> bool:
    """A CUDA error (an illegal address, a failed launch) is sticky: every later CUDA call of the process fails with
    it, and it may have been raised by a kernel of the job before, surfacing at this one's first synchronisation."""
    return type(error).__name__ == "AcceleratorError" or "CUDA error" in str(error)


def is_out_of_memory(error: BaseException) -> bool:
    """The GPU's memory ran out. Not sticky, and where jobs share the GPU often not the job's own doing: its
    neighbours' caches held the memory at that moment."""
    return type(error).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(error)


def release_device_memory() -> None:
    """Give the GPU memory this process caches but no longer uses back to the device, so that the jobs sharing the
    GPU see it: a worker's cache otherwise keeps the peak of every run it served."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def run_job(values: dict[str, Any]) -> None:
    from eval.config import RunConfig
    from eval.runner import run

    run(RunConfig.from_dict(values))


def worker(jobs: "mp.Queue", results: "mp.Queue", threads: int | None, run=run_job, first: Job | None = None) -> None:
    """One process: runs ``first`` if given, then jobs from ``jobs`` until it is empty, reporting each as (key,
    error or None, what failed: None, "fault" or "memory"). After a device fault it reports and exits: the driver
    starts a fresh process."""
    os.chdir(REPO)  # run directories are relative to the repository, as for run.py
    from icecache.errors import ConfigError

    while True:
        if first is not None:
            job, first = first, None
        else:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
        values = dict(job.values)
        if threads is not None and values.get("threads") is None:
            values["threads"] = threads  # not part of a run's identity: the directory stays the same
        try:
            run(values)
            outcome = (job.key, None, None)
        except ConfigError as error:
            outcome = (job.key, str(error), None)
        except Exception as error:  # noqa: BLE001  one job's failure (out of memory, a bug) must not stop the others
            traceback.print_exc()
            kind = "fault" if is_device_fault(error) else "memory" if is_out_of_memory(error) else None
            outcome = (job.key, f"{type(error).__name__}: {error}", kind)
        if outcome[2] == "fault":
            results.put(outcome)
            return
        release_device_memory()  # here, not in the handler: the handled error's frames hold the run's tensors there
        results.put(outcome)


def run_all(jobs: list[Job], workers: int, deadline_s: float | None, run=run_job) -> tuple[int, list[str]]:
    """(jobs finished in this call, their errors); hands ``jobs`` out in their order and stops the workers at the
    deadline. A job that ends in a device fault is run once more in a fresh process (the fault may be the job
    before's); a second fault is its error. A job that runs out of GPU memory is run once more after every other
    job has ended, in one process alone on the GPU (its neighbours' memory may have been the cause); a second time
    is its error. Either retry resumes from the samples the first attempt saved."""
    if deadline_s is not None and deadline_s <= 0:
        return 0, []
    context = mp.get_context("spawn")  # CUDA does not survive a fork
    pending: mp.Queue = context.Queue()
    for job in jobs:  # in the order given (run_here: longest_first)
        pending.put(job)
    results: mp.Queue = context.Queue()
    threads = max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None
    by_key = {job.key: job for job in jobs}
    retried: set[str] = set()  # run again after a device fault
    deferred: list[str] = []  # out of GPU memory once: to run again, alone, once the others have ended
    retried_memory: set[str] = set()
    processes: list = []

    def start_worker(first: Job | None = None) -> None:
        process = context.Process(target=worker, args=(pending, results, threads, run, first), daemon=True)
        process.start()
        processes.append(process)

    for _ in range(min(workers, len(jobs))):
        start_worker()

    def stop(signum, frame):  # a kill of the driver (SIGTERM) stops its workers too, through the finally below
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    start, finished, errors = time.monotonic(), 0, []
    try:
        while finished + len(errors) < len(jobs):
            left = None if deadline_s is None else deadline_s - (time.monotonic() - start)
            if left is not None and left <= 0:
                print(f"deadline of {deadline_s:.0f} s reached: stopping the workers; the next call resumes",
                      flush=True)
                break
            only_deferred_left = bool(deferred) and finished + len(errors) + len(deferred) == len(jobs)
            if only_deferred_left and not any(p.is_alive() for p in processes):
                for name in deferred:
                    pending.put(by_key[name])
                print(f"running {len(deferred)} job(s) that ran out of GPU memory again, one at a time", flush=True)
                deferred.clear()
                start_worker()
            try:
                name, error, failure = results.get(timeout=min(5.0, left) if left is not None else 5.0)
            except queue.Empty:
                if not only_deferred_left and not any(p.is_alive() for p in processes):
                    break  # a worker died (killed for host memory, say) and nothing more will come
                continue
            if failure == "memory" and name not in retried_memory:
                retried_memory.add(name)
                deferred.append(name)
                print(f"out of GPU memory in {name}: it runs again when the other jobs have ended", flush=True)
                continue
            if failure == "fault":
                # The faulted worker has exited, its CUDA context with it. Its replacement starts with the job
                # (once), ahead of the queue, so that a retry is not left behind long jobs by a deadline.
                if name not in retried:
                    retried.add(name)
                    start_worker(first=by_key[name])
                    print(f"device fault in {name}: running it again in a fresh process", flush=True)
                    continue
                start_worker()
            if error:
                errors.append(f"{name}: {error}")
                print(f"error: {name}: {error}", file=sys.stderr, flush=True)
            else:
                finished += 1
                print(f"done {finished}/{len(jobs)}: {name}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for process in processes:
            if process.is_alive():
                process.terminate()  # samples are fsynced as they finish; a torn last line is dropped on resume
        for process in processes:
            process.join(timeout=30)
    return finished, errors


def run_here(runs: list[Job], host: HostOptions) -> int:
    """The runs not done, on this host: 0 when every run is done, 2 when a task cannot run here or a job failed,
    3 when the deadline came first."""
    todo = longest_first([job for job in runs if not job.is_done()], evidence=runs)
    print(f"{len(runs)} distinct runs: {len(runs) - len(todo)} done, {len(todo)} to run", flush=True)
    if not todo:
        return 0
    task_errors = check_tasks(todo)
    for error in task_errors:
        print(f"error: {error}", file=sys.stderr)
    if task_errors:
        return 2
    _, failed = run_all(sharded(todo, host.shards), host.workers, host.deadline_s)
    if failed:
        return 2
    return 3 if any(not job.is_done() for job in todo) else 0


# ---------------------------------------------------------------------------------------------------------------
# Curation: the finished runs of the sweeps as one result file per model, and its figures


def curated_json(payload: dict[str, Any]) -> str:
    """A curated file's text: JSON with sorted keys, one space an indent level, but each run's samples one a line,
    so that a file of thousands of samples stays a few MB (a GPU host takes the working tree with it) and a sample
    is found with grep."""
    runs, held = [], {}
    for i, run in enumerate(payload.get("runs", [])):
        if isinstance(run, dict) and isinstance(run.get("samples"), list) and run["samples"]:
            mark = f"@samples of run {i}@"
            held[json.dumps(mark)] = run["samples"]
            run = {**run, "samples": mark}
        runs.append(run)
    text = json.dumps({**payload, "runs": runs}, indent=1, sort_keys=True, default=str)
    for mark, samples in held.items():
        lines = ",\n".join("    " + json.dumps(sample, sort_keys=True, separators=(",", ":"), default=str)
                           for sample in samples)
        text = text.replace(mark, "[\n" + lines + "\n   ]", 1)
    return text


def curate(jobs: list[Job], sweeps: list[list[str]], name: str, out: Path, bench: Path | None,
           plots: bool = True) -> list[Path]:
    """One result file per model of the sweeps' finished runs, and its figures."""
    from eval import provenance
    from eval.report import accuracy as A
    from eval.report.collect import reference_bench_rows, safe_name
    from eval.report.paired import attach_paired, attach_samples
    from eval.report.summary import accuracy_figures

    by_model: dict[str, dict[str, list]] = {}
    paths = {str(job.run_dir): job.path for job in jobs}
    for job in jobs:
        model = job.values["model"]["name"]
        entry = by_model.setdefault(model, {"runs": [], "missing": []})
        if job.is_done():
            payload = json.loads((job.path / "metrics.json").read_text(encoding="utf-8"))
            payload["run_dir"] = str(job.run_dir)
            entry["runs"].append(payload)
        else:
            entry["missing"].append(str(job.run_dir))
    for entry in by_model.values():
        # each run's samples go into the file, so that a later host without this disk still pairs with them
        attach_samples(entry["runs"], lambda payload: paths[payload["run_dir"]])
        attach_paired(entry["runs"], lambda payload: paths[payload["run_dir"]])
    out.mkdir(parents=True, exist_ok=True)
    bench_rows = reference_bench_rows(bench) if bench is not None else []
    written = []
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for model, entry in sorted(by_model.items()):
        stem = f"{name}_{safe_name(model)}"
        path = out / f"{stem}_{stamp}.json"
        figures: list[Path] = []
        if plots and entry["runs"]:
            import matplotlib

            matplotlib.use("Agg")
            rows = A.accuracy_rows(entry["runs"])
            # a curated file of another kind (a diagnostic grid) draws its figures under its own name
            prefix = "" if name == "accuracy" else f"{name}_"
            for figure in accuracy_figures(rows, bench_rows, out, prefix=prefix):
                if figure.suffix == ".png":
                    figures.append(figure)
                else:
                    figure.unlink()  # the PNG is what the page shows; collect.py writes both
        payload = {"kind": name, "model": model, "sweeps": [" ".join(s) for s in sweeps],
                   "n_runs": len(entry["runs"]), "missing": entry["missing"], "runs": entry["runs"],
                   "provenance": provenance.collect()}
        if figures:  # the page names these beside the file's table, not another file's figures of the model
            payload["figures"] = [figure.name for figure in figures]
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(curated_json(payload), encoding="utf-8")
        tmp.replace(path)
        written += [path, *figures]
        print(f"wrote {path}: {len(entry['runs'])} finished run(s), {len(entry['missing'])} not finished")
    return written


# ---------------------------------------------------------------------------------------------------------------
# Submitit launches (hydra/launcher=slurm, slurm_local): the runs that are not done, as one job array, through
# hydra-submitit-launcher's launcher object, then a report of every task from its own outcome


def is_submitit(base) -> bool:
    return cli.is_submitit_launcher(base)


def launch_submitit(overrides: list[str], todo: list[Job], n_done: int) -> int:
    """Submit ``todo`` as one array with the configured submitit launcher, wait for every task, report each
    (eval/cli.py: the same report as ``run.py -m``'s): 0 when all finished, 2 when some stopped with an error
    line, 1 when one crashed or vanished."""
    # Relative paths (output_root, the sweep dir) mean the same on the nodes as here: tasks start in the folder
    # sbatch was called from, which is the repository, as the run directories listed here are. That folder also
    # makes eval importable there (submitit starts each task with python -m), so the task function goes by
    # reference.
    os.chdir(REPO)
    launcher, cfg = cli.multirun_launcher(overrides, cli.run_task)
    return cli.launch_submitit(launcher, cfg, [cli.task_overrides(job.overrides) for job in todo], skipped=n_done)


def submit(sweep: Sweep, runs: list[Job]) -> int:
    """The sweep's runs that are not done, through its submitit launcher."""
    cli.check_launcher(sweep.base)
    todo = [job for job in runs if not job.is_done()]
    if not todo:
        print(f"all {len(runs)} runs of the sweep are done; nothing to submit")
        return 0
    return launch_submitit(normalise_overrides(sweep.overrides), todo, len(runs) - len(todo))


# ---------------------------------------------------------------------------------------------------------------
# The command line (scripts/sweep.py)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="scripts/sweep.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of one sweep, as for run.py -m")
    parser.add_argument("--sweep", action="append", default=[], metavar="OVERRIDES",
                        help="the overrides of another sweep, quoted as one argument (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="list the jobs and the launch; run nothing")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="compute run directories as on a host with this device (default: this machine)")
    parser.add_argument("--json", action="store_true", help="with --dry-run: print the jobs as JSON lines")
    parser.add_argument("--strict", action="store_true", help="with --dry-run: exit 2 if any job cannot run")
    here = parser.add_argument_group("this host's launcher (hydra/launcher=local)")
    here.add_argument("--workers", type=int, default=1, help="runs at once (each its own process and model)")
    here.add_argument("--shards", type=int, default=1, metavar="N",
                      help="split every run left into N jobs, each with every N-th sample, so that the longest "
                           "runs do not hold the end of the call (default 1)")
    here.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                      help="seconds after which the workers are stopped (the next call resumes)")
    curation = parser.add_argument_group("results")
    curation.add_argument("--restore", type=Path, metavar="CURATED", action="append", default=[],
                          help="first put back the finished runs of this curated file that the sweeps name and "
                               "this disk lacks (their metrics.json), so that they are not run again (repeatable)")
    curation.add_argument("--no-run", action="store_true", help="run nothing (with --curate: curate only)")
    curation.add_argument("--curate", metavar="NAME", help="write <out>/<NAME>_<model>_<date>.json and its figures")
    curation.add_argument("--out", type=Path, default=REPO / "results" / "bench", help="folder of the curated file")
    curation.add_argument("--bench", type=Path, default=REPO / "results" / "bench",
                          help="latency_*.json folder for the TPOT figure")
    curation.add_argument("--no-plots", action="store_true", help="with --curate: the file alone")
    args = parser.parse_intermixed_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.shards < 1:
        parser.error("--shards must be at least 1")
    return args, parser


def run_driver(sweep: Sweep, driver: list[str], dry_run: bool) -> int:
    """An experiment with a ``bench`` block runs through its own driver, which takes its own options."""
    extra = [o for o in sweep.overrides if not o.split("=", 1)[0].lstrip("+") == "experiment"]
    if extra:
        print(f"note: {sweep.base.bench.driver} takes its own options; ignoring {' '.join(extra)}", file=sys.stderr)
    print("this experiment runs through its driver:\n  " + " ".join(shlex.quote(c) for c in driver))
    if dry_run:
        return 0
    return subprocess.call(driver, cwd=REPO)


def main(argv: list[str] | None = None) -> int:
    args, parser = parse_args(argv)
    sweeps = ([args.overrides] if args.overrides or not args.sweep else []) + [shlex.split(s) for s in args.sweep]
    for overrides in sweeps:
        # Syntax and choices here; every job is composed and checked by expand (a job that fails is listed).
        cli.check_syntax([o.replace("+experiment=", "experiment=") for o in overrides])
    try:
        planned = plan(sweeps, args.device)
    except Exception as error:  # noqa: BLE001  a sweep itself does not compose (not one of its jobs)
        cli.fail(f"bad override: {cli.first_line(error)}")

    drivers = [(sweep, bench_command(sweep.base)) for sweep in planned.sweeps]
    drivers = [(sweep, command) for sweep, command in drivers if command is not None]
    if drivers:
        if len(planned.sweeps) > 1:
            cli.fail(f"{' '.join(drivers[0][0].overrides)} runs through its driver: give it as the only sweep")
        return run_driver(*drivers[0], args.dry_run)

    base = planned.sweeps[0].base
    host = None if is_submitit(base) else HostOptions(args.workers, args.shards, args.deadline)
    if any(is_submitit(sweep.base) for sweep in planned.sweeps) and len(planned.sweeps) > 1:
        cli.fail("several sweeps at once run on this host (hydra/launcher=local); submit each sweep by itself")
    if host is None and (args.workers != 1 or args.shards != 1 or args.deadline is not None):
        parser.error("--workers, --shards and --deadline are this host's launcher's (hydra/launcher=local)")

    for curated in args.restore:
        print(f"{restore(planned.runs, curated)} finished run(s) put back from {curated}", flush=True)
    runs, failed = planned.runs, planned.failed
    if args.dry_run:
        print_listing(planned.jobs, args.json)
        if not args.json:
            done = sum(job.is_done() for job in runs)
            print(f"{len(planned.jobs)} jobs: {len(runs)} distinct runs ({done} done), "
                  f"{len(planned.jobs) - len(runs) - len(failed)} duplicates, {len(failed)} that cannot run (error)")
            print(launcher_summary(base, len(runs) - done, host))
        return 2 if failed and args.strict else 0

    if failed and not args.no_run:
        cli.fail(f"{len(failed)} of the sweep's {len(planned.jobs)} jobs cannot run; the first, "
                 f"{' '.join(failed[0].overrides)}: {failed[0].error} (--dry-run lists them all)")
    for error in planned.errors:
        print(f"error: {error}", file=sys.stderr)
    code = 0
    if not args.no_run:
        code = run_here(runs, host) if host is not None else submit(planned.sweeps[0], runs)
    if args.curate:
        curate(runs, sweeps, args.curate, args.out, args.bench, plots=not args.no_plots)
    left = [job for job in runs if not job.is_done()]
    if left:
        print(f"{len(left)} run(s) not finished: call again with the same sweeps to resume")
    if not args.no_run:
        print(cli.collect_hint(list(dict.fromkeys(str(job.values["output_root"]) for job in runs if job.values))))
    return code or (2 if failed else 0)
