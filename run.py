#!/usr/bin/env python
"""One (model, method, task, budget) run. Examples:

    python run.py                                          # embedded default: SmolLM2 passkey at 4k, IceCache
    python run.py method=quest budget=256 task=passkey task.lengths=[8192]
    python run.py -m method=full,icecache budget=64,256   # a sweep (hydra/launcher=slurm for a cluster)

Results land in results/runs/<task>/<model>/<method>/budget-<b>/<hash>/ (see README).
"""

from __future__ import annotations

import sys
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
GROUPS = ("model", "method", "task", "experiment")


def precheck(argv: list[str]) -> None:
    """Reject malformed overrides, unknown config choices and unknown keys with one line, before any work."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in argv if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
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
    if "-m" in argv or "--multirun" in argv:
        return  # sweep values are checked per job
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            compose(config_name="config", overrides=overrides)
    except Exception as error:  # noqa: BLE001  composition errors (unknown keys, bad types) -> one line
        fail(f"bad override: {first_line(error)}")


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    precheck(sys.argv[1:])
    import hydra
    from omegaconf import OmegaConf

    @hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
    def _run(cfg) -> None:
        from icecache.runner import main_from_dict

        values = OmegaConf.to_container(cfg, resolve=True)
        for key in ("experiment", "reference_runs", "bench"):  # sweep-level keys, not run settings
            values.pop(key, None)
        metrics = main_from_dict(values)
        if metrics:
            print(f"{metrics['task']} / {metrics['method']} / budget {metrics['budget']}: {metrics['metrics']}")

    _run()


if __name__ == "__main__":
    main()
