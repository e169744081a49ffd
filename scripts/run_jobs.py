#!/usr/bin/env python
"""Run the jobs of one or more sweeps on this host, several at once, within a deadline, resumably; and curate the
finished runs into one result file.

    python scripts/run_jobs.py --sweep "experiment=accuracy_passkey" --sweep "experiment=accuracy_ruler" --workers 4
    python scripts/run_jobs.py --sweep "experiment=accuracy_ruler model=qwen25_coder_05b" --deadline 540
    python scripts/run_jobs.py --sweep "experiment=accuracy_passkey" --dry-run         # what is done, what is not
    python scripts/run_jobs.py --sweep "experiment=accuracy_passkey" --sweep "experiment=accuracy_ruler" \\
        --no-run --curate accuracy --out results/bench                                # the result file alone

A sweep is what ``python scripts/sweep.py <overrides>`` expands (the experiment's grid and its reference runs;
duplicates once). Jobs already done are skipped; the others go to ``--workers`` processes, the most work left
first (samples left times a sample's time, both read from the runs on disk: ``longest_first``; ties grouped by task
and length), each of which runs them one after another with the runner (which keeps the model, its tokenizer and
the built samples between the jobs of a process). Every sample is on disk when it is finished, so a deadline or a kill
loses at most the samples in flight: at ``--deadline`` seconds the workers are stopped and the next call resumes
(exit status 3: time ran out with jobs left; 0: every job done; 2: a job cannot run). ``--shards N`` splits each
run left into N jobs of every N-th sample (the runner's ``n_shards``), so that a slow method's run is spread over
several workers instead of setting the end of the call; a later call may shard differently without losing or
repeating a sample.

``--restore CURATED`` first puts back the finished runs of an earlier curated file (their metrics.json), so that
a host without the runs' directories skips them, and curating carries them into the next file.

``--curate NAME`` then writes ``<out>/<NAME>_<model>_<date>.json``: every finished run of the sweeps (its
metrics.json and directory, and where its predictions and the full cache's over the same samples are on disk, its
paired difference with the full cache: eval/report/paired.py), the runs not finished, the sweeps and
this machine's provenance, with the accuracy
table's figures beside it (``accuracy_vs_budget_<model>.png``, ``accuracy_vs_tpot_<model>.png`` with TPOT from the
latency files in ``--bench``, ``mass_by_layer_<model>.png``). scripts/bench_tables.py renders BENCHMARKS.md's
accuracy table from that file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import queue
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def expand(sweeps: list[list[str]], device: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """The distinct jobs of the sweeps as ``{"overrides", "run_dir", "values"}`` (values: the run's settings, for
    ``RunConfig.from_dict``), and the one-line errors of the jobs that cannot run."""
    import sweep

    jobs: list[dict[str, Any]] = []
    errors: list[str] = []
    seen: dict[str, dict[str, Any]] = {}
    infos: dict[str, Any] = {}  # each model's geometry, read once for all the sweeps
    for overrides in sweeps:
        expanded, _ = sweep.expand(overrides, device, infos=infos)
        for job in expanded:
            if job.error:
                errors.append(f"{' '.join(job.overrides)}: {job.error}")
                continue
            if job.duplicate_of is not None:
                continue  # its first listing carries its reference flag too
            if str(job.run_dir) in seen:  # the same run in another sweep: a reference run if either says so
                seen[str(job.run_dir)]["reference"] |= job.reference
                continue
            entry = {"overrides": job.overrides, "run_dir": str(job.run_dir), "values": job.values,
                     "reference": job.reference}
            seen[entry["run_dir"]] = entry
            jobs.append(entry)
    return jobs, errors


def check_tasks(jobs: list[dict[str, Any]]) -> list[str]:
    """The one-line errors of the jobs' tasks' own checks, which need this host (their data, the packages they
    read, such as RULER's word lists), each distinct task once, before any worker loads a model."""
    from eval.tasks.base import build_task
    from icecache.errors import ConfigError

    errors, seen = [], set()
    here = Path.cwd()
    os.chdir(REPO)  # as a worker sees the task's paths
    try:
        for job in jobs:
            task = job["values"].get("task") or {}
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


def is_done(job: dict[str, Any]) -> bool:
    return (resolve(job["run_dir"]) / "metrics.json").exists()


def restore(jobs: list[dict[str, Any]], curated: Path) -> int:
    """Put back the finished runs a curated file holds (``--curate``'s output) that are jobs of these sweeps and
    not finished on this disk: each gets its metrics.json, which marks it done and is all that curating and the
    tables read, so a host that has lost the runs' directories (a fresh one) does not run them again. Returns how
    many it put back."""
    from eval.runner import write_json_atomic

    try:
        payload = json.loads(curated.read_text(encoding="utf-8"))
        runs = payload["runs"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"error: --restore {curated}: not a curated result file ({error})") from None
    wanted = {job["run_dir"]: job for job in jobs if not is_done(job)}
    restored = 0
    for run in runs:
        job = wanted.pop(run.get("run_dir"), None)
        if job is None:
            continue
        target = resolve(job["run_dir"])
        target.mkdir(parents=True, exist_ok=True)
        write_json_atomic(target / "metrics.json", {k: v for k, v in run.items() if k != "run_dir"})
        restored += 1
    return restored


def resolve(run_dir: str) -> Path:
    path = Path(run_dir)
    return path if path.is_absolute() else REPO / path


def order(job: dict[str, Any]) -> tuple:
    """Jobs of one task and length next to each other: a worker then reuses the samples it built."""
    task = job["values"].get("task") or {}
    return (str(task.get("name")), json.dumps(task.get("lengths"), default=str))


def _samples_on_disk(job: dict[str, Any]) -> tuple[int, list[float]]:
    """(samples in the run's predictions files, its shards' included, and the seconds each took: its prefill plus
    its decode steps)."""
    from eval.runner import run_records

    directory = resolve(job["run_dir"])
    records = run_records(directory) if directory.is_dir() else {}
    seconds = []
    for record in records.values():
        gen = record.get("gen") or {}
        if gen.get("ttft_s") is not None:
            seconds.append(gen["ttft_s"] + (gen.get("tpot_s") or 0.0) * gen.get("new_tokens", 0))
    return len(records), seconds


def sharded(jobs: list[dict[str, Any]], n_shards: int) -> list[dict[str, Any]]:
    """Each job as ``n_shards`` jobs of the same run, next to each other in the order given: the run's samples
    shard, shard + n_shards, ... go to job ``shard``, so that the longest runs end in a fraction of their time
    (the runner merges the shards' files; a run's directory does not depend on its sharding)."""
    if n_shards == 1:
        return jobs
    return [{**job, "key": f"{job['run_dir']}#{shard + 1}/{n_shards}",
             "values": {**job["values"], "shard": shard, "n_shards": n_shards}}
            for job in jobs for shard in range(n_shards)]


def key(job: dict[str, Any]) -> str:
    """A job's name in the queue: its run directory, and its shard when the run is sharded."""
    return job.get("key", job["run_dir"])


def longest_first(jobs: list[dict[str, Any]], evidence: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``jobs`` in the order a queue should hand them out: the most work left first, so that the runs that take
    longest do not start last and leave the other workers idle at the end (longest-processing-time scheduling).
    A job's work left is its samples left times the seconds a sample of its method at its lengths took, both read
    from the predictions on disk of ``evidence`` (default ``jobs``; pass the sweeps' finished runs too): a sample's
    time pooled over the method's runs (budgets pooled; any lengths of the method when none at these; every
    method's when the method has none), a run's sample count from a finished run of the same task settings (else
    the most any run of them holds, else the largest run of the task). Jobs with nothing to go on keep ``order``'s
    grouping, which every tie falls back to. The experiments' reference runs (``"reference": True``, the full cache
    the tables divide by) go before all others whatever their work: a call that ends at its deadline then leaves
    every finished run its "% of full", and a reference run is among the cheapest of a grid."""
    runs = {job["run_dir"]: job for job in [*(evidence or []), *jobs]}  # each run once
    on_disk = {run_dir: _samples_on_disk(job) for run_dir, job in runs.items()}

    def method(job) -> str | None:
        return (job["values"].get("method") or {}).get("name")

    def settings(job) -> str:
        return json.dumps(job["values"].get("task"), sort_keys=True, default=str)

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
        if is_done(job):
            finished_size[settings(job)] = max(finished_size.get(settings(job), 0), count)
        largest_size[settings(job)] = max(largest_size.get(settings(job), 0), count)
    task_size: dict[str, int] = {}  # task name -> its largest run size, for task settings with no samples yet
    for job in runs.values():
        size = finished_size.get(settings(job)) or largest_size[settings(job)]
        task_size[order(job)[0]] = max(task_size.get(order(job)[0], 0), size)

    def work_left(job) -> float:
        samples = by_method_length[method(job), order(job)[1]] or by_method[method(job)] or every
        if not samples:
            return 0.0
        total = (finished_size.get(settings(job)) or largest_size[settings(job)] or task_size[order(job)[0]]
                 or 1)
        return max(total - on_disk[job["run_dir"]][0], 1) * sum(samples) / len(samples)

    ordered = sorted(jobs, key=order)  # the grouping first; a stable sort keeps it among equals
    return sorted(ordered, key=lambda job: (bool(job.get("reference")), work_left(job)), reverse=True)


def is_device_fault(error: BaseException) -> bool:
    """A CUDA error (an illegal address, a failed launch) is sticky: every later CUDA call of the process fails with
    it, and it may have been raised by a kernel of the job before, surfacing at this one's first synchronisation."""
    return type(error).__name__ == "AcceleratorError" or "CUDA error" in str(error)


def run_job(values: dict[str, Any]) -> None:
    from eval.runner import RunConfig, run

    run(RunConfig.from_dict(values))


def worker(jobs: "mp.Queue", results: "mp.Queue", threads: int | None, run=run_job,
           first: dict[str, Any] | None = None) -> None:
    """One process: runs ``first`` if given, then jobs from ``jobs`` until it is empty, reporting each as (run_dir,
    error or None, whether the error is a device fault). After a device fault it reports and exits: the driver
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
        values = dict(job["values"])
        if threads is not None and values.get("threads") is None:
            values["threads"] = threads  # not part of a run's identity: the directory stays the same
        try:
            run(values)
            results.put((key(job), None, False))
        except ConfigError as error:
            results.put((key(job), str(error), False))
        except Exception as error:  # noqa: BLE001  one job's failure (out of memory, a bug) must not stop the others
            traceback.print_exc()
            fault = is_device_fault(error)
            results.put((key(job), f"{type(error).__name__}: {error}", fault))
            if fault:
                return


def run_all(jobs: list[dict[str, Any]], workers: int, deadline_s: float | None,
            run=run_job) -> tuple[int, list[str]]:
    """(jobs finished in this call, their errors); hands ``jobs`` out in their order and stops the workers at the
    deadline. A job that ends in a device fault is run once more in a fresh process (the fault may be the job
    before's); a second fault is its error."""
    if deadline_s is not None and deadline_s <= 0:
        return 0, []
    context = mp.get_context("spawn")  # CUDA does not survive a fork
    pending: mp.Queue = context.Queue()
    for job in jobs:  # in the order given (main: longest_first)
        pending.put(job)
    results: mp.Queue = context.Queue()
    threads = max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None
    by_key = {key(job): job for job in jobs}
    retried: set[str] = set()
    processes: list = []

    def start_worker(first: dict[str, Any] | None = None) -> None:
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
            try:
                name, error, fault = results.get(timeout=min(5.0, left) if left is not None else 5.0)
            except queue.Empty:
                if not any(p.is_alive() for p in processes):
                    break  # a worker died (out of memory, say) and nothing more will come
                continue
            if fault:
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


def curate(jobs: list[dict[str, Any]], sweeps: list[list[str]], name: str, out: Path, bench: Path | None,
           plots: bool = True) -> list[Path]:
    """One result file per model of the sweeps' finished runs, and its figures."""
    from eval import provenance
    from eval.report import accuracy as A
    from eval.report.collect import latest_bench, load_bench, safe_name
    from eval.report.paired import attach_paired
    from eval.report.summary import accuracy_figures

    by_model: dict[str, dict[str, list]] = {}
    for job in jobs:
        path = resolve(job["run_dir"]) / "metrics.json"
        model = job["values"]["model"]["name"]
        entry = by_model.setdefault(model, {"runs": [], "missing": []})
        if path.exists():
            payload = json.loads(path.read_text(encoding="utf-8"))
            payload["run_dir"] = job["run_dir"]
            entry["runs"].append(payload)
        else:
            entry["missing"].append(job["run_dir"])
    for entry in by_model.values():
        attach_paired(entry["runs"], lambda payload: resolve(payload["run_dir"]))
    out.mkdir(parents=True, exist_ok=True)
    bench_rows = []
    if bench is not None and bench.exists():
        frame = latest_bench(load_bench(bench))
        bench_rows = frame.to_dict("records") if not frame.empty else []
    written = []
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for model, entry in sorted(by_model.items()):
        stem = f"{name}_{safe_name(model)}"
        path = out / f"{stem}_{stamp}.json"
        payload = {"kind": name, "model": model, "sweeps": [" ".join(s) for s in sweeps],
                   "n_runs": len(entry["runs"]), "missing": entry["missing"], "runs": entry["runs"],
                   "provenance": provenance.collect()}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str), encoding="utf-8")
        tmp.replace(path)
        written.append(path)
        print(f"wrote {path}: {len(entry['runs'])} finished run(s), {len(entry['missing'])} not finished")
        if plots and entry["runs"]:
            import matplotlib

            matplotlib.use("Agg")
            rows = A.accuracy_rows(entry["runs"])
            for figure in accuracy_figures(rows, bench_rows, out):
                if figure.suffix == ".png":
                    written.append(figure)
                else:
                    figure.unlink()  # the PNG is what the page shows; collect.py writes both
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="append", required=True, metavar="OVERRIDES",
                        help="the overrides of one sweep, as for scripts/sweep.py (repeatable)")
    parser.add_argument("--workers", type=int, default=1, help="jobs at once (each its own process and model)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds after which the workers are stopped")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="compute run directories as on a host with this device (default: this machine)")
    parser.add_argument("--dry-run", action="store_true", help="list the jobs and their status; run nothing")
    parser.add_argument("--no-run", action="store_true", help="run nothing (with --curate: curate only)")
    parser.add_argument("--curate", metavar="NAME", help="write <out>/<NAME>_<model>_<date>.json and its figures")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "bench", help="folder of the curated file")
    parser.add_argument("--bench", type=Path, default=REPO / "results" / "bench",
                        help="latency_*.json folder for the TPOT figure")
    parser.add_argument("--no-plots", action="store_true", help="with --curate: the file alone")
    parser.add_argument("--shards", type=int, default=1, metavar="N",
                        help="split every run left into N jobs, each with every N-th sample, so that the longest "
                             "runs do not hold the end of the call (default 1)")
    parser.add_argument("--restore", type=Path, metavar="CURATED", action="append", default=[],
                        help="first put back the finished runs of this curated file that the sweeps name and this "
                             "disk lacks (their metrics.json), so that they are not run again (repeatable)")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.shards < 1:
        parser.error("--shards must be at least 1")
    sweeps = [shlex.split(s) for s in args.sweep]
    jobs, errors = expand(sweeps, args.device)
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    for curated in args.restore:
        print(f"{restore(jobs, curated)} finished run(s) put back from {curated}", flush=True)
    todo = longest_first([job for job in jobs if not is_done(job)], evidence=jobs)
    print(f"{len(jobs)} distinct runs: {len(jobs) - len(todo)} done, {len(todo)} to run"
          + (f", {len(errors)} that cannot run" if errors else ""), flush=True)
    if args.dry_run:
        for job in jobs:
            print(f"{'done' if is_done(job) else 'todo':<5} {job['run_dir']}")
        return 2 if errors else 0
    if errors and not args.no_run:
        return 2
    if todo and not args.no_run:
        task_errors = check_tasks(todo)
        for error in task_errors:
            print(f"error: {error}", file=sys.stderr)
        if task_errors:
            return 2
    failed: list[str] = []
    if todo and not args.no_run:
        _, failed = run_all(sharded(todo, args.shards), args.workers, args.deadline)
    if args.curate:
        curate(jobs, sweeps, args.curate, args.out, args.bench, plots=not args.no_plots)
    left = [job for job in jobs if not is_done(job)]
    if left:
        print(f"{len(left)} run(s) not finished: call again with the same sweeps to resume")
    return 2 if failed or errors else (3 if left and not args.no_run else 0)


if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    sys.exit(main())
