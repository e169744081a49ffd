"""What ``run.py`` does before and around Hydra: the command line split into overrides and Hydra's flags, the
overrides checked (syntax, config choices, keys, run settings) before any work, a sweep's jobs composed and
checked, the launcher checked, and the Hydra main that runs a job and reports a sweep's failed jobs.

Bad input stops with one line starting ``error:`` and exit code 2. Under ``-m`` every job of the sweep is composed
and checked first; a job that still fails while the sweep runs prints its line and the others go on. Whichever
launcher runs the jobs (local, slurm, slurm_local), each job's outcome comes back in the JobReturn the launcher
hands over, and the sweep ends with one report of the jobs that did not finish, their logs and exit status 2
(1 when one crashed): the same report as scripts/sweep.py's.

The few Hydra internals this needs (no public API does the same) are in one section at the end of this file.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import eval.plugins  # noqa: F401  the registries, and the method defaults that configs/method/*.yaml start from

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIG_NAME = "config"
GROUPS = ("model", "method", "task", "experiment")
SWEEP_LEVEL_KEYS = ("experiment", "reference_runs", "bench")  # sweep settings, not run settings
# Hydra's command-line flags that take a value (``--cfg job``), and the values --info may take.
FLAGS_WITH_VALUE = frozenset({"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                              "--config-dir", "-cd", "--experimental-rerun"})
INFO_FLAGS, INFO_VALUES = frozenset({"--info", "-i"}), frozenset(
    {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"})
MULTIRUN_FLAGS = frozenset({"-m", "--multirun"})
# Flags after which Hydra prints something and runs no job: the overrides must compose, no more.
NO_JOB_FLAGS = frozenset({"--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help", "--version",
                          "--shell-completion", "-sc"})
HYDRA_FLAGS = FLAGS_WITH_VALUE | INFO_FLAGS | MULTIRUN_FLAGS | NO_JOB_FLAGS | {"--resolve", "--run", "-r"}


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, Hydra flags with their values): ``--cfg job`` is a flag and its value, not an override."""
    overrides, flags = [], []
    index = 0
    while index < len(argv):
        arg = argv[index]
        if not arg.startswith("-"):
            overrides.append(arg)
        else:
            flags.append(arg)
            name = arg.split("=", 1)[0]
            has_value = "=" not in arg and index + 1 < len(argv)
            if has_value and (name in FLAGS_WITH_VALUE or (name in INFO_FLAGS and argv[index + 1] in INFO_VALUES)):
                flags.append(argv[index + 1])
                index += 1
        index += 1
    return overrides, flags


def precheck(argv: list[str]) -> None:
    """Reject malformed overrides, unknown config choices, unknown keys, bad settings and (under ``-m``) any job
    of the sweep that cannot compose or cannot run, with one line, before any work."""
    overrides, flags = split_argv(argv)
    flag_names = {flag.split("=", 1)[0] for flag in flags if flag.startswith("-")}
    if unknown_flags := sorted(flag_names - HYDRA_FLAGS):
        fail(f"unknown flag {', '.join(unknown_flags)}; Hydra's flags: -m (a sweep), --cfg job (print the config), "
             f"--info, --help (python run.py --help lists them)")
    parsed = check_syntax(overrides)
    if flag_names & MULTIRUN_FLAGS:
        check_sweep(overrides, launching=not flag_names & NO_JOB_FLAGS)
        return
    if any(override.is_sweep_override() for override in parsed):
        fail("a sweep override (a,b or range) needs -m: python run.py -m " + " ".join(overrides))
    try:
        with hydra_context():
            cfg = compose_one(overrides)
    except Exception as error:  # noqa: BLE001  composition errors (unknown keys, bad types) -> one line
        fail(composition_error(overrides, error))
    if not flag_names & NO_JOB_FLAGS:
        check_run_settings(cfg)


