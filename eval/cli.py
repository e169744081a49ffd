"""What ``run.py`` does before and around Hydra: the command line split into overrides and Hydra's flags, the
overrides checked (syntax, config choices, keys, run settings) before any work, a sweep's jobs composed and
checked, the launcher checked, and the Hydra main that runs a job and reports a sweep's failed jobs.

Bad input stops with one line starting ``error:`` and exit code 2. Under ``-m`` every job of the sweep is composed
and checked first; a job that still fails while the sweep runs prints its line and the others go on.

The few Hydra internals this needs (no public API does the same) are in one section at the end of this file.
"""

from __future__ import annotations

import shutil
import sys
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
    parsed = check_syntax(overrides)
    flag_names = {flag.split("=", 1)[0] for flag in flags}
    if flag_names & MULTIRUN_FLAGS:
        check_sweep(overrides, launching=not flag_names & NO_JOB_FLAGS)
        return
    if any(override.is_sweep_override() for override in parsed):
        fail("a sweep override (a,b or range) needs -m: python run.py -m " + " ".join(overrides))
    try:
        with hydra_context():
            cfg = compose_one(overrides)
    except Exception as error:  # noqa: BLE001  composition errors (unknown keys, bad types) -> one line
        fail(f"bad override: {first_line(error)}")
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
        fail(f"malformed override ({first_line(error)}); write key=value, e.g. method=quest budget=256")
    for override in parsed:
        group = override.get_key_element().lstrip("+~")
        if group in GROUPS:
            choices = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
            values = override.value()
            for value in values.list if hasattr(values, "list") else [values]:
                if isinstance(value, str) and value not in choices:
                    fail(f"unknown {group} {value!r}; choose one of: {', '.join(choices)}")
    return parsed


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

    values = OmegaConf.to_container(cfg, resolve=True)
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


FAILED_JOBS: list[str] = []  # jobs of this process's sweep that stopped with an error line


def run_job(cfg) -> None:
    """One job, as Hydra hands it over: the run; under ``-m`` a job that stops with an error line is noted and the
    sweep goes on."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from eval.runner import main_from_dict

    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    metrics = main_from_dict(run_values(cfg), exit_on_error=not multirun)
    if multirun and metrics is None:
        FAILED_JOBS.append(" ".join(HydraConfig.get().overrides.task))


def main() -> None:
    precheck(sys.argv[1:])
    import hydra

    # The job's name (hydra.job.name, Slurm's job name) is set in configs/config.yaml: Hydra would otherwise name
    # it after this module.
    hydra.main(config_path=str(CONFIG_DIR), config_name=CONFIG_NAME, version_base="1.3")(run_job)()
    if FAILED_JOBS:
        print(f"error: {len(FAILED_JOBS)} job(s) of the sweep stopped with the error above; the others ran. "
              f"Resubmit the same sweep after fixing them: finished runs are skipped", file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------------------------------------------------------
# Hydra internals, each used here only, where Hydra has no public API that does the same:
# - the grid of a sweep: BasicSweeper.split_arguments is the rule ``run.py -m`` expands a sweep by; using it keeps
#   the jobs listed and submitted here the ones Hydra's sweeper would make;
# - a job's plain overrides onto a composed config: ConfigLoaderImpl._apply_overrides_to_config is the step
#   Hydra's composition ends with (tests/test_sweeps.py compares the result with hydra.compose);
# - a launcher instantiated with its multirun config: the public hydra.compose composes in RUN mode, which refuses
#   sweep overrides, and HydraContext needs Hydra's Callbacks; a submitit launcher's executor name is a class
#   attribute of the plugin.


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


def submitit_executor_name(launcher) -> str:
    """``slurm`` or ``local``: the submitit executor a hydra-submitit-launcher launcher submits with."""
    return launcher._EXECUTOR