def parse_overrides(overrides: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(overrides)


def check_syntax(overrides: list[str]) -> list:
    """Parse the overrides and check the config groups' choices; -> the parsed overrides."""
    try:
        parsed = parse_overrides(overrides)
    except Exception as error:  # noqa: BLE001  the parser raises several types; the user needs only the line
        fail(malformed_override(overrides, error))
    for override in parsed:
        group = override.get_key_element().lstrip("+~")
        if group in GROUPS:
            choices = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
            values = override.value()
            for value in values.list if hasattr(values, "list") else [values]:
                if isinstance(value, str) and value not in choices:
                    fail(f"unknown {group} {value!r}; choose one of: {', '.join(choices)}")
    return parsed


def malformed_override(overrides: list[str], error: BaseException) -> str:
    """The line for overrides Hydra's parser refuses: which one, why, and for a value that only quoting makes
    valid (letters beyond ASCII, quotes, shell characters) how to quote it."""
    bad = next((o for o in overrides if not parses(o)), None)
    if bad is None:
        return f"malformed override ({first_line(error)}); write key=value, e.g. method=quest budget=256"
    key, _, value = bad.partition("=")
    if value and not value.startswith(("'", '"', "[", "{")) and parses(f"{key}='{value}'"):
        return (f"malformed override {bad}: Hydra takes a value with characters beyond plain ASCII letters, digits "
                f"and /._- only quoted: write \"{key}='{value}'\"")
    return f"malformed override {bad} ({first_line(error)}); write key=value, e.g. method=quest budget=256"


def parses(override: str) -> bool:
    try:
        parse_overrides([override])
    except Exception:  # noqa: BLE001  the parser raises several types
        return False
    return True


def composition_error(overrides: list[str], error: BaseException) -> str:
    """The line for overrides that do not compose: a key that is not there names the key most like it."""
    import difflib
    import re

    found = re.match(r"Could not override '([^']+)'", str(error))
    if found is None:
        return f"bad override: {first_line(error)}"
    key = found.group(1)
    parent, _, leaf = key.rpartition(".")
    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        with hydra_context():
            node = compose_one(rest)
        for part in parent.split(".") if parent else []:
            node = node[part]
        known = sorted(str(k) for k in node.keys())
    except Exception:  # noqa: BLE001  without the others composing, no suggestion
        known = []
    close = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
    meant = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""
    where = f"{parent}'s settings" if parent else "the top-level keys"
    return f"bad override: no key {key}{meant}; {where}: {', '.join(known)}" if known else \
        f"bad override: no key {key}"


def check_run_settings(cfg) -> None:
    """What the settings alone show (types, budget rules, unknown method keys): ``RunConfig.from_dict``."""
    from eval.config import RunConfig
    from icecache.errors import ConfigError

    try:
        RunConfig.from_dict(run_values(cfg))
    except ConfigError as error:
        fail(str(error))


def run_values(cfg) -> dict[str, Any]:
    """A composed job config -> the run's settings (the sweep-level keys dropped)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from icecache.errors import ConfigError

    try:
        values = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:  # ``~budget``: method.budget reads ${budget}
        raise ConfigError(f"bad override: {getattr(error, 'full_key', None) or 'a value'} cannot be resolved "
                          f"({first_line(error)})") from None
    for key in SWEEP_LEVEL_KEYS:
        values.pop(key, None)
    return values


# ---------------------------------------------------------------------------------------------------------------
# Sweeps: the jobs of ``run.py -m <overrides>``, composed quickly (one Hydra composition per choice of config
# groups, the plain key=value overrides applied to a copy of it by Hydra's own override code)


class hydra_context:
    """``initialize_config_dir`` on the repository's configs, clearing any Hydra state before and after."""

    def __enter__(self):
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        GlobalHydra.instance().clear()
        self._init = initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3")
        self._init.__enter__()
        return self

    def __exit__(self, *exc):
        from hydra.core.global_hydra import GlobalHydra

        self._init.__exit__(*exc)
        GlobalHydra.instance().clear()


def compose_one(overrides: list[str], with_hydra: bool = False):
    from hydra import compose

    return compose(config_name=CONFIG_NAME, overrides=overrides, return_hydra_config=with_hydra)


def sweep_jobs(overrides: list[str], extra_grids: list[list[str]] | None = None):
    """(job overrides, base config): the jobs ``run.py -m <overrides>`` launches (the experiment's
    ``hydra.sweeper.params`` with the command line replacing the keys it names, Hydra's BasicSweeper rule), and
    the config composed without the swept keys (its ``hydra`` node tells the launcher). ``extra_grids`` are more
    override lists appended to the same grid (the experiment's reference runs). Call inside ``hydra_context``."""
    from omegaconf import OmegaConf

    plain = [o.input_line for o in parse_overrides(overrides) if not o.is_sweep_override()]
    base = compose_one(plain, with_hydra=True)
    sweeper_params = base.hydra.sweeper.get("params")
    params = [f"{k}={v}" for k, v in (OmegaConf.to_container(sweeper_params) if sweeper_params else {}).items()]
    jobs: list[list[str]] = []
    for extra in [[]] + list(extra_grids or []):
        jobs += basic_sweeper_grid(params + overrides + extra)
    return jobs, base


class JobComposer:
    """Composes many jobs that differ in a few keys: Hydra composes once per choice of config groups, and each
    job's plain ``key=value`` overrides go onto a copy with the function Hydra's own composition ends with (same
    result; tests compare the two)."""

    def __init__(self):
        from hydra.core.global_hydra import GlobalHydra

        self.repository = GlobalHydra.instance().config_loader().repository
        self.cache: dict[tuple[str, ...], object] = {}

    def is_group(self, override) -> bool:
        key = override.key_or_group
        return override.package is not None or "/" in key or self.repository.group_exists(key)

    def compose(self, job: list[str]):
        from omegaconf import OmegaConf

        parsed = parse_overrides(job)
        groups = tuple(o.input_line for o in parsed if self.is_group(o))
        values = [o for o in parsed if not self.is_group(o) and not o.is_hydra_override()]
        if groups not in self.cache:
            self.cache[groups] = compose_one(list(groups))
        cfg = OmegaConf.create(OmegaConf.to_container(self.cache[groups]))
        OmegaConf.set_struct(cfg, True)
        apply_value_overrides(values, cfg)
        return cfg


def check_sweep(overrides: list[str], launching: bool) -> None:
    """Every job of the sweep composes and passes ``RunConfig.from_dict``; else one line: how many fail, and the
    first with its overrides and its reason. A Slurm launch needs Slurm."""
    from eval.config import RunConfig
    from icecache.errors import ConfigError

    try:
        with hydra_context():
            jobs, base = sweep_jobs(overrides)
            composer = JobComposer()
            failures = []
            for index, job in enumerate(jobs):
                try:
                    cfg = composer.compose(job)
                except Exception as error:  # noqa: BLE001  a job that cannot compose
                    failures.append((index, job, f"bad override: {first_line(error)}"))
                    continue
                try:
                    RunConfig.from_dict(run_values(cfg))
                except ConfigError as error:
                    failures.append((index, job, str(error)))
    except Exception as error:  # noqa: BLE001  the sweep itself does not compose
        fail(f"bad override: {first_line(error)}")
    if failures:
        index, job, reason = failures[0]
        fail(f"{len(failures)} of the sweep's {len(jobs)} jobs cannot run; the first, [{index}] {' '.join(job)}: "
             f"{reason} (python scripts/sweep.py {' '.join(overrides)} --dry-run lists them all)")
    if launching:
        check_launcher(base)


def check_launcher(base) -> None:
    """``hydra/launcher=slurm`` submits with sbatch: without it, say so instead of submitit's traceback."""
    target = str(base.hydra.launcher.get("_target_", ""))
    if "SlurmLauncher" in target and shutil.which("sbatch") is None:
        fail("hydra/launcher=slurm needs a Slurm cluster (no sbatch on this machine's PATH); run on the cluster's "
             "login node, or here with hydra/launcher=local (one job after another) or hydra/launcher=slurm_local "
             "(the same submitit path, jobs as local processes)")


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------------------------------------------------------
# The Hydra main (run.py)


def run_job(cfg) -> None:
    """One run, as Hydra hands it over (``run.py`` without ``-m``)."""
    from eval.runner import main_from_dict

    main_from_dict(run_values(cfg))


def main() -> None:
    precheck(sys.argv[1:])
    overrides, flags = split_argv(sys.argv[1:])
    flag_names = {flag.split("=", 1)[0] for flag in flags if flag.startswith("-")}
    if flag_names & MULTIRUN_FLAGS and not flag_names & NO_JOB_FLAGS:
        if flag_names - MULTIRUN_FLAGS:
            fail(f"run.py -m takes overrides only (not {' '.join(sorted(flag_names - MULTIRUN_FLAGS))}); "
                 f"--cfg, --info and --help show the sweep's config without launching it")
        sys.exit(launch_sweep(overrides))
    import hydra

    # The job's name (hydra.job.name, Slurm's job name) is set in configs/config.yaml: Hydra would otherwise name
    # it after this module.
    hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")(run_job)()


# ---------------------------------------------------------------------------------------------------------------
# A sweep launched (run.py -m, scripts/sweep.py): every job through the configured launcher, each job's outcome
# read from the JobReturn the launcher hands back, and one report of the jobs that did not finish, the same for
# every launcher. Hydra's own multirun cannot do this: its sweeper raises at the first job that raised and drops
# the others, a job whose run stopped with an error line returns normally (so a submitit launcher reports it as
# completed), and hydra.main returns none of the JobReturns to its caller.


@dataclass
class JobResult:
    """What a sweep's job returns to the launching process (pickled by submitit): its run's error line, if any."""

    error: str | None = None


def run_task(cfg) -> JobResult:
    """One job of a sweep, where the launcher runs it (this process, a local subprocess, a Slurm node): the run,
    as ``run.py`` runs it; an error line ends this job only and goes back to the sweep's report."""
    from eval.runner import main_from_dict

    with ErrorLineTee() as seen:
        metrics = main_from_dict(run_values(cfg), exit_on_error=False)
    if metrics is None and seen.line is None and cfg.get("n_shards", 1) > 1:
        return JobResult()  # a shard that is not the run's last: its samples are done
    return JobResult(None if metrics is not None else seen.line or "the run stopped with an error")


class ErrorLineTee:
    """stderr as it is, remembering the last ``error:`` line written to it (the runner prints a run's error
    there); the line is the job's reason in the sweep's report."""

    def __init__(self):
        self.line: str | None = None
        self._pending = ""
        self._stream = sys.stderr

    def write(self, text: str) -> int:
        self._stream.write(text)
        *complete, self._pending = (self._pending + text).split("\n")
        for line in complete:
            if line.startswith("error: "):
                self.line = line.removeprefix("error: ")
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __enter__(self):
        self._stream, sys.stderr = sys.stderr, self
        return self

    def __exit__(self, *exc):
        sys.stderr = self._stream


@dataclass
class TaskOutcome:
    index: int
    overrides: list[str]  # the job's task overrides (``python run.py <overrides>`` runs it alone)
    status: str = "pending"  # finished, failed (an error line), crashed (raised, killed, vanished)
    reason: str = ""
    log: Path | None = None  # None: the job ran in this process, its output is above


def task_overrides(overrides: list[str]) -> list[str]:
    """A job's overrides without the ``hydra...`` ones: those belong to the sweep's config, which the launcher
    composes each job from (as Hydra's own sweeper hands its launcher only the task overrides)."""
    return [o.input_line for o in parse_overrides(overrides) if not o.is_hydra_override()]


def launch_sweep(overrides: list[str]) -> int:
    """``run.py -m <overrides>``: every job of the grid (Hydra's BasicSweeper rule) through the configured
    launcher, then the report; 0 when all finished, 2 when some stopped with an error line, 1 when one crashed."""
    from omegaconf import OmegaConf

    with hydra_context():
        grid, _ = sweep_jobs(overrides)
        composer = JobComposer()
        roots = list(dict.fromkeys(str(composer.compose(job).output_root) for job in grid))
    jobs = [task_overrides(job) for job in grid]
    launcher, cfg = multirun_launcher(overrides, run_task)
    if is_submitit_launcher(cfg):
        code = launch_submitit(launcher, cfg, jobs)
    else:
        sweep_dir = Path(str(cfg.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, sweep_dir / "multirun.yaml")
        code = report(launch_here(launcher, jobs))
    print(collect_hint(roots))
    return code


def launch_here(launcher, jobs: list[list[str]]) -> list[TaskOutcome]:
    """Hydra's basic launcher: the jobs one after another in this process (one that raises does not stop the
    next), then each one's JobReturn read; a job that raised has its traceback printed."""
    import traceback

    outcomes = []
    for index, (job, returned) in enumerate(zip(jobs, launcher.launch(jobs, initial_job_idx=0))):
        outcome = TaskOutcome(index, job)
        read_return(returned, outcome)
        if outcome.status == "crashed":
            print(f"job [{index}] raised:", file=sys.stderr)
            traceback.print_exception(job_return_value(returned), file=sys.stderr)
        outcomes.append(outcome)
    return outcomes


def is_submitit_launcher(cfg) -> bool:
    return "hydra_submitit_launcher" in str(cfg.hydra.launcher.get("_target_", ""))


def launch_submitit(launcher, cfg, jobs: list[list[str]], skipped: int = 0) -> int:
    """Submit ``jobs`` (task overrides) as one array with a submitit launcher (set up by ``multirun_launcher``
    with ``run_task``), wait for every task, report each: 0 when all finished, 2 when some stopped with an error
    line, 1 when one crashed or vanished."""
    import contextlib
    import io

    from omegaconf import OmegaConf

    sweep_dir = Path(str(cfg.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, sweep_dir / "multirun.yaml")
    slurm = submitit_executor_name(launcher) == "slurm"
    runs = f"{len(jobs)} run{'s' if len(jobs) != 1 else ''}"
    kind = ("to Slurm" + (" as one job array" if len(jobs) > 1 else "")) if slurm else "as submitit local processes"
    print(f"submitting {runs} {kind}" + (f" ({skipped} done, skipped)" if skipped else ""), flush=True)
    try:
        # submitit prints sbatch's stderr before it raises; the reason goes in the one error line instead
        with contextlib.redirect_stderr(io.StringIO()):
            submitted = submit_array(launcher, jobs)
    except Exception as error:  # noqa: BLE001  sbatch refused the array (a partition, account or QOS it rejects)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        fail(f"the submission failed, nothing was submitted: {lines[-1] if lines else type(error).__name__}")
    if slurm:
        # submitit submits a lone task as a plain job, not an array of one
        what = (f"job array {submitted[0].job_id.split('_')[0]} (tasks 0-{len(submitted) - 1})"
                if len(submitted) > 1 else f"job {submitted[0].job_id}")
        print(f"submitted {what}; logs: {submitted[0].paths.folder.parent}; waiting for it (interrupting leaves it "
              f"running)", flush=True)
    one_log = launcher.params.get("stderr_to_stdout", False)  # else the error lines are in the .err file
    outcomes = [TaskOutcome(i, job, log=task.paths.stdout if one_log else task.paths.stderr)
                for i, (job, task) in enumerate(zip(jobs, submitted))]
    try:
        wait_for_tasks(submitted, outcomes, slurm)
    except KeyboardInterrupt:
        print("interrupted: the tasks go on; resubmit the same sweep later to wait for (or rerun) what is left",
              file=sys.stderr)
        return 130
    return report(outcomes)


# squeue states of a task that may still write its result (a preempted task is PENDING again once requeued).
ACTIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "RESIZING",
                           "SUSPENDED", "SIGNALING", "STAGE_OUT"})
LOST_AFTER_S = 10.0  # a task gone from squeue's active states with no result for this long has died


def wait_for_tasks(jobs, outcomes: list[TaskOutcome], slurm: bool) -> None:
    """Until every task has an outcome: its result file (the JobReturn the task returned, or what it raised),
    or, for a Slurm task that left the queue without one (killed, out of memory, node failure), "crashed". Slurm
    states come from squeue, which every cluster has (sacct needs an accounting database)."""
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
                read_submitit_result(job, outcome)
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
    import subprocess

    try:
        result = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", array_id, "-o", "%i %T"],
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return dict(line.split(None, 1) for line in result.stdout.splitlines() if len(line.split(None, 1)) == 2)


def read_submitit_result(job, outcome: TaskOutcome) -> None:
    try:
        returned = job.result()
    except Exception as error:  # noqa: BLE001  the task raised outside the run (submitit's own failure)
        outcome.status, outcome.reason = "crashed", first_line(error)
        return
    read_return(returned, outcome)


def read_return(returned, outcome: TaskOutcome) -> None:
    """A job's outcome from the JobReturn its launcher handed back: ``FAILED`` (the job raised) is a crash, a
    ``JobResult`` with an error line a failure."""
    from hydra.core.utils import JobStatus

    value = job_return_value(returned)
    if returned.status == JobStatus.FAILED:
        outcome.status, outcome.reason = "crashed", f"{type(value).__name__}: {first_line(value)}"
    elif not isinstance(value, JobResult):
        outcome.status, outcome.reason = "crashed", f"the job returned {type(value).__name__}, not a JobResult"
    elif value.error is not None:
        outcome.status, outcome.reason = "failed", value.error
    else:
        outcome.status = "finished"


def report(outcomes: list[TaskOutcome]) -> int:
    """Every job that did not finish, with its reason, its log and the command that runs it alone; -> the exit
    status: 1 when one crashed, 2 when some stopped with an error line, else 0."""
    import shlex

    counts = {status: sum(o.status == status for o in outcomes) for status in ("finished", "failed", "crashed")}
    print(f"sweep: {len(outcomes)} tasks: {counts['finished']} finished, {counts['failed']} failed, "
          f"{counts['crashed']} crashed")
    for outcome in outcomes:
        if outcome.status == "finished":
            continue
        log = outcome.log or "this process's output, above"
        alone = "python run.py " + " ".join(shlex.quote(o) for o in outcome.overrides)
        print(f"[{outcome.index:4d}] {outcome.status}: {outcome.reason}\n       log: {log}\n       {alone}")
    left = counts["failed"] + counts["crashed"]
    if left:
        print(f"error: {left} job(s) of the sweep did not finish (listed above); resubmit the same sweep after "
              f"fixing them: finished runs are skipped, partial ones resume", file=sys.stderr)
    return 1 if counts["crashed"] else 2 if counts["failed"] else 0


def collect_hint(output_roots: list[str]) -> str:
    """The command that tables a sweep's results, naming the output roots its runs went to."""
    import shlex

    roots = output_roots or ["results/runs"]
    return ("collect the results (whatever the exit code): python scripts/collect.py "
            + " ".join(shlex.quote(root) for root in roots) + " --out results/summary")


# ---------------------------------------------------------------------------------------------------------------
# Hydra internals, each used here only, where Hydra has no public API that does the same:
# - the grid of a sweep: BasicSweeper.split_arguments is the rule ``run.py -m`` expands a sweep by; using it keeps
#   the jobs listed and submitted here the ones Hydra's sweeper would make;
# - a job's plain overrides onto a composed config: ConfigLoaderImpl._apply_overrides_to_config is the step
#   Hydra's composition ends with (tests/test_sweeps.py compares the result with hydra.compose);
# - a launcher instantiated with its multirun config: the public hydra.compose composes in RUN mode, which refuses
#   sweep overrides, and HydraContext needs Hydra's Callbacks; a submitit launcher's executor name is a class
#   attribute of the plugin;
# - a submitit launch that does not stop at the first task without a result: what the plugin's launch method
#   submits, from its parameters, returning the submitit jobs;
# - a JobReturn's value without re-raising a failed job's exception (JobReturn._return_value).


def basic_sweeper_grid(overrides: list[str]) -> list[list[str]]:
    """Every job of the grid the overrides make, in BasicSweeper's order (a later override replaces the key)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    return [list(job) for batch in BasicSweeper.split_arguments(parse_overrides(overrides), None) for job in batch]


def apply_value_overrides(overrides: list, cfg) -> None:
    """Apply parsed ``key=value`` overrides (no config groups) to ``cfg`` in place, as Hydra's composition does."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config(overrides, cfg)


def multirun_launcher(overrides: list[str], task_function):
    """(launcher, config): the launcher ``run.py -m <overrides>`` would use, set up with its multirun config and
    ``task_function`` as each job's function (job name ``run``, as run.py's)."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode

    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="run", config_search_path=create_config_search_path(str(CONFIG_DIR)))
    cfg = hydra.compose_config(CONFIG_NAME, overrides, run_mode=RunMode.MULTIRUN)
    context = HydraContext(config_loader=hydra.config_loader, callbacks=Callbacks(cfg))
    launcher = Plugins.instance().instantiate_launcher(config=cfg, hydra_context=context, task_function=task_function)
    return launcher, cfg


def submit_array(launcher, job_overrides: list[list[str]]):
    """What ``BaseSubmititLauncher.launch`` submits (its executor, its parameters, the launcher object as each
    task's callable), returning the submitit jobs instead of waiting on them in order: that method returns
    only when every task wrote a result and raises at the first one that did not, dropping the others' report."""
    import submitit
    from hydra.core.singleton import Singleton
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    params, executor_name = launcher.params, submitit_executor_name(launcher)
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


def submitit_executor_name(launcher) -> str:
    """``slurm`` or ``local``: the submitit executor a hydra-submitit-launcher launcher submits with."""
    return launcher._EXECUTOR


def job_return_value(returned):
    """What the job returned, or the exception it raised (``JobReturn.return_value`` re-raises that)."""
    return returned._return_value
